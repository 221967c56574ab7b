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
from typing import Any

from skorch_accel_callbacks._core import accelerate_io, sync
from skorch_accel_callbacks.errors import CheckpointError
from skorch_accel_callbacks.format import (
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    PROBE_PREFIX,
    EarlyFlush,
    discard_in_background,
    discard_path,
    give_plain_modes,
    is_checkpoint_name,
    is_leftover,
    pointer_name,
    probe_name,
    read_json,
    read_manifest,
    remove_path,
    replace_folder,
    write_json,
    write_manifest,
)
from skorch_accel_callbacks.storage._interface import CheckpointStorage, Found, is_committer
from skorch_accel_callbacks.storage._lock import FolderLock

__all__ = ['CheckpointFolder']


class CheckpointFolder(CheckpointStorage):
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

    keeps_local_folder = True

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
        return self.path(name) + PARTIAL_SUFFIX

    def _pointer(self, which: str) -> str:
        return self.path(pointer_name(which))

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
            if is_leftover(name) or name.endswith(PARTIAL_SUFFIX):
                remove_path(self.path(name))

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
        probe = self.path(probe_name(rank))
        with sync.agree(net, f"probing checkpoint folder {self.dirname}"):
            if probing:
                os.makedirs(self.dirname, exist_ok=True)
                write_json(probe, {'rank': rank})
        others = None
        if probing:
            others = sorted(
                int(name[len(PROBE_PREFIX):]) for name in os.listdir(self.dirname)
                if name.startswith(PROBE_PREFIX) and name != os.path.basename(probe))
        seen = sync.gather(net, others)
        with sync.agree(net, f"removing probe files in {self.dirname}"):
            if probing:
                discard_path(probe)
        return {rank_: ranks for rank_, ranks in enumerate(seen) if ranks is not None}

    # ------------------------------------------------------------ backend reads

    def exists(self) -> bool:
        return os.path.isdir(self.dirname)

    def list_names(self) -> list[str]:
        """The checkpoint folders: committed by their rename, so that one
        without a manifest is a damaged checkpoint, not a partial one."""
        if not os.path.isdir(self.dirname):
            return []
        return [name for name in os.listdir(self.dirname)
                if is_checkpoint_name(name) and os.path.isdir(self.path(name))]

    def read_json(self, *parts: str) -> Any:
        return read_json(os.path.join(self.dirname, *parts))

    def check(self, name: str) -> tuple[dict[str, Any], str | None]:
        try:
            return read_manifest(self.path(name)), None
        except CheckpointError as exc:  # and CorruptCheckpointError
            try:
                saved = self.read_json(name, MANIFEST_NAME)
            except (OSError, ValueError):
                saved = {}
            return (saved if isinstance(saved, dict) else {}), str(exc)

    def fetch(self, name: str) -> Found:
        """Checkpoint ``name`` read where it is, its manifest verified."""
        return Found(self.path(name), read_manifest(self.path(name)))

    def checked_in_place(self, name: str) -> str:
        """The folder of checkpoint ``name``: :meth:`fetch` checks it where it is."""
        return self.path(name)

    # ------------------------------------------------------------ writing

    def start(self, name: str) -> str:
        """An empty partial folder for checkpoint ``name``; its path."""
        partial = self.partial_path(name)
        discard_path(partial)
        os.makedirs(partial)
        return partial

    def commit(self, name: str, sealed: dict[str, Any], durable: bool, best: bool,
               started: float | None = None,
               early: EarlyFlush | None = None) -> dict[str, Any]:
        """Give the files and folders in the partial folder of ``name`` the
        modes a plain ``open`` and ``mkdir`` give (:func:`atomic.plain_modes`),
        seal it with the manifest ``sealed``, rename it into place and point
        ``latest.json`` (and ``best.json`` if ``best``) at it; return the
        manifest written. ``started``: when the save began
        (:func:`time.monotonic`), for the manifest's ``save_seconds``
        (:func:`~skorch_accel_callbacks.format._manifest.write_manifest`); ``early``:
        the fsyncs begun as the files were written, which the seal waits for.

        Runs on the committing process, in the background with
        ``async_save``: it touches no net and runs no collective.
        """
        partial = self.partial_path(name)
        # before the manifest flushes them: their writers (safetensors)
        # may have made them private
        give_plain_modes(partial)
        written = write_manifest(partial, sealed, durable=durable, started=started,
                                  early=early)
        replaced = replace_folder(partial, self.path(name))
        if replaced is not None:
            self._removals.append(replaced)
        write_json(self._pointer('latest'), {'name': name})
        if best:
            write_json(self._pointer('best'), {'name': name})
        return written

    def remove(self, name: str) -> None:
        """Remove checkpoint ``name``: renamed aside at once, its files
        removed in the background (:meth:`wait`)."""
        thread = discard_in_background(self.path(name))
        if thread is not None:
            self._removals.append(thread)

    def wait(self) -> None:
        """Wait until the retired and replaced checkpoints' files are removed."""
        for thread in self._removals:
            thread.join()
        self._removals = []
