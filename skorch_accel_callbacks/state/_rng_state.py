"""The random states of a process and of its training loader, captured,
given back, and derived anew for a resume on another number of processes.

The loader's state is its epoch counter and the shuffling generator that
accelerate gives its sampler with more than one process: accelerate
creates both when the loader is prepared and saves neither.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from skorch_accel_callbacks.state._fingerprint import feed

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = [
    'apply_loader_state',
    'capture_rng',
    'derived_rank_state',
    'derived_rng',
    'loader_state',
    'reseed_origin',
    'restore_rng',
]


def capture_rng() -> dict[str, Any]:
    """The global random states of this process (Python, numpy, torch, CUDA)."""
    state = {
        'python': random.getstate(),
        'numpy': np.random.get_state(),
        'torch': torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    random.setstate(state['python'])
    np.random.set_state(state['numpy'])
    torch.set_rng_state(state['torch'])
    if 'cuda' in state:
        torch.cuda.set_rng_state_all(state['cuda'])


def loader_state(loader: DataLoader | None) -> dict[str, Any]:
    """The shuffling state of a training loader (None: of none), in the form
    :func:`apply_loader_state` takes: its epoch counter
    (``'loader_iteration'``) and its generator's state (``'generator'``, if
    it has one)."""
    state = {'loader_iteration': 0}
    if loader is not None:
        state['loader_iteration'] = int(getattr(loader, 'iteration', 0))
        generator = getattr(loader, 'synchronized_generator', None)
        if generator is not None:
            state['generator'] = generator.get_state()
    return state


def apply_loader_state(loader: DataLoader | None, state: Mapping[str, Any]) -> None:
    """Give ``loader`` the state :func:`loader_state` returned."""
    if loader is None:
        return
    loader.iteration = state['loader_iteration']
    generator = getattr(loader, 'synchronized_generator', None)
    if generator is not None and 'generator' in state:
        generator.set_state(state['generator'])


# ---------------------------------------------------------------- reseeding

def reseed_origin(rng: Mapping[str, Any], rank_state: Mapping[str, Any]) -> int:
    """A 64-bit number that stands for the random states a checkpoint's rank 0
    was saved with (its global generators and its loader's shuffling state):
    the origin from which another number of processes derives its own."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr(rng['python']).encode())
    feed(digest, list(rng['numpy']))
    feed(digest, rng['torch'])
    feed(digest, rank_state.get('generator'))
    return int.from_bytes(digest.digest(), 'little')


def _derived_seed(origin: int, world_size: int, purpose: str) -> int:
    digest = hashlib.blake2b(f"{origin}:{world_size}:{purpose}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), 'little')


def derived_rng(origin: int, world_size: int, rank: int) -> dict[str, Any]:
    """The global random states of ``rank`` in a run of ``world_size``
    processes resumed from a checkpoint of ``origin``, in the form
    :func:`capture_rng` returns: different on every rank, the same at every
    resume of that checkpoint on that many processes."""
    seed = _derived_seed(origin, world_size, f"rank{rank}")
    state = {
        'python': random.Random(seed).getstate(),
        'numpy': np.random.RandomState([seed & 0xFFFFFFFF, seed >> 32]).get_state(),
        'torch': torch.Generator().manual_seed(seed).get_state(),
    }
    if torch.cuda.is_available():
        current = torch.cuda.get_rng_state_all()
        torch.cuda.manual_seed_all(seed)
        state['cuda'] = torch.cuda.get_rng_state_all()
        torch.cuda.set_rng_state_all(current)
    return state


def derived_rank_state(origin: int, world_size: int, loader_iteration: int) -> dict[str, Any]:
    """The loader state of every rank of such a run: the epoch counter goes
    on, and the shuffling generator, which accelerate keeps the same on all
    ranks, is derived from ``origin`` and ``world_size``."""
    seed = _derived_seed(origin, world_size, 'loader')
    return {'loader_iteration': loader_iteration,
            'generator': torch.Generator().manual_seed(seed).get_state()}
