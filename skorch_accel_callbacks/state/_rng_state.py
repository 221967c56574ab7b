"""The random states of a process and of its training loader, captured,
given back, and derived anew for a resume on another number of processes.

The loader's state is its epoch counter, the shuffling generator that
accelerate gives its sampler with more than one process (accelerate
creates both when the loader is prepared and saves neither), and every
other generator the loader draws from: the loader's own ``generator`` (the
workers' base seed, and the sampler skorch's ``iterator_train__shuffle``
builds) and a user's sampler's (``WeightedRandomSampler(...,
generator=g)``, a ``BatchSampler`` over a sampler with one), found by their
path from the loader (``'batch_sampler.sampler.generator'``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.state._fingerprint import feed

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = [
    'apply_loader_state',
    'capture_rng',
    'derived_rank_state',
    'derived_rng',
    'loader_generators',
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


def loader_generators(loader: DataLoader) -> dict[str, torch.Generator]:
    """The generators that ``loader`` draws from besides accelerate's
    ``synchronized_generator``, each once, by its path from the torch loader
    under it (``'generator'``, ``'batch_sampler.sampler.generator'``)."""
    synchronized = getattr(loader, 'synchronized_generator', None)
    seen = {id(synchronized)}
    found = {}
    # (object, its path): the loader, then its samplers, however nested
    todo = [(accelerate_io.base_loader(loader), '')]
    while todo:
        obj, path = todo.pop(0)
        generator = getattr(obj, 'generator', None)
        if isinstance(generator, torch.Generator) and id(generator) not in seen:
            seen.add(id(generator))
            found[f'{path}generator'] = generator
        if path.count('.') < 8:
            for name in ('batch_sampler', 'sampler'):
                inner = getattr(obj, name, None)
                if inner is not None and inner is not obj:
                    todo.append((inner, f'{path}{name}.'))
    return found


def loader_state(loader: DataLoader | None) -> dict[str, Any]:
    """The shuffling state of a training loader (None: of none), in the form
    :func:`apply_loader_state` takes: its epoch counter
    (``'loader_iteration'``), accelerate's generator's state (``'generator'``,
    if it has one) and the states of the other generators it draws from
    (``'generators'``: path -> state, see :func:`loader_generators`)."""
    state = {'loader_iteration': 0, 'generators': {}}
    if loader is not None:
        state['loader_iteration'] = int(getattr(loader, 'iteration', 0))
        generator = getattr(loader, 'synchronized_generator', None)
        if generator is not None:
            state['generator'] = generator.get_state()
        state['generators'] = {path: generator.get_state()
                               for path, generator in loader_generators(loader).items()}
    return state


def apply_loader_state(loader: DataLoader | None, state: Mapping[str, Any]) -> None:
    """Give ``loader`` the state :func:`loader_state` returned (a generator
    the state does not name, as in a checkpoint of an older version, keeps
    its own)."""
    if loader is None:
        return
    loader.iteration = state['loader_iteration']
    generator = getattr(loader, 'synchronized_generator', None)
    if generator is not None and 'generator' in state:
        generator.set_state(state['generator'])
    saved = state.get('generators', {})
    for path, generator in loader_generators(loader).items():
        if path in saved:
            generator.set_state(saved[path])


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
