"""One job per remote checkpoint folder: a lease object in the store.

An object store has no flock, and a job that is killed cannot remove what
it wrote there. So the folder's lock is an object, a lease: JSON naming its
holder (pid, host, a token) and when it expires. It is taken with a
create-only conditional write (S3 ``If-None-Match: *``), and every later
write of it (renewal, takeover, removal) is conditional on the ETag of the
version the writer last saw (``If-Match``): of two writers, exactly one
succeeds. The holder renews it from a background thread; a holder that was
killed stops renewing, its lease expires, and the next job takes it over
with a warning. A write the store made whose answer never came back (the
connection dropped, or the client gave up at its deadline) leaves the lease
at a version its writer did not hear of, and the writer's next conditional
write fails: where the lease holds the writer's own token, the writer takes
that version as its own, instead of counting the lease as lost (to itself),
or, for the create that takes it, as held by another job (itself). Every
request for the lease, a read as a write, is given up after a third of its
``ttl_seconds`` (a renewal's interval): a store that went silent fails the
job in time, whatever the client's own timeouts.

``expires_at`` is wall-clock UTC: the jobs that read it run on other hosts,
where a monotonic clock means nothing. Hosts' clocks differ, so a lease
counts as expired only ``clock_skew_seconds`` after its ``expires_at``.
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
import threading
import uuid
import warnings
import weakref
from datetime import UTC, datetime, timedelta
from typing import Any, Self

from skorch_accel_callbacks.errors import FolderInUseError, LeaseLostError
from skorch_accel_callbacks.storage import _transfer as transfer

__all__ = ['ObjectLease', 'take_lease']

# a lease that keeps being created and removed under us (by jobs that take
# and release it) is looked at this often before giving up
_ATTEMPTS = 5


class ObjectLease:
    """An exclusive lease on a remote checkpoint folder for one job: the
    object ``path`` in the store of ``fs``.

    :meth:`acquire` creates the object, or refuses with
    :class:`~skorch_accel_callbacks.errors.FolderInUseError` naming the holder
    while its lease is live, or takes over a lease that expired (its holder
    was killed, or lost the store) with a ``UserWarning`` naming the previous
    holder. A thread renews the lease every ``renew_every`` seconds until
    :meth:`release`. If another job took it over meanwhile (this process was
    suspended, or cut off from the store, for longer than the lease lasts),
    renewing stops, :meth:`check` raises :class:`LeaseLostError` and
    :meth:`release` warns. A lease dropped without release is released when
    it is collected or the interpreter exits, silently; one whose process
    was killed expires. A copy (pickle) holds nothing.

    Parameters
    ----------
    fs : fsspec filesystem
      The store: ``s3fs.S3FileSystem`` (or one with its conditional writes:
      ``pipe_file(..., mode='create')`` raising ``FileExistsError``,
      ``pipe_file(..., IfMatch=etag)`` returning the new ``ETag``, and
      ``call_s3('delete_object', ..., IfMatch=etag)``).

    path : str
      The lease object, e.g. ``'bucket/run1/.lease.json'``.

    ttl_seconds : float (default=60.0)
      How long a lease lasts after each renewal: how long a new job is
      refused after the holder was killed (plus ``clock_skew_seconds``).

    renew_every : float or None (default=None)
      Seconds between renewals; None: ``ttl_seconds / 3``, so that two
      renewals can fail before the lease expires.

    clock_skew_seconds : float (default=10.0)
      How far the clocks of two hosts may disagree: a lease is taken over
      only this long after it expired by the taker's clock.

    Raises
    ------
    FolderInUseError
      From :meth:`acquire`, while another job holds the lease.

    LeaseLostError
      From :meth:`check`, once another job took the lease over.

    Examples
    --------
    Against a local S3 server (moto's, as the tests use):

    >>> import s3fs
    >>> from moto.server import ThreadedMotoServer
    >>> server = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)
    >>> server.start()
    >>> host, port = server.get_host_and_port()
    >>> fs = s3fs.S3FileSystem(key='testing', secret='testing', skip_instance_cache=True,
    ...                        client_kwargs={'endpoint_url': f'http://{host}:{port}'})
    >>> fs.mkdir('bucket')
    >>> lease = ObjectLease(fs, 'bucket/run1/.lease.json').acquire()
    >>> other = ObjectLease(fs, 'bucket/run1/.lease.json')
    >>> other.acquire()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    skorch_accel_callbacks.errors.FolderInUseError: ...
    >>> lease.check()  # before each commit: LeaseLostError if taken over
    >>> lease.release()
    >>> server.stop()

    """

    def __init__(
            self, fs: Any, path: str, ttl_seconds: float = 60.0,
            renew_every: float | None = None, clock_skew_seconds: float = 10.0,
    ) -> None:
        self.fs = fs
        self.path = path
        self.ttl_seconds = ttl_seconds
        self.renew_every = renew_every
        self.clock_skew_seconds = clock_skew_seconds
        self._held = None
        self._finalizer = None

    @property
    def url(self) -> str:
        """The lease object's URL, as messages name it."""
        return self.fs.unstrip_protocol(self.path)

    @property
    def held(self) -> bool:
        """Whether this object holds the lease, as far as it knows."""
        return self._held is not None and self._held.lost_to is None

    def acquire(self) -> Self:
        """Take the lease (once per object), or raise
        :class:`~skorch_accel_callbacks.errors.FolderInUseError` naming the
        holder; warn when taking over an expired one."""
        if self._held is not None:
            return self
        interval = self._interval()
        for _ in range(_ATTEMPTS):
            record = self._new_record()
            try:
                etag = _write(self.fs, self.path, record, self.ttl_seconds, mode='create')
            except FileExistsError:
                etag = self._take_over(record)
                if etag is None:
                    continue
            except OSError:
                # given up at its deadline, or its connection lost past the
                # client's retries: the store may have made it all the same;
                # a store that took it and went silent must not hold the job
                found = _read(self.fs, self.path, self.ttl_seconds)
                if found is None:
                    raise  # it made nothing: the store is slow or out of reach
                if not _written_by(found, record):
                    continue  # another job's, made meanwhile: look at it again
                etag = found[1]
            held = _Held(self.fs, self.path, record, etag, self.ttl_seconds)
            held.start(interval, f'lease renewal {self.url}')
            # the finalizer and the thread hold the state, not the lease: a
            # lease dropped without release is collected, and released
            self._finalizer = weakref.finalize(self, held.release_quietly)
            self._held = held
            return self
        raise FolderInUseError(
            f"lease {self.url} was taken and released {_ATTEMPTS} times while this "
            "job tried to take it: other jobs keep using the folder; try again")

    def check(self) -> None:
        """Renew the lease now; raise :class:`LeaseLostError` if another job
        took it over (and ``OSError`` if the store cannot be reached)."""
        if self._held is None:
            raise RuntimeError(f"lease {self.url} is not held: acquire() it first")
        try:
            self._held.renew()
        except LeaseLostError:
            self._held.lost_reported = True
            raise

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still this job's;
        warn if another job took it over or it could not be removed.
        Idempotent."""
        held, self._held = self._held, None
        if held is None:
            return
        self._finalizer.detach()
        self._finalizer = None
        message = held.release()
        if message is not None:
            warnings.warn(message)

    def _interval(self) -> float:
        interval = self.ttl_seconds / 3 if self.renew_every is None else self.renew_every
        if not 0 < interval < self.ttl_seconds:
            raise ValueError(
                f"lease {self.url}: renew_every={self.renew_every!r} must be more than 0 and "
                f"less than ttl_seconds={self.ttl_seconds!r}, or the lease expires between "
                "renewals")
        return interval

    def _new_record(self) -> dict[str, Any]:
        now = datetime.now(UTC)
        return {'holder': os.getpid(), 'host': socket.gethostname(), 'boot_id': _boot_id(),
                'pid_namespace': _pid_namespace(), 'started': _start_time(os.getpid()),
                'token': uuid.uuid4().hex, 'acquired_at': now.isoformat(),
                'expires_at': _expiry(now, self.ttl_seconds), 'ttl_seconds': self.ttl_seconds}

    def _take_over(self, record: dict[str, Any]) -> str | None:
        """Take over the lease that is there if it expired (its ETag, or None
        if it changed meanwhile: look again); refuse while it is live."""
        found = _read(self.fs, self.path, self.ttl_seconds)
        if found is None:
            return None
        if _written_by(found, record):
            # this job's create: the store made it, its answer was lost, and
            # the client's retry of it found the lease there
            return found[1]
        previous, etag = found
        try:
            expires_at = datetime.fromisoformat(previous['expires_at'])
            holder = _describe(previous)
        except (KeyError, TypeError, ValueError):
            raise FolderInUseError(
                f"lease {self.url} of checkpoint folder {self._folder()} cannot be read "
                f"({previous!r:.200}): if no job uses that folder, remove it") from None
        gone = _holder_is_gone(previous)
        live = datetime.now(UTC) <= expires_at + timedelta(seconds=self.clock_skew_seconds)
        if live and not gone:
            raise FolderInUseError(self._refusal(holder, previous['expires_at']))
        try:
            new_etag = _write(self.fs, self.path, record, self.ttl_seconds, IfMatch=etag)
        except OSError:
            now = _read(self.fs, self.path, self.ttl_seconds)
            if now is not None and now[1] == etag:
                raise
            if _written_by(now, record):
                new_etag = now[1]  # the store took it; its answer was lost
            else:
                return None  # another job took it over first
        warnings.warn(
            f"took over the lease {self.url} of checkpoint folder {self._folder()} from "
            + (f"{holder}, a process of this machine that is gone (killed)" if gone else
               f"{holder}, which expired at {previous['expires_at']} without being renewed: "
               "that job was killed or cut off from the store; if it still runs, it will "
               "find its lease lost"))
        return new_etag

    def _folder(self) -> str:
        return self.fs.unstrip_protocol(posixpath.dirname(self.path))

    def _refusal(self, holder: str, expires_at: str) -> str:
        return (
            f"checkpoint folder {self._folder()} is in use by another running job "
            f"({holder}, lease {self.url}, renewed until {expires_at}): two jobs saving "
            "into one folder would overwrite or retire each other's checkpoints; wait for "
            "it to end (the lease of a job that was killed expires "
            f"{self.clock_skew_seconds:g} s after that time) or give this job its own folder")

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _held=None, _finalizer=None)


#: how long the end of a job waits for the store to remove its lease
RELEASE_SECONDS = 10.0


class _Held:
    """A lease this process holds: what renewing and removing it need, apart
    from the :class:`ObjectLease`, so that neither the renewal thread nor the
    finalizer keeps that alive."""

    def __init__(self, fs: Any, path: str, record: dict[str, Any], etag: str,
                 ttl_seconds: float) -> None:
        self.fs = fs
        self.path = path
        self.record = record
        self.etag = etag
        self.ttl_seconds = ttl_seconds
        # who took the lease over, once a conditional write found out
        self.lost_to = None
        self.lost_reported = False
        # renew() runs in the renewal thread and in check()
        self.guard = threading.Lock()
        self.stopped = threading.Event()
        self.thread = None

    def start(self, interval: float, name: str) -> None:
        self.thread = threading.Thread(
            target=self._renew_until_stopped, args=(interval,), name=name, daemon=True)
        self.thread.start()

    def _renew_until_stopped(self, interval: float) -> None:
        while not self.stopped.wait(interval):
            try:
                self.renew()
            except LeaseLostError:
                return
            except Exception:
                # the store was out of reach: the next tick tries again; if
                # the lease expires meanwhile and is taken, that write finds out
                continue

    def renew(self) -> None:
        """Move ``expires_at`` on, conditional on our last ETag."""
        with self.guard:
            if self.lost_to is None:
                record = dict(self.record, expires_at=_expiry(datetime.now(UTC),
                                                              self.ttl_seconds))
                try:
                    self.etag = _write(self.fs, self.path, record, self.ttl_seconds,
                                       IfMatch=self.etag)
                    self.record = record
                except OSError:
                    now = _read(self.fs, self.path, self.ttl_seconds)
                    if now is not None and now[1] == self.etag:
                        raise  # not for the lease: the next renewal tries again
                    if not self._caught_up(now):
                        self.lost_to = _holder_of(now)
            if self.lost_to is not None:
                raise LeaseLostError(self.lost_message())

    def _caught_up(self, now: tuple[Any, str] | None) -> bool:
        """Whether the lease as read now (:func:`_read`) is still this
        holding's, at a version that a write of its own made: one the store
        took though its answer never came back (the connection dropped, or
        the write was given up at its deadline while under way). Its record
        and ETag are then taken as this holding's."""
        if not _written_by(now, self.record):
            return False
        self.record, self.etag = now
        return True

    def lost_message(self) -> str:
        folder = self.fs.unstrip_protocol(posixpath.dirname(self.path))
        return (
            f"this job lost the lease {self.fs.unstrip_protocol(self.path)} of checkpoint "
            f"folder {folder}: it was not renewed before it expired (this job was suspended "
            f"or cut off from the store) and {self.lost_to} took it over; checkpoints "
            "that this job wrote since then may be mixed with that job's")

    def release(self) -> str | None:
        """Stop renewing and remove the lease if it is still ours; what the
        job should be told: the lease's loss if another job took it and no
        check() said so, or why it could not be removed."""
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join()
        with self.guard:
            not_removed = self._remove() if self.lost_to is None else None
            if self.lost_to is None or self.lost_reported:
                return not_removed
            return self.lost_message()

    def _remove(self) -> str | None:
        """Remove the lease; why it is still there if it could not be."""
        bucket, key, _ = self.fs.split_path(self.path)
        failed = None
        try:
            for _ in range(_ATTEMPTS):
                try:
                    self.fs.call_s3('delete_object', Bucket=bucket, Key=key, IfMatch=self.etag,
                                    **transfer.deadline(self.fs, RELEASE_SECONDS))
                    return None
                except FileNotFoundError:
                    self.lost_to = 'a job that removed it'
                    return None
                except TimeoutError as error:
                    # a store that does not answer would not answer whether the
                    # lease changed either; the lease expires by itself
                    return (
                        f"could not remove the lease {self.fs.unstrip_protocol(self.path)}: "
                        f"the store did not answer within {RELEASE_SECONDS:g} s "
                        f"({error or type(error).__name__}); a new job is refused the folder "
                        f"until it expires at {self.record['expires_at']}")
                except OSError as error:
                    failed = error
                    try:
                        now = _read(self.fs, self.path, self.ttl_seconds)
                    except OSError:
                        return self._not_removed(error)
                    if now is not None and now[1] == self.etag:
                        return self._not_removed(error)
                    if not self._caught_up(now):
                        self.lost_to = _holder_of(now)
                        return None
                    # a renewal of ours that the store took after its answer
                    # was lost moved the lease on: remove that version
            return self._not_removed(failed)
        finally:
            self.fs.invalidate_cache(self.path)

    def _not_removed(self, error: OSError | None) -> str:
        return (
            f"could not remove the lease {self.fs.unstrip_protocol(self.path)} "
            f"({error}): a new job is refused the folder until it expires at "
            f"{self.record['expires_at']}")

    def release_quietly(self) -> None:
        """Release for a lease dropped without release, or at interpreter
        exit: nothing to tell anyone, and no one to raise to. (No
        ``warnings.catch_warnings`` to hush it: the collector runs this in
        whichever thread it is in, and that context manager swaps the
        process's warning filters under every other thread's feet.)"""
        try:
            self.release()
        except Exception:
            pass  # the lease expires


def _expiry(now: datetime, ttl_seconds: float) -> str:
    return (now + timedelta(seconds=ttl_seconds)).isoformat()


def _write(fs: Any, path: str, record: dict[str, Any], ttl_seconds: float,
           **condition: Any) -> str:
    """Write ``record`` to ``path`` under ``condition``; the new ETag. A
    write that goes unanswered for a third of the lease's ``ttl_seconds``
    (a renewal's interval) is given up: the next renewal tries again."""
    written = fs.pipe_file(path, json.dumps(record).encode(), **condition,
                           **transfer.deadline(fs, ttl_seconds / 3))
    etag = (written or {}).get('ETag')
    if not etag:
        raise TypeError(
            f"{type(fs).__name__} did not report the ETag of writing {path}: a lease needs "
            "a store with conditional writes (S3, through s3fs)")
    return etag


def _read(fs: Any, path: str, ttl_seconds: float) -> tuple[Any, str] | None:
    """The lease at ``path`` and its ETag, or None if there is none. Each
    request is given up after a third of the lease's ``ttl_seconds``, as a
    write is: a store that went silent fails the acquire, ``check()`` or the
    release in time, where the client's own read timeout and retries
    (botocore's defaults: a minute, several times) would hold the job."""
    deadline = transfer.deadline(fs, ttl_seconds / 3)
    # the ETag first: a lease read after it is that version or a newer one,
    # and a write conditional on an older ETag than the content read fails;
    # the other order could overwrite a newer, live lease
    try:
        fs.invalidate_cache(path)
        etag = fs.info(path, **deadline)['ETag']
        content = fs.cat_file(path, **deadline)
    except FileNotFoundError:
        return None
    try:
        return json.loads(content), etag
    except ValueError:
        return content, etag


def _describe(record: dict[str, Any]) -> str:
    return f"pid {record['holder']} on host {record['host']}"


def _written_by(found: tuple[Any, str] | None, record: dict[str, Any]) -> bool:
    """Whether the lease as read (:func:`_read`) is the holding of
    ``record``: its token, which no other job's lease has."""
    return (found is not None and isinstance(found[0], dict)
            and found[0].get('token') == record['token'])


def _holder_of(found: tuple[Any, str] | None) -> str:
    """Who holds the lease as read (:func:`_read`), for a message."""
    if found is None:
        return 'a job that removed it'
    try:
        return f"another job ({_describe(found[0])})"
    except (KeyError, TypeError):
        return 'another job'


def _boot_id() -> str | None:
    """This machine's boot: a process id names a process within one boot."""
    try:
        with open('/proc/sys/kernel/random/boot_id') as file:
            return file.read().strip() or None
    except OSError:
        return None


def _pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[inode]``): a pid names a process
    only within one, and two containers of one machine have their own."""
    try:
        return os.readlink('/proc/self/ns/pid')
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (``/proc``'s
    ``stat``, field 22), or None: a pid that is used again by a new
    process has another start time."""
    try:
        with open(f'/proc/{pid}/stat') as file:
            stat = file.read()
    except OSError:
        return None
    # the command name, in parentheses, may hold spaces and parentheses
    fields = stat[stat.rindex(')') + 2:].split()
    return int(fields[19])


def _holder_is_gone(record: dict[str, Any]) -> bool:
    """Whether the lease's holder was a process of this machine, in this
    boot and this PID namespace, that no longer exists (or whose pid is now
    another process's): a killed job restarted on its machine need not wait
    for the lease to expire. A host name alone could be another machine's,
    and a pid of another PID namespace (another container on this host)
    says nothing here, so in those cases the lease runs its course."""
    pid = record.get('holder')
    if (type(pid) is not int or _boot_id() is None or record.get('boot_id') != _boot_id()
            or _pid_namespace() is None or record.get('pid_namespace') != _pid_namespace()):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists, another user's
    started = record.get('started')
    return started is not None and _start_time(pid) not in (None, started)


def take_lease(fs: Any, path: str, ttl_seconds: float = 60.0) -> ObjectLease | None:
    """The acquired lease at ``path`` of a store with S3's conditional
    writes (through s3fs), lasting ``ttl_seconds`` after each renewal, or
    None for another store, which a lease cannot guard (the job holds its
    local staging folder's lock only)."""
    if not transfer.is_s3(fs):
        return None
    return ObjectLease(fs, path, ttl_seconds=ttl_seconds).acquire()
