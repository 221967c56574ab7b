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
   file) and the callbacks' state within the epoch; a loader that reads in
   this process had read batches ahead of training, whose fetches drew from
   the random states recorded before them: they are saved too and given
   back before the same fetches
   (:mod:`~skorch_accel_callbacks.state._loader_pass`).

Nothing here is pickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import IterableDataset

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.format import position_name
from skorch_accel_callbacks.state import _rng_state as rng_state

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = ['EpochStart', 'Position', 'can_skip', 'check_can_skip', 'load_position',
           'save_position']


@dataclass(frozen=True)
class EpochStart:
    """The random states of this rank as an epoch began, before its loader
    drew the epoch's order."""

    #: the global random states (:func:`~skorch_accel_callbacks.state._rng_state.capture_rng`)
    rng: dict[str, Any]
    #: the state of accelerate's shuffling generator, if the loader has one
    generator: torch.Tensor | None
    #: the loader's epoch counter
    iteration: int
    #: the states of the loader's other generators, by path
    #: (:func:`~skorch_accel_callbacks.state._rng_state.loader_generators`)
    generators: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def capture(cls, loader: DataLoader) -> EpochStart:
        state = rng_state.loader_state(loader)
        return cls(rng_state.capture_rng(), state.get('generator'), state['loader_iteration'],
                   state['generators'])

    def restore(self, loader: DataLoader) -> None:
        """Give this process and ``loader`` these states back."""
        rng_state.restore_rng(self.rng)
        rng_state.apply_loader_state(
            loader, {'loader_iteration': self.iteration, 'generators': self.generators,
                     **({} if self.generator is None else {'generator': self.generator})})


def _encode_rng(prefix: str, rng: Mapping[str, Any]) -> tuple[dict, dict]:
    """``rng`` (:func:`~skorch_accel_callbacks.state._rng_state.capture_rng`'s
    form) as safetensors tensors and metadata, their keys prefixed."""
    python_version, python_state, python_gauss = rng['python']
    kind, key, pos, has_gauss, cached_gaussian = rng['numpy']
    tensors = {
        f'{prefix}python': torch.tensor(python_state, dtype=torch.int64),
        f'{prefix}numpy': torch.from_numpy(np.asarray(key, dtype=np.int64)),
        f'{prefix}torch': rng['torch'],
    }
    for index, state in enumerate(rng.get('cuda', ())):
        tensors[f'{prefix}cuda.{index}'] = state
    metadata = {
        f'{prefix}python': json.dumps([python_version, python_gauss]),
        f'{prefix}numpy': json.dumps([kind, int(pos), int(has_gauss), float(cached_gaussian)]),
        f'{prefix}cuda_devices': str(len(rng.get('cuda', ()))),
    }
    return tensors, metadata


def _decode_rng(f: Any, meta: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """The random states :func:`_encode_rng` wrote with ``prefix``."""
    python_version, python_gauss = json.loads(meta[f'{prefix}python'])
    kind, pos, has_gauss, cached_gaussian = json.loads(meta[f'{prefix}numpy'])
    rng = {
        'python': (python_version, tuple(f.get_tensor(f'{prefix}python').tolist()),
                   python_gauss),
        'numpy': (kind, f.get_tensor(f'{prefix}numpy').numpy().astype(np.uint32), pos,
                  has_gauss, cached_gaussian),
        'torch': f.get_tensor(f'{prefix}torch'),
    }
    devices = int(meta[f'{prefix}cuda_devices'])
    if devices:
        rng['cuda'] = [f.get_tensor(f'{prefix}cuda.{i}') for i in range(devices)]
    return rng


@dataclass(frozen=True)
class Position:
    """Where this rank is inside an epoch, as a checkpoint saved it."""

    #: training batches of the epoch trained
    batches: int
    #: the states the epoch began with
    start: EpochStart
    #: the random states before each fetch that the loader had made ahead of
    #: training, in this process (:meth:`PassControl.read_ahead`)
    read_ahead: tuple[dict[str, Any], ...] = ()


def save_position(folder: str | os.PathLike, rank: int, start: EpochStart, batches: int,
                  read_ahead: Sequence[Mapping[str, Any]] = ()) -> None:
    """Save where this rank is: ``batches`` trained in the epoch that began
    with ``start`` (an :class:`EpochStart`), and the random states before the
    fetches read ahead of training (``read_ahead``)."""
    tensors, metadata = _encode_rng('', start.rng)
    if start.generator is not None:
        tensors['generator'] = start.generator
    tensors.update({f'generators.{path}': state for path, state in start.generators.items()})
    for index, rng in enumerate(read_ahead):
        more_tensors, more_metadata = _encode_rng(f'ahead.{index}.', rng)
        tensors.update(more_tensors)
        metadata.update(more_metadata)
    metadata.update(batches=str(batches), iteration=str(start.iteration),
                    read_ahead=str(len(read_ahead)))
    save_file(tensors, f"{folder}/{position_name(rank)}", metadata=metadata)


def load_position(folder: str | os.PathLike, rank: int) -> Position:
    """The :class:`Position` that :func:`save_position` saved."""
    with safe_open(f"{folder}/{position_name(rank)}", framework='pt') as f:
        meta = f.metadata()
        generator = f.get_tensor('generator') if 'generator' in f.keys() else None
        generators = {key.removeprefix('generators.'): f.get_tensor(key)
                      for key in f.keys() if key.startswith('generators.')}
        start = EpochStart(_decode_rng(f, meta, ''), generator, int(meta['iteration']),
                           generators)
        read_ahead = tuple(_decode_rng(f, meta, f'ahead.{index}.')
                           for index in range(int(meta.get('read_ahead', 0))))
        return Position(int(meta['batches']), start, read_ahead)


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

