"""Moving one checkpoint's files between a local folder and a store.

A store has no rename to commit with, so an upload sends a checkpoint's
files first, then its manifest with a create-only write (``If-None-Match:
*`` on S3), then the pointers: in the store a checkpoint is complete
exactly when its manifest is there and every file it lists has its listed
size. A download fetches the files into an empty (partial) folder and
writes the manifest last, as a local save does.

On S3 every object is sent with a CRC32 checksum that the server verifies
before it stores the object (``ChecksumAlgorithm``: botocore sends one with
each request anyway, and with it the object of a multipart upload gets
one too, combined from its parts'). s3fs
aborts a multipart upload that fails, but not when the abort fails too
(the network is down) nor when its process is killed: such uploads are
invisible to readers and :func:`abort_uploads` removes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skorch_accel_callbacks import format
from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError

__all__ = ['Store', 'abort_uploads', 'check_reachable', 'check_remote', 'download', 'holds',
           'holds_manifest', 'is_s3', 'point', 'remove_manifest', 'remove_unsealed',
           'same_files', 'seal', 'send', 'staged_manifest', 'upload']


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


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is an S3 filesystem (s3fs)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return bool(set(protocols) & {'s3', 's3a'})


def _verified(fs: Any) -> dict[str, str]:
    """The arguments of a write that the store verifies with a checksum."""
    return {'ChecksumAlgorithm': 'CRC32'} if is_s3(fs) else {}


def check_reachable(store: Store) -> None:
    """Check that the folder's bucket exists and the credentials are
    accepted; else raise :class:`CheckpointError` naming the URL."""
    bucket = store.root.split('/', 1)[0]
    try:
        store.fs.invalidate_cache()
        store.fs.info(bucket)
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"cannot save into {store.dirname}: the bucket {bucket} does not exist") from exc
    except Exception as exc:
        # refused credentials are a PermissionError, missing ones botocore's
        # NoCredentialsError, an endpoint out of reach EndpointConnectionError
        raise CheckpointError(
            f"cannot save into {store.dirname}: {type(exc).__name__}: {exc}; check "
            "the credentials and the endpoint") from exc


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
    sealed = staged_manifest(local)
    if replace:
        remove_manifest(store, name)
    send(store, local, name, list(json.loads(sealed)['files']))
    seal(store, name, sealed, best, before_manifest)


def staged_manifest(local: str) -> bytes:
    """The manifest of the committed folder ``local``, as written."""
    return Path(local, format.MANIFEST_NAME).read_bytes()


def remove_manifest(store: Store, name: str) -> None:
    """Remove the manifest of checkpoint ``name``, if there is one.

    An epoch trained again after resuming from an older checkpoint replaces
    it, as in a local folder; its manifest goes before any of its new files
    are sent, so that no reader takes the old manifest for the new files.
    """
    with contextlib.suppress(FileNotFoundError):
        store.fs.rm_file(store.path(name, format.MANIFEST_NAME))


#: the pauses before sending a checkpoint's files again. s3fs retries a
#: request that met a network error (for about 2 s), but not an upload
#: that failed for a reason of its own: the completion of a multipart
#: upload, sent again because its answer was lost, fails with NoSuchUpload
#: when the first one completed it. Sending the files again is safe: they
#: are not committed until the manifest is written.
SEND_PAUSES = (1.0, 4.0)


def send(store: Store, local: str, name: str, files: list[str]) -> None:
    """Upload ``files`` (paths relative to the folder ``local``) into
    checkpoint ``name``; after a failure, again after each of
    :data:`SEND_PAUSES` (with a warning), before the failure is raised."""
    if not files:
        return
    sources = [os.path.join(local, rel) for rel in files]
    targets = [store.path(name, rel) for rel in files]
    for pause in (*SEND_PAUSES, None):
        try:
            # one call: an async filesystem (s3fs) sends the files concurrently,
            # and of a file of 100 MiB or more up to 10 parts (max_concurrency)
            # of 50 MiB at once: s3fs's own put (benchmarks/RESULTS.rst).
            # botocore sends each part's CRC32 anyway; ChecksumAlgorithm makes
            # the object's checksum the composite of those, where S3's default
            # is a full-object CRC64NVME
            store.fs.put(sources, targets, **_verified(store.fs))
            return
        except (FileNotFoundError, PermissionError):
            raise  # a file or the bucket is missing, or writing refused: no retry helps
        except Exception as exc:
            if pause is None:
                raise
            warnings.warn(f"sending the files of {store.url(name)} failed "
                          f"({type(exc).__name__}: {exc}); sending them again in {pause:g} s",
                          UserWarning)
            time.sleep(pause)


def seal(store: Store, name: str, sealed: bytes, best: bool,
         before_manifest: Callable[[], None]) -> None:
    """Commit checkpoint ``name``, whose files are sent: write its manifest
    ``sealed`` create-only (after ``before_manifest()``), then point at it.

    Raises :class:`CheckpointError` naming the manifest's URL if another
    job committed that name meanwhile.
    """
    before_manifest()
    manifest = store.path(name, format.MANIFEST_NAME)
    try:
        store.fs.pipe_file(manifest, sealed, mode='create', **_verified(store.fs))
    except FileExistsError as exc:
        if _reads(store, manifest) == sealed:
            # this write's own: the store stored it, then its answer was lost
            # and the client's retry was refused
            point(store, name, best)
            return
        raise CheckpointError(
            f"{store.url(name, format.MANIFEST_NAME)} exists already: another job committed "
            f"{store.url(name)} while this one trained; only one job may save into a "
            "dirname") from exc
    point(store, name, best)


def point(store: Store, name: str, best: bool) -> None:
    """Point ``latest.json`` and, if ``best``, ``best.json`` at checkpoint ``name``."""
    pointer = json.dumps({'name': name}).encode()
    store.fs.pipe_file(store.path(format.pointer_name('latest')), pointer,
                       **_verified(store.fs))
    if best:
        store.fs.pipe_file(store.path(format.pointer_name('best')), pointer,
                           **_verified(store.fs))


def _reads(store: Store, path: str) -> bytes | None:
    """The bytes of ``path`` in the store, or None if it cannot be read."""
    try:
        store.fs.invalidate_cache(path)
        return store.fs.cat_file(path)
    except OSError:
        return None


def holds_manifest(local: str, sealed: bytes) -> bool:
    """Whether the folder ``local`` holds the manifest ``sealed``: it is a
    copy of the checkpoint of that manifest (if complete)."""
    path = os.path.join(local, format.MANIFEST_NAME)
    return os.path.isfile(path) and Path(path).read_bytes() == sealed


def same_files(local: str, sealed: bytes) -> list[str]:
    """The files of the committed folder ``local`` that the manifest
    ``sealed`` lists with the sizes and checksums of ``local``'s own
    manifest: those of its node, when the nodes of a job staged a
    checkpoint each (``save_on_each_node``) and ``sealed`` lists them all."""
    try:
        mine = json.loads(staged_manifest(local))
        theirs = json.loads(sealed)
        return [rel for rel, size in mine['files'].items()
                if theirs['files'].get(rel) == size
                and theirs.get('checksums', {}).get(rel) is not None
                and theirs['checksums'].get(rel) == mine.get('checksums', {}).get(rel)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def holds(store: Store, name: str, local: str) -> bool:
    """Whether checkpoint ``name`` in the store lists every file of the
    committed folder ``local``, the same: it is that folder uploaded."""
    try:
        sealed = store.fs.cat_file(store.path(name, format.MANIFEST_NAME))
        listed = json.loads(staged_manifest(local))['files']
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return len(same_files(local, sealed)) == len(listed)


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


def download(store: Store, name: str, files: list[str], sealed: bytes,
             partial: str, reuse: str | None = None) -> dict[str, Any]:
    """Download checkpoint ``name`` into the empty folder ``partial``: its
    ``files``, then the manifest ``sealed`` last; check them there against
    the sizes and checksums of the manifest, and return it. ``reuse``: a
    committed folder whose files that are the same (:func:`same_files`) and
    intact are linked, not downloaded.

    Raises :class:`CorruptCheckpointError` naming the URL of a file whose
    bytes differ from those the manifest lists."""
    linked = _link_same_files(reuse, sealed, partial) if reuse is not None else set()
    fetched = [rel for rel in files if rel not in linked]
    targets = [os.path.join(partial, rel) for rel in fetched]
    for folder in {os.path.dirname(path) for path in targets}:
        os.makedirs(folder, exist_ok=True)
    if fetched:
        # one call, s3fs's own get: the files concurrently, a file over 50 MiB
        # in up to 10 ranged GETs of 50 MiB at once
        store.fs.get([store.path(name, rel) for rel in fetched], targets)
    with open(os.path.join(partial, format.MANIFEST_NAME), 'wb') as file:
        file.write(sealed)
    manifest, problems = format.check(partial)
    if problems:
        problem = problems[0]
        raise type(problem.error)(
            f"the download of {store.url(name, problem.file or format.MANIFEST_NAME)} "
            f"is refused: {problem.error}")
    return manifest


def _link_same_files(local: str, sealed: bytes, partial: str) -> set[str]:
    """Hard-link into ``partial`` the files of ``local`` that ``sealed``
    lists the same and whose bytes have their checksum; their paths."""
    checksums = json.loads(sealed).get('checksums', {})
    linked = set()
    for rel in same_files(local, sealed):
        source, target = os.path.join(local, rel), os.path.join(partial, rel)
        try:
            if format.checksum_file(source) != checksums[rel]:
                continue  # damaged here: downloaded instead
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.link(source, target)
        except OSError:
            continue
        linked.add(rel)
    return linked


def abort_uploads(store: Store) -> None:
    """Abort the unfinished multipart uploads of the folder's checkpoints
    (S3; none elsewhere): those of a file of a checkpoint folder right under
    it. A run in a folder nested under this one (``run1/sub``) uploads
    under the same prefix; its uploads, live or not, are its own."""
    if not is_s3(store.fs):
        return
    bucket, key, _ = store.fs.split_path(store.root)
    prefix = f"{key}/" if key else ''
    markers: dict[str, str] = {}
    while True:
        listed = store.fs.call_s3('list_multipart_uploads', Bucket=bucket,
                                  Prefix=prefix, **markers)
        for unfinished in listed.get('Uploads', []):
            folder = unfinished['Key'][len(prefix):].split('/', 1)[0]
            if not format.is_checkpoint_name(folder):
                continue
            store.fs.call_s3('abort_multipart_upload', Bucket=bucket,
                             Key=unfinished['Key'], UploadId=unfinished['UploadId'])
        if not listed.get('IsTruncated'):
            return
        markers = {'KeyMarker': listed['NextKeyMarker'],
                   'UploadIdMarker': listed['NextUploadIdMarker']}


def remove_unsealed(store: Store, committed: set[str]) -> None:
    """Remove the checkpoint folders under the folder that are not in
    ``committed`` (those with a manifest)."""
    try:
        paths = store.fs.ls(store.root, detail=False, refresh=True)
    except FileNotFoundError:
        return
    for path in paths:
        name = path.rstrip('/').rsplit('/', 1)[-1]
        if format.is_checkpoint_name(name) and name not in committed:
            store.fs.rm(path, recursive=True)
