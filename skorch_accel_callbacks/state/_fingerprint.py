"""Values that stand for the training data and the settings of a run, the
same in every run with the same ones: what a checkpoint records to refuse
a resume on other data (:func:`data_fingerprint`) or other
hyper-parameters (:func:`describe`).

Nothing is pickled, and no address (``<... at 0x...>``) is part of one.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

__all__ = ['data_fingerprint', 'describe', 'describe_data', 'feed', 'fixed_rng']

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
        feed(digest, row)
    return digest.hexdigest()


def feed(digest: hashlib.blake2b, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        digest.update(str(obj.dtype).encode())
        digest.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, dict):
        for key, value in obj.items():
            digest.update(repr(key).encode())
            feed(digest, value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            feed(digest, value)
    else:
        digest.update(repr(obj).encode())


# nesting of objects that a description follows, beyond which an object is
# described by its type
_DESCRIBE_DEPTH = 4


def describe(value: Any, depth: int = 0) -> Any:
    """A JSON value that stands for ``value`` and is the same in every run
    with the same value: classes and functions by module and qualified name,
    arrays and tensors by shape, dtype and a hash of some rows, other objects
    by their type and (estimators) ``get_params()``, a ``repr`` without an
    address, or public attributes.
    Nothing is pickled, and no address (``<... at 0x...>``) is part of it."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {'float': repr(value)}
    if isinstance(value, (list, tuple)):
        return [describe(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return {str(key): describe(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((describe(item, depth + 1) for item in value), key=repr)
    if isinstance(value, functools.partial):
        return {'partial': describe(value.func, depth + 1),
                'args': describe(value.args, depth + 1),
                'keywords': describe(value.keywords, depth + 1)}
    if isinstance(value, type) or (callable(value) and hasattr(value, '__qualname__')):
        return {'callable': f"{value.__module__}.{value.__qualname__}"}
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    data = describe_data(value)
    if data is not None:
        return {'type': kind, 'data': data}
    if isinstance(value, torch.nn.Module) or depth >= _DESCRIBE_DEPTH:
        # a module instance's layout and weights are the checkpoint's models
        return {'type': kind}
    if hasattr(value, 'get_params'):
        return {'type': kind, 'params': describe(value.get_params(deep=False), depth + 1)}
    text = repr(value)
    if ' at 0x' not in text:  # a repr that says the value (torch.float32, an enum)
        return {'type': kind, 'repr': text}
    attrs = getattr(value, '__dict__', None)
    if isinstance(attrs, dict):
        return {'type': kind, 'attrs': {
            key: describe(item, depth + 1) for key, item in sorted(attrs.items())
            if not key.startswith('_')}}
    return {'type': kind}
