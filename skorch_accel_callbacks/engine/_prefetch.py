"""A checkpoint's files read into the page cache while the net initializes.

A relaunch spends most of its time before training begins in ``initialize``
(the module built, its parameters initialized, the accelerator's
``prepare``), mostly on the CPU; the resume then checks and loads the
checkpoint when training begins, and with the page cache cold (a new
machine, a node restarted after preemption) its files are read from the
disk then, on the way to the first step. :class:`PageCacheFill` reads them
meanwhile, from the moment the resume callback is initialized, into the
page cache only: nothing is parsed, checked or applied, and the resume
reads and checks every file as before, from memory where the fill got to
it first. It is stopped when training begins (the check reads the rest).

Only what is not in the page cache yet is read (a probe of the first,
middle and last byte of each chunk with ``preadv(RWF_NOWAIT)``, which fails
rather than waits for the disk): with the cache warm the fill costs a few
system calls a chunk. It reads no more than half the memory the kernel
reports available, and one process a node reads (the launcher's
``LOCAL_RANK`` 0): the page cache is the node's. It reads a checkpoint's
folder only (one with a manifest: a path that is none is not walked) and
its regular files only (a FIFO would block the read, and the stop with
it). Any error stops it silently: the resume's own read reports what is
wrong.

``benchmarks/bench_resume.py`` times the relaunch with it and without: on
2 cores and one disk, with the page cache cold, the load no longer waits
for the disk, but ``initialize`` takes longer meanwhile (the fill's reads
share the disk and the cores with it), and the relaunch is 0.93-0.98x as
long (``benchmarks/RESULTS.rst``); the gain is where the disk is idle
while the net initializes.
"""

from __future__ import annotations

import os
import stat
import threading

from skorch_accel_callbacks.format import MANIFEST_NAME

__all__ = ['FILL_CHUNK', 'PageCacheFill', 'fills_on_this_process']

FILL_CHUNK = 8 * 2 ** 20


def fills_on_this_process() -> bool:
    """Whether this process is the one of its node that fills the page
    cache: the first of the node as its launcher numbers them
    (``LOCAL_RANK``; a process started without a launcher is)."""
    return os.environ.get('LOCAL_RANK', '0') == '0'


class PageCacheFill:
    """Reads the files of ``folder`` into the page cache, the largest first,
    on a thread of its own until done or :meth:`stop`; what is cached
    already is not read again.

    Attributes
    ----------
    bytes_read : int
      The bytes read from the files so far (not those found cached).
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = os.fspath(folder)
        self.bytes_read = 0
        self._stopped = threading.Event()
        # a daemon: a process that exits before training (an initialize
        # alone) is not held up by a read of the whole checkpoint
        self._thread = threading.Thread(target=self._fill, name='checkpoint-page-cache-fill',
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the fill; returns once its thread ended (a chunk's read at most)."""
        self._stopped.set()
        self._thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the fill to end; whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _fill(self) -> None:
        try:
            # a path that is no checkpoint (a resume refuses it) is not walked
            if not os.path.isfile(os.path.join(self.folder, MANIFEST_NAME)):
                return
            budget = _available_memory() // 2
            buffer = bytearray(FILL_CHUNK)
            for path, size in _largest_first(self.folder):
                if self._stopped.is_set():
                    return
                if size <= budget:
                    budget -= size
                    self._fill_file(path, buffer)
        except OSError:  # the resume's own read of the folder reports it
            return

    def _fill_file(self, path: str, buffer: bytearray) -> None:
        with open(path, 'rb', buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            for offset in range(0, size, FILL_CHUNK):
                if self._stopped.is_set():
                    return
                end = min(offset + FILL_CHUNK, size)
                if all(_cached(file.fileno(), at) for at in (offset, (offset + end) // 2, end - 1)):
                    continue
                file.seek(offset)
                self.bytes_read += file.readinto(buffer) or 0


def _cached(fd: int, offset: int) -> bool:
    """Whether the byte at ``offset`` of the file ``fd`` is in the page cache."""
    try:
        return os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT) == 1
    except (OSError, AttributeError):
        # EAGAIN: not cached; another error (a file system without
        # RWF_NOWAIT) or a system without it: read it to be sure
        return False


def _largest_first(folder: str) -> list[tuple[str, int]]:
    """The regular files under ``folder`` and their sizes, the largest first."""
    files = []
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            status = os.stat(path)
            # a FIFO or a device would block the read, and stop() with it
            if stat.S_ISREG(status.st_mode):
                files.append((path, status.st_size))
    return sorted(files, key=lambda file: -file[1])


def _available_memory() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (bytes); where there is none,
    the free pages the system reports."""
    try:
        with open('/proc/meminfo') as meminfo:
            for line in meminfo:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
