"""A folder of checkpoints: what is in it, and every change made to it.

A checkpoint is a sub-folder ``epoch-NNNN`` holding a manifest
(:mod:`~skorch_accel_callbacks.format._manifest`). It is written as
``epoch-NNNN.partial`` and committed by a rename once complete, then
``latest.json`` (and ``best.json``) point at it, and only then are older
checkpoints retired. A crash at any moment leaves the previous checkpoints
intact; what a killed job left (partial folders, temporary files, folders
half removed) is removed by the next job that locks the folder.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from skorch_accel_callbacks._core import accelerate_io, sync
from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.format import _atomic as atomic, _manifest
from skorch_accel_callbacks.storage._lock import FolderLock

__all__ = ['CheckpointFolder', 'Found', 'is_committer', 'retained']


@dataclass(frozen=True)
class Found:
    """A complete checkpoint as found: its folder and the manifest read
    (and verified) there, so that a resume does not read it again."""

    path: str
    manifest: dict[str, Any]


def is_committer(net: Any) -> bool:
    """Whether this process commits checkpoint folders: the main process,
    or with ``save_on_each_node`` the main process of each node."""
    if accelerate_io.save_on_each_node(net.accelerator):
        return sync.is_local_main_process(net)
    return sync.is_main_process(net)


def retained(names: list[str], keep_last: int, best: Iterable[str | None],
             keep: Iterable[str | None]) -> set[str | None]:
    """The committed checkpoints ``names`` (oldest first) that retention
    keeps, in a folder and in a store alike: the ``keep_last`` newest, the
    newest taken at an epoch's end (the one a refusal to continue inside an
    epoch advises, while checkpoints inside epochs rotate), the ``best``
    ones and those in ``keep`` (the one the fit under way resumed from)."""
    return (set(names[-keep_last:]) | {_manifest.newest_at_epoch_end(names)}
            | set(best) | set(keep))


class CheckpointFolder:
    """The checkpoints in ``dirname``: read them, commit new ones, retire old ones.

    Only the committing process of a job changes the folder, and only while
    it holds the folder's lock (:meth:`claim`). Reading needs no lock. A
    copy (pickle, deepcopy) holds no lock and no removal in progress.

    One job at a time uses a folder: from the start of training to its end
    the committing process holds a lock on ``<dirname>/.lock``, and a second
    job on the same folder fails when training begins, naming the holder's
    pid and host. The lock ends with the holder's process, also when it is
    killed.

    Parameters
    ----------
    dirname : str or path-like
      The folder.

    """

    def __init__(self, dirname: str | os.PathLike[str]) -> None:
        self.dirname = os.fspath(dirname)
        self._lock = FolderLock(self.dirname)
        self._claimed = False
        self._removals = []

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _claimed=False, _removals=[])

    # ------------------------------------------------------------ paths

    def path(self, name: str) -> str:
        return os.path.join(self.dirname, name)

    def url(self, name: str) -> str:
        """Where checkpoint ``name`` is kept, for messages: its path."""
        return self.path(name)

    def partial_path(self, name: str) -> str:
        return self.path(name) + _manifest.PARTIAL_SUFFIX

    @staticmethod
    def name_of(path: str | os.PathLike[str]) -> str:
        """The checkpoint name of a checkpoint folder's path."""
        return os.path.basename(os.path.normpath(path))

    def _pointer(self, which: str) -> str:
        return self.path(_manifest.pointer_name(which))

    # ------------------------------------------------------------ claiming

    def claim(self, net: Any) -> None:
        """Create and lock the folder for this job's training; every rank
        calls it, and it acts once until :meth:`release`.

        The committing process(es) create the folder, take its lock and
        remove what killed jobs left: only the job that holds the lock may,
        since another job's partial folder is still being written. Raises on
        every rank if any fails: :class:`~skorch_accel_callbacks.errors.FolderInUseError`
        naming the holder, or :class:`CheckpointError` when
        ``save_on_each_node`` committers share the folder.
        """
        if self._claimed:
            return
        committer = is_committer(net)
        with sync.agree(net, f"preparing checkpoint folder {self.dirname}"):
            if committer:
                self._prepare()
        if accelerate_io.save_on_each_node(net.accelerator) and sync.is_distributed(net):
            # before the lock, so that two nodes of one job sharing a folder
            # get this message, not the lock's "another running job"
            self._check_not_shared(net, committer)
        with sync.agree(net, f"locking checkpoint folder {self.dirname}"):
            if committer:
                self._lock.acquire()
                self._remove_leftovers()
        self._claimed = True

    def release(self) -> None:
        """End this job's claim; the lock is released (the kernel also
        releases it when the process ends)."""
        self._claimed = False
        self._lock.release()

    def _prepare(self) -> None:
        if os.path.lexists(self.dirname) and not os.path.isdir(self.dirname):
            raise NotADirectoryError(
                f"checkpoint folder {self.dirname} is a file, not a folder")
        os.makedirs(self.dirname, exist_ok=True)
        if not os.access(self.dirname, os.W_OK | os.X_OK):
            raise PermissionError(f"checkpoint folder {self.dirname} is not writable")

    def _remove_leftovers(self) -> None:
        for name in os.listdir(self.dirname):
            if atomic.is_leftover(name) or name.endswith(_manifest.PARTIAL_SUFFIX):
                atomic.remove(self.path(name))

    def _check_not_shared(self, net: Any, committer: bool) -> None:
        """With save_on_each_node, two nodes committing into one shared folder
        would race."""
        clashes = [(rank, ranks) for rank, ranks in self._probes_seen(net, committer).items()
                   if ranks]
        if clashes:
            rank, ranks = clashes[0]
            raise CheckpointError(
                f"save_on_each_node=True, but rank {rank} and rank(s) {ranks} "
                f"commit into the same folder {self.dirname}: give each node its own "
                "dirname, or set save_on_each_node=False on a shared filesystem")

    def check_shared(self, net: Any, why: str) -> None:
        """Raise :class:`CheckpointError` on every rank if the main process
        of a node does not see the folder the main process sees (one of the
        same path on another machine); ``why`` says what needs one folder."""
        if not sync.is_distributed(net):
            return
        seen = self._probes_seen(net, sync.is_local_main_process(net))
        apart = [rank for rank, ranks in seen.items() if rank != 0 and 0 not in ranks]
        if apart:
            raise CheckpointError(
                f"rank {apart[0]} (the main process of its node) does not see the folder "
                f"{self.dirname} as rank 0 does: {why}")

    def _probes_seen(self, net: Any, probing: bool) -> dict[int, list[int]]:
        """Each probing rank leaves a probe file in the folder and lists
        the other ranks' probes it finds there: ``{probing rank: ranks
        found}``, the same on every rank."""
        rank = sync.process_index(net)
        probe = self.path(_manifest.probe_name(rank))
        with sync.agree(net, f"probing checkpoint folder {self.dirname}"):
            if probing:
                os.makedirs(self.dirname, exist_ok=True)
                atomic.write_json(probe, {'rank': rank})
        others = None
        if probing:
            others = sorted(
                int(name[len(_manifest.PROBE_PREFIX):]) for name in os.listdir(self.dirname)
                if name.startswith(_manifest.PROBE_PREFIX) and name != os.path.basename(probe))
        seen = sync.gather(net, others)
        with sync.agree(net, f"removing probe files in {self.dirname}"):
            if probing:
                atomic.discard(probe)
        return {rank_: ranks for rank_, ranks in enumerate(seen) if ranks is not None}

    # ------------------------------------------------------------ reading

    def committed(self) -> list[str]:
        """Names of the committed checkpoint folders, oldest commit first."""
        if not os.path.isdir(self.dirname):
            return []
        found = []
        for name in os.listdir(self.dirname):
            path = self.path(name)
            if _manifest.is_checkpoint_name(name) and os.path.isdir(path):
                sealed = os.path.join(path, _manifest.MANIFEST_NAME)
                stamp = os.path.getmtime(sealed) if os.path.exists(sealed) else 0.0
                found.append((stamp, name))
        return [name for _, name in sorted(found)]

    def pointed(self, which: str) -> str | None:
        """The name ``latest.json`` or ``best.json`` points at, or None."""
        try:
            return _manifest.pointed_name(atomic.read_json(self._pointer(which)))
        except (OSError, ValueError):
            return None

    def newest_first(self) -> list[str]:
        """The names of the committed checkpoints, the one ``latest.json``
        names first, then the others newest first."""
        latest = self.pointed('latest')
        return ([latest] if latest else []) + [
            name for name in reversed(self.committed()) if name != latest]

    def named(self, which: str | os.PathLike[str]) -> str:
        """The folder ``which`` names, not read: for ``'latest'`` and
        ``'best'`` the checkpoint the pointer names, for a checkpoint name
        (``'epoch-0003'``) that one of this folder, else the path ``which``.

        Raises
        ------
        FileNotFoundError
          The pointer is missing or names no checkpoint; there is no
          checkpoint of that name.
        """
        which = os.fspath(which)
        if which in _manifest.POINTERS:
            name = self.pointed(which)
            if name is not None:
                return self.path(name)
            file = self._pointer(which)
            if os.path.exists(file):
                raise FileNotFoundError(
                    f"no {which} checkpoint in {self.dirname}: {file} names no checkpoint")
            why = (": only checkpoints saved because of `monitor` are best ones"
                   if which == 'best' else '')
            raise FileNotFoundError(
                f"no {which} checkpoint in {self.dirname}: there is no {file}{why}")
        if _manifest.is_checkpoint_name(which):
            path = self.path(which)
            if not os.path.isdir(path):
                raise FileNotFoundError(
                    f"no checkpoint {which} in {self.dirname}; it has "
                    f"{self.committed() or 'none'}")
            return path
        return which

    def find_checkpoint(self, which: str | os.PathLike[str] = 'latest') -> Found | None:
        """The checkpoint to resume from and its manifest, or None if there is none.

        ``which`` is ``'latest'``, ``'best'``, the name of a checkpoint of
        this folder (``'epoch-0003'``) or the path of a checkpoint folder.
        For ``'latest'``, a folder that is not a complete checkpoint (a
        missing or damaged file) is skipped with a warning naming it, and
        the newest complete one is used.

        Raises
        ------
        FileNotFoundError
          There is no checkpoint of the name ``which``.
        CorruptCheckpointError
          A named folder (a path, a name, or ``'best'``) is not a complete
          checkpoint.
        CheckpointError
          A checkpoint is of a newer format; there is no best checkpoint
          although there are checkpoints; none of the checkpoints is complete.
        """
        if which == 'best':
            if self.pointed('best') is None:
                if self.committed():
                    raise CheckpointError(
                        f"no best checkpoint in {self.dirname}: only checkpoints saved "
                        "because of `monitor` are best ones")
                return None
        if which != 'latest':
            path = self.named(which)
            return Found(path, _manifest.read(path))
        problems = []
        for name in self.newest_first():
            try:
                return Found(self.path(name), _manifest.read(self.path(name)))
            except CorruptCheckpointError as exc:
                warnings.warn(f"skipping checkpoint {self.path(name)}: {exc}", UserWarning)
                problems.append(str(exc))
        if problems:
            raise CheckpointError(
                f"{self.dirname} holds checkpoints but none is complete: "
                + '; '.join(problems))
        return None

    def find(self, which: str | os.PathLike[str] = 'latest') -> str | None:
        """Path of the checkpoint to resume from, or None if there is none:
        that of :meth:`find_checkpoint`."""
        found = self.find_checkpoint(which)
        return None if found is None else found.path

    # ------------------------------------------------------------ writing

    def start(self, name: str) -> str:
        """An empty partial folder for checkpoint ``name``; its path."""
        partial = self.partial_path(name)
        atomic.discard(partial)
        os.makedirs(partial)
        return partial

    def commit(self, name: str, sealed: dict[str, Any], durable: bool, best: bool,
               started: float | None = None) -> dict[str, Any]:
        """Give the files and folders in the partial folder of ``name`` the
        modes a plain ``open`` and ``mkdir`` give (:func:`atomic.plain_modes`),
        seal it with the manifest ``sealed``, rename it into place and point
        ``latest.json`` (and ``best.json`` if ``best``) at it; return the
        manifest written. ``started``: when the save began
        (:func:`time.monotonic`), for the manifest's ``save_seconds``
        (:func:`~skorch_accel_callbacks.format._manifest.write`).

        Runs on the committing process, in the background with
        ``async_save``: it touches no net and runs no collective.
        """
        partial = self.partial_path(name)
        # before the manifest flushes them: their writers (safetensors)
        # may have made them private
        atomic.give_plain_modes(partial)
        written = _manifest.write(partial, sealed, durable=durable, started=started)
        replaced = atomic.replace_folder(partial, self.path(name))
        if replaced is not None:
            self._removals.append(replaced)
        atomic.write_json(self._pointer('latest'), {'name': name})
        if best:
            atomic.write_json(self._pointer('best'), {'name': name})
        return written

    def retire(self, keep_last: int, keep_best: int | None = None,
               keep: Iterable[str | None] = ()) -> None:
        """Remove all but the checkpoints :func:`retained` keeps: the
        ``keep_last`` newest, the newest taken at an epoch's end, the best
        one (or the ``keep_best`` newest of those marked best) and those named
        in ``keep`` (the one the fit under way resumed from); the files go in
        the background."""
        names = self.committed()
        best = [self.pointed('best')]
        if keep_best:
            best += [name for name in names if self._marked_best(name)][-keep_best:]
        keep = retained(names, keep_last, best, keep)
        for name in names:
            if name in keep:
                continue
            try:
                thread = atomic.discard_in_background(self.path(name))
            except OSError as exc:
                warnings.warn(f"could not remove old checkpoint {self.path(name)}: {exc}",
                              UserWarning)
            else:
                if thread is not None:
                    self._removals.append(thread)

    def _marked_best(self, name: str) -> bool:
        try:
            return bool(atomic.read_json(
                os.path.join(self.path(name), _manifest.MANIFEST_NAME)).get('best'))
        except (OSError, ValueError, AttributeError):
            return False  # not a complete checkpoint: nothing to keep

    def wait(self) -> None:
        """Wait until the retired and replaced checkpoints' files are removed."""
        for thread in self._removals:
            thread.join()
        self._removals = []
