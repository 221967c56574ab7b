"""What a resume needs beside ``accelerator.save_state``, one function per artefact.

- the skorch history (JSON);
- the state of the net's callbacks by name (JSON, tensors in safetensors);
- per rank: the training loader's shuffling generator and epoch counter,
  which accelerate creates when the loader is prepared and does not save.

Nothing here is pickled, so loading executes no code. The files are written
into a checkpoint's partial folder, which nobody reads before it is
committed, and the commit flushes every file of the folder to disk: so they
are written plainly, without a temporary name and a flush of their own each.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import time
import warnings
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from skorch.callbacks import (
    BatchScoring,
    Callback,
    EpochScoring,
    EpochTimer,
    LRScheduler,
    PassthroughScoring,
    PrintLog,
    ProgressBar,
)
from skorch.history import History

from skorch_accel_callbacks import accelerate_io
from skorch_accel_callbacks.atomic import read_json, write_json
from skorch_accel_callbacks.format import (
    CALLBACK_TENSORS_NAME,
    CALLBACKS_NAME,
    HISTORY_NAME,
    epoch_caches_names,
    rank_state_name,
)

if TYPE_CHECKING:
    from skorch import NeuralNet
    from torch.utils.data import DataLoader

__all__ = [
    'capture_rng',
    'restore_rng',
    'reseed_origin',
    'derived_rng',
    'derived_rank_state',
    'data_fingerprint',
    'describe_data',
    'fixed_rng',
    'keep_new_optimizer_settings',
    'epoch_completed',
    'optimizer_steps',
    'find_train_loader',
    'optimizer_hyperparameters',
    'restore_optimizer_hyperparameters',
    'save_history',
    'load_history',
    'save_callback_states',
    'load_callback_states',
    'apply_callback_states',
    'save_epoch_caches',
    'load_epoch_caches',
    'apply_epoch_caches',
    'unknown_batch_state',
    'save_rank_state',
    'load_rank_state',
    'apply_rank_state',
]

# Fitted attributes that are scratch space of one epoch, not state: saving
# them would only cost disk (they are reset when the next epoch begins).
_TRANSIENT = {
    EpochScoring: ('y_trues_', 'y_preds_'),
}
# Fitted attributes that hold a wall-clock time: saved as the seconds since
# then and given back as that long before the resume, so that a resumed
# epoch's ``dur`` counts the time spent training, not the time the job was down.
_CLOCKS = {
    EpochTimer: ('epoch_start_time_',),
}
# Callbacks with nothing to resume: restoring PrintLog would only suppress
# the table header of the resumed run.
_SKIPPED = (PrintLog,)
# key under which a callback's own state_dict() is stored
_OWN_STATE = '<state_dict>'


# ---------------------------------------------------------------- history

def epoch_completed(net: NeuralNet) -> bool:
    """Whether the last epoch of the history ran to its end (skorch records
    ``train_loss`` when an epoch's training batches are all done)."""
    return bool(net.history) and 'train_loss' in net.history[-1]


def optimizer_steps(history: Iterable[Mapping[str, Any]], accumulation_steps: int) -> int:
    """The optimizer steps of the complete epochs of ``history``, with a
    step every ``accumulation_steps`` batches and at each epoch's last."""
    return sum(math.ceil(row['train_batch_count'] / accumulation_steps)
               for row in history if 'train_batch_count' in row)


def save_history(folder: str | os.PathLike, net: NeuralNet) -> None:
    net.history.to_file(f"{folder}/{HISTORY_NAME}")


def load_history(folder: str | os.PathLike) -> History:
    return History.from_file(f"{folder}/{HISTORY_NAME}")


# ---------------------------------------------------------------- data

# rows hashed for a fingerprint, spread evenly over the data
_SAMPLE_ROWS = 64


def data_fingerprint(X: Any, y: Any = None) -> dict[str, Any]:
    """A cheap fingerprint of the training data: lengths, shapes, dtypes and
    a hash of a few rows spread over it (not of all of it: it is computed
    at every ``fit``).

    Arrays, tensors, pandas objects, dicts of those and (torch) datasets
    are described; anything else by its type only. The rows of a data set
    are read under :func:`fixed_rng`: one that draws random numbers when
    it loads a row (augmentation) has the same fingerprint at every
    launch, and the run's random states are left as they were.
    """
    with fixed_rng():
        return {'X': _describe(X), 'y': _describe(y)}


@contextmanager
def fixed_rng(seed: int = 0) -> Iterator[None]:
    """Inside, Python's, numpy's and torch's generators (CPU, and the current
    CUDA device's once CUDA is initialized) start from ``seed``; after, they
    are where they were before."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        random.seed(seed)
        np.random.seed(seed)
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def describe_data(data: object) -> dict | None:
    """The fingerprint of an array, tensor or pandas object (length, shape,
    dtype, a hash of some rows); ``None`` for anything else."""
    if hasattr(data, 'to_numpy'):  # pandas
        data = data.to_numpy()
    if isinstance(data, (np.ndarray, torch.Tensor)):
        length = len(data) if data.ndim else 0
        return {'len': length, 'shape': list(data.shape), 'dtype': str(data.dtype),
                'sample': _digest(data[i] for i in _sample_rows(length))}
    return None


def _describe(data: Any) -> dict[str, Any] | None:
    if data is None:
        return None
    if isinstance(data, dict):
        return {str(key): _describe(value) for key, value in data.items()}
    array = describe_data(data)
    if array is not None:
        return array
    if hasattr(data, '__len__') and hasattr(data, '__getitem__'):
        length = len(data)
        return {'type': type(data).__qualname__, 'len': length,
                'sample': _digest(data[i] for i in _sample_rows(length))}
    return {'type': type(data).__qualname__}


def _sample_rows(length: int) -> range | list[int]:
    if length <= _SAMPLE_ROWS:
        return range(length)
    return np.linspace(0, length - 1, _SAMPLE_ROWS).astype(int).tolist()


def _digest(rows: Iterable[Any]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for row in rows:
        _feed(digest, row)
    return digest.hexdigest()


def _feed(digest: hashlib.blake2b, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        digest.update(str(obj.dtype).encode())
        digest.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, dict):
        for key, value in obj.items():
            digest.update(repr(key).encode())
            _feed(digest, value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _feed(digest, value)
    else:
        digest.update(repr(obj).encode())


# ---------------------------------------------------------------- RNG

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


# ---------------------------------------------------------------- reseeding

def reseed_origin(rng: Mapping[str, Any], rank_state: Mapping[str, Any]) -> int:
    """A 64-bit number that stands for the random states a checkpoint's rank 0
    was saved with (its global generators and its loader's shuffling state):
    the origin from which another number of processes derives its own."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr(rng['python']).encode())
    _feed(digest, list(rng['numpy']))
    _feed(digest, rng['torch'])
    _feed(digest, rank_state.get('generator'))
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


# ---------------------------------------------------------------- optimizer

def optimizer_hyperparameters(
        optimizers: Iterable[torch.optim.Optimizer],
) -> list[list[dict[str, Any]]]:
    """Each optimizer's param-group settings (lr, momentum, ...) without the params."""
    return [[{key: value for key, value in group.items() if key != 'params'}
             for group in optimizer.param_groups] for optimizer in optimizers]


def keep_new_optimizer_settings(
        net: NeuralNet,
        names: Collection[str],
        fresh: Sequence[Sequence[dict[str, Any]]],
        saved: Sequence[Sequence[dict[str, Any]]],
) -> None:
    """Make the values that the net's parameters ``names`` give its
    optimizers now (``fresh``, as :func:`optimizer_hyperparameters` read
    them before the checkpoint was loaded) win over those of the checkpoint
    (``saved``, changed in place): ``lr`` sets every optimizer's ``lr``,
    ``<optimizer>__<key>`` that optimizer's ``key``, and
    ``<optimizer>__param_groups`` all its settings."""
    present = [name for name in net._optimizers if getattr(net, name + '_', None) is not None]
    for optimizer, new_groups, old_groups in zip(present, fresh, saved, strict=True):
        keys = {'lr'} if 'lr' in names else set()
        keys |= {name[len(optimizer) + 2:] for name in names
                 if name.startswith(optimizer + '__')}
        for new, old in zip(new_groups, old_groups, strict=True):
            taken = new if 'param_groups' in keys else keys & set(new)
            old.update({key: new[key] for key in taken})


def restore_optimizer_hyperparameters(
        optimizers: Iterable[torch.optim.Optimizer],
        saved: Sequence[Sequence[Mapping[str, Any]]],
) -> None:
    """Undo what was done to the loaded settings since, e.g. by skorch's
    LRScheduler, which steps a new scheduler (changing the lr) when it is
    created at the start of training."""
    for optimizer, groups in zip(optimizers, saved, strict=True):
        for group, settings in zip(optimizer.param_groups, groups, strict=True):
            group.update(settings)


# ---------------------------------------------------------------- loader

def find_train_loader(net: NeuralNet, dataset_train: Any) -> DataLoader | None:
    """The loader that accelerate prepared for ``dataset_train``, if any."""
    accelerator = getattr(net, 'accelerator', None)
    if accelerator is None or dataset_train is None:
        return None
    for loader in reversed(accelerate_io.dataloaders(accelerator)):
        if getattr(loader, 'dataset', None) is dataset_train:
            return loader
    return None


def save_rank_state(folder: str | os.PathLike, rank: int, loader: DataLoader | None) -> None:
    """Save the shuffling state of this rank's training loader.

    With more than one process accelerate gives the sampler a generator of
    its own, seeded when the loader is prepared; ``save_state`` writes no
    file for it with map-style data sets.
    """
    tensors = {}
    metadata = {'loader_iteration': '0'}
    if loader is not None:
        metadata['loader_iteration'] = str(getattr(loader, 'iteration', 0))
        generator = getattr(loader, 'synchronized_generator', None)
        if generator is not None:
            tensors['generator'] = generator.get_state()
    # safetensors refuses an empty file
    tensors.setdefault('_', torch.zeros(0))
    save_file(tensors, f"{folder}/{rank_state_name(rank)}", metadata=metadata)


def load_rank_state(folder: str | os.PathLike, rank: int) -> dict[str, Any]:
    path = f"{folder}/{rank_state_name(rank)}"
    with safe_open(path, framework='pt') as f:
        metadata = f.metadata() or {}
        state = {'loader_iteration': int(metadata.get('loader_iteration', 0))}
        if 'generator' in f.keys():
            state['generator'] = f.get_tensor('generator')
    return state


def apply_rank_state(loader: DataLoader | None, state: Mapping[str, Any]) -> None:
    if loader is None:
        return
    loader.iteration = state['loader_iteration']
    generator = getattr(loader, 'synchronized_generator', None)
    if generator is not None and 'generator' in state:
        generator.set_state(state['generator'])


# ---------------------------------------------------------------- callbacks

class _Encoder:
    """JSON for scalars and containers; tensors go to a safetensors file."""

    def __init__(self) -> None:
        self.tensors = {}

    def encode(self, value: Any, key: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (int, np.integer)):
            return int(value)
        if isinstance(value, (float, np.floating)):
            value = float(value)
            return value if math.isfinite(value) else {'__float__': repr(value)}
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value.detach().cpu().clone().contiguous()
            return {'__tensor__': key}
        if isinstance(value, np.ndarray):
            self.tensors[key] = torch.from_numpy(np.ascontiguousarray(value)).clone()
            return {'__ndarray__': key}
        if isinstance(value, (list, tuple)):
            return {'__' + type(value).__name__ + '__': [
                self.encode(v, f"{key}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            return {'__dict__': [
                [self.encode(k, f"{key}.k{i}"), self.encode(v, f"{key}.{i}")]
                for i, (k, v) in enumerate(value.items())]}
        raise TypeError(type(value).__name__)


def _decode(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if not isinstance(obj, dict):
        return obj
    (kind, value), = obj.items()
    if kind == '__float__':
        return float(value)
    if kind == '__tensor__':
        return tensors[value]
    if kind == '__ndarray__':
        return tensors[value].numpy()
    if kind == '__list__':
        return [_decode(v, tensors) for v in value]
    if kind == '__tuple__':
        return tuple(_decode(v, tensors) for v in value)
    if kind == '__dict__':
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value}
    raise ValueError(f"unknown encoding {kind!r}")


def _is_configuration(value: Any) -> bool:
    # classes and functions are set up by the user's code, not learned
    return isinstance(value, type) or (
        callable(value) and not hasattr(value, 'state_dict'))


def _callback_state(callback: Callback) -> dict[str, dict[str, Any]]:
    """The attributes of a callback that a resumed run needs."""
    if hasattr(callback, 'state_dict') and hasattr(callback, 'load_state_dict'):
        return {_OWN_STATE: {'state_dict': callback.state_dict()}}
    transient, clocks = (), ()
    for cls, names in _TRANSIENT.items():
        if isinstance(callback, cls):
            transient = names
    for cls, names in _CLOCKS.items():
        if isinstance(callback, cls):
            clocks = names
    state = {}
    for attr, value in vars(callback).items():
        if not attr.endswith('_') or attr.startswith('_') or attr in transient:
            continue
        if _is_configuration(value):
            continue
        if attr in clocks and value is not None:
            state[attr] = {'elapsed': time.time() - value}
        elif hasattr(value, 'state_dict') and not isinstance(value, type):
            state[attr] = {'state_dict': value.state_dict()}
        else:
            state[attr] = {'value': value}
    return state


def save_callback_states(
        folder: str | os.PathLike, net: NeuralNet, skip: Collection[Callback] = (),
) -> None:
    """Save the state of every callback of ``net`` by name.

    A callback with ``state_dict()``/``load_state_dict()`` methods decides
    itself what is saved; for the others, the fitted attributes (names ending
    in ``_``) are saved, and objects with a ``state_dict`` (such as the
    scheduler of skorch's ``LRScheduler``) through it. An attribute that is
    neither data nor has a ``state_dict`` is left out with a warning.
    """
    encoder = _Encoder()
    states = {}
    for name, callback in net.callbacks_:
        if isinstance(callback, _SKIPPED) or any(callback is s for s in skip):
            continue
        encoded = {}
        for attr, entry in _callback_state(callback).items():
            key = f"{name}/{attr}"
            try:
                encoded[attr] = {kind: encoder.encode(value, key)
                                 for kind, value in entry.items()}
            except TypeError as exc:
                warnings.warn(
                    f"callback {name!r}: attribute {attr!r} of type {exc} cannot "
                    "be saved without pickle and is not restored on resume; give "
                    "the callback state_dict()/load_state_dict() methods to "
                    "control what is saved", UserWarning, stacklevel=2)
        states[name] = encoded
    write_json(f"{folder}/{CALLBACKS_NAME}", states, atomic=False)
    save_file(encoder.tensors or {'_': torch.zeros(0)}, f"{folder}/{CALLBACK_TENSORS_NAME}")


def load_callback_states(folder: str | os.PathLike) -> dict[str, dict[str, dict[str, Any]]]:
    """Read what :func:`save_callback_states` wrote: name -> attr -> entry."""
    states = read_json(f"{folder}/{CALLBACKS_NAME}")
    tensors = load_file(f"{folder}/{CALLBACK_TENSORS_NAME}")
    return {
        name: {attr: {kind: _decode(value, tensors) for kind, value in entry.items()}
               for attr, entry in attrs.items()}
        for name, attrs in states.items()
    }


def apply_callback_states(
        net: NeuralNet, states: Mapping[str, Mapping[str, Mapping[str, Any]]],
) -> None:
    """Give the net's callbacks the state they had when it was saved."""
    for name, callback in net.callbacks_:
        attrs = states.get(name)
        if attrs is None:
            continue
        if _OWN_STATE in attrs:
            callback.load_state_dict(attrs[_OWN_STATE]['state_dict'])
            continue
        for attr, entry in attrs.items():
            if 'state_dict' in entry:
                target = getattr(callback, attr, None)
                if target is None or not hasattr(target, 'load_state_dict'):
                    raise ValueError(
                        f"callback {name!r} has no {attr!r} to load the saved "
                        "state into")
                target.load_state_dict(entry['state_dict'])
            elif 'elapsed' in entry:
                setattr(callback, attr, time.time() - entry['elapsed'])
            else:
                setattr(callback, attr, entry['value'])


# ---------------------------------------------------------------- within an epoch

def save_epoch_caches(folder: str | os.PathLike, rank: int, net: NeuralNet) -> None:
    """Save this rank's scratch space of the epoch under way (the
    predictions EpochScoring collects on the training batches), which a
    checkpoint in the middle of an epoch needs: at the epoch's end they are
    scored together."""
    encoder = _Encoder()
    caches = {}
    for name, callback in net.callbacks_:
        for cls, attrs in _TRANSIENT.items():
            if isinstance(callback, cls):
                caches[name] = {attr: encoder.encode(getattr(callback, attr, None),
                                                     f"{name}/{attr}")
                                for attr in attrs}
    json_name, tensors_name = epoch_caches_names(rank)
    write_json(f"{folder}/{json_name}", caches, atomic=False)
    save_file(encoder.tensors or {'_': torch.zeros(0)}, f"{folder}/{tensors_name}")


def load_epoch_caches(folder: str | os.PathLike, rank: int) -> dict[str, dict[str, Any]]:
    json_name, tensors_name = epoch_caches_names(rank)
    caches = read_json(f"{folder}/{json_name}")
    tensors = load_file(f"{folder}/{tensors_name}")
    return {name: {attr: _decode(value, tensors) for attr, value in attrs.items()}
            for name, attrs in caches.items()}


def apply_epoch_caches(
        net: NeuralNet,
        caches: Mapping[str, Mapping[str, Any]],
        device: torch.device | str | None = None,
) -> None:
    """Give the callbacks their scratch space of the epoch back; tensors go
    to ``device`` (where the net's predictions are)."""
    def place(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and device is not None:
            return value.to(device)
        if isinstance(value, list):
            return [place(v) for v in value]
        return value

    for name, callback in net.callbacks_:
        for attr, value in caches.get(name, {}).items():
            setattr(callback, attr, place(value))


# skorch's callbacks whose state within an epoch a checkpoint holds: their
# fitted attributes (LRScheduler's batch count and scheduler), EpochScoring's
# caches, the history's batch rows; or that have none
_BATCH_STATE_KNOWN = (BatchScoring, EpochScoring, EpochTimer, LRScheduler, PassthroughScoring,
                      PrintLog, ProgressBar)


def unknown_batch_state(net: NeuralNet, own: Iterable[type[Callback]] = ()) -> list[str]:
    """Names of the net's callbacks that act on every batch and whose state
    within an epoch no checkpoint is known to hold: not one of skorch's
    handled above nor ``own``, and without ``state_dict()`` (only their
    fitted attributes, as the main process saved them, come back)."""
    names = []
    for name, callback in net.callbacks_:
        if isinstance(callback, _BATCH_STATE_KNOWN + tuple(own)) or hasattr(
                callback, 'state_dict'):
            continue
        hooks = ('on_batch_begin', 'on_batch_end', 'on_grad_computed')
        if any(getattr(type(callback), hook) is not getattr(Callback, hook) for hook in hooks):
            names.append(name)
    return names
