"""One job per folder (an exclusive ``flock`` on ``<folder>/.lock``), or per
set of files: :class:`PrefixLock` on the files of one ``fn_prefix``."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from typing import Any, Self, TextIO

from skorch_accel_callbacks.errors import FolderInUseError
from skorch_accel_callbacks.format import LOCK_NAME

__all__ = ['FolderLock', 'PrefixLock', 'probe']


class _Hold:
    """A lock file that this process holds, shared by the locks of the thread
    that took it: the callbacks of one job share a folder's lock, a job
    fitted in another thread is refused."""

    def __init__(self, lock_file: TextIO, thread: threading.Thread, remove: bool) -> None:
        self.file = lock_file
        self.thread = thread
        # the file is removed on the last release only if every holder asks
        self.remove = remove
        self.holders = 0


# The locks this process holds: lock file's real path -> _Hold. A flock
# belongs to an open file (unlike a POSIX fcntl lock, which a process holds
# once and loses on any close of the file), so flock itself refuses a second
# open of the file in this process: the callbacks of one job share the file
# opened once, and a job in another thread is refused here, naming the thread.
_HELD = {}
# a lock file that keeps being replaced under us (by holders that remove it
# on release) is retried this often before giving up
_ATTEMPTS = 50
# reentrant: release() also runs from __del__, whenever the collector does
_HELD_GUARD = threading.RLock()
# A lock file whose recorded holder has ended, on this host and in this pid
# namespace, is still locked by a process that holds a descriptor of it
# (inherited before this module was imported, or passed on purpose): such a
# process is retried for this long before the job is refused, as a
# DataLoader worker of a killed job notices its parent's death within about
# 5 s (torch's MP_STATUS_CHECK_INTERVAL) and exits.
_ORPHAN_GRACE_S = 15.0
_ORPHAN_POLL_S = 0.25


def _forget_held_in_child() -> None:
    """Close, in a forked child, every lock file this process holds.

    A ``flock`` belongs to the open file, which a fork shares with the
    child: a DataLoader worker or a user's fork pool would keep the folder
    locked after the job that took it was killed, and refuse its relaunch.
    Closing the child's descriptor leaves the parent's lock as it is
    (``LOCK_UN`` would release it for the parent too). The lock objects
    the child inherited hold nothing from now on.
    """
    for held in _HELD.values():
        held.file.close()
    _HELD.clear()


# runs in every child that os.fork() or multiprocessing's fork start method
# makes, before the child's own code; a child that execs closes the file
# anyway (Python opens files non-inheritable)
os.register_at_fork(after_in_child=_forget_held_in_child)


class FolderLock:
    """An exclusive lock on a folder for one job: ``flock`` on ``<folder>/.lock``.

    The kernel releases the lock when the holder's process ends, however it
    ends, so a job that was killed leaves no stale lock behind. The file
    keeps the holder's pid and host, so that a refused job can say who holds
    it. By default it stays on disk (it is the lock's anchor, not its
    state); with ``remove_on_release=True`` the last holder removes it when
    it releases the lock (a killed holder leaves it, unlocked, until the
    next holder releases it). Within one process the lock is shared
    (counted) by the thread that took it: a job's callbacks that use the
    same folder do not refuse each other, while a job fitted in another
    thread is refused like one in another process. A copy (pickle,
    deepcopy) of a lock holds nothing: a lock belongs to its process.

    Parameters
    ----------
    folder : str or path-like
      The folder of the lock file.

    name : str (default='.lock')
      Name of the lock file in ``folder``.

    remove_on_release : bool (default=False)
      Whether the last holder in the process removes the lock file when it
      releases the lock. Every holder of a lock file must either leave it or
      remove it only while it still holds the lock (as this class does):
      :meth:`acquire` checks after locking that the file it locked is still
      the one at the path.

    Examples
    --------
    >>> import os
    >>> os.makedirs('run1')
    >>> lock = FolderLock('run1').acquire()  # FolderInUseError if held elsewhere
    >>> lock.release()

    """

    def __init__(
            self, folder: str | os.PathLike, name: str = LOCK_NAME, remove_on_release: bool = False,
    ) -> None:
        self.folder = os.fspath(folder) or '.'
        self.path = os.path.join(self.folder, name)
        self.remove_on_release = remove_on_release
        # the real path when it was taken: the folder may not exist before
        self._key = None
        self._file = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock (never in a forked child)."""
        return self._file is not None and not self._file.closed

    def acquire(self) -> Self:
        """Take the lock (once per object) or raise :class:`FolderInUseError`
        naming the holder: another process, or another thread of this one."""
        with _HELD_GUARD:
            if self._file is None:
                key = os.path.realpath(self.path)
                thread = threading.current_thread()
                held = _HELD.get(key)
                if held is None:
                    held = _HELD[key] = _Hold(self._lock_file(), thread, True)
                elif held.thread is not thread:
                    raise FolderInUseError(self._refusal(_thread_holder(held)))
                held.holders += 1
                held.remove = held.remove and self.remove_on_release
                self._key = key
                self._file = held.file
        return self

    def _lock_file(self) -> TextIO:
        # A holder that removes the lock file on release (remove_on_release)
        # unlinks it while it still holds the flock, then closes it. Another
        # job may have opened the old file just before: its flock then
        # succeeds on a file that no longer has a name, while a third job
        # creates a new file at the path and locks that one; both would hold
        # "the" lock. So a flock counts only if the file locked is still the
        # one at the path (same device and inode) once it is held; if not,
        # the file is closed and the path opened again. A refusal is checked
        # the same way: the holder may have released (and removed) the file
        # between our open and our flock.
        attempts = 0
        orphaned_since = None
        while attempts < _ATTEMPTS:
            attempts += 1
            lock_file = open(self.path, 'a+', encoding='utf-8')
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not _is_at_path(lock_file, self.path):
                    lock_file.close()
                    continue
                record = _record(lock_file)
                lock_file.close()
                if not _has_ended(record):
                    raise FolderInUseError(self._refusal(_described(record))) from None
                # left locked by what the ended job forked: wait for it to exit
                now = time.monotonic()
                orphaned_since = orphaned_since or now
                if now - orphaned_since > _ORPHAN_GRACE_S:
                    raise FolderInUseError(self._orphan_refusal(record)) from None
                attempts -= 1
                time.sleep(_ORPHAN_POLL_S)
                continue
            except BaseException:
                lock_file.close()
                raise
            try:
                if not _is_at_path(lock_file, self.path):
                    lock_file.close()
                    continue
                lock_file.seek(0)
                lock_file.truncate()
                json.dump(_this_holder(), lock_file)
                lock_file.flush()
            except BaseException:
                lock_file.close()
                raise
            return lock_file
        raise FolderInUseError(
            f"lock file {self.path} was replaced {_ATTEMPTS} times while this job "
            "tried to lock it: other jobs keep taking and releasing it; try again")

    def _refusal(self, holder: str) -> str:
        return (
            f"checkpoint folder {self.folder} is in use by another running job "
            f"({holder}, lock file {self.path}): two jobs saving into one "
            "folder would overwrite or retire each other's checkpoints; wait for "
            "it to end or give this job its own folder")

    def _orphan_refusal(self, record: dict[str, Any]) -> str:
        return (
            f"checkpoint folder {self.folder} is still locked (lock file {self.path}) "
            f"{_ORPHAN_GRACE_S:g} s after the job that took it, pid {record['pid']} on "
            f"host {record['host']}, ended: a process it forked (a DataLoader worker, a "
            "fork pool) or was handed the lock file to still holds it open; end that "
            "process, or give this job its own folder")

    def release(self) -> None:
        """Release this hold; the last one in the process closes the file,
        which releases the flock (removing the file first with
        ``remove_on_release``)."""
        with _HELD_GUARD:
            if self._file is None:
                return
            held = _HELD.get(self._key)
            mine, self._file = self._file, None
            if held is None or held.file is not mine:
                return  # taken by the parent of this forked process: not ours
            held.holders -= 1
            if held.holders == 0:
                del _HELD[self._key]
                try:
                    # removed while still locked: see _lock_file; a file that
                    # someone else put at the path is not ours to remove
                    # at interpreter exit the file may be closed (finalized)
                    # before this runs: the flock went with it
                    if (held.remove and not held.file.closed
                            and _is_at_path(held.file, self.path)):
                        os.remove(self.path)
                except OSError:
                    pass
                finally:
                    held.file.close()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _file=None, _key=None)

    # a lock dropped without release (a fit that raised, then forgotten)
    # closes its file itself, without a ResourceWarning
    __del__ = release


class PrefixLock(FolderLock):
    """The lock of the files whose names start with ``prefix`` in ``folder``,
    for one job: ``flock`` on ``<folder>/.<prefix>lock``, removed when
    released.

    Jobs that write files of different prefixes into one folder do not refuse
    each other; two with the same prefix do. No lock file is left behind by a
    job that ends normally (one killed leaves it, unlocked, until the next
    job with that prefix releases it). With ``prefix=''`` the lock file is
    ``<folder>/.lock``, the lock of a whole folder (:class:`FolderLock`).

    Examples
    --------
    >>> import os
    >>> os.makedirs('run1', exist_ok=True)
    >>> lock = PrefixLock('run1', 'train_end_').acquire()
    >>> os.path.exists('run1/.train_end_lock')
    True
    >>> lock.release()
    >>> os.path.exists('run1/.train_end_lock')
    False

    """

    def __init__(self, folder: str | os.PathLike, prefix: str = '') -> None:
        super().__init__(folder, name=f'.{prefix}lock', remove_on_release=True)
        self.prefix = prefix

    def _refusal(self, holder: str) -> str:
        return (
            f"checkpoint folder {self.folder} is in use by another running job "
            f"({holder}, lock file {self.path}) for the files of fn_prefix="
            f"{self.prefix!r}: two jobs saving the same files would overwrite "
            "each other's; wait for it to end, or give this job its own folder "
            "or fn_prefix")


def _is_at_path(lock_file: TextIO, path: str) -> bool:
    """Whether ``lock_file`` (open) is the file that ``path`` names now."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(lock_file.fileno())
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def _pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[4026531836]``), None where
    /proc does not say (macOS)."""
    try:
        return os.readlink('/proc/self/ns/pid')
    except OSError:
        return None


def _this_holder() -> dict[str, Any]:
    """What a holder writes into the lock file: enough for a refused job to
    name it, and to tell whether it still runs."""
    return {'pid': os.getpid(), 'host': socket.gethostname(), 'pid_ns': _pid_namespace()}


def _parse_record(text: str) -> dict[str, Any] | None:
    """The holder's record in a lock file, None if ``text`` holds none."""
    try:
        record = json.loads(text)
        if isinstance(record, dict) and isinstance(record.get('pid'), int) and 'host' in record:
            return record
    except ValueError:
        pass
    return None


def _record(lock_file: TextIO) -> dict[str, Any] | None:
    lock_file.seek(0)
    return _parse_record(lock_file.read())


def _has_ended(record: dict[str, Any] | None) -> bool:
    """Whether the job that ``record`` names has ended, as far as this process
    can tell: only a pid of this host and pid namespace can be looked up (a
    container that shares the folder and the host name has pids of its own)."""
    if record is None or record['host'] != socket.gethostname():
        return False
    namespace = _pid_namespace()
    if namespace is None or record.get('pid_ns') != namespace:
        return False
    try:
        os.kill(record['pid'], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it runs, as another user
    return False


def _named_holder(text: str) -> str | None:
    """``pid P on host H`` as a holder wrote it into a lock file, or None
    if ``text`` names none."""
    record = _parse_record(text)
    return None if record is None else f"pid {record['pid']} on host {record['host']}"


def _described(record: dict[str, Any] | None) -> str:
    """Who holds a lock file whose holder wrote ``record``."""
    if record is None:
        # the holder is between taking the lock and writing its name
        return 'a job that is starting'
    described = f"pid {record['pid']} on host {record['host']}"
    if record['pid'] == os.getpid() and record['host'] == socket.gethostname():
        # a thread of this process that reached the folder by another path
        # (a bind mount): the registry did not know it as the same file
        described += ", this process, through another path to the lock file"
    return described


def probe(path: str | os.PathLike) -> dict[str, Any]:
    """The lock file ``path``, without taking it: ``{'exists', 'held', 'holder'}``.

    ``holder`` is the pid and host the lock file names (the last job that
    took it; None if it names none); ``held`` whether a running job holds
    it now (None if the file cannot be read). That is found by trying a
    shared, non-blocking ``flock`` on the file, opened read-only, which is
    released at once: a job that tries to take the lock in that same
    instant is refused as if the folder were in use.
    """
    try:
        lock_file = open(path, encoding='utf-8')
    except FileNotFoundError:
        return {'exists': False, 'held': False, 'holder': None}
    except OSError:  # not readable: who holds it cannot be told
        return {'exists': True, 'held': None, 'holder': None}
    with lock_file:
        try:
            holder = _named_holder(lock_file.read())
        except OSError:
            holder = None
        try:
            fcntl.flock(lock_file, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            held = True
        else:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
            held = False
    return {'exists': True, 'held': held, 'holder': holder}


def _thread_holder(held: _Hold) -> str:
    """Who holds ``held``: a thread of this process."""
    described = (f"pid {os.getpid()} on host {socket.gethostname()}, thread "
                 f"{held.thread.name!r} of this process")
    if not held.thread.is_alive():
        # a fit there raised: its callbacks keep the lock until their net
        # is initialized again or collected
        described += ", a thread that has ended without releasing it"
    return described
