"""Atomic files: a reader sees the old complete file or the new one, never a torn one.

A file is written under a temporary name in its own folder, flushed to disk
and moved over its final name with ``os.replace``. Several files that must
change together go through :class:`StagedFiles` and its journal. A file or
folder is removed by first renaming it to a marked name, so that a crash
halfway through a removal leaves nothing that looks complete.

Checkpoint folders, their manifest and their commit are built on these in
:mod:`~skorch_accel_callbacks.storage._local`; the big tensor files inside a
checkpoint folder are written by accelerate
(:mod:`~skorch_accel_callbacks._core.accelerate_io`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any

__all__ = [
    'DISCARD_MARK',
    'EarlyFlush',
    'StagedFiles',
    'TEMP_MARK',
    'atomic_path',
    'discard_path',
    'discard_in_background',
    'finish_staged',
    'fsync_dir',
    'fsync_files',
    'give_plain_modes',
    'is_leftover',
    'plain_modes',
    'read_json',
    'remove_path',
    'remove_temp_files',
    'replace_folder',
    'unique_name',
    'write_json',
]

# Part of every temporary name, so that leftovers of a killed writer can be
# told apart from real files (and are never taken for a checkpoint).
TEMP_MARK = '.tmp-'
# a folder being replaced or deleted is renamed to carry this mark first, so
# that a crash halfway through leaves no complete-looking folder behind
DISCARD_MARK = '.discard-'


def unique_name(path: str | os.PathLike, mark: str) -> str:
    """A hidden sibling of ``path`` that carries ``mark`` and a random suffix."""
    folder, name = os.path.split(os.path.normpath(os.fspath(path)))
    return os.path.join(folder, f".{name}{mark}{uuid.uuid4().hex[:12]}")


def is_leftover(name: str) -> bool:
    """Whether ``name`` is a temporary or half-removed file of a killed writer."""
    return DISCARD_MARK in name or TEMP_MARK in name


def _umask_from_proc() -> int | None:
    """The process's umask from ``/proc/self/status`` (Linux 4.7+), or None."""
    try:
        with open('/proc/self/status', encoding='ascii') as status:
            for line in status:
                if line.startswith('Umask:'):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def _umask_from_probe(folder: str) -> int:
    """The umask that a file created in ``folder`` gets now, by creating one."""
    probe = unique_name(os.path.join(folder or '.', 'umask'), TEMP_MARK)
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o777)
    try:
        return 0o777 & ~os.fstat(fd).st_mode
    finally:
        os.close(fd)
        os.remove(probe)


def plain_modes(folder: str) -> tuple[int, int]:
    """The modes ``(file, folder)`` that a plain ``open`` and ``mkdir`` give
    what they create in ``folder`` now: ``0o666`` and ``0o777`` less the
    umask.

    Writers that create their file privately (safetensors, as ``mkstemp``
    does) give it ``0o600``, which a team sharing checkpoints cannot read.
    The umask is read, not set: ``os.umask`` can only be read by setting it,
    and another thread creating a file meanwhile would get the mode that was
    set. Linux reports it in ``/proc/self/status``; elsewhere a file created
    in ``folder`` shows it.
    """
    umask = _umask_from_proc()
    if umask is None:
        umask = _umask_from_probe(folder)
    return 0o666 & ~umask, 0o777 & ~umask


def _chmod(path: str, mode: int) -> None:
    try:
        os.chmod(path, mode)
    except OSError as exc:
        # a filesystem without Unix modes (vfat, some FUSE mounts) refuses:
        # its files have the mode it gives, as those of a plain open do
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.ENOSYS):
            raise


def give_plain_modes(root: str) -> None:
    """Give ``root`` and every file and folder under it the modes of
    :func:`plain_modes`; symbolic links are left alone."""
    file_mode, folder_mode = plain_modes(root)
    _chmod(root, folder_mode)
    for folder, folders, files in os.walk(root):
        for names, mode in ((folders, folder_mode), (files, file_mode)):
            for name in names:
                path = os.path.join(folder, name)
                if not os.path.islink(path):
                    _chmod(path, mode)


def _give_plain_mode(path: str) -> None:
    _chmod(path, plain_modes(os.path.dirname(path))[0])


def fsync_dir(path: str) -> None:
    """Flush a folder's entries (a rename inside it) to disk."""
    fd = os.open(path or '.', os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        # not every filesystem can fsync a directory; the rename stands anyway
        pass
    finally:
        os.close(fd)


def _fsync_file(path: str, flush: Callable[[int], None] = os.fsync) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        flush(fd)
    except OSError as error:
        raise OSError(error.errno, error.strerror, path) from error
    finally:
        os.close(fd)


def fsync_files(paths: Sequence[str], early: EarlyFlush | None = None) -> None:
    """Flush files to disk, in parallel: one slow fsync (the model file)
    does not hold up the others, and the disk gets several requests at once.

    With ``early``, the fsyncs it began as the files were written are
    waited for too, and the first of their failures raised.
    """
    if len(paths) < 2:
        for path in paths:
            _fsync_file(path)
    else:
        with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
            # list() re-raises the first failure
            list(pool.map(_fsync_file, paths))
    if early is not None:
        early.wait()


class EarlyFlush:
    """The data of each large file of a save flushed to disk as soon as the
    file is complete (``fdatasync``, in threads), so that the disk writes
    the model file back while the optimizer's is still being serialized,
    rather than all of them after the last (benchmarks/RESULTS.rst).

    A head start only: the seal fsyncs every file again
    (:func:`fsync_files`), after the file's mode was set, which waits for
    the writeback begun here. What it cannot do is report an error of this
    one: Linux reports a failed writeback to the first flush after it only
    (the error is then marked seen), so :meth:`wait` raises the first
    failure of these. :meth:`close` (or the end of a ``with`` block) waits
    for them without raising, when the save failed anyway.

    Examples
    --------
    >>> import os
    >>> from skorch_accel_callbacks.format._atomic import EarlyFlush, fsync_files
    >>> with open('model.bin', 'wb') as f:
    ...     _ = f.write(bytes(1024))
    >>> with EarlyFlush() as early:
    ...     early.begin('model.bin')  # as soon as the file is complete
    ...     fsync_files(['model.bin'], early)  # the seal: all files, and the early ones' errors
    >>> os.remove('model.bin')

    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix='checkpoint-fsync')
        self._begun: list[Future] = []

    def __enter__(self) -> EarlyFlush:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def begin(self, path: str | os.PathLike) -> None:
        """Start flushing the complete file ``path`` to disk."""
        self._begun.append(self._pool.submit(_fsync_file, os.fspath(path), os.fdatasync))

    def wait(self) -> None:
        """Wait for every fsync begun; raise the first failure."""
        for future in self._begun:
            future.result()

    def close(self) -> None:
        """Wait for every fsync begun, raising nothing."""
        self._pool.shutdown(wait=True)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path next to ``path``; on success move it into place.

    The caller writes the complete file to the yielded path (with any writer
    that takes a path: ``torch.save``, ``safetensors.torch.save_file``,
    ``net.save_params``). When the block ends without an exception, the file
    gets the mode a plain ``open`` gives (:func:`plain_modes`), is flushed
    to disk and atomically renamed to ``path``; when it raises,
    the temporary file is removed and ``path`` is left as it was.

    Examples
    --------
    >>> import os
    >>> import torch
    >>> from skorch_accel_callbacks.format._atomic import atomic_path
    >>> module = torch.nn.Linear(4, 2)
    >>> with atomic_path('params.pt') as tmp:
    ...     torch.save(module.state_dict(), tmp)
    >>> os.listdir('.')  # no temporary file is left
    ['params.pt']

    """
    path = os.fspath(path)
    tmp = unique_name(path, TEMP_MARK)
    try:
        yield tmp
        if not os.path.exists(tmp):
            raise FileNotFoundError(f"nothing was written for {path!r}")
        _give_plain_mode(tmp)
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(os.path.dirname(path))


def write_json(path: str | os.PathLike, obj: Any, atomic: bool = True) -> None:
    """Write ``obj`` as JSON to ``path``, atomically unless told otherwise.

    ``atomic=False`` is for files inside a partial checkpoint folder, which
    becomes visible (and is flushed) as a whole when it is committed.
    """
    if not atomic:
        _dump_json(path, obj)
        return
    with atomic_path(path) as tmp:
        _dump_json(tmp, obj)


def _dump_json(path: str | os.PathLike, obj: Any) -> None:
    # one write: json.dump writes each token on its own
    text = json.dumps(obj, indent=1, sort_keys=True)
    with open(path, 'w', encoding='utf-8') as f:
        f.write(text)


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a torn or invalid file raises ``ValueError`` naming it."""
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


class StagedFiles:
    """Several files replaced together: all of them or none.

    Each file is written under a temporary name next to its final one
    (:meth:`temp_path`). :meth:`commit` gives them the mode a plain ``open``
    gives (:func:`plain_modes`), flushes them, writes ``journal`` (the
    list of moves) atomically, moves every file into place and removes the
    journal. A crash before the journal exists leaves every final file as it
    was; a crash after it leaves the journal, and :func:`finish_staged`
    completes the moves. Readers that run :func:`finish_staged` first never
    see files of two different saves side by side.
    """

    def __init__(self, journal: str | os.PathLike) -> None:
        self.journal = os.fspath(journal)
        self._moves = []
        self._journaled = False

    def temp_path(self, path: str | os.PathLike) -> str:
        """The temporary path to write ``path``'s new content to."""
        tmp = unique_name(path, TEMP_MARK)
        self._moves.append((tmp, os.fspath(path)))
        return tmp

    def commit(self) -> None:
        for tmp, path in self._moves:
            if not os.path.exists(tmp):
                raise FileNotFoundError(f"nothing was written for {path!r}")
        for tmp, _ in self._moves:
            _give_plain_mode(tmp)
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

    def abort(self) -> None:
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


def finish_staged(journal: str | os.PathLike) -> list[str]:
    """Complete the moves of a :class:`StagedFiles` commit that a crash
    interrupted; return the files moved into place (none if no journal).

    Raises ``ValueError`` naming the journal if it cannot be read.
    """
    journal = os.fspath(journal)
    if not os.path.exists(journal):
        return []
    base = os.path.dirname(journal) or '.'
    try:
        moves = [(os.path.join(base, tmp), os.path.join(base, path))
                 for tmp, path in read_json(journal)['moves']]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{journal} does not list the moves of an interrupted save: {exc}") from exc
    pending = [(tmp, path) for tmp, path in moves if os.path.exists(tmp)]
    _move_and_forget(journal, pending)
    return [path for _, path in pending]


def _move_and_forget(journal: str, moves: Iterable[tuple[str, str]]) -> None:
    for tmp, path in moves:
        os.replace(tmp, path)
    for folder in sorted({os.path.dirname(path) for _, path in moves}):
        fsync_dir(folder)
    # not flushed: a journal that comes back after a power loss lists moves
    # already made, and finish_staged only removes it again
    os.remove(journal)


def remove_temp_files(folder: str, names: Iterable[str]) -> None:
    """Remove the temporary files (:func:`unique_name` with :data:`TEMP_MARK`)
    that killed writers of the files ``names`` left in ``folder``.

    ``names`` are regular expressions of final names; the temporary files of
    other files (another job's, whose save may be in flight) are left alone.
    """
    names = list(names)
    if not names or not os.path.isdir(folder or '.'):
        return
    pattern = re.compile(
        rf"\.(?:{'|'.join(names)}){re.escape(TEMP_MARK)}[0-9a-f]{{12}}")
    for entry in os.listdir(folder or '.'):
        if pattern.fullmatch(entry):
            os.remove(os.path.join(folder, entry))


def remove_path(path: str | os.PathLike) -> None:
    """Remove a file or a whole folder right away.

    What is already gone counts as removed: a discard thread of an earlier
    fit in this process (one that raised, so nobody awaited its thread) may
    be removing the same leftover folder file by file.
    """
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, **{_RMTREE_HANDLER: _raise_unless_gone})
    else:
        with suppress(FileNotFoundError):
            os.remove(path)


# Python 3.12 deprecates onerror (which gets sys.exc_info()) for onexc
# (which gets the exception)
_RMTREE_HANDLER = 'onexc' if sys.version_info >= (3, 12) else 'onerror'


def _raise_unless_gone(function: Any, path: str, error: Any) -> None:
    exc = error[1] if isinstance(error, tuple) else error
    if not isinstance(exc, FileNotFoundError):
        raise exc


def discard_path(path: str | os.PathLike) -> None:
    """Remove a folder (or file) so that no half of it is ever visible."""
    if os.path.lexists(path):
        remove_path(_mark_discarded(path))


def discard_in_background(path: str | os.PathLike) -> threading.Thread | None:
    """Like :func:`discard_path`, but the files are removed by a thread.

    Only the rename happens before it returns; the started thread is
    returned, or None if there was nothing to remove. Removing a large
    folder takes a while that nobody needs to wait for. A crash meanwhile
    leaves a folder marked discarded (:func:`is_leftover`); a failure to
    remove is a warning.
    """
    if not os.path.lexists(path):
        return None
    return _remove_in_background(_mark_discarded(path), path)


def _remove_in_background(doomed: str, path: str | os.PathLike) -> threading.Thread:
    def remove_doomed() -> None:
        try:
            remove_path(doomed)
        except OSError as exc:
            warnings.warn(f"could not remove old checkpoint {path} ({doomed}): {exc}",
                          UserWarning)

    thread = threading.Thread(target=remove_doomed, name=f'discard-{doomed}')
    thread.start()
    return thread


def _mark_discarded(path: str | os.PathLike) -> str:
    doomed = unique_name(path, DISCARD_MARK)
    os.replace(path, doomed)
    return doomed


def replace_folder(partial: str | os.PathLike, final: str | os.PathLike) -> threading.Thread | None:
    """Move the complete folder ``partial`` to ``final`` in one step.

    A folder already at ``final`` (an epoch trained again after resuming
    from an older checkpoint) is moved aside first, and removed by a thread
    once the new one is in place: removing a large folder costs about as
    much as writing it, which a save need not wait for. Returns that thread,
    or None if nothing was replaced.
    """
    parent = os.path.dirname(os.path.normpath(final))
    doomed = _mark_discarded(final) if os.path.lexists(final) else None
    os.replace(partial, final)
    fsync_dir(parent)
    return None if doomed is None else _remove_in_background(doomed, final)
