"""Atomic files on disk: the one place where this package writes bytes.

A file is written under a temporary name in its own folder, flushed to disk
and moved over its final name with ``os.replace``, so a reader (or a resumed
run after a crash) sees either the old complete file or the new complete
file, never a torn one.
"""

import fcntl
import json
import os
import re
import shutil
import threading
import socket
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

__all__ = [
    'CorruptCheckpointError',
    'FolderInUseError',
    'FolderLock',
    'LOCK_NAME',
    'MANIFEST_NAME',
    'PARTIAL_SUFFIX',
    'StagedFiles',
    'TEMP_MARK',
    'atomic_path',
    'commit_folder',
    'discard',
    'discard_in_background',
    'file_sizes',
    'finish_staged',
    'fresh_folder',
    'fsync_dir',
    'fsync_files',
    'read_json',
    'read_manifest',
    'remove_leftovers',
    'remove_temp_files',
    'write_json',
]

# Part of every temporary name, so that leftovers of a killed writer can be
# told apart from real files (and are never taken for a checkpoint).
TEMP_MARK = '.tmp-'


def fsync_dir(path):
    """Flush a folder's entries (a rename inside it) to disk."""
    fd = os.open(path or '.', os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        # not every filesystem can fsync a directory; the rename stands anyway
        pass
    finally:
        os.close(fd)


def _fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(paths):
    """Flush files to disk, in parallel: one slow fsync (the model file)
    does not hold up the others, and the disk gets several requests at once."""
    if len(paths) < 2:
        for path in paths:
            _fsync_file(path)
        return
    with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
        # list() re-raises the first failure
        list(pool.map(_fsync_file, paths))


def _temp_name(path):
    folder, name = os.path.split(os.fspath(path))
    return os.path.join(folder, f".{name}{TEMP_MARK}{uuid.uuid4().hex[:12]}")


@contextmanager
def atomic_path(path):
    """Yield a temporary path next to ``path``; on success move it into place.

    The caller writes the complete file to the yielded path (with any writer
    that takes a path: ``torch.save``, ``safetensors.torch.save_file``,
    ``net.save_params``). When the block ends without an exception, the file
    is flushed to disk and atomically renamed to ``path``; when it raises,
    the temporary file is removed and ``path`` is left as it was.

    Examples
    --------
    >>> with atomic_path('run/params.pt') as tmp:
    ...     torch.save(module.state_dict(), tmp)

    """
    path = os.fspath(path)
    folder = os.path.dirname(path)
    tmp = _temp_name(path)
    try:
        yield tmp
        if not os.path.exists(tmp):
            raise FileNotFoundError(f"nothing was written for {path!r}")
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(folder)


class StagedFiles:
    """Several files replaced together: all of them or none.

    Each file is written under a temporary name next to its final one
    (:meth:`temp_path`). :meth:`commit` flushes them, writes ``journal`` (the
    list of moves) atomically, moves every file into place and removes the
    journal. A crash before the journal exists leaves every final file as it
    was; a crash after it leaves the journal, and :func:`finish_staged`
    completes the moves. Readers that run :func:`finish_staged` first never
    see files of two different saves side by side.
    """

    def __init__(self, journal):
        self.journal = os.fspath(journal)
        self._moves = []
        self._journaled = False

    def temp_path(self, path):
        """The temporary path to write ``path``'s new content to."""
        tmp = _temp_name(path)
        self._moves.append((tmp, os.fspath(path)))
        return tmp

    def commit(self):
        for tmp, path in self._moves:
            if not os.path.exists(tmp):
                raise FileNotFoundError(f"nothing was written for {path!r}")
        fsync_files([tmp for tmp, _ in self._moves])
        # an earlier commit that failed halfway must not be overwritten unfinished
        finish_staged(self.journal)
        base = os.path.dirname(self.journal) or '.'
        write_json(self.journal, {'moves': [
            [os.path.relpath(tmp, base), os.path.relpath(path, base)]
            for tmp, path in self._moves]})
        self._journaled = True
        _move_and_forget(self.journal, self._moves)
        self._moves = []

    def abort(self):
        """Remove the temporary files of a save that did not commit.

        Once the journal is written the files belong to it: a commit that
        failed after that is completed by :func:`finish_staged`.
        """
        if self._journaled:
            return
        for tmp, _ in self._moves:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
        self._moves = []


def finish_staged(journal):
    """Complete the moves of a :class:`StagedFiles` commit that a crash
    interrupted; return the files moved into place (none if no journal)."""
    journal = os.fspath(journal)
    if not os.path.exists(journal):
        return []
    base = os.path.dirname(journal) or '.'
    try:
        moves = [(os.path.join(base, tmp), os.path.join(base, path))
                 for tmp, path in read_json(journal)['moves']]
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{journal} does not list the moves of an interrupted save: {exc}") from exc
    pending = [(tmp, path) for tmp, path in moves if os.path.exists(tmp)]
    _move_and_forget(journal, pending)
    return [path for _, path in pending]


def _move_and_forget(journal, moves):
    for tmp, path in moves:
        os.replace(tmp, path)
    for folder in sorted({os.path.dirname(path) for _, path in moves}):
        fsync_dir(folder)
    # not flushed: a journal that comes back after a power loss lists moves
    # already made, and finish_staged only removes it again
    os.remove(journal)


def remove_temp_files(folder, prefix=''):
    """Remove the temporary files that killed writers left in ``folder``,
    of the files whose names start with ``prefix``."""
    pattern = re.compile(
        rf'\.{re.escape(prefix)}.*{re.escape(TEMP_MARK)}[0-9a-f]{{12}}')
    if not os.path.isdir(folder or '.'):
        return
    for name in os.listdir(folder or '.'):
        if pattern.fullmatch(name):
            os.remove(os.path.join(folder, name))


def write_json(path, obj, atomic=True):
    """Write ``obj`` as JSON to ``path``, atomically unless told otherwise.

    ``atomic=False`` is for files inside a partial checkpoint folder, which
    becomes visible (and is flushed) as a whole when it is committed.
    """
    if not atomic:
        _dump_json(path, obj)
        return
    with atomic_path(path) as tmp:
        _dump_json(tmp, obj)


def _dump_json(path, obj):
    with open(path, 'w', encoding='utf-8') as f:
        json.dump(obj, f, indent=1, sort_keys=True)


def read_json(path):
    """Read a JSON file; a torn or invalid file raises ``ValueError`` naming it."""
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


# ---------------------------------------------------------------------------
# Checkpoint folders: written under a partial name, committed by a rename.

MANIFEST_NAME = 'manifest.json'
PARTIAL_SUFFIX = '.partial'
# a folder being replaced or deleted is renamed to carry this mark first, so
# that a crash halfway through leaves no complete-looking folder behind
DISCARD_MARK = '.discard-'


def fresh_folder(path):
    """Create an empty folder at ``path``, removing leftovers of a killed run."""
    if os.path.lexists(path):
        discard(path)
    os.makedirs(path)


def discard(path):
    """Remove a folder (or file) so that no half of it is ever visible."""
    if os.path.lexists(path):
        _remove(_mark_discarded(path))


def discard_in_background(path):
    """Like :func:`discard`, but the files are removed by a thread.

    Only the rename happens before it returns; the started thread is
    returned, or None if there was nothing to remove. Removing a large
    folder takes a while (0.3 s for 1.1 GiB on an ext4 disk mounted with
    ``discard``) that nobody needs to wait for. A crash meanwhile leaves a
    folder marked discarded, which :func:`remove_leftovers` removes; a
    failure to remove is a warning.
    """
    if not os.path.lexists(path):
        return None
    doomed = _mark_discarded(path)

    def remove():
        try:
            _remove(doomed)
        except OSError as exc:
            warnings.warn(f"could not remove old checkpoint {path} ({doomed}): {exc}",
                          UserWarning)

    thread = threading.Thread(target=remove, name=f'discard-{doomed}')
    thread.start()
    return thread


def _mark_discarded(path):
    folder, name = os.path.split(os.path.normpath(path))
    doomed = os.path.join(folder, f".{name}{DISCARD_MARK}{uuid.uuid4().hex[:12]}")
    os.replace(path, doomed)
    return doomed


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def remove_leftovers(dirname):
    """Remove partial folders, temporary files and half-deleted folders of
    killed runs."""
    if not os.path.isdir(dirname):
        return
    for name in os.listdir(dirname):
        if DISCARD_MARK in name or TEMP_MARK in name or name.endswith(PARTIAL_SUFFIX):
            _remove(os.path.join(dirname, name))


def file_sizes(folder):
    """Relative path -> size of every file below ``folder``."""
    sizes = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, folder)] = os.path.getsize(path)
    return sizes


def commit_folder(partial, final, manifest, durable=True):
    """Seal ``partial`` with ``manifest`` and move it to ``final`` atomically.

    The manifest (with the size of every file) is written last, after all
    files were flushed to disk when ``durable``; the rename makes the folder
    visible under its final name in one step. A folder already at ``final``
    (an epoch trained again after resuming from an older checkpoint) is
    replaced only after the new one is complete.
    """
    files = file_sizes(partial)
    files.pop(MANIFEST_NAME, None)
    if durable:
        fsync_files([os.path.join(partial, rel) for rel in files])
    write_json(os.path.join(partial, MANIFEST_NAME), dict(manifest, files=files))
    parent = os.path.dirname(os.path.normpath(final))
    if os.path.lexists(final):
        name = os.path.basename(os.path.normpath(final))
        doomed = os.path.join(parent, f".{name}{DISCARD_MARK}{uuid.uuid4().hex[:12]}")
        os.replace(final, doomed)
        os.replace(partial, final)
        fsync_dir(parent)
        _remove(doomed)
    else:
        os.replace(partial, final)
        fsync_dir(parent)


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
    same folder do not refuse each other.
    """

    def __init__(self, folder):
        self.folder = os.fspath(folder) or '.'
        self.path = os.path.join(self.folder, LOCK_NAME)
        self._key = os.path.realpath(self.path)
        self._file = None

    def acquire(self):
        """Take the lock or raise :class:`FolderInUseError` naming the holder."""
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

    # a lock dropped without release (a fit that raised, then forgotten)
    # closes its file itself, without a ResourceWarning
    __del__ = release


class CorruptCheckpointError(ValueError):
    """A checkpoint folder is incomplete, damaged or not a checkpoint."""


def read_manifest(folder):
    """Read and verify a committed folder's manifest.

    Raises :class:`CorruptCheckpointError` naming the file at fault when the
    manifest is missing or unreadable, or when a file it lists is missing or
    has another size than when it was written.
    """
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isdir(folder):
        raise CorruptCheckpointError(f"{folder} is not a folder")
    if not os.path.isfile(path):
        raise CorruptCheckpointError(
            f"{path} is missing: {folder} is not a complete checkpoint")
    try:
        manifest = read_json(path)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(str(exc)) from exc
    files = manifest.get('files') if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CorruptCheckpointError(f"{path} lists no files")
    for rel, size in files.items():
        file = os.path.join(folder, rel)
        if not os.path.isfile(file):
            raise CorruptCheckpointError(f"{file} is missing (listed in {path})")
        actual = os.path.getsize(file)
        if actual != size:
            raise CorruptCheckpointError(
                f"{file} has {actual} bytes, {path} says {size}: the file is damaged")
    return manifest
