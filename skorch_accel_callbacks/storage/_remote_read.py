"""Reading the checkpoints of a folder in a store: which are complete, and
the one to resume from, downloaded into the staging folder.

In the store a checkpoint is complete exactly when its manifest is there
and every file it lists has its listed size: an upload cut short leaves
files without a manifest, which nothing here takes for a checkpoint.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.format import _atomic as atomic, _manifest
from skorch_accel_callbacks.storage import _transfer as transfer
from skorch_accel_callbacks.storage._local import CheckpointFolder, Found

__all__ = ['check', 'committed', 'fetch', 'find_checkpoint', 'marked_best', 'pointed']


def _read_json(store: transfer.Store, *parts: str) -> Any:
    return json.loads(store.fs.cat_file(store.path(*parts)))


def pointed(store: transfer.Store, which: str) -> str | None:
    """The name ``latest.json`` or ``best.json`` in the store points at, or None."""
    try:
        return _manifest.pointed_name(_read_json(store, _manifest.pointer_name(which)))
    except (OSError, ValueError):
        return None


def check(store: transfer.Store, name: str) -> tuple[dict[str, Any], str | None]:
    """The manifest of checkpoint ``name`` in the store (``{}`` if it
    cannot be read) and why the checkpoint is not complete there (None if
    it is), without downloading it."""
    try:
        sealed, _ = transfer.check_remote(store, name)
        return json.loads(sealed), None
    except CorruptCheckpointError as exc:
        try:
            saved = _read_json(store, name, _manifest.MANIFEST_NAME)
        except (OSError, ValueError):
            saved = {}
        return (saved if isinstance(saved, dict) else {}), str(exc)


def marked_best(store: transfer.Store, name: str) -> bool:
    """Whether the manifest of checkpoint ``name`` marks it a best one."""
    try:
        return bool(_read_json(store, name, _manifest.MANIFEST_NAME).get('best'))
    except (OSError, ValueError, AttributeError):
        return False


def committed(store: transfer.Store) -> list[str]:
    """Names of the checkpoints in the store with a manifest, oldest first:
    in the order of their names, which is the order of their commits since
    the create-only manifest never lets a name be committed twice."""
    # s3fs's listing cache misses what other writers added
    store.fs.invalidate_cache()
    try:
        # one listing of every object below (a request per 1000 on S3),
        # where a glob of '*/manifest.json' lists each checkpoint in turn
        paths = store.fs.find(store.root)
    except FileNotFoundError:
        return []
    names = set()
    for path in paths:
        name, _, rest = path[len(store.root) + 1:].partition('/')
        if rest == _manifest.MANIFEST_NAME and _manifest.is_checkpoint_name(name):
            names.add(name)
    return sorted(names)


def find_checkpoint(store: transfer.Store, staging: CheckpointFolder,
                    which: str | os.PathLike[str] = 'latest') -> Found | None:
    """The checkpoint ``which`` names (``'latest'``, ``'best'``, a name in
    the store, or a local path), downloaded into ``staging`` and checked
    there, with its manifest; None if there is none.

    As :meth:`CheckpointFolder.find_checkpoint`: for ``'latest'`` a damaged
    checkpoint (a file missing or of another size than its manifest lists)
    is skipped with a warning naming its URL.
    """
    which = os.fspath(which)
    names = committed(store)
    if which == 'best':
        best = pointed(store, 'best')
        if best is None:
            if names:
                raise CheckpointError(
                    f"no best checkpoint in {store.dirname}: only checkpoints saved "
                    "because of `monitor` are best ones")
            return None
        return fetch(store, staging, best)
    if _manifest.is_checkpoint_name(which):
        if which not in names:
            raise FileNotFoundError(
                f"no checkpoint {which} in {store.dirname}; it has {names or 'none'}")
        return fetch(store, staging, which)
    if which != 'latest':
        return Found(which, _manifest.read(which))
    latest = pointed(store, 'latest')
    problems = []
    for name in ([latest] if latest in names else []) + [
            name for name in reversed(names) if name != latest]:
        try:
            return fetch(store, staging, name)
        except CorruptCheckpointError as exc:
            warnings.warn(f"skipping checkpoint {store.url(name)}: {exc}", UserWarning)
            problems.append(str(exc))
    if problems:
        raise CheckpointError(
            f"{store.dirname} holds checkpoints but none is complete: " + '; '.join(problems))
    return None


def fetch(store: transfer.Store, staging: CheckpointFolder, name: str) -> Found:
    """Checkpoint ``name`` checked in the store, downloaded unless
    ``staging`` has it complete, and checked again there.

    The files that ``staging``'s copy has the same (those of its node,
    when each node staged its part) are linked, not downloaded."""
    sealed, files = transfer.check_remote(store, name)
    local = staging.path(name)
    if transfer.holds_manifest(local, sealed):
        manifest, problems = _manifest.check(local)
        if not problems:
            return Found(local, manifest)
    # a partial folder renamed into place once complete, as a save
    partial = staging.start(name)
    reuse = local if os.path.isdir(local) else None
    manifest = transfer.download(store, name, files, sealed, partial, reuse=reuse)
    replaced = atomic.replace_folder(partial, local)
    if replaced is not None:
        replaced.join()
    return Found(local, manifest)
