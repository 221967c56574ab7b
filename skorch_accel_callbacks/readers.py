"""Reading checkpoint files without executing code, and naming the one at fault.

A reader's own error (torch's weights-only unpickler, JSON, safetensors)
rarely says which file it was reading; after a load failed, the files are
read again one by one, on that error path only, to name it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any

import torch
from safetensors.torch import load_file

from skorch_accel_callbacks.atomic import read_json

__all__ = ['first_unloadable', 'load_without_code']

# how each kind of file is read; torch files with weights_only=True
_READERS = {
    'safetensors': load_file,
    'json': read_json,
    # on the CPU: the file of a GPU run is not at fault where no GPU is
    'torch': functools.partial(torch.load, map_location='cpu', weights_only=True),
}


def _kind_of(file: str) -> str:
    if file.endswith('.safetensors'):
        return 'safetensors'
    if file.endswith('.json'):
        return 'json'
    return 'torch'


def load_without_code(file: str | os.PathLike, kind: str | None = None) -> Any:
    """Load ``file`` as ``kind`` (``'safetensors'``, ``'json'`` or
    ``'torch'``; by its suffix if None) without executing code."""
    return _READERS[kind or _kind_of(os.fspath(file))](file)


def first_unloadable(
        files: Iterable[str | os.PathLike], kind: str | None = None,
) -> tuple[str | os.PathLike, Exception] | None:
    """``(file, exception)`` of the first of ``files`` that does not load,
    or None if all of them do."""
    for file in files:
        try:
            load_without_code(file, kind)
        except Exception as exc:  # pylint: disable=broad-except
            return file, exc
    return None
