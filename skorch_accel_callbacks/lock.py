"""One job per folder: an exclusive ``flock`` on ``<folder>/.lock``."""

import fcntl
import json
import os
import socket
import threading

__all__ = ['FolderInUseError', 'FolderLock', 'LOCK_NAME']

LOCK_NAME = '.lock'


class FolderInUseError(RuntimeError):
    """Another running job holds the lock of a checkpoint folder."""


# flock refuses a second open file of the same process too; the callbacks of
# one job that share a folder share its lock: lock file's real path ->
# [open file, number of holders]
_HELD = {}
# reentrant: release() also runs from __del__, whenever the collector does
_HELD_GUARD = threading.RLock()


class FolderLock:
    """An exclusive lock on a folder for one job: ``flock`` on ``<folder>/.lock``.

    The kernel releases the lock when the holder's process ends, however it
    ends, so a job that was killed leaves no stale lock behind. The file
    keeps the holder's pid and host, so that a refused job can say who holds
    it; it stays on disk (it is the lock's anchor, not its state). Within
    one process the lock is shared (counted): a job's callbacks that use the
    same folder do not refuse each other. A copy (pickle, deepcopy) of a
    lock holds nothing: a lock belongs to its process.

    Examples
    --------
    >>> lock = FolderLock('run1').acquire()  # FolderInUseError if held elsewhere
    >>> lock.release()

    """

    def __init__(self, folder, name=LOCK_NAME):
        self.folder = os.fspath(folder) or '.'
        self.path = os.path.join(self.folder, name)
        self._key = os.path.realpath(self.path)
        self._file = None

    @property
    def held(self):
        """Whether this object holds the lock."""
        return self._file is not None

    def acquire(self):
        """Take the lock (once per object) or raise :class:`FolderInUseError`
        naming the holder."""
        with _HELD_GUARD:
            if self._file is None:
                held = _HELD.get(self._key)
                if held is None:
                    held = _HELD[self._key] = [self._lock_file(), 0]
                held[1] += 1
                self._file = held[0]
        return self

    def _lock_file(self):
        lock_file = open(self.path, 'a+', encoding='utf-8')
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            try:
                holder = json.loads(lock_file.read())
                holder = f"pid {holder['pid']} on host {holder['host']}"
            except (ValueError, KeyError, TypeError):
                # the holder is between taking the lock and writing its name
                holder = 'a job that is starting'
            lock_file.close()
            raise FolderInUseError(
                f"checkpoint folder {self.folder} is in use by another running job "
                f"({holder}, lock file {self.path}): two jobs saving into one "
                "folder would overwrite or retire each other's checkpoints; wait for "
                "it to end or give this job its own folder") from None
        except BaseException:
            lock_file.close()
            raise
        lock_file.seek(0)
        lock_file.truncate()
        json.dump({'pid': os.getpid(), 'host': socket.gethostname()}, lock_file)
        lock_file.flush()
        return lock_file

    def release(self):
        """Release this hold; the last one in the process closes the file,
        which releases the flock."""
        with _HELD_GUARD:
            if self._file is None:
                return
            self._file = None
            held = _HELD[self._key]
            held[1] -= 1
            if held[1] == 0:
                held[0].close()
                del _HELD[self._key]

    def __getstate__(self):
        return dict(self.__dict__, _file=None)

    # a lock dropped without release (a fit that raised, then forgotten)
    # closes its file itself, without a ResourceWarning
    __del__ = release
