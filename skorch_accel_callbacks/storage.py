"""Atomic files on disk: the one place where this package writes bytes.

A file is written under a temporary name in its own folder, flushed to disk
and moved over its final name with ``os.replace``, so a reader (or a resumed
run after a crash) sees either the old complete file or the new complete
file, never a torn one.
"""

import json
import os
import uuid
from contextlib import contextmanager

__all__ = [
    'TEMP_MARK',
    'atomic_path',
    'fsync_dir',
    'read_json',
    'write_json',
]

# Part of every temporary name, so that leftovers of a killed writer can be
# told apart from real files (and are never taken for a checkpoint).
TEMP_MARK = '.tmp-'


def fsync_dir(path):
    """Flush a folder's entries (a rename inside it) to disk."""
    fd = os.open(path or '.', os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        # not every filesystem can fsync a directory; the rename stands anyway
        pass
    finally:
        os.close(fd)


def _fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path):
    """Yield a temporary path next to ``path``; on success move it into place.

    The caller writes the complete file to the yielded path (with any writer
    that takes a path: ``torch.save``, ``safetensors.torch.save_file``,
    ``net.save_params``). When the block ends without an exception, the file
    is flushed to disk and atomically renamed to ``path``; when it raises,
    the temporary file is removed and ``path`` is left as it was.

    Examples
    --------
    >>> with atomic_path('run/params.pt') as tmp:
    ...     torch.save(module.state_dict(), tmp)

    """
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}{TEMP_MARK}{uuid.uuid4().hex[:12]}")
    try:
        yield tmp
        if not os.path.exists(tmp):
            raise FileNotFoundError(f"nothing was written for {path!r}")
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(folder)


def write_json(path, obj):
    """Write ``obj`` as JSON to ``path`` atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, 'w', encoding='utf-8') as f:
            json.dump(obj, f, indent=1, sort_keys=True)


def read_json(path):
    """Read a JSON file; a torn or invalid file raises ``ValueError`` naming it."""
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
