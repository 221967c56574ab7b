"""Saves written in the background: ``AccelerateCheckpoint(async_save=True)``.

Training is blocked only while the model and optimizer states are copied
into host memory (into buffers kept from one save to the next, so the copy
costs no fresh allocation); a thread then writes them and commits the
folder. Everything else in a checkpoint is small and written in the
foreground by every rank, before the ranks agree that this part succeeded.
accelerate writes the model and optimizer files on the committing process
only, so only that process has a background thread, and the thread needs
nothing from the other ranks. It never runs a collective: one from a second
thread would interleave with the collectives of training.
"""

import threading

import numpy as np
import torch

from skorch_accel_callbacks import accelerate_io

__all__ = ['BackgroundSaver', 'copy_into']


class BackgroundSaver:
    """Copy the large states of an accelerator, write them in a thread.

    One save at a time: :meth:`join` must be called before the next
    :meth:`snapshot`, which overwrites the buffers the previous save wrote
    from. A copy (pickle, deepcopy) of a saver has no save in flight and no
    buffers.
    """

    def __init__(self):
        self._buffers = {}
        self._thread = None
        self._error = None

    def __getstate__(self):
        return {'_buffers': {}, '_thread': None, '_error': None}

    # ------------------------------------------------------------ foreground

    def snapshot(self, accelerator, folder, safe_serialization, writer):
        """Write the small files of ``accelerator.save_state`` into
        ``folder``, and return a copy of the model and optimizer states that
        :meth:`start` writes (``None`` on a rank that writes none).
        """
        if self._thread is not None:
            raise RuntimeError("the previous background save was not joined")
        models, optimizers = accelerate_io.save_state_in_two(
            accelerator, folder, safe_serialization)
        if not writer:
            return None
        memo = {}
        models = [self._copy(state, ('model', i), memo) for i, state in enumerate(models)]
        optimizers = [self._copy(state, ('optimizer', i), memo)
                      for i, state in enumerate(optimizers)]
        return (models, optimizers, accelerate_io.save_on_each_node(accelerator),
                safe_serialization)

    def _copy(self, obj, key, memo):
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

    # ------------------------------------------------------------ background

    def start(self, folder, snapshot, then):
        """Write ``snapshot`` into ``folder`` in a thread, then call ``then()``.

        A failure is kept and raised by :meth:`join`.
        """
        def run():
            try:
                if snapshot is not None:
                    accelerate_io.write_large_state(folder, *snapshot)
                then()
            except BaseException as exc:  # pylint: disable=broad-except
                self._error = exc

        self._thread = threading.Thread(
            target=run, name=f'checkpoint-writer-{folder}', daemon=False)
        self._thread.start()

    def busy(self):
        """Whether a save is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def join(self):
        """Wait for the save in flight; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self):
        """Wait for the save in flight and free the buffers."""
        try:
            self.join()
        finally:
            self._buffers = {}


def copy_into(buffer, tensor):
    """``buffer.copy_(tensor)``; between host tensors, a memcpy on this thread.

    A host copy is bound by memory bandwidth, which one thread reaches;
    torch's intra-op threads wait for each other, and stall when the
    machine is busy (benchmarks/RESULTS.rst).
    """
    if tensor.device.type == 'cpu' and tensor.dim() and tensor.is_contiguous():
        np.copyto(buffer.view(torch.uint8).numpy(), tensor.view(torch.uint8).numpy())
    else:
        buffer.copy_(tensor)
