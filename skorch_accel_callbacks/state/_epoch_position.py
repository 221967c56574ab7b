"""Where a checkpoint is inside an epoch, and how a resume gets back there.

A checkpoint taken after batch ``b`` of an epoch (``every_n_steps``,
``every_n_seconds``, a signal) lets a resume

1. draw that epoch's data order again: each rank saves the random states it
   had when the epoch began (the global generators, from which a sampler
   without a generator of its own seeds itself, and the loader's shuffling
   generator and epoch counter), and they are restored before the loader is
   iterated;
2. skip the ``b`` batches already trained without loading them: for that
   one pass the loader's batch sampler is wrapped in accelerate's
   ``SkipBatchSampler``, so a skipped batch is a list of indices, never rows;
3. go on with the random states of batch ``b`` (accelerate's random-state
   file) and the callbacks' state within the epoch.

Nothing here is pickled.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import IterableDataset

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.format._manifest import position_name
from skorch_accel_callbacks.state import _rng_state as rng_state

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = ['EpochStart', 'can_skip', 'check_can_skip', 'load_position', 'save_position']


@dataclass(frozen=True)
class EpochStart:
    """The random states of this rank as an epoch began, before its loader
    drew the epoch's order."""

    #: the global random states (:func:`~skorch_accel_callbacks.state._rng_state.capture_rng`)
    rng: dict[str, Any]
    #: the state of the loader's shuffling generator, if it has one
    generator: torch.Tensor | None
    #: the loader's epoch counter
    iteration: int

    @classmethod
    def capture(cls, loader: DataLoader) -> EpochStart:
        state = rng_state.loader_state(loader)
        return cls(rng_state.capture_rng(), state.get('generator'), state['loader_iteration'])

    def restore(self, loader: DataLoader) -> None:
        """Give this process and ``loader`` these states back."""
        rng_state.restore_rng(self.rng)
        rng_state.apply_loader_state(
            loader, {'loader_iteration': self.iteration,
                     **({} if self.generator is None else {'generator': self.generator})})


def save_position(folder: str | os.PathLike, rank: int, start: EpochStart, batches: int) -> None:
    """Save where this rank is: ``batches`` trained in the epoch that began
    with ``start`` (an :class:`EpochStart`)."""
    python_version, python_state, python_gauss = start.rng['python']
    kind, key, pos, has_gauss, cached_gaussian = start.rng['numpy']
    tensors = {
        'python': torch.tensor(python_state, dtype=torch.int64),
        'numpy': torch.from_numpy(np.asarray(key, dtype=np.int64)),
        'torch': start.rng['torch'],
    }
    for index, state in enumerate(start.rng.get('cuda', ())):
        tensors[f'cuda.{index}'] = state
    if start.generator is not None:
        tensors['generator'] = start.generator
    metadata = {
        'batches': str(batches),
        'iteration': str(start.iteration),
        'python': json.dumps([python_version, python_gauss]),
        'numpy': json.dumps([kind, int(pos), int(has_gauss), float(cached_gaussian)]),
        'cuda_devices': str(len(start.rng.get('cuda', ()))),
    }
    save_file(tensors, f"{folder}/{position_name(rank)}", metadata=metadata)


def load_position(folder: str | os.PathLike, rank: int) -> tuple[int, EpochStart]:
    """``(batches, EpochStart)`` as :func:`save_position` saved them."""
    with safe_open(f"{folder}/{position_name(rank)}", framework='pt') as f:
        meta = f.metadata()
        python_version, python_gauss = json.loads(meta['python'])
        kind, pos, has_gauss, cached_gaussian = json.loads(meta['numpy'])
        rng = {
            'python': (python_version, tuple(f.get_tensor('python').tolist()), python_gauss),
            'numpy': (kind, f.get_tensor('numpy').numpy().astype(np.uint32), pos, has_gauss,
                      cached_gaussian),
            'torch': f.get_tensor('torch'),
        }
        devices = int(meta['cuda_devices'])
        if devices:
            rng['cuda'] = [f.get_tensor(f'cuda.{i}') for i in range(devices)]
        generator = f.get_tensor('generator') if 'generator' in f.keys() else None
        return int(meta['batches']), EpochStart(rng, generator, int(meta['iteration']))


def check_can_skip(loader: Any, owner: str) -> None:
    """Raise ``ValueError`` naming ``owner`` if ``loader`` cannot skip
    batches by index, which saves inside an epoch need."""
    if not can_skip(loader):
        raise ValueError(
            f"{owner}: every_n_steps and every_n_seconds save in the middle of an epoch, "
            "which a resume skips by index: that needs a map-style training data set "
            "(an IterableDataset cannot skip)")


def can_skip(loader: DataLoader | None) -> bool:
    """Whether the batches of ``loader`` can be skipped by index: a map-style
    data set, read through a batch sampler."""
    if loader is None:
        return False
    base = accelerate_io.base_loader(loader)
    return (not isinstance(base.dataset, IterableDataset)
            and getattr(base, 'batch_sampler', None) is not None)

