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

import asyncio
import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from skorch_accel_callbacks.errors import (
    CheckpointError,
    CorruptCheckpointError,
    FolderInUseError,
    StoreUnavailableError,
)
from skorch_accel_callbacks.format import (
    MANIFEST_NAME,
    SHARED_FOLDER,
    check_manifest,
    checksum_file,
    frozen_parts_of,
    is_checkpoint_name,
    pointer_name,
    shared_object,
)

T = TypeVar('T')

__all__ = [
    'REACHABLE_SECONDS',
    'S3FS_RETRIES',
    'S3_CLIENT_DEFAULTS',
    'Store',
    'abort_uploads',
    'check_reachable',
    'check_remote',
    'client_options',
    'deadline',
    'download',
    'holds',
    'holds_manifest',
    'is_s3',
    'open_filesystem',
    'point',
    'put_files',
    'remove_checkpoint',
    'remove_manifest',
    'remove_unsealed',
    'same_files',
    'seal',
    'send',
    'staged_manifest',
    'upload',
]


#: the errors of a request that sending it again cannot mend: a file or the
#: bucket is missing, writing is refused, a create-only write found the
#: object there (an answer, which the caller reads), another job's lease
_FINAL_ERRORS = (FileNotFoundError, PermissionError, FileExistsError, CheckpointError,
                 FolderInUseError)
#: the first pause before a failed request is sent again; each next one is
#: twice as long, up to the last
_FIRST_PAUSE, _LAST_PAUSE = 1.0, 8.0


@dataclass(frozen=True)
class Store:
    """A folder of checkpoints in a store: the fsspec filesystem, the
    folder's path in it, its URL (as messages name it), and how long a
    request of an upload may fail or go unanswered before the upload fails
    (:meth:`persist`)."""

    fs: Any
    root: str
    dirname: str
    outage_seconds: float = 60.0

    def persist(self, what: str, request: Callable[[float], T]) -> T:
        """``request(seconds)``, sent again after a failure (pauses of 1, 2,
        4, 8, 8, ... s) for up to ``outage_seconds`` after it was first
        sent, then its error raised as :class:`StoreUnavailableError`
        naming ``what`` and how long it failed. The first failure warns.

        ``seconds`` is what is left of ``outage_seconds``: the request gives
        up when the store has not answered for that long
        (:func:`deadline`, :func:`put_files`), so that a store that accepts
        connections and never answers fails it too, in ``outage_seconds``.
        The client's own retries (s3fs, botocore) ride out a blip of a
        second or two; an outage of the network or the store lasts longer,
        and every request of an upload (files, lease, manifest, pointers,
        removals) must survive the same one. Errors that an attempt more
        cannot mend (:data:`_FINAL_ERRORS`) are raised at once.
        """
        began, pause, warned = time.monotonic(), _FIRST_PAUSE, False
        while True:
            try:
                return request(max(self.outage_seconds - (time.monotonic() - began), 1.0))
            except _FINAL_ERRORS:
                raise
            except Exception as exc:  # pylint: disable=broad-except
                failed_for = time.monotonic() - began
                if failed_for + pause > self.outage_seconds:
                    raise StoreUnavailableError(
                        f"{what} failed for {failed_for:.0f} s, past "
                        f"outage_seconds={self.outage_seconds:g}: the store did not answer "
                        f"or kept failing ({type(exc).__name__}: {exc})") from exc
                if not warned:
                    warned = True
                    warnings.warn(
                        f"{what} failed ({type(exc).__name__}: {exc}); sending it again "
                        f"for up to {self.outage_seconds:g} s", UserWarning)
                time.sleep(pause)
                pause = min(2 * pause, _LAST_PAUSE)

    def path(self, *parts: str) -> str:
        """The path in the filesystem of ``parts`` under the folder."""
        return '/'.join((self.root, *(part.replace(os.sep, '/') for part in parts)))

    def url(self, *parts: str) -> str:
        """The URL of ``parts`` under the folder."""
        return '/'.join((self.dirname, *(part.replace(os.sep, '/') for part in parts)))


def _is_async(fs: Any) -> bool:
    # imported here: fsspec is optional (the [s3] extra), as every store is
    from fsspec.asyn import AsyncFileSystem
    return isinstance(fs, AsyncFileSystem)


def deadline(fs: Any, seconds: float) -> dict[str, float]:
    """The argument of a call of ``fs`` that gives it up after ``seconds``
    (fsspec's ``timeout`` of an async filesystem's call, which cancels it;
    none for a synchronous one). A store that accepts a request with a body
    and never answers holds it past the client's read timeout: botocore
    asks ``Expect: 100-continue`` of every upload, and aiohttp's read
    timeout does not cover the wait for the 100."""
    return {'timeout': seconds} if _is_async(fs) else {}


class _Progress:
    """An fsspec callback that notes when a transfer last moved on: a file,
    or a part of one, sent (fsspec's ``Callback`` protocol: ``call`` on
    every update, ``branched`` for each file of a transfer of several)."""

    def __init__(self, moved: list[float] | None = None,
                 requests: list[asyncio.Task] | None = None) -> None:
        self.moved = [time.monotonic()] if moved is None else moved
        #: the tasks sending the files, as each begins (see :func:`_put_while_moving`)
        self.requests: list[asyncio.Task] = [] if requests is None else requests

    def set_size(self, size: int | None) -> None:
        self.call()

    def relative_update(self, inc: int = 1) -> None:
        self.call()

    def absolute_update(self, value: int) -> None:
        self.call()

    def call(self, *args: Any, **kwargs: Any) -> None:
        self.moved[0] = time.monotonic()

    def branched(self, path_1: str, path_2: str, **kwargs: Any) -> _Progress:
        return _Progress(self.moved, self.requests)

    def branch_coro(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        async def with_branch(path_1: str, path_2: str, **kwargs: Any) -> Any:
            self.requests.append(asyncio.current_task())
            return await fn(path_1, path_2, callback=self.branched(path_1, path_2), **kwargs)
        return with_branch


def put_files(fs: Any, sources: list[str], targets: list[str], seconds: float,
              **kwargs: Any) -> None:
    """``fs.put(sources, targets, **kwargs)``, given up with
    ``FSTimeoutError`` once no file, nor part of a file, got through for
    ``seconds``: a whole checkpoint takes as long as it takes, a store that
    stopped answering is found out (see :func:`deadline`). No request of
    the files is left running once it returned or raised."""
    if not _is_async(fs):
        fs.put(sources, targets, **kwargs)
        return
    putting = asyncio.run_coroutine_threadsafe(
        _put_while_moving(fs, sources, targets, seconds, kwargs), fs.loop)
    try:
        putting.result()
    except BaseException:
        # a Ctrl-C while it waits: the requests end with the upload
        putting.cancel()
        raise


async def _put_while_moving(fs: Any, sources: list[str], targets: list[str], seconds: float,
                            kwargs: dict[str, Any]) -> None:
    """:func:`put_files` on the loop of the async filesystem ``fs``."""
    from fsspec.exceptions import FSTimeoutError
    progress = _Progress()
    # the async API of fsspec's filesystems, on this (the filesystem's) loop
    sending = asyncio.ensure_future(fs._put(sources, targets, callback=progress, **kwargs))
    try:
        while not (await asyncio.wait({sending}, timeout=1.0))[0]:
            if time.monotonic() - progress.moved[0] > seconds:
                raise FSTimeoutError(
                    f"the store took no part of the files for {seconds:.0f} s")
        sending.result()
    finally:
        # fsspec's put, cancelled, leaves its files' requests running (it
        # waits for them with asyncio.wait, which does not cancel them): they
        # went on sending after the upload gave up, landed in a folder that
        # a retry or a removal had moved on from, and logged errors nobody
        # retrieved. A request that began meanwhile is found by the next turn.
        while unfinished := [task for task in (sending, *progress.requests)
                             if not task.done()]:
            for task in unfinished:
                task.cancel()
            await asyncio.wait(unfinished)


#: the URL schemes of S3 (s3fs's protocols)
_S3_PROTOCOLS = frozenset({'s3', 's3a'})


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is an S3 filesystem (s3fs)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return bool(set(protocols) & _S3_PROTOCOLS)


#: the client's settings for ``s3://`` that ``storage_options`` does not
#: set: botocore's ``Config`` (s3fs's ``config_kwargs``) bounds each attempt
#: of a request (a store that accepts connections and never answers held a
#: save for 414 s with botocore's 60 s read timeout, retried by botocore and
#: by s3fs) and retries once, with its jittered back-off, for a blip; a
#: filesystem of our own (not fsspec's cached instance, which other code
#: shares) so that s3fs's own retries (5, after 0.1-0.8 s) can be set to
#: one (:data:`S3FS_RETRIES`): an attempt then takes 30 s at the most, and
#: :meth:`Store.persist` rides out what lasts longer, the same for every
#: request of an upload
S3_CLIENT_DEFAULTS: dict[str, Any] = {
    'skip_instance_cache': True,
    'config_kwargs': {'connect_timeout': 5, 'read_timeout': 10,
                      'retries': {'max_attempts': 2, 'mode': 'standard'}},
}
#: s3fs's attempts of a request (its class attribute ``retries``, not an
#: argument), on a filesystem of our own
S3FS_RETRIES = 1


def client_options(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` for the filesystem of ``url``, with those of
    :data:`S3_CLIENT_DEFAULTS` that it does not set, for ``s3://``."""
    import fsspec  # optional (the [s3] extra), as the filesystem is
    protocol = fsspec.core.split_protocol(url)[0]
    if protocol not in _S3_PROTOCOLS:
        return dict(storage_options)
    options = {**S3_CLIENT_DEFAULTS, **storage_options}
    options['config_kwargs'] = {**S3_CLIENT_DEFAULTS['config_kwargs'],
                                **storage_options.get('config_kwargs', {})}
    return options


def open_filesystem(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path of ``url`` in it, opened
    with :func:`client_options`."""
    import fsspec
    options = client_options(url, storage_options)
    fs, root = fsspec.core.url_to_fs(url, **options)
    if is_s3(fs) and options.get('skip_instance_cache'):
        fs.retries = S3FS_RETRIES
    return fs, root


def _verified(fs: Any) -> dict[str, str]:
    """The arguments of a write that the store verifies with a checksum."""
    return {'ChecksumAlgorithm': 'CRC32'} if is_s3(fs) else {}


#: how long opening a store and its first request may take before a job
#: that cannot reach it is refused: without network, gcsfs spent 18 s
#: looking for credentials and then sent the request 6 times with pauses of
#: up to 17 s, 88 s in all, printing its tracebacks; s3's client settings
#: (:data:`S3_CLIENT_DEFAULTS`) give up sooner
REACHABLE_SECONDS = 30.0


def check_reachable(store: Store, seconds: float = REACHABLE_SECONDS) -> None:
    """Check that the folder's bucket exists and the credentials are
    accepted, within ``seconds`` (what opening ``store`` left of
    :data:`REACHABLE_SECONDS`, at least 1); else raise
    :class:`CheckpointError` naming the URL."""
    from fsspec.exceptions import FSTimeoutError
    bucket = store.root.split('/', 1)[0]
    try:
        store.fs.invalidate_cache()
        store.fs.info(bucket, **deadline(store.fs, max(seconds, 1.0)))
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"cannot save into {store.dirname}: the bucket {bucket} does not exist") from exc
    except FSTimeoutError:
        raise CheckpointError(
            f"cannot save into {store.dirname}: the store did not answer within "
            f"{REACHABLE_SECONDS:g} s (no network, a name that does not resolve, or an "
            "endpoint that does not answer); check the network and the endpoint") from None
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
    manifest = json.loads(sealed)
    send(store, local, name, list(manifest['files']), manifest)
    seal(store, name, sealed, best, before_manifest)


def staged_manifest(local: str) -> bytes:
    """The manifest of the committed folder ``local``, as written."""
    return Path(local, MANIFEST_NAME).read_bytes()


def remove_checkpoint(store: Store, name: str) -> None:
    """Remove checkpoint ``name``: its manifest first, then its files, each
    request sent again through an outage (:meth:`Store.persist`)."""
    store.persist(f"removing {store.url(name, MANIFEST_NAME)}",
                  lambda seconds: store.fs.rm_file(store.path(name, MANIFEST_NAME),
                                                   **deadline(store.fs, seconds)))
    store.persist(f"removing {store.url(name)}",
                  lambda seconds: store.fs.rm(store.path(name), recursive=True,
                                              **deadline(store.fs, seconds)))


def remove_manifest(store: Store, name: str) -> None:
    """Remove the manifest of checkpoint ``name``, if there is one.

    An epoch trained again after resuming from an older checkpoint replaces
    it, as in a local folder; its manifest goes before any of its new files
    are sent, so that no reader takes the old manifest for the new files.
    """
    with contextlib.suppress(FileNotFoundError):
        store.persist(f"removing {store.url(name, MANIFEST_NAME)}",
                      lambda seconds: store.fs.rm_file(store.path(name, MANIFEST_NAME),
                                                       **deadline(store.fs, seconds)))


def object_parts(name: str, rel: str, manifest: dict[str, Any]) -> tuple[str, ...]:
    """Where in the store the file ``rel`` of checkpoint ``name``
    (``manifest``) lies, as parts of a :meth:`Store.path` or
    :meth:`Store.url`: in the checkpoint's folder, or for a frozen part
    the object its checkpoints share
    (:func:`~skorch_accel_callbacks.format.shared_object`)."""
    shared = shared_object(manifest, rel)
    return (name, rel) if shared is None else tuple(shared.split('/'))


def object_path(store: Store, name: str, rel: str, manifest: dict[str, Any]) -> str:
    """The path in the store's filesystem of :func:`object_parts`."""
    return store.path(*object_parts(name, rel, manifest))


def shared_sizes(store: Store) -> dict[str, int]:
    """Path -> size of every object in the store's shared folder (one
    listing); empty where there is none."""
    folder = store.path(SHARED_FOLDER)
    store.fs.invalidate_cache(folder)
    try:
        found = store.persist(f"listing {store.url(SHARED_FOLDER)}", lambda seconds: store.fs.find(
            folder, detail=True, **deadline(store.fs, seconds)))
    except FileNotFoundError:
        return {}
    return {path: info['size'] for path, info in found.items()}


def send(store: Store, local: str, name: str, files: list[str],
         manifest: dict[str, Any]) -> None:
    """Upload ``files`` (paths relative to the folder ``local``) of
    checkpoint ``name`` (``manifest``), sent again while the store fails
    (:meth:`Store.persist`); a frozen part that the store holds already
    (:func:`object_path`: named by its checksum, of the listed size) is not
    sent again.

    s3fs retries a request that met a network error, but not an upload
    that failed for a reason of its own: the completion of a multipart
    upload, sent again because its answer was lost, fails with NoSuchUpload
    when the first one completed it. Sending the files again is safe: they
    are not committed until the manifest is written.
    """
    paths = {rel: object_path(store, name, rel, manifest) for rel in files}
    if any(shared_object(manifest, rel) for rel in files):
        held = shared_sizes(store)
        files = [rel for rel in files if held.get(paths[rel]) != manifest['files'][rel]]
    if not files:
        return
    sources = [os.path.join(local, rel) for rel in files]
    targets = [paths[rel] for rel in files]
    # one call: an async filesystem (s3fs) sends the files concurrently,
    # and of a file of 100 MiB or more up to 10 parts (max_concurrency)
    # of 50 MiB at once: s3fs's own put (benchmarks/RESULTS.rst).
    # botocore sends each part's CRC32 anyway; ChecksumAlgorithm makes
    # the object's checksum the composite of those, where S3's default
    # is a full-object CRC64NVME
    store.persist(f"sending the files of {store.url(name)}", lambda seconds: put_files(
        store.fs, sources, targets, seconds, **_verified(store.fs)))


def seal(store: Store, name: str, sealed: bytes, best: bool,
         before_manifest: Callable[[], None]) -> None:
    """Commit checkpoint ``name``, whose files are sent: write its manifest
    ``sealed`` create-only (after ``before_manifest()``), then point at it.

    Raises :class:`CheckpointError` naming the manifest's URL if another
    job committed that name meanwhile.
    """
    store.persist(f"checking the lease before the manifest of {store.url(name)}",
                  lambda seconds: before_manifest())
    manifest = store.path(name, MANIFEST_NAME)
    try:
        store.persist(f"writing {store.url(name, MANIFEST_NAME)}",
                      lambda seconds: store.fs.pipe_file(
                          manifest, sealed, mode='create', **_verified(store.fs),
                          **deadline(store.fs, seconds)))
    except FileExistsError as exc:
        if _reads(store, manifest) == sealed:
            # this write's own: the store stored it, then its answer was lost
            # and the client's retry was refused
            point(store, name, best)
            return
        raise CheckpointError(
            f"{store.url(name, MANIFEST_NAME)} exists already: another job committed "
            f"{store.url(name)} while this one trained; only one job may save into a "
            "dirname") from exc
    point(store, name, best)


def point(store: Store, name: str, best: bool) -> None:
    """Point ``latest.json`` and, if ``best``, ``best.json`` at checkpoint ``name``."""
    pointer = json.dumps({'name': name}).encode()
    for which in ('latest', 'best') if best else ('latest',):
        target = store.path(pointer_name(which))
        store.persist(f"writing {store.url(pointer_name(which))}",
                      lambda seconds, target=target: store.fs.pipe_file(
                          target, pointer, **_verified(store.fs), **deadline(store.fs, seconds)))


def _reads(store: Store, path: str) -> bytes | None:
    """The bytes of ``path`` in the store, or None if there are none."""
    def read(seconds: float) -> bytes:
        store.fs.invalidate_cache(path)
        return store.fs.cat_file(path, **deadline(store.fs, seconds))

    try:
        return store.persist(f"reading {store.fs.unstrip_protocol(path)}", read)
    except FileNotFoundError:
        return None


def holds_manifest(local: str, sealed: bytes) -> bool:
    """Whether the folder ``local`` holds the manifest ``sealed``: it is a
    copy of the checkpoint of that manifest (if complete)."""
    path = os.path.join(local, MANIFEST_NAME)
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
        sealed = store.fs.cat_file(store.path(name, MANIFEST_NAME))
        listed = json.loads(staged_manifest(local))['files']
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return len(same_files(local, sealed)) == len(listed)


def check_remote(store: Store, name: str) -> tuple[bytes, list[str]]:
    """The manifest's bytes and the files of checkpoint ``name`` in the
    store; :class:`CorruptCheckpointError` naming the URL at fault."""
    fs, remote, url = store.fs, store.path(name), store.url(name)
    target = f"{url}/{MANIFEST_NAME}"
    try:
        sealed = fs.cat_file(f"{remote}/{MANIFEST_NAME}")
        files = json.loads(sealed)['files']
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{target} is missing") from exc
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptCheckpointError(f"{target} is not a manifest: {exc}") from exc
    manifest = json.loads(sealed)
    fs.invalidate_cache(remote)
    sizes = {path: info['size'] for path, info in fs.find(remote, detail=True).items()}
    if any(shared_object(manifest, rel) for rel in files):
        sizes.update(shared_sizes(store))
    for rel, size in files.items():
        path = object_path(store, name, rel, manifest)
        where = store.url(*object_parts(name, rel, manifest))
        if path not in sizes:
            raise CorruptCheckpointError(f"{where} is missing (listed in {target})")
        if sizes[path] != size:
            raise CorruptCheckpointError(
                f"{where} has {sizes[path]} bytes, {target} says {size}: "
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
        manifest = json.loads(sealed)
        # one call, s3fs's own get: the files concurrently, a file over 50 MiB
        # in up to 10 ranged GETs of 50 MiB at once
        store.fs.get([object_path(store, name, rel, manifest) for rel in fetched], targets)
    with open(os.path.join(partial, MANIFEST_NAME), 'wb') as file:
        file.write(sealed)
    manifest, problems = check_manifest(partial)
    if problems:
        problem = problems[0]
        raise type(problem.error)(
            f"the download of {store.url(name, problem.file or MANIFEST_NAME)} "
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
            if checksum_file(source) != checksums[rel]:
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
            if not is_checkpoint_name(folder):
                continue
            store.fs.call_s3('abort_multipart_upload', Bucket=bucket,
                             Key=unfinished['Key'], UploadId=unfinished['UploadId'])
        if not listed.get('IsTruncated'):
            return
        markers = {'KeyMarker': listed['NextKeyMarker'],
                   'UploadIdMarker': listed['NextUploadIdMarker']}


def remove_unshared(store: Store, manifests: list[dict[str, Any]]) -> None:
    """Remove the objects of the store's shared folder that none of
    ``manifests`` (those of every checkpoint the store keeps) lists: the
    frozen parts of retired checkpoints that no kept one shares, and those
    a job killed before its manifest sent."""
    kept = {store.path(*shared.split('/')) for manifest in manifests
            for rel in frozen_parts_of(manifest).values()
            if (shared := shared_object(manifest, rel)) is not None}
    for path in shared_sizes(store):
        if path not in kept:
            store.persist(f"removing {store.url(SHARED_FOLDER, path.rpartition('/')[2])}",
                          lambda seconds, path=path: store.fs.rm_file(
                              path, **deadline(store.fs, seconds)))


def remove_unsealed(store: Store, committed: set[str]) -> None:
    """Remove the checkpoint folders under the folder that are not in
    ``committed`` (those with a manifest)."""
    try:
        paths = store.fs.ls(store.root, detail=False, refresh=True)
    except FileNotFoundError:
        return
    for path in paths:
        name = path.rstrip('/').rsplit('/', 1)[-1]
        if is_checkpoint_name(name) and name not in committed:
            store.fs.rm(path, recursive=True)
