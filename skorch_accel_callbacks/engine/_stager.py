"""The stager of a save in the background (``AccelerateCheckpoint(async_save=True)``).

Training is blocked only while the model and optimizer states are copied
into host memory (into buffers kept from one save to the next, so the copy
costs no fresh allocation); the background writer
(:class:`~skorch_accel_callbacks.engine._writer.BackgroundWriter`) then writes them
and commits the folder. Everything else in a checkpoint is small and written in the
foreground by every rank, before the ranks agree that this part succeeded.
accelerate writes the model and optimizer files on the committing process
only, so only that process has a background thread, and the thread needs
nothing from the other ranks. It never runs a collective: one from a second
thread would interleave with the collectives of training.
"""

import dataclasses
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.engine import _state_files as state_files
from skorch_accel_callbacks.engine._frozen import FrozenPart, FrozenParts, Split

__all__ = ['COPY_CHUNK', 'COPY_THREADS', 'HostStager', 'Staged', 'copy_all']

# the host copies of a stage are cut into pieces of COPY_CHUNK bytes, which
# COPY_THREADS threads, the calling one among them, take from one queue one
# after the other (numpy's copy lets go of the GIL): a thread that the
# machine stalls holds up one piece, not a share fixed beforehand, as torch's
# intra-op threads of ``copy_`` do. Each thread runs to the end of the queue:
# a future a piece, waited for by the caller, woke it and traded the GIL
# with the copying threads at every piece (about 700 preemptions a save of
# 1.1 GiB against 6; benchmarks/RESULTS.rst)
COPY_CHUNK = 16 * 2 ** 20
COPY_THREADS = min(2, os.cpu_count() or 1)


@dataclass(frozen=True)
class Staged:
    """Host copies of an accelerator's model and optimizer states (of their
    frozen parts, those to be written), and how ``save_state`` would write
    them."""

    split: Split
    save_on_each_node: bool
    safe_serialization: bool

    def write(self, folder: str, written: Callable[[str], None] | None = None) -> None:
        """Write the model and optimizer files into ``folder``, calling
        ``written`` with each one's path once complete; on any thread."""
        state_files.write_large_state(folder, self.split, self.save_on_each_node,
                                      self.safe_serialization, written)


class HostStager:
    """Copies the large states of an accelerator into host buffers, kept
    from one save to the next.

    The copy a :meth:`stage` returns is overwritten by the next one: the
    writer of one must be done before the next is staged. A copy (pickle,
    deepcopy) of a stager has no buffers.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def __getstate__(self) -> dict:
        return {'_buffers': {}}

    def stage(self, accelerator: Any, folder: str, safe_serialization: bool,
              writer: bool, frozen: FrozenParts | None = None) -> Staged | None:
        """Write the small files of ``accelerator.save_state`` into
        ``folder``, and return a copy of the model and optimizer states
        (``None`` on a process that writes none: ``writer`` is False).
        With ``frozen``, the frozen parameters are split off
        (:func:`~skorch_accel_callbacks.engine._state_files.split_states`):
        a part linked now is not copied."""
        models, optimizers = accelerate_io.save_state_in_two(
            accelerator, folder, safe_serialization)
        if not writer:
            return None
        split = state_files.split_states(accelerator, models, optimizers, folder,
                                         safe_serialization, frozen)
        memo: dict = {}
        copies: list = []
        staged = Staged(
            Split([self._copy(state, ('model', i), memo, copies)
                   for i, state in enumerate(split.models)],
                  [self._copy(state, ('optimizer', i), memo, copies)
                   for i, state in enumerate(split.optimizers)],
                  [self._copy_part(part, memo, copies) for part in split.parts]),
            accelerate_io.save_on_each_node(accelerator), safe_serialization)
        copy_all(copies)
        return staged

    def _copy_part(self, part: FrozenPart, memo: dict, copies: list) -> FrozenPart:
        """``part`` with its state to be written in host buffers."""
        if part.state is None:
            return part
        return dataclasses.replace(
            part, state=self._copy(part.state, ('frozen', part.file), memo, copies))

    def _copy(self, obj: Any, key: tuple, memo: dict, copies: list) -> Any:
        """``obj`` with every tensor replaced by a host buffer kept under
        ``key``; the copies into them are appended to ``copies``
        (``(buffer, tensor)``), to be made by :func:`copy_all`."""
        if isinstance(obj, torch.Tensor):
            # tied weights stay one tensor, as in the state dict
            seen = memo.get((obj.data_ptr(), obj.dtype, tuple(obj.shape)))
            if seen is not None and obj.numel():
                return seen
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                buffer = torch.empty(obj.shape, dtype=obj.dtype, device='cpu')
                self._buffers[key] = buffer
            copies.append((buffer, obj.detach()))
            memo[(obj.data_ptr(), obj.dtype, tuple(obj.shape))] = buffer
            return buffer
        if isinstance(obj, dict):
            # keeps OrderedDict: accelerate's save() cleans those for safetensors
            return type(obj)((k, self._copy(v, key + (k,), memo, copies))
                             for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, key + (i,), memo, copies)
                             for i, v in enumerate(obj))
        # numbers, strings, None: immutable; optimizer settings are plain values
        return obj

    def free(self) -> None:
        """Let go of the buffers."""
        self._buffers = {}


def _is_host_copy(tensor: torch.Tensor) -> bool:
    return tensor.device.type == 'cpu' and bool(tensor.dim()) and tensor.is_contiguous()


def copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``tensor`` of ``copies`` into its ``buffer``; the host
    copies in pieces of :data:`COPY_CHUNK` bytes on this thread and
    :data:`COPY_THREADS` - 1 others, the others (from a device, or of a
    strided tensor) with ``copy_`` on this thread. Returns once every copy
    is made; the first that failed raises."""
    pieces = []
    for buffer, tensor in copies:
        if not _is_host_copy(tensor):
            buffer.copy_(tensor)
            continue
        source = tensor.view(-1).view(torch.uint8).numpy()
        target = buffer.view(-1).view(torch.uint8).numpy()
        pieces += [(target[at:at + COPY_CHUNK], source[at:at + COPY_CHUNK])
                   for at in range(0, source.size, COPY_CHUNK)]
    if len(pieces) < 2 or COPY_THREADS < 2:
        for target, source in pieces:
            np.copyto(target, source)
        return
    queue = iter(pieces)
    taking = threading.Lock()

    def copy_until_done() -> None:
        while True:
            with taking:
                piece = next(queue, None)
            if piece is None:
                return
            np.copyto(*piece)

    # leaving the pool waits for its threads, also where this thread's
    # copy failed: none goes on writing into the buffers after the return
    with ThreadPoolExecutor(max_workers=COPY_THREADS - 1,
                            thread_name_prefix='checkpoint-copy') as pool:
        helpers = [pool.submit(copy_until_done) for _ in range(COPY_THREADS - 1)]
        copy_until_done()
    for helper in helpers:
        helper.result()
