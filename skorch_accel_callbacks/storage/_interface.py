"""Where the checkpoints of a folder live: the interface, and its policy written once.

The writers (:mod:`~skorch_accel_callbacks.engine._writer`), the callbacks
and the tools use a storage through :class:`CheckpointStorage` only, so
that another kind of storage plugs in without a change to any of them. A
storage holds named checkpoints; one is written into a partial place
(:meth:`~CheckpointStorage.start`), becomes a checkpoint at once and
completely when committed (:meth:`~CheckpointStorage.commit`), and is read
back by name or by a pointer (``'latest'``, ``'best'``).

What a storage holds and which checkpoint a name or a pointer chooses (the
committed ones in training order, the pointers, the newest complete one
skipping the damaged, retention, "marked best") is decided here, once, over
a few operations of a backend: list the committed names
(:meth:`~CheckpointStorage.list_names`), read a JSON file
(:meth:`~CheckpointStorage.read_json`), bring one checkpoint to a local
folder checked (:meth:`~CheckpointStorage.fetch`), remove one
(:meth:`~CheckpointStorage.remove`), and write and commit one
(:meth:`~CheckpointStorage.start`, :meth:`~CheckpointStorage.commit`, whose
create-only manifest or rename is the commit). The backends are a local
folder (:class:`~skorch_accel_callbacks.storage._local.CheckpointFolder`) and
any fsspec store (:class:`~skorch_accel_callbacks.storage._remote.RemoteStorage`);
:func:`~skorch_accel_callbacks.storage._open.open_storage` chooses one for a
``dirname``. This module imports neither.

The order of the checkpoints is their training order, as their names record
it (:func:`~skorch_accel_callbacks.format._manifest.training_order`: the
epochs, then the step; the manifest's ``epoch`` and ``step`` are the same):
one listing gives it in both backends, it survives a copy or a download
(which change every file's time), and it is the order in which a fit writes
them. Which one was committed last is what ``latest.json`` says.
"""

from __future__ import annotations

import abc
import os
import warnings
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from skorch_accel_callbacks._core import accelerate_io, sync
from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.format import (
    MANIFEST_NAME,
    POINTERS,
    EarlyFlush,
    is_checkpoint_name,
    newest_at_epoch_end,
    pointed_name,
    pointer_name,
    read_manifest,
    training_order,
)

__all__ = ['CheckpointStorage', 'Found', 'ReadAhead', 'is_committer', 'retained']

#: called with a checkpoint's folder before its files are checked in place
ReadAhead = Callable[[str], None]


@dataclass(frozen=True)
class Found:
    """A complete checkpoint as found: its local folder and the manifest
    read (and verified) there, so that a resume does not read it again."""

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
    keeps: the ``keep_last`` newest, the newest taken at an epoch's end (the
    one a refusal to continue inside an epoch advises, while checkpoints
    inside epochs rotate), the ``best`` ones and those in ``keep`` (the one
    the fit under way resumed from)."""
    return (set(names[-keep_last:]) | {newest_at_epoch_end(names)}
            | set(best) | set(keep))


class CheckpointStorage(abc.ABC):
    """The checkpoints of one ``dirname``, as a writer, a resume and the
    tools use them: the policy, over the operations of a backend.

    A backend implements the abstract methods; the call order of a save is
    :meth:`claim` (every rank), :meth:`wait_for_room`, :meth:`start` and
    the writes into :meth:`partial_path`, :meth:`commit`, :meth:`retire`,
    and at the end of training :meth:`wait` and :meth:`release`. Reading (:meth:`committed`,
    :meth:`pointed`, :meth:`find_checkpoint`) needs no claim.
    """

    dirname: str
    #: whether the checkpoints are kept in the local folder ``dirname``,
    #: beside the folder's lock file and what a job leaves over; False for
    #: an object store, of whose checkpoints :meth:`path` names a local copy
    keeps_local_folder: bool = False

    # ------------------------------------------------------------ backend

    @abc.abstractmethod
    def claim(self, net: Any) -> None:
        """Take the storage for this job's training, on every rank."""

    @abc.abstractmethod
    def release(self) -> None:
        """End this job's claim."""

    @abc.abstractmethod
    def path(self, name: str) -> str:
        """Where the committed checkpoint ``name`` is read from (a local folder)."""

    @abc.abstractmethod
    def url(self, name: str) -> str:
        """Where the committed checkpoint ``name`` is kept, as messages name it."""

    @abc.abstractmethod
    def partial_path(self, name: str) -> str:
        """Where every rank writes the files of checkpoint ``name``."""

    @abc.abstractmethod
    def start(self, name: str) -> str:
        """An empty partial place for checkpoint ``name`` (the committer)."""

    @abc.abstractmethod
    def commit(self, name: str, sealed: dict[str, Any], durable: bool, best: bool,
               started: float | None = None,
               early: EarlyFlush | None = None) -> dict[str, Any]:
        """Seal and commit checkpoint ``name`` and point ``latest.json`` (and
        ``best.json`` if ``best``) at it; return the manifest written.
        ``early``: the fsyncs begun as its files were written, which the
        seal waits for (:func:`~skorch_accel_callbacks.format._manifest.write_manifest`)."""

    @abc.abstractmethod
    def wait(self) -> str | None:
        """Wait for the storage's background work (removals, uploads) and
        raise what failed; return what to tell the user of it (how long an
        upload took), or None."""

    def wait_for_room(self) -> str | None:
        """Before a save: wait until the storage has room for it, and raise
        what failed of its background work; return what to tell the user,
        or None. By default all of it (:meth:`wait`); a store waits for no
        upload while its queue has room."""
        return self.wait()

    @abc.abstractmethod
    def exists(self) -> bool:
        """Whether the folder (or the bucket that would hold it) exists;
        :class:`CheckpointError` if the storage cannot be reached."""

    @abc.abstractmethod
    def list_names(self) -> Iterable[str]:
        """The names of the committed checkpoints, in any order; an empty
        listing if there is no folder."""

    @abc.abstractmethod
    def read_json(self, *parts: str) -> Any:
        """The JSON file ``parts`` below ``dirname`` (a pointer, a manifest);
        raises ``OSError`` or ``ValueError`` if it cannot be read."""

    @abc.abstractmethod
    def check(self, name: str) -> tuple[dict[str, Any], str | None]:
        """The manifest of checkpoint ``name`` as stored (``{}`` if it cannot
        be read) and why the checkpoint is not complete (None if it is),
        without fetching it: the manifest and the size of every file."""

    @abc.abstractmethod
    def fetch(self, name: str) -> Found:
        """The committed checkpoint ``name`` in a local folder, checked there;
        :class:`CorruptCheckpointError` naming the file at fault."""

    def checked_in_place(self, name: str) -> str | None:
        """The folder of committed checkpoint ``name`` whose files
        :meth:`fetch` checks where they are, or None where it brings them
        there first (a download could replace the files that a read begun
        before it had read). None here; a local folder's backend returns it."""
        return None

    @abc.abstractmethod
    def remove(self, name: str) -> None:
        """Remove the committed checkpoint ``name`` (its manifest first: it is
        no checkpoint any more even if the rest stays); ``OSError`` or
        :class:`CheckpointError` if it cannot."""

    # ------------------------------------------------------------ policy

    @staticmethod
    def name_of(path: str | os.PathLike[str]) -> str:
        """The checkpoint name of a checkpoint's local folder or URL."""
        return os.path.basename(os.path.normpath(path))


    def committed(self) -> list[str]:
        """Names of the committed checkpoints, oldest first (training order)."""
        return sorted(set(self.list_names()), key=training_order)

    def pointed(self, which: str) -> str | None:
        """The name ``latest.json`` or ``best.json`` points at, or None."""
        try:
            return pointed_name(self.read_json(pointer_name(which)))
        except (OSError, ValueError):
            return None

    def marked_best(self, name: str) -> bool:
        """Whether the manifest of checkpoint ``name`` marks it a best one."""
        try:
            return bool(self.read_json(name, MANIFEST_NAME).get('best'))
        except (OSError, ValueError, AttributeError):
            return False  # not a complete checkpoint: nothing to keep

    def newest_first(self, names: list[str] | None = None) -> list[str]:
        """The committed checkpoints (``names``, oldest first, if given), the
        one ``latest.json`` names first, then the others newest first."""
        names = self.committed() if names is None else names
        latest = self.pointed('latest')
        return ([latest] if latest in names else []) + [
            name for name in reversed(names) if name != latest]

    def named(self, which: str | os.PathLike[str], names: list[str] | None = None) -> str:
        """The name of the committed checkpoint ``which`` names, not read:
        for ``'latest'`` and ``'best'`` the one the pointer names, else the
        checkpoint name ``which`` itself.

        Raises
        ------
        FileNotFoundError
          The pointer is missing or names no checkpoint; there is no
          committed checkpoint of that name.
        ValueError
          ``which`` is neither a pointer nor a checkpoint name.
        """
        which = os.fspath(which)
        names = self.committed() if names is None else names
        if which in POINTERS:
            file = self.url(pointer_name(which))
            try:
                name = pointed_name(self.read_json(pointer_name(which)))
            except FileNotFoundError:
                why = (": only checkpoints saved because of `monitor` are best ones"
                       if which == 'best' else '')
                raise FileNotFoundError(
                    f"no {which} checkpoint in {self.dirname}: there is no {file}{why}") from None
            except (OSError, ValueError):
                name = None
            if name is None:
                raise FileNotFoundError(
                    f"no {which} checkpoint in {self.dirname}: {file} names no checkpoint")
            return name
        if not is_checkpoint_name(which):
            raise ValueError(f"{which!r} is not 'latest', 'best' or a checkpoint name "
                             "(epoch-NNNN)")
        if which not in names:
            raise FileNotFoundError(
                f"no checkpoint {which} in {self.dirname}; it has {names or 'none'}")
        return which

    def find_checkpoint(self, which: str | os.PathLike[str] = 'latest',
                        read_ahead: ReadAhead | None = None) -> Found | None:
        """The checkpoint to resume from and its manifest, or None if there is none.

        ``which`` is ``'latest'``, ``'best'``, the name of a checkpoint of
        this storage (``'epoch-0003'``) or the path of a local checkpoint
        folder. For ``'latest'``, a checkpoint that is not complete (a
        missing or damaged file) is skipped with a warning naming it, and
        the newest complete one is used. ``read_ahead(folder)`` is called
        before the files of each checkpoint folder that is checked in place
        (:meth:`checked_in_place`) are checked: its caller may begin to
        read them meanwhile.

        Raises
        ------
        FileNotFoundError
          There is no checkpoint of the name ``which``.
        CorruptCheckpointError
          A named checkpoint (a path, a name, or ``'best'``) is not complete.
        CheckpointError
          A checkpoint is of a newer format; there is no best checkpoint
          although there are checkpoints; none of the checkpoints is complete.
        """
        which = os.fspath(which)
        if not (which in POINTERS or is_checkpoint_name(which)):
            if read_ahead is not None:
                read_ahead(which)
            return Found(which, read_manifest(which))
        names = self.committed()
        if which == 'best' and self.pointed('best') is None:
            if names:
                raise CheckpointError(
                    f"no best checkpoint in {self.dirname}: only checkpoints saved "
                    "because of `monitor` are best ones")
            return None
        if which != 'latest':
            name = self.pointed('best') if which == 'best' else self.named(which, names)
            return self._fetch(name, read_ahead)
        problems = []
        latest = self.pointed('latest')
        # a pointer naming what is not a checkpoint (a file in its place, a
        # folder removed by hand) is damage to report, not a fresh start
        dangling = [latest] if latest is not None and latest not in names else []
        for name in dangling + self.newest_first(names):
            try:
                return self._fetch(name, read_ahead)
            except CorruptCheckpointError as exc:
                warnings.warn(f"skipping checkpoint {self.url(name)}: {exc}", UserWarning)
                problems.append(str(exc))
        if problems:
            raise CheckpointError(
                f"{self.dirname} holds checkpoints but none is complete: "
                + '; '.join(problems))
        return None

    def _fetch(self, name: str, read_ahead: ReadAhead | None) -> Found:
        """:meth:`fetch`, ``read_ahead`` called first with the folder it
        checks in place, if any."""
        folder = self.checked_in_place(name) if read_ahead is not None else None
        if folder is not None:
            read_ahead(folder)
        return self.fetch(name)

    def folder_to_check(self, which: str | os.PathLike[str] = 'latest') -> str | None:
        """The local folder whose files :meth:`find_checkpoint` would check
        first for ``which``, found without reading a checkpoint (a pointer
        and the folder's listing only): a path itself; the checkpoint a name
        or pointer names (for ``'latest'`` without a pointer, the newest);
        None where there is none or its files are checked elsewhere
        (:meth:`checked_in_place`)."""
        which = os.fspath(which)
        if not (which in POINTERS or is_checkpoint_name(which)):
            return which
        if not self.keeps_local_folder:  # a store's: listing it is a request
            return None
        if which == 'latest':
            name = next(iter(self.newest_first()), None)
        else:
            name = self.pointed(which) if which in POINTERS else which
        return None if name is None else self.checked_in_place(name)

    def find(self, which: str | os.PathLike[str] = 'latest') -> str | None:
        """Path of the checkpoint to resume from, or None if there is none:
        that of :meth:`find_checkpoint`."""
        found = self.find_checkpoint(which)
        return None if found is None else found.path

    def kept(self, keep_last: int, keep_best: int | None = None,
             keep: Iterable[str | None] = ()) -> tuple[list[str], set[str | None]]:
        """The committed checkpoints (oldest first) and those of them that
        retention keeps (:func:`retained`): the ``keep_last`` newest, the
        newest taken at an epoch's end, the best one (or the ``keep_best``
        newest of those marked best) and those named in ``keep``."""
        names = self.committed()
        best = [self.pointed('best')]
        if keep_best:
            best += [name for name in names if self.marked_best(name)][-keep_best:]
        return names, retained(names, keep_last, best, keep)

    def retire(self, keep_last: int, keep_best: int | None = None,
               keep: Iterable[str | None] = ()) -> None:
        """Remove all but the checkpoints :meth:`kept` keeps; one that
        cannot be removed is left with a warning naming it."""
        self.remove_unkept(*self.kept(keep_last, keep_best, keep))

    def remove_unkept(self, names: Iterable[str], kept: Collection[str]) -> None:
        """Remove each of ``names`` not in ``kept`` (:meth:`kept`'s answer);
        one that cannot be removed is left with a warning naming it: an old
        checkpoint too many is no loss."""
        for name in names:
            if name in kept:
                continue
            try:
                self.remove(name)
            except (OSError, CheckpointError) as exc:
                warnings.warn(f"could not remove old checkpoint {self.url(name)}: {exc}",
                              UserWarning)
