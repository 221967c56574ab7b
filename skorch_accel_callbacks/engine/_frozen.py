"""The frozen parameters of a save: split off into files of their own, and
not written again while they are unchanged.

Fine-tuning a frozen base (skorch's ``Freezer``, ``requires_grad_(False)``,
the base model under LoRA adapters) changes a small part of a model; a
checkpoint of the whole rewrites the rest at every save. Here each model
whose state dict holds parameters that require no gradient is saved in two
files: its model file (accelerate's name) with everything else, and beside
it the frozen part (:func:`~skorch_accel_callbacks.format.frozen_part_name`).
So is each optimizer that holds a state of such parameters (a base trained
before it was frozen keeps Adam's two moments of each weight, twice the
frozen weights' bytes, which no step changes while it stays frozen): the
entries of its state dict's ``state`` of the frozen parameters go into the
optimizer's frozen part (``optimizer_frozen.bin``), the rest into its file.
When a frozen part is unchanged since the last checkpoint this process
committed, the new checkpoint's part is a hard link to that checkpoint's
file: no byte is written, read or hashed, and the manifest takes the
checksum its first save computed (``linked`` names that save). Each
checkpoint stays a complete folder of ordinary files, which ``verify``,
``export`` and ``load_params`` read as any other; removing one leaves the
others' links intact, and damage to the shared file shows in every
checkpoint that holds it.

Unchanged is decided without reading a tensor: the part holds the same
entries, and each is the same tensor as when the linked file was written
(the same memory, dtype, shape and strides, on the same device) with the
same version counter. torch counts every in-place change of a tensor in that
counter, which the parameter, its state-dict entry and every view of it
share: an optimizer step, ``load_state_dict`` (skorch's ``load_params``),
``torch.nn.init``, ``param.add_(...)`` under ``no_grad``, and
``param.detach()`` changed in place all move it; a new tensor in its place
(``param.data = ...``, ``module.to(dtype)``) moves the memory. A write
through ``param.data`` or a NumPy view of it is the one change that it does
not see (torch gives ``.data`` a counter of its own): the frozen flag is a
promise not to change the parameter, and a run that changes frozen weights
that way must save with ``AccelerateCheckpoint(reuse_frozen=False)``. An
optimizer's state of a parameter is checked alike, tensor by tensor, and
a number in it (a step count that is no tensor) by its value: a step moves
them only where the parameter has a gradient, which a frozen one lacks.

A checkpoint in a bucket is written to its local staging folder first: a
link works there while the previous checkpoint is still staged; the upload
sends the part once, into the store's shared folder, where every later
checkpoint's manifest references it
(:func:`~skorch_accel_callbacks.format.shared_object`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.format import frozen_part_name

__all__ = ['FrozenPart', 'FrozenParts', 'Split', 'no_split', 'tensor_identity']


def tensor_identity(state: Mapping[Any, Any], keys: Iterable[Any]) -> tuple:
    """What says that the values of ``state`` under ``keys`` are unchanged:
    of each tensor, its memory, dtype, shape, strides, device and version
    counter; of a mapping, list or tuple (an optimizer's state of one
    parameter), that of each of its values; a number, string or None
    itself. Any other object might change in place unseen: its identity
    equals no other, and a part that holds one is written at every save."""
    identity = []
    for key in sorted(keys):
        value = state[key]
        if isinstance(value, torch.Tensor):
            identity.append((key, value.data_ptr(), str(value.dtype), tuple(value.shape),
                             value.stride(), str(value.device), value._version))
        elif isinstance(value, Mapping):
            identity.append((key, tensor_identity(value, value)))
        elif isinstance(value, (list, tuple)):
            identity.append((key, type(value).__name__,
                             tensor_identity(dict(enumerate(value)), range(len(value)))))
        elif value is None or isinstance(value, (bool, int, float, str)):
            identity.append((key, 'value', value))
        else:
            identity.append((key, 'object', object()))
    return tuple(identity)


@dataclass(frozen=True)
class FrozenPart:
    """The frozen parameters of one model of a save, or the state one
    optimizer holds of them."""

    #: the model's or optimizer's file, which holds the rest of its state dict
    rest_file: str
    #: the file of the frozen parameters (or of the optimizer's state of them)
    file: str
    #: :func:`tensor_identity` of them
    identity: tuple
    #: what the file holds, to be written; None where :attr:`linked`. A
    #: model's: its state dict of the frozen parameters; an optimizer's:
    #: ``{'state': {index: state}}`` of them, as ``Optimizer.state_dict``
    #: numbers the parameters
    state: dict[Any, Any] | None
    #: ``(origin, checksum)``: the file is a hard link to the bytes that
    #: checkpoint ``origin`` wrote, of that checksum
    linked: tuple[str, str] | None = None
    #: whether it is an optimizer's (written as its optimizer file is)
    of_optimizer: bool = False


@dataclass(frozen=True)
class Split:
    """The model and optimizer states of a save, split: what goes into the
    model and optimizer files, and the frozen parts of those that have one
    (models' first, in accelerate's order, then optimizers')."""

    models: list[dict[str, Any]]
    optimizers: list[dict[str, Any]]
    parts: list[FrozenPart]

    def manifest_fields(self) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
        """The arguments of :func:`~skorch_accel_callbacks.format.with_frozen_parts`:
        model or optimizer file -> part file, and the linked parts ->
        ``(origin, checksum)``."""
        return ({part.rest_file: part.file for part in self.parts},
                {part.file: part.linked for part in self.parts if part.linked is not None})


@dataclass(frozen=True)
class _Committed:
    """A frozen part of the checkpoint last committed."""

    path: str
    origin: str
    checksum: str
    identity: tuple


class FrozenParts:
    """Splits the frozen parameters off each model state of a save, and
    links those unchanged since the last commit instead of writing them.

    The writing process keeps what its last commit holds (in memory: a new
    process writes its first save in full). A copy (pickle, deepcopy)
    remembers nothing.
    """

    def __init__(self) -> None:
        self._committed: dict[str, _Committed] = {}
        # False once the file system refused a hard link: tried no more
        self._links = True

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _committed={}, _links=True)

    def split(self, model_states: Sequence[dict[str, Any]], frozen: Sequence[set[str]],
              optimizer_states: Sequence[dict[str, Any]], frozen_entries: Sequence[set[int]],
              folder: str | os.PathLike) -> Split:
        """Split ``model_states`` (live tensors, in accelerate's order) by
        ``frozen`` (:func:`~skorch_accel_callbacks._core.accelerate_io.frozen_keys`),
        and ``optimizer_states`` by ``frozen_entries``
        (:func:`~skorch_accel_callbacks._core.accelerate_io.frozen_optimizer_entries`),
        linking into ``folder`` each part that is unchanged since the last
        commit; a part that cannot be linked is to be written."""
        models, optimizers, parts = [], [], []
        for index, (state, frozen_keys) in enumerate(zip(model_states, frozen, strict=True)):
            keys = [key for key in state if key in frozen_keys]
            if not keys:
                models.append(state)
                continue
            models.append(type(state)((k, v) for k, v in state.items() if k not in frozen_keys))
            parts.append(self._part(accelerate_io.model_file(index, safe_serialization=True),
                                    state, keys, folder, type(state)))
        for index, (state, entries) in enumerate(
                zip(optimizer_states, frozen_entries, strict=True)):
            held = state['state']
            keys = [key for key in held if key in entries]
            if not keys:
                optimizers.append(state)
                continue
            optimizers.append(dict(state, state={k: v for k, v in held.items()
                                                 if k not in entries}))
            parts.append(self._part(accelerate_io.optimizer_file(index), held, keys, folder,
                                    lambda items: {'state': dict(items)}, of_optimizer=True))
        return Split(models, optimizers, parts)

    def _part(self, rest_file: str, state: Mapping[Any, Any], keys: Sequence[Any],
              folder: str | os.PathLike, content: Callable[[Iterator[tuple]], dict[Any, Any]],
              of_optimizer: bool = False) -> FrozenPart:
        """The frozen part of ``state`` under ``keys``, split off the file
        ``rest_file``: linked into ``folder`` where unchanged, else to be
        written, what ``content`` makes of its entries."""
        file = frozen_part_name(rest_file)
        identity = tensor_identity(state, keys)
        linked = self._link(file, identity, os.path.join(folder, file))
        return FrozenPart(rest_file, file, identity,
                          None if linked else content((k, state[k]) for k in keys), linked,
                          of_optimizer)

    def _link(self, file: str, identity: tuple, target: str) -> tuple[str, str] | None:
        """Link ``target`` to the committed part ``file`` if its tensors are
        those of ``identity``: ``(origin, checksum)``, or None."""
        committed = self._committed.get(file)
        if not self._links or committed is None or committed.identity != identity:
            return None
        try:
            os.link(committed.path, target)
        except FileNotFoundError:
            return None  # removed by hand: written again
        except OSError as exc:
            warnings.warn(
                f"cannot hard-link {target} to {committed.path} ({exc}): the frozen "
                "parameters are written again at every save on this file system",
                UserWarning)
            self._links = False
            return None
        return committed.origin, committed.checksum

    def committed(self, name: str, path: str, manifest: Mapping[str, Any],
                  parts: Sequence[FrozenPart]) -> None:
        """Remember the frozen ``parts`` of checkpoint ``name``, committed
        at ``path`` with ``manifest``: the next save links those unchanged.
        Only the last commit's are kept: an older one's may be retired."""
        checksums = manifest.get('checksums') or {}
        self._committed = {
            part.file: _Committed(os.path.join(path, part.file),
                                  part.linked[0] if part.linked else name,
                                  checksums[part.file], part.identity)
            for part in parts if part.file in checksums}

def no_split(model_states: Sequence[dict[str, Any]],
             optimizer_states: Sequence[dict[str, Any]]) -> Split:
    """``model_states`` and ``optimizer_states`` unsplit: none has a frozen part."""
    return Split(list(model_states), list(optimizer_states), [])
