"""Moving one checkpoint's files between a local folder and a store.

A store has no rename to commit with, so an upload sends a checkpoint's
files first, then its manifest with a create-only write (``If-None-Match:
*`` on S3), then the pointers: in the store a checkpoint is complete
exactly when its manifest is there and every file it lists has its listed
size. A download fetches the files into an empty (partial) folder and
writes the manifest last, as a local save does.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from skorch_accel_callbacks import format
from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError

__all__ = ['Store', 'check_remote', 'download', 'upload']


@dataclass(frozen=True)
class Store:
    """A folder of checkpoints in a store: the fsspec filesystem, the
    folder's path in it, and its URL (as messages name it)."""

    fs: Any
    root: str
    dirname: str

    def path(self, *parts: str) -> str:
        """The path in the filesystem of ``parts`` under the folder."""
        return '/'.join((self.root, *(part.replace(os.sep, '/') for part in parts)))

    def url(self, *parts: str) -> str:
        """The URL of ``parts`` under the folder."""
        return '/'.join((self.dirname, *(part.replace(os.sep, '/') for part in parts)))


def upload(store: Store, local: str, name: str, best: bool, replace: bool,
           before_manifest: Callable[[], None]) -> None:
    """Upload the committed checkpoint folder ``local`` as checkpoint
    ``name``: its files, its manifest (create-only, after
    ``before_manifest()``), then ``latest.json`` and, if ``best``,
    ``best.json``. ``replace``: a checkpoint of that name that this job may
    replace is in the store.

    Raises :class:`CheckpointError` naming the manifest's URL if another
    job committed that name meanwhile.
    """
    fs = store.fs
    with open(os.path.join(local, format.MANIFEST_NAME), 'rb') as file:
        sealed = file.read()
    files = list(json.loads(sealed)['files'])
    if replace:
        # an epoch trained again after resuming from an older checkpoint
        # replaces it, as in a local folder; its manifest goes first, so
        # that no reader takes the old manifest for the new files
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(store.path(name, format.MANIFEST_NAME))
    # one call: an async filesystem (s3fs) sends the files concurrently
    fs.put([os.path.join(local, rel) for rel in files],
           [store.path(name, rel) for rel in files])
    before_manifest()
    try:
        fs.pipe_file(store.path(name, format.MANIFEST_NAME), sealed, mode='create')
    except FileExistsError as exc:
        raise CheckpointError(
            f"{store.url(name, format.MANIFEST_NAME)} exists already: another job committed "
            f"{store.url(name)} while this one trained; only one job may save into a "
            "dirname") from exc
    pointer = json.dumps({'name': name}).encode()
    fs.pipe_file(store.path(format.pointer_name('latest')), pointer)
    if best:
        fs.pipe_file(store.path(format.pointer_name('best')), pointer)


def check_remote(store: Store, name: str) -> tuple[bytes, list[str]]:
    """The manifest's bytes and the files of checkpoint ``name`` in the
    store; :class:`CorruptCheckpointError` naming the URL at fault."""
    fs, remote, url = store.fs, store.path(name), store.url(name)
    target = f"{url}/{format.MANIFEST_NAME}"
    try:
        sealed = fs.cat_file(f"{remote}/{format.MANIFEST_NAME}")
        files = json.loads(sealed)['files']
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{target} is missing") from exc
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptCheckpointError(f"{target} is not a manifest: {exc}") from exc
    fs.invalidate_cache(remote)
    sizes = {path[len(remote) + 1:]: info['size']
             for path, info in fs.find(remote, detail=True).items()}
    for rel, size in files.items():
        rel = rel.replace(os.sep, '/')
        if rel not in sizes:
            raise CorruptCheckpointError(f"{url}/{rel} is missing (listed in {target})")
        if sizes[rel] != size:
            raise CorruptCheckpointError(
                f"{url}/{rel} has {sizes[rel]} bytes, {target} says {size}: "
                "the file is damaged")
    return sealed, list(files)


def download(store: Store, name: str, files: list[str], sealed: bytes, partial: str) -> None:
    """Download checkpoint ``name`` into the empty folder ``partial``: its
    ``files``, then the manifest ``sealed`` last."""
    targets = [os.path.join(partial, rel) for rel in files]
    for folder in {os.path.dirname(path) for path in targets}:
        os.makedirs(folder, exist_ok=True)
    store.fs.get([store.path(name, rel) for rel in files], targets)
    with open(os.path.join(partial, format.MANIFEST_NAME), 'wb') as file:
        file.write(sealed)
