"""Checkpoints in an object store (``s3://bucket/run1``), through fsspec.

A store has no rename to commit with: a checkpoint is committed into a
local staging folder exactly as a local save is (training waits no
longer), then uploaded in the background
(:mod:`~skorch_accel_callbacks.storage._transfer`): its files, its manifest last
with a create-only write (``If-None-Match: *`` on S3), then the pointers.
In the store a checkpoint is complete exactly when its manifest is there
and every file it lists has its listed size: an upload cut short leaves
files without a manifest. A resume downloads the checkpoint it chose into
the staging folder and reads it there, also on a new machine
(:mod:`~skorch_accel_callbacks.storage._remote_read`). Nodes that stage on their
own disks (``save_on_each_node``) upload a part each
(:mod:`~skorch_accel_callbacks.storage._node_upload`).

fsspec (and the protocol's package, s3fs for ``s3://``) is imported only
when a store is used (``s3fs``: the ``[s3]`` extra). The
credentials and endpoint come from ``storage_options`` or the protocol's
usual configuration (for s3fs the ``AWS_*`` variables, ``AWS_ENDPOINT_URL``
included).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from skorch_accel_callbacks._core import accelerate_io, sync
from skorch_accel_callbacks.errors import CheckpointError, FolderInUseError, StoreUnavailableError
from skorch_accel_callbacks.format import (
    LEASE_NAME,
    MANIFEST_NAME,
    EarlyFlush,
    discard_in_background,
)
from skorch_accel_callbacks.storage import (
    _node_upload as node_upload,
    _remote_read as remote_read,
    _transfer as transfer,
)
from skorch_accel_callbacks.storage._interface import CheckpointStorage, Found, is_committer
from skorch_accel_callbacks.storage._lease import ObjectLease, take_lease
from skorch_accel_callbacks.storage._local import CheckpointFolder
from skorch_accel_callbacks.storage._upload_queue import (
    UploadQueue,
    newest_complete,
    told,
    upload_next,
    wait_for,
)

__all__ = ['RemoteStorage', 'default_staging']


def default_staging(url: str) -> str:
    """The staging folder of ``url`` when none is given: the same on every
    process of a machine, and another for each URL."""
    digest = hashlib.sha1(url.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), 'skorch-accel-staging', digest)


# the fsspec package of each store the package's extras install: (extra, package)
_EXTRAS = {'s3': ('s3', 's3fs'), 'gs': ('gcs', 'gcsfs'), 'gcs': ('gcs', 'gcsfs')}


class RemoteStorage(CheckpointStorage):
    """The checkpoints under the URL ``dirname``, staged in a local folder.

    Implements :class:`~skorch_accel_callbacks.storage._interface.CheckpointStorage`.
    The writers write and commit into the staging folder (:meth:`path`,
    :meth:`partial_path` and :meth:`start` are the staging folder's); the
    upload runs on one background thread, at most one at a time, and
    :meth:`wait` raises what failed. After an upload the staging folder
    keeps only that checkpoint. A copy (pickle, deepcopy) holds no
    connection, claim or upload in progress.

    Parameters
    ----------
    dirname : str
      The URL of the folder of checkpoints, e.g. ``s3://bucket/run1``.
    local_dir : str or None (default=None)
      The staging folder; None: a folder under the system's temporary
      folder named after the URL (:func:`default_staging`).
    storage_options : dict or None (default=None)
      Arguments of the fsspec filesystem (``key``, ``secret``,
      ``endpoint_url``, ...). For ``s3://``, those of
      :data:`~skorch_accel_callbacks.storage._transfer.S3_CLIENT_DEFAULTS` that it
      does not set bound each attempt of a request (a connection within
      5 s, an answer within 10 s, one retry), on a filesystem of its own.
    outage_seconds : float (default=60.0)
      How long each request of an upload may fail, or go unanswered, before
      the upload fails; it is sent again meanwhile
      (:meth:`~skorch_accel_callbacks.storage._transfer.Store.persist`).
    lease_seconds : float (default=60.0)
      How long the lease of the folder in the store lasts after each
      renewal (S3): how long a job elsewhere is refused the folder after
      this job was killed (plus 10 s for clocks that disagree).
    """

    def __init__(self, dirname: str, local_dir: str | os.PathLike[str] | None = None,
                 storage_options: dict[str, Any] | None = None, *,
                 outage_seconds: float = 60.0, lease_seconds: float = 60.0) -> None:
        self.dirname = os.fspath(dirname).rstrip('/')
        self.local_dir = os.fspath(local_dir or default_staging(self.dirname))
        self.storage_options = dict(storage_options or {})
        self.outage_seconds = outage_seconds
        self.lease_seconds = lease_seconds
        self.staging = CheckpointFolder(self.local_dir)
        self._fs = None
        self._root = None
        self._executor: ThreadPoolExecutor | None = None
        # the background work: uploads (each returns its URL and seconds,
        # or None when it found no checkpoint waiting) and retirements
        self._pending: list[Future] = []
        # guards the queue and _known, shared by the training thread (or
        # the writer's) and the upload thread
        self._lock = threading.Lock()
        self._queue = UploadQueue()
        # the removals of older staged checkpoints
        self._removals: list[threading.Thread | None] = []
        # in the store when this job took it, or committed by it: replaceable
        self._known: set[str] = set()
        # the one-job lock in the store (lease.ObjectLease), taken in claim
        self._lease = None
        # with save_on_each_node, the nodes' main processes (sync.NodeGroup)
        self._nodes = None
        self._main = True
        self._claimed = False

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _fs=None, _root=None, _executor=None, _pending=[],
                    _removals=[], _known=set(), _lease=None, _nodes=None, _main=True,
                    _claimed=False, _lock=None, _queue=UploadQueue())

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    # ------------------------------------------------------------ paths

    def path(self, name: str) -> str:
        """Where checkpoint ``name`` is read from: its staged copy."""
        return self.staging.path(name)

    def url(self, name: str) -> str:
        """Where checkpoint ``name`` is kept: its URL."""
        return f"{self.dirname}/{name}"

    def partial_path(self, name: str) -> str:
        return self.staging.partial_path(name)

    def _filesystem(self) -> tuple[Any, str]:
        """The fsspec filesystem and the path of ``dirname`` in it."""
        if self._fs is None:
            self._fs, self._root = transfer.open_filesystem(self.dirname, self.storage_options)
        return self._fs, self._root

    def _store(self) -> transfer.Store:
        return transfer.Store(*self._filesystem(), self.dirname, self.outage_seconds)

    # ------------------------------------------------------------ claiming

    def claim(self, net: Any) -> None:
        """Check that the store can be reached and take the staging folder,
        on every rank; acts once until :meth:`release`.

        The staging folder is one that every rank sees, or with
        ``save_on_each_node`` one on each node's own disk
        (:mod:`~skorch_accel_callbacks.storage._node_upload`). Raises on every rank
        :class:`CheckpointError` naming the URL when fsspec or the
        protocol's package is missing, the bucket does not exist, the
        credentials are refused, or a node does not see the staging folder
        without ``save_on_each_node``; the errors of
        :meth:`CheckpointFolder.claim` for the staging folder.
        """
        if self._claimed:
            return
        with sync.agree(net, f"opening {self.dirname}"):
            # on every rank: each raises the store's refusal itself
            self._check_reachable()
        # the staging folder's lock keeps a second job of this machine out;
        # with save_on_each_node it refuses nodes that share the folder
        try:
            self.staging.claim(net)
        except FolderInUseError as exc:
            # the user named the URL; the default staging folder is a hash
            raise FolderInUseError(f"{self.dirname} is in use by another running job on this "
                                   f"machine, which stages it in the same folder: {exc}") from exc
        if not (accelerate_io.save_on_each_node(net.accelerator) and sync.is_distributed(net)):
            self._nodes = None
            self.staging.check_shared(
                net, f"every rank stages its files there for rank 0 to upload to "
                f"{self.dirname}; give local_dir a shared folder, or set "
                "save_on_each_node=True to stage on each node's own disk")
        elif self._nodes is None:
            # kept for the next fits: a process group lasts as long as its process
            self._nodes = sync.NodeGroup.of_node_mains(net)
        self._main = sync.is_main_process(net)
        with sync.agree(net, f"taking the lease of {self.dirname}"):
            if self._main:
                # one job at a time in the store, before this one changes it
                self._lease = _take_lease(self._store(), self.lease_seconds)
            if is_committer(net):
                self._known = set(self.committed())
        self._finish_upload(net)
        with sync.agree(net, f"removing what killed uploads left in {self.dirname}"):
            if self._main:
                self._remove_leftovers()
        self._claimed = True

    def _check_reachable(self) -> None:
        began = time.monotonic()
        try:
            store = self._store()
        except (ImportError, ValueError) as exc:
            scheme = self.dirname.partition('://')[0]
            extra = _EXTRAS.get(scheme)
            hint = (f" (pip install {extra[1]}: the package's [{extra[0]}] extra)"
                    if extra else "")
            raise CheckpointError(f"cannot open {self.dirname}: {exc}{hint}") from exc
        # opening a store may take long (gcsfs looks for credentials on the
        # network), and counts toward the same bound
        transfer.check_reachable(
            store, transfer.REACHABLE_SECONDS - (time.monotonic() - began))

    def _finish_upload(self, net: Any) -> None:
        """Finish the upload of the checkpoint that a job of this machine
        (or of these nodes) committed into the staging folder but was killed
        before it uploaded it, or before it wrote the pointers: the newest
        complete staged one, if it is the same on every node and not older
        than every one in the store (names sort in training order); the
        older ones staged (the upload queue's) are not uploaded. A store
        emptied by hand stays empty."""
        newest = None
        with sync.agree(net, f"reading the staging folder {self.local_dir}"):
            if is_committer(net):
                newest = newest_complete(self.staging)
        staged = sync.gather(net, newest)
        committers = [0] if self._nodes is None else self._nodes.ranks
        todo = None
        with sync.agree(net, f"looking for an unfinished upload into {self.dirname}"):
            if self._main:
                todo = self._unfinished([staged[rank] for rank in committers])
        todo = sync.broadcast(net, todo)
        if todo is None:
            return
        what, name, best = todo
        with sync.agree(net, f"finishing the upload of {self.url(name)}"):
            if what == 'upload' and is_committer(net):
                self._upload(name, best)
            elif what == 'point' and self._main:
                transfer.point(self._store(), name, best)

    def _unfinished(self, staged: list[tuple[str, bool] | None]) -> tuple[str, str, bool] | None:
        """What is left to do of the upload of the newest staged checkpoint
        (``staged``: each committer's): ``('upload' or 'point', name, best)``."""
        if None in staged or len(set(staged)) > 1 or not self._known:
            return None
        name, best = staged[0]
        if name < max(self._known):
            return None
        if name not in self._known:
            return 'upload', name, best
        if (self.pointed('latest') != name
                and transfer.holds(self._store(), name, self.staging.path(name))):
            return 'point', name, best
        return None

    def _remove_leftovers(self) -> None:
        """Remove what killed or failed uploads left in the store, once the
        cut one is finished and under the lease (no other job writes): the
        unfinished multipart uploads, the checkpoint folders without a manifest."""
        transfer.abort_uploads(self._store())
        transfer.remove_unsealed(self._store(), set(self.committed()))

    def release(self) -> None:
        """End this job's claim: the upload thread ends once its work is
        done (:meth:`wait` reports a failure), the staging folder is released."""
        self._claimed = False
        try:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
        finally:
            lease, self._lease = self._lease, None
            try:
                if lease is not None:
                    lease.release()
            except Exception as exc:
                # the store out of reach: the error a training raises goes on
                warnings.warn(f"could not remove the lease of {self.dirname} ({exc!r}): it "
                              f"expires {lease.ttl_seconds:g} s after its last renewal")
            finally:
                self.staging.release()

    # ------------------------------------------------------------ writing

    def start(self, name: str) -> str:
        return self.staging.start(name)

    def commit(self, name: str, sealed: dict[str, Any], durable: bool, best: bool,
               started: float | None = None,
               early: EarlyFlush | None = None) -> dict[str, Any]:
        """Commit checkpoint ``name`` into the staging folder and queue its
        upload (:meth:`wait` waits for it); return the manifest written."""
        written = self.staging.commit(name, sealed, durable=durable, best=best,
                                      started=started, early=early)
        with self._lock:
            self._queue.add(name, best)
            needed = self._queue.busy()
        self._submit(self._upload_next)
        # the store has the older ones, and should the uploads fail, the
        # next job uploads the newest staged one
        self._discard_staged(set(self.staging.committed()) - needed)
        return written

    def _discard_staged(self, names: Iterable[str]) -> None:
        """Remove the staged copies of ``names`` in the background (from the
        training thread or the upload thread): one at a time, so that the
        two threads never rename one folder aside at once."""
        for name in names:
            with self._lock:
                self._removals.append(discard_in_background(self.staging.path(name)))

    def _submit(self, work: Any, *args: Any) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix='checkpoint-upload')
        self._pending.append(self._executor.submit(work, *args))

    def _upload_next(self) -> tuple[str, float] | None:
        """Upload the oldest waiting checkpoint; its URL and the seconds it
        took, or None if none waits (superseded ones were dropped)."""
        uploaded = upload_next(self._lock, self._queue, self._upload)
        if uploaded is None:
            return None
        name, seconds, superseded = uploaded
        if superseded:
            # in the store, and a newer one is staged
            self._discard_staged([name])
        return self.url(name), seconds

    def _upload(self, name: str, best: bool) -> float:
        """Upload checkpoint ``name`` from the staging folder; the seconds it took."""
        started = time.monotonic()
        try:
            if self._nodes is None:
                transfer.upload(self._store(), self.staging.path(name), name, best,
                                replace=name in self._known, before_manifest=self._check_lease)
            else:
                node_upload.upload_from_nodes(
                    self._nodes, self._store(), self.staging.path(name), name, best,
                    replace=name in self._known, before_manifest=self._check_lease)
        except StoreUnavailableError as exc:
            raise StoreUnavailableError(
                f"the upload of {self.url(name)} failed: {exc}; {self._kept(name)}") from exc
        except (CheckpointError, FolderInUseError):
            raise
        except Exception as exc:
            raise CheckpointError(
                f"the upload of {self.url(name)} failed ({type(exc).__name__}: {exc}); "
                f"{self._kept(name)}") from exc
        with self._lock:
            self._known.add(name)
        return time.monotonic() - started

    def _kept(self, name: str) -> str:
        """What became of checkpoint ``name`` when its upload failed."""
        return f"the checkpoint stays staged in {self.staging.path(name)}, " + (
            "which the next job on this machine with this dirname and local_dir uploads "
            "before it trains: nothing is lost" if self._known else
            "but the store holds no checkpoint yet: the next job starts afresh")

    def _check_lease(self) -> None:
        if self._lease is not None:
            # another job that took over an expired lease owns the store now
            self._lease.check()

    def retire(self, keep_last: int, keep_best: int | None = None,
               keep: Iterable[str | None] = ()) -> None:
        """Drop from the upload queue the waiting checkpoints that a newer
        one supersedes and that retention would not keep in the store
        (:class:`~skorch_accel_callbacks.storage._upload_queue.UploadQueue`),
        their staged copies removed; then remove from the store, in the
        background, all but the checkpoints :meth:`~CheckpointStorage.kept`
        keeps, once the upload before it uploaded one (:meth:`remove`)."""
        if not self._main:
            return  # the main process's upload commits, and retires, for every node
        with self._lock:
            dropped = self._queue.supersede(self._known, keep_last, keep_best)
        self._discard_staged(dropped)
        upload = self._pending[-1] if self._pending else None
        self._submit(self._retire, upload, keep_last, keep_best, tuple(keep))

    def _retire(self, upload: Future | None, keep_last: int, keep_best: int | None,
                keep: tuple[str | None, ...]) -> None:
        if upload is not None and (upload.exception() is not None or upload.result() is None):
            return  # nothing new in the store: keep what is there
        try:
            # listings and reads: the client's read timeout bounds each
            names, kept = self._store().persist(
                f"listing the checkpoints of {self.dirname} to retire",
                lambda seconds: self.kept(keep_last, keep_best, keep))
        except (CheckpointError, StoreUnavailableError) as exc:
            # the newest is in the store: an older one too many is no loss
            warnings.warn(f"could not retire old checkpoints of {self.dirname}: {exc}",
                          UserWarning)
            return
        self.remove_unkept(names, kept)
        self._remove_unshared()

    def _remove_unshared(self) -> None:
        """Remove the frozen parts in the store's shared folder that no
        checkpoint still in the store lists (:func:`transfer.remove_unshared`):
        listed again after the removals, so that a retired one that could
        not be removed keeps its part. Where a manifest cannot be read,
        none: a part too many is no loss, a part removed that a checkpoint
        lists would be."""
        store = self._store()
        try:
            manifests = [store.persist(
                f"reading {self.url(name)}/{MANIFEST_NAME}",
                lambda seconds, name=name: remote_read.read_json(store, name, MANIFEST_NAME))
                for name in remote_read.names(store)]
            if not all(isinstance(manifest, dict) for manifest in manifests):
                raise ValueError("a manifest is not a JSON object")
            transfer.remove_unshared(store, manifests)
        except (OSError, ValueError, CheckpointError, StoreUnavailableError) as exc:
            warnings.warn(f"could not remove the frozen parts that no checkpoint of "
                          f"{self.dirname} holds: {exc}", UserWarning)

    def remove(self, name: str) -> None:
        """Remove checkpoint ``name`` from the store: its manifest first,
        then its files, each request sent again through an outage."""
        transfer.remove_checkpoint(self._store(), name)

    def wait(self) -> str | None:
        """Wait for every upload queued, the retirements and the staging
        folder's removals; raise the first that failed. Return what to tell
        the user (:func:`~skorch_accel_callbacks.storage._upload_queue.told`):
        how long each upload took, and how long this wait blocked if one was
        still running."""
        began, busy = time.monotonic(), not all(future.done() for future in self._pending)
        futures.wait(self._pending)
        waited = time.monotonic() - began
        error, said, _ = wait_for(self._pending, lambda: False)
        with self._lock:
            removals, self._removals = self._removals, []
        for removal in removals:
            if removal is not None:
                removal.join()
        self.staging.wait()
        if error is not None:
            raise error
        return self._said(said, waited if busy else None)

    def wait_for_room(self) -> str | None:
        """Before a save: raise what failed of the background work that
        ended, and wait for uploads only while the queue has no room
        (:meth:`UploadQueue.has_room`): a save does not wait for the
        network. With ``save_on_each_node`` it waits for every upload
        (:meth:`wait`): the nodes' uploads run collectives, and which
        checkpoint each uploads must not depend on timing."""
        if self._nodes is not None:
            return self.wait()
        # one read of the queue's length, without the lock: a stale one
        # waits for one upload more or less
        error, said, waited = wait_for(self._pending, self._queue.has_room)
        with self._lock:
            self._removals = [removal for removal in self._removals
                              if removal is not None and removal.is_alive()]
        if error is not None:
            raise error
        return self._said(said, waited)

    def _said(self, said: list[str], waited: float | None) -> str | None:
        with self._lock:
            dropped, self._queue.dropped = self._queue.dropped, []
        return told(said, [self.url(name) for name in dropped], waited)

    # ------------------------------------------------------------ reading

    def exists(self) -> bool:
        """Whether the bucket exists: a folder in a store is only a prefix."""
        try:
            transfer.check_reachable(self._store())
        except CheckpointError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return False
            raise
        return True

    def list_names(self) -> set[str]:
        """The checkpoints in the store with a manifest."""
        return remote_read.names(self._store())

    def read_json(self, *parts: str) -> Any:
        return remote_read.read_json(self._store(), *parts)

    def fetch(self, name: str) -> Found:
        """Checkpoint ``name`` checked in the store, downloaded into the
        staging folder and checked there (:func:`remote_read.fetch`)."""
        return remote_read.fetch(self._store(), self.staging, name)

    def check(self, name: str) -> tuple[dict[str, Any], str | None]:
        """The manifest of checkpoint ``name`` in the store and why it is not
        complete there (:func:`remote_read.check`)."""
        return remote_read.check(self._store(), name)


def _take_lease(store: transfer.Store, ttl_seconds: float) -> ObjectLease | None:
    try:
        return take_lease(store.fs, store.path(LEASE_NAME), ttl_seconds)
    except FolderInUseError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"cannot save into {store.dirname}: writing its lease failed "
            f"({type(exc).__name__}: {exc}); check that the credentials may write") from exc
