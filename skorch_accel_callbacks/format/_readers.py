"""Reading checkpoint files without executing code, and naming the one at fault.

The one table of the files this package reads and how: safetensors as
such, JSON as JSON, torch files (``.bin``, ``.pkl``, ``.pt``, ``.pth``) with
``torch.load(weights_only=True)`` as accelerate's ``load_state`` reads them.
A reader's own error (torch's weights-only unpickler, JSON, safetensors)
rarely says which file it was reading; after a load failed, the files are
read again one by one, on that error path only, to name it
(:func:`read_naming_fault`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from accelerate.utils import load as accelerate_load
from safetensors.torch import load_file

from skorch_accel_callbacks.errors import CorruptCheckpointError
from skorch_accel_callbacks.format._atomic import read_json

__all__ = ['first_unloadable', 'kind_of', 'load_without_code', 'read_naming_fault']

T = TypeVar('T')

# how each kind of file is read
_READERS: dict[str, Callable[[str | os.PathLike], Any]] = {
    'safetensors': load_file,
    'json': read_json,
    # weights_only=True, with the numpy types that accelerate's random
    # states hold allowed; on the CPU: the file of a GPU run is not at
    # fault where no GPU is
    'torch': functools.partial(accelerate_load, map_location='cpu'),
}
# the kind of file each suffix is; files of other suffixes are not read
_KINDS = {
    '.safetensors': 'safetensors',
    '.json': 'json',
    '.bin': 'torch',
    '.pkl': 'torch',
    '.pt': 'torch',
    '.pth': 'torch',
}


def kind_of(file: str | os.PathLike) -> str | None:
    """The reader of ``file`` by its suffix (``'safetensors'``, ``'json'``,
    ``'torch'``), or None for a file this package does not read."""
    return _KINDS.get(os.path.splitext(os.fspath(file))[1])


def load_without_code(file: str | os.PathLike, kind: str | None = None) -> Any:
    """Load ``file`` as ``kind`` (``'safetensors'``, ``'json'`` or
    ``'torch'``; by its suffix if None) without executing code."""
    kind = kind or kind_of(file)
    if kind is None:
        raise ValueError(f"{file} is not a file of a kind this package reads")
    return _READERS[kind](file)


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


def read_naming_fault(
        files: Sequence[str], read: Callable[[], T], *,
        error: type[Exception] = CorruptCheckpointError,
        failed: str = 'cannot be loaded',
        fallback: str | None = None,
) -> T:
    """``read()``, which reads ``files``; if it raises, raise ``error``
    naming the first of ``files`` that does not load (else ``fallback``, or
    all of them): ``"<file> <failed>: <exception>"``."""
    try:
        return read()
    except Exception as exc:  # pylint: disable=broad-except
        if len(files) == 1 and fallback is None:
            named = files[0]
        else:
            at_fault = first_unloadable(files)
            named = at_fault[0] if at_fault else fallback or ' or '.join(files)
        raise error(f"{named} {failed}: {type(exc).__name__}: {exc}") from exc
