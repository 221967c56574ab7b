"""A tree of values as a pair of files: JSON for scalars and containers,
a safetensors file for the tensors and arrays in it.

Nothing is pickled, so reading a pair executes no code. The tree's leaves
are encoded by the writer's ``encode`` (its outer levels, names, are
written as they are); :func:`read_pair` decodes the values ``depth``
levels down.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from safetensors.torch import save

from skorch_accel_callbacks.format import load_without_code

__all__ = ['encode_pair', 'read_pair', 'write_pair', 'write_bytes']

Encode = Callable[[Any, str], Any]


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


def encode_pair(build: Callable[[Encode], Any]) -> tuple[bytes, bytes]:
    """The bytes of the pair of files of the tree that ``build(encode)``
    returns, its values encoded by ``encode(value, key)`` (``key`` names a
    tensor in the tensors file; ``TypeError`` for a value that cannot be
    saved without pickle): the JSON file's, then the safetensors file's.

    In memory, so that the ranks can compare their pairs before any is
    written (the same tree gives the same bytes).
    """
    encoder = _Encoder()
    tree = build(encoder.encode)
    # as atomic.write_json writes JSON, so that both read back alike
    text = json.dumps(tree, indent=1, sort_keys=True).encode('utf-8')
    # safetensors refuses an empty file
    return text, save(encoder.tensors or {'_': torch.zeros(0)})


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` plainly, into a partial folder whose commit flushes it."""
    with open(path, 'wb') as f:
        f.write(data)


def write_pair(json_file: str | os.PathLike, tensors_file: str | os.PathLike,
               build: Callable[[Encode], Any]) -> None:
    """Write the pair :func:`encode_pair` encodes, plainly, into a partial
    folder whose commit flushes it."""
    for path, data in zip((json_file, tensors_file), encode_pair(build), strict=True):
        write_bytes(path, data)


def read_pair(json_file: str | os.PathLike, tensors_file: str | os.PathLike,
              depth: int) -> Any:
    """The tree :func:`write_pair` wrote, its values ``depth`` levels down decoded."""
    tree = load_without_code(json_file, 'json')
    tensors = load_without_code(tensors_file, 'safetensors')

    def decoded(node: Any, levels: int) -> Any:
        if levels == 0:
            return _decode(node, tensors)
        return {name: decoded(value, levels - 1) for name, value in node.items()}

    return decoded(tree, depth)
