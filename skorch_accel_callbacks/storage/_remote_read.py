"""Reading the checkpoints of a folder in a store: which are committed,
whether one is complete, and one downloaded into the staging folder (the
reads of :class:`~skorch_accel_callbacks.storage._remote.RemoteStorage`; which
checkpoint to read is :class:`~skorch_accel_callbacks.storage._interface.CheckpointStorage`'s
policy).

In the store a checkpoint is complete exactly when its manifest is there
and every file it lists has its listed size: an upload cut short leaves
files without a manifest, which nothing here takes for a checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

from skorch_accel_callbacks.errors import CorruptCheckpointError
from skorch_accel_callbacks.format import (
    CHECKSUM_ALGORITHM,
    MANIFEST_NAME,
    check_manifest,
    checksum_stream,
    is_checkpoint_name,
    replace_folder,
)
from skorch_accel_callbacks.storage import _transfer as transfer
from skorch_accel_callbacks.storage._interface import Found
from skorch_accel_callbacks.storage._local import CheckpointFolder

__all__ = ['check', 'fetch', 'names', 'read_json']


def read_json(store: transfer.Store, *parts: str) -> Any:
    """The JSON file ``parts`` below the store's folder."""
    return json.loads(store.fs.cat_file(store.path(*parts)))


def check(store: transfer.Store, name: str) -> tuple[dict[str, Any], str | None]:
    """The manifest of checkpoint ``name`` in the store (``{}`` if it
    cannot be read) and why the checkpoint is not complete there (None if
    it is): as :func:`~skorch_accel_callbacks.format._manifest.check_manifest` of a
    local folder, each listed file's size and checksum, its bytes read from
    the store as they stream in, not staged."""
    try:
        sealed, files = transfer.check_remote(store, name)
        manifest = json.loads(sealed)
        _check_checksums(store, name, files, manifest)
        return manifest, None
    except CorruptCheckpointError as exc:
        try:
            saved = read_json(store, name, MANIFEST_NAME)
        except (OSError, ValueError):
            saved = {}
        return (saved if isinstance(saved, dict) else {}), str(exc)


def _check_checksums(store: transfer.Store, name: str, files: list[str],
                     manifest: dict[str, Any]) -> None:
    """:class:`CorruptCheckpointError` naming the first file of ``files``
    whose bytes in the store have another checksum than ``manifest``'s
    (a frozen part: its shared object, :func:`transfer.object_parts`)."""
    checksums = manifest.get('checksums') or {}
    for rel in files:
        expected = checksums.get(rel)
        # a checksum of another algorithm cannot be checked, as locally
        if not (isinstance(expected, str)
                and expected.startswith(f'{CHECKSUM_ALGORITHM}:')):
            continue
        where = transfer.object_parts(name, rel, manifest)
        with store.fs.open(store.path(*where), 'rb') as stream:
            actual = checksum_stream(stream)
        if actual != expected:
            raise CorruptCheckpointError(
                f"{store.url(*where)} has checksum {actual}, "
                f"{store.url(name)}/{MANIFEST_NAME} says {expected}: "
                "the file is damaged")


def names(store: transfer.Store) -> set[str]:
    """Names of the checkpoints in the store with a manifest: the
    create-only manifest, written after every file, commits one."""
    # s3fs's listing cache misses what other writers added
    store.fs.invalidate_cache()
    try:
        # one listing of every object below (a request per 1000 on S3),
        # where a glob of '*/manifest.json' lists each checkpoint in turn
        paths = store.fs.find(store.root)
    except FileNotFoundError:
        return set()
    found = set()
    for path in paths:
        name, _, rest = path[len(store.root) + 1:].partition('/')
        if rest == MANIFEST_NAME and is_checkpoint_name(name):
            found.add(name)
    return found


def fetch(store: transfer.Store, staging: CheckpointFolder, name: str) -> Found:
    """Checkpoint ``name`` checked in the store, downloaded unless
    ``staging`` has it complete, and checked again there.

    The files that ``staging``'s copy has the same (those of its node,
    when each node staged its part) are linked, not downloaded."""
    sealed, files = transfer.check_remote(store, name)
    local = staging.path(name)
    if transfer.holds_manifest(local, sealed):
        manifest, problems = check_manifest(local)
        if not problems:
            return Found(local, manifest)
    # a partial folder renamed into place once complete, as a save
    partial = staging.start(name)
    reuse = local if os.path.isdir(local) else None
    manifest = transfer.download(store, name, files, sealed, partial, reuse=reuse)
    replaced = replace_folder(partial, local)
    if replaced is not None:
        replaced.join()
    return Found(local, manifest)
