"""The files of a checkpoint that ``Accelerator.save_state`` writes.

For one process and DDP they are written as ``save_state`` writes them, in
its order, from accelerate's parts (:mod:`~skorch_accel_callbacks._core.accelerate_io`):
the model files by accelerate's ``save``, the optimizer files by the
format's archive writer without the CRC-32 of its records
(:func:`~skorch_accel_callbacks.format.save_without_crc`), then the small
files; :func:`write_large_state` writes the model and optimizer files alone,
from state dicts, on any thread (a save in the background hands it host
copies). Under FSDP2 ``save_state`` itself writes them (its shards go
through torch.distributed.checkpoint).

With a :class:`~skorch_accel_callbacks.engine._frozen.FrozenParts`, the
frozen parameters of each model, and each optimizer's state of them, are
split off into a file of their own (:func:`split_states`), linked instead
of written while unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.engine._frozen import FrozenParts, Split, no_split
from skorch_accel_callbacks.format import save_without_crc

__all__ = ['save_state', 'split_states', 'write_large_state']


def save_state(
        accelerator: Any, folder: str | os.PathLike, safe_serialization: bool,
        written: Callable[[str], None] | None = None,
        frozen: FrozenParts | None = None,
) -> Split:
    """Write what ``Accelerator.save_state`` writes into ``folder``;
    ``written`` is called with the path of each model and optimizer file as
    soon as it is complete (for one process and DDP). With ``frozen``, the
    frozen parameters go into files of their own (:func:`split_states`);
    the split is returned."""
    if accelerate_io.is_fsdp2(accelerator):
        accelerate_io.save_state_with_accelerate(accelerator, folder, safe_serialization)
        return no_split([], [])
    accelerate_io.check_plain_state(accelerator, 'a save')
    os.makedirs(folder, exist_ok=True)  # as save_state does, on every rank
    model_states, optimizer_states = accelerate_io.large_states(accelerator, folder)
    each_node = accelerate_io.save_on_each_node(accelerator)
    split = split_states(accelerator, model_states, optimizer_states, folder,
                         safe_serialization, frozen)
    write_large_state(folder, split, each_node, safe_serialization, written)
    accelerate_io.save_small_files(accelerator, folder, safe_serialization)
    return split


def split_states(accelerator: Any, model_states: Sequence[dict[str, Any]],
                 optimizer_states: Sequence[dict[str, Any]], folder: str | os.PathLike,
                 safe_serialization: bool, frozen: FrozenParts | None) -> Split:
    """``model_states`` and ``optimizer_states`` split by ``frozen``
    (:meth:`~skorch_accel_callbacks.engine._frozen.FrozenParts.split`), on
    the process that writes their files, in safetensors; else unsplit."""
    each_node = accelerate_io.save_on_each_node(accelerator)
    if frozen is None or not safe_serialization or not accelerate_io.writes_large_files(each_node):
        return no_split(model_states, optimizer_states)
    return frozen.split(model_states, accelerate_io.frozen_keys(accelerator), optimizer_states,
                        accelerate_io.frozen_optimizer_entries(accelerator), folder)


def write_large_state(
        folder: str | os.PathLike,
        split: Split,
        each_node: bool,
        safe_serialization: bool,
        written: Callable[[str], None] | None = None,
) -> None:
    """The model and optimizer files of ``save_state``, from state dicts
    (split off their frozen parts, each written unless it was linked);
    ``written`` is called with each one's path as soon as it is complete.

    Runs on any thread: it touches no accelerator and runs no collective.
    """
    writes = accelerate_io.writes_large_files(each_node)

    def done(path: str) -> None:
        if writes and written is not None:
            written(path)

    for i, state in enumerate(split.models):
        path = f"{folder}/{accelerate_io.model_file(i, safe_serialization)}"
        accelerate_io.save_model_file(state, path, each_node, safe_serialization)
        done(path)
    for part in split.parts:
        if part.state is not None and not part.of_optimizer:
            path = f"{folder}/{part.file}"
            accelerate_io.save_model_file(part.state, path, each_node, True)
            done(path)
    if not writes:
        return
    for i, state in enumerate(split.optimizers):
        path = f"{folder}/{accelerate_io.optimizer_file(i)}"
        save_without_crc(state, path)
        done(path)
    for part in split.parts:
        if part.state is not None and part.of_optimizer:
            path = f"{folder}/{part.file}"
            save_without_crc(part.state, path)
            done(path)
