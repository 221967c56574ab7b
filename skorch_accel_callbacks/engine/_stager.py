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

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from skorch_accel_callbacks._core import accelerate_io

__all__ = ['HostStager', 'Staged', 'copy_into']


@dataclass(frozen=True)
class Staged:
    """Host copies of an accelerator's model and optimizer states, and how
    ``save_state`` would write them."""

    models: list[Any]
    optimizers: list[Any]
    save_on_each_node: bool
    safe_serialization: bool

    def write(self, folder: str) -> None:
        """Write the model and optimizer files into ``folder``; on any thread."""
        accelerate_io.write_large_state(folder, self.models, self.optimizers,
                                        self.save_on_each_node, self.safe_serialization)


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
              writer: bool) -> Staged | None:
        """Write the small files of ``accelerator.save_state`` into
        ``folder``, and return a copy of the model and optimizer states
        (``None`` on a process that writes none: ``writer`` is False)."""
        models, optimizers = accelerate_io.save_state_in_two(
            accelerator, folder, safe_serialization)
        if not writer:
            return None
        memo: dict = {}
        return Staged(
            [self._copy(state, ('model', i), memo) for i, state in enumerate(models)],
            [self._copy(state, ('optimizer', i), memo) for i, state in enumerate(optimizers)],
            accelerate_io.save_on_each_node(accelerator), safe_serialization)

    def _copy(self, obj: Any, key: tuple, memo: dict) -> Any:
        """``obj`` with every tensor copied into a host buffer kept under ``key``."""
        if isinstance(obj, torch.Tensor):
            # tied weights stay one tensor, as in the state dict
            seen = memo.get((obj.data_ptr(), obj.dtype, tuple(obj.shape)))
            if seen is not None and obj.numel():
                return seen
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                buffer = torch.empty(obj.shape, dtype=obj.dtype, device='cpu')
                self._buffers[key] = buffer
            copy_into(buffer, obj.detach())
            memo[(obj.data_ptr(), obj.dtype, tuple(obj.shape))] = buffer
            return buffer
        if isinstance(obj, dict):
            # keeps OrderedDict: accelerate's save() cleans those for safetensors
            return type(obj)((k, self._copy(v, key + (k,), memo)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, key + (i,), memo) for i, v in enumerate(obj))
        # numbers, strings, None: immutable; optimizer settings are plain values
        return obj

    def free(self) -> None:
        """Let go of the buffers."""
        self._buffers = {}


def copy_into(buffer: torch.Tensor, tensor: torch.Tensor) -> None:
    """``buffer.copy_(tensor)``; between host tensors, a memcpy on this thread.

    A host copy is bound by memory bandwidth, which one thread reaches;
    torch's intra-op threads wait for each other, and stall when the
    machine is busy (benchmarks/RESULTS.rst).
    """
    if tensor.device.type == 'cpu' and tensor.dim() and tensor.is_contiguous():
        np.copyto(buffer.view(torch.uint8).numpy(), tensor.view(torch.uint8).numpy())
    else:
        buffer.copy_(tensor)
