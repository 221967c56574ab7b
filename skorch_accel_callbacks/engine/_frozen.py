"""The frozen parameters of a save: split off into files of their own, and
not written again while they are unchanged.

Fine-tuning a frozen base (skorch's ``Freezer``, ``requires_grad_(False)``,
the base model under LoRA adapters) changes a small part of a model; a
checkpoint of the whole rewrites the rest at every save. Here each model
whose state dict holds parameters that require no gradient is saved in two
files: its model file (accelerate's name) with everything else, and beside
it the frozen part (:func:`~skorch_accel_callbacks.format.frozen_part_name`).
When the frozen part is unchanged since the last checkpoint this process
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
that way must save with ``AccelerateCheckpoint(reuse_frozen=False)``.

A checkpoint in a bucket is written to its local staging folder first: a
link works there while the previous checkpoint is still staged; the upload
sends the part once, into the store's shared folder, where every later
checkpoint's manifest references it
(:func:`~skorch_accel_callbacks.format.shared_object`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.format import frozen_part_name

__all__ = ['FrozenPart', 'FrozenParts', 'Split', 'no_split', 'tensor_identity']


def tensor_identity(state: Mapping[str, Any], keys: Sequence[str]) -> tuple:
    """What says that the tensors of ``state`` under ``keys`` are unchanged:
    of each, its memory, dtype, shape, strides, device and version counter."""
    identity = []
    for key in sorted(keys):
        tensor = state[key]
        identity.append((key, tensor.data_ptr(), str(tensor.dtype), tuple(tensor.shape),
                         tensor.stride(), str(tensor.device), tensor._version))
    return tuple(identity)


@dataclass(frozen=True)
class FrozenPart:
    """The frozen parameters of one model of a save."""

    #: the model's file, which holds the rest of its state dict
    model_file: str
    #: the file of the frozen parameters
    file: str
    #: :func:`tensor_identity` of them
    identity: tuple
    #: their state dict, to be written; None where :attr:`linked`
    state: dict[str, Any] | None
    #: ``(origin, checksum)``: the file is a hard link to the bytes that
    #: checkpoint ``origin`` wrote, of that checksum
    linked: tuple[str, str] | None = None


@dataclass(frozen=True)
class Split:
    """The model states of a save, split: what goes into the model files,
    and of each model its frozen part or None."""

    models: list[dict[str, Any]]
    parts: list[FrozenPart | None]

    def manifest_fields(self) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
        """The arguments of :func:`~skorch_accel_callbacks.format.with_frozen_parts`:
        model file -> part file, and the linked parts -> ``(origin, checksum)``."""
        parts = [part for part in self.parts if part is not None]
        return ({part.model_file: part.file for part in parts},
                {part.file: part.linked for part in parts if part.linked is not None})


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
              folder: str | os.PathLike) -> Split:
        """Split ``model_states`` (live tensors, in accelerate's order) by
        ``frozen`` (:func:`~skorch_accel_callbacks._core.accelerate_io.frozen_keys`),
        linking into ``folder`` each part that is unchanged since the last
        commit; a part that cannot be linked is to be written."""
        models, parts = [], []
        for index, (state, frozen_keys) in enumerate(zip(model_states, frozen, strict=True)):
            keys = [key for key in state if key in frozen_keys]
            if not keys:
                models.append(state)
                parts.append(None)
                continue
            model_file = accelerate_io.model_file(index, safe_serialization=True)
            file = frozen_part_name(model_file)
            identity = tensor_identity(state, keys)
            linked = self._link(file, identity, os.path.join(folder, file))
            models.append(type(state)((k, v) for k, v in state.items() if k not in frozen_keys))
            parts.append(FrozenPart(
                model_file, file, identity,
                None if linked else type(state)((k, state[k]) for k in keys), linked))
        return Split(models, parts)

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
                  parts: Sequence[FrozenPart | None]) -> None:
        """Remember the frozen ``parts`` of checkpoint ``name``, committed
        at ``path`` with ``manifest``: the next save links those unchanged.
        Only the last commit's are kept: an older one's may be retired."""
        checksums = manifest.get('checksums') or {}
        self._committed = {
            part.file: _Committed(os.path.join(path, part.file),
                                  part.linked[0] if part.linked else name,
                                  checksums[part.file], part.identity)
            for part in parts if part is not None and part.file in checksums}

def no_split(model_states: Sequence[dict[str, Any]]) -> Split:
    """``model_states`` unsplit: no model has a frozen part."""
    return Split(list(model_states), [None] * len(model_states))
