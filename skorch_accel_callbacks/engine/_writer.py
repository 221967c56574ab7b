"""How a checkpoint reaches its storage: one interface, two writers.

The checkpoint callback decides when to save and hands a
:class:`SaveRequest` to its writer. A writer has every rank write its files
into the storage's partial place (:meth:`SyncWriter.stage`: the model,
optimizer and random states through ``accelerator.save_state``, then one
function per artefact of :mod:`skorch_accel_callbacks.state`), and the
committing process commit it (:meth:`SyncWriter.commit`, down to the
storage's rename). :class:`SyncWriter` does both before it returns;
:class:`BackgroundWriter` wraps one, as Lightning's ``AsyncCheckpointIO``
wraps a ``CheckpointIO``: it returns once the large states are copied into
host memory, writes and commits them on a one-worker executor, and raises a
failure at the next :meth:`~BackgroundWriter.wait`. Every save ends in a
:class:`SaveReport`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from skorch.utils import noop

from skorch_accel_callbacks._core import sync
from skorch_accel_callbacks._core.messages import format_bytes, say
from skorch_accel_callbacks._core.wrapping import own_registries
from skorch_accel_callbacks.engine import _state_files as state_files
from skorch_accel_callbacks.engine._frozen import FrozenPart, FrozenParts, no_split
from skorch_accel_callbacks.engine._stager import HostStager, Staged
from skorch_accel_callbacks.format import (
    EarlyFlush,
    linked_of,
    manifest_content,
    with_frozen_parts,
)
from skorch_accel_callbacks.state import (
    EpochStart,
    checkpoint_record,
    encode_rank_states,
    per_rank_items,
    save_epoch_caches,
    save_position,
    save_rank_state,
    write_rank_states,
)
from skorch_accel_callbacks.storage import CheckpointStorage, is_committer

__all__ = ['BackgroundWriter', 'CheckpointWriter', 'Retention', 'SaveReport', 'SaveRequest',
           'StagedSave', 'SyncWriter']


@dataclass(frozen=True)
class SaveRequest:
    """What the checkpoint callback asks its writer to save of the net."""

    #: the checkpoint's name, e.g. ``epoch-0003``
    name: str
    #: optimizer steps taken, over resumes
    step: int
    #: training batches of the epoch under way; 0 at an epoch's end
    batches: int
    #: the training loader of the epoch (its shuffling state and rows)
    train_loader: Any
    #: the random states the epoch under way began with (inside an epoch)
    epoch_start: EpochStart | None = None
    #: the random states before the fetches read ahead of training (inside
    #: an epoch, a loader that reads in this process)
    read_ahead: tuple[dict[str, Any], ...] = ()
    #: the training loader's worker processes drew random numbers in this fit
    workers_drew: bool = False
    #: the fingerprint of the training data
    data: dict | None = None
    #: ``best.json`` points at it
    best: bool = False
    #: training ended with it (``max_epochs`` reached, or stopped early)
    finished: bool = False
    #: a callback stopped training: resuming it trains nothing
    stopped_early: bool = False
    #: checkpoints that retirement keeps besides its policy (the one the
    #: fit under way resumed from)
    keep: tuple[str | None, ...] = ()
    #: when the callback asked (``time.monotonic()``): training is blocked from then
    requested_at: float = field(default_factory=time.monotonic)
    #: the fit calls since ``initialize`` up to the one under way: for each,
    #: the complete epochs when it began and those after which it ends
    fit_calls: tuple[tuple[int, int], ...] = ()

    def position(self) -> dict[str, Any]:
        """Where in training it is taken, as the manifest records it."""
        position = {'step': self.step, 'batches': self.batches}
        if self.fit_calls:
            position['fit_calls'] = [list(call) for call in self.fit_calls]
        return position


@dataclass(frozen=True)
class Retention:
    """Which committed checkpoints a writer keeps after a commit."""

    #: the newest checkpoints kept
    keep_last: int
    #: the newest best checkpoints kept besides, or None for the best one only
    keep_best: int | None = None


@dataclass(frozen=True)
class SaveReport:
    """A save, as the process that reports it knows it (the committing
    process knows its size and times, the others only its path)."""

    path: str
    finished: bool = False
    bytes: int | None = None
    seconds: float | None = None
    #: with a background writer: how long training waited
    blocked_seconds: float | None = None
    #: of :attr:`bytes`, those of files hard-linked to an earlier checkpoint's
    #: (unchanged frozen parameters), not written by this save
    linked_bytes: int = 0

    def message(self) -> str:
        """What the callback tells its sink."""
        text = f"Saved checkpoint {self.path}" + (" (finished)" if self.finished else '')
        if self.bytes is not None:
            text += f": {format_bytes(self.bytes)} in {self.seconds:.2f} s"
            if self.linked_bytes:
                text += f" ({format_bytes(self.linked_bytes)} of it unchanged, linked)"
            if self.blocked_seconds is not None:
                text += f", training blocked {self.blocked_seconds:.2f} s"
        return text


class StagedSave(NamedTuple):
    """A save whose files every rank wrote, before the commit."""

    #: the manifest's content, on the committing process (None elsewhere)
    content: dict | None
    #: the model and optimizer states still to write, when staged in memory
    large: Staged | None
    #: the frozen parts of its models and optimizers (on the process that
    #: writes their files)
    frozen: tuple[FrozenPart, ...] = ()


class CheckpointWriter(Protocol):
    """Saves the training state of a net into a storage.

    Every process calls every method at the same point; a failure on any
    rank raises on every rank.
    """

    storage: CheckpointStorage

    def save(self, net: Any, request: SaveRequest) -> SaveReport | None:
        """Save; the report, or None while the save is still being written."""

    def wait(self, net: Any, before_save: bool = False) -> SaveReport | None:
        """Wait for the save being written, if any; its report. The
        storage's background work is waited for too, ``before_save`` only
        until the storage has room for the next save."""

    def busy(self) -> bool:
        """Whether a save is being written on this process."""

    def close(self) -> None:
        """Wait for this process's writing without collectives; raise what failed."""


class SyncWriter:
    """Writes and commits a checkpoint before :meth:`save` returns.

    Parameters
    ----------
    storage : CheckpointStorage
      Where the checkpoints go.
    retention : Retention
      Which checkpoints are kept after each commit.
    durable : bool
      Flush every file before the commit.
    safe_serialization : bool
      Models in safetensors (``accelerator.save_state``'s argument).
    sink : callable
      Where what the storage's background work says goes (main process
      only): an upload's time, and how long a wait for it blocked.
    reuse_frozen : bool
      The frozen parameters of each model go into a file of their own,
      linked instead of written again while unchanged
      (:mod:`~skorch_accel_callbacks.engine._frozen`); False writes them at
      every save (in the model files, as ``accelerator.save_state``).
    """

    def __init__(self, storage: CheckpointStorage, retention: Retention, durable: bool = True,
                 safe_serialization: bool = True, sink: Callable[[str], Any] = noop,
                 reuse_frozen: bool = True) -> None:
        self.storage = storage
        self.retention = retention
        self.durable = durable
        self.safe_serialization = safe_serialization
        self.sink = sink
        self.reuse_frozen = reuse_frozen
        self._frozen = FrozenParts() if reuse_frozen else None

    def save(self, net: Any, request: SaveRequest) -> SaveReport:
        started = time.monotonic()
        with _early_flush(self.durable) as early:
            staged = self.stage(net, request, early=early)
            path = self.storage.url(request.name)
            report = None
            with sync.agree(net, f"committing checkpoint {path}"):
                if staged.content is not None:
                    report = self.commit(request, staged.content, started, early,
                                         staged.frozen)
        return report or SaveReport(path, request.finished)

    def wait(self, net: Any, before_save: bool = False) -> None:
        """Wait for the storage's background work (removals, uploads),
        ``before_save`` only until it has room for the next save
        (:meth:`~CheckpointStorage.wait_for_room`); it raises on every rank
        if it failed."""
        with sync.agree(net, f"finishing the background work of {self.storage.dirname}"):
            said = _wait_for_storage(self.storage, before_save)
        if said:
            say(net, self.sink, said)

    def busy(self) -> bool:
        return False

    def close(self) -> None:
        self.storage.wait()

    def stage(self, net: Any, request: SaveRequest, stager: HostStager | None = None,
              early: EarlyFlush | None = None) -> StagedSave:
        """Write every rank's files of ``request`` into the storage's partial
        place; the manifest's content is returned on the committing process.

        With a ``stager``, the model and optimizer states are copied into
        host memory instead of written (the rest of ``save_state`` is).
        The frozen parameters are split off each model and optimizer state
        first; a part unchanged since the last commit is linked then, not
        written nor copied (:mod:`~skorch_accel_callbacks.engine._frozen`).
        With ``early``, each model and optimizer file written begins to be
        flushed to disk at once; the committing process's seal waits for
        it (:meth:`commit`), any other process before it agrees.

        The history, the callbacks' states and (under FSDP2) the buffers
        exist per rank: the ranks compare digests of them first; what every
        rank holds alike is written once (the files an older reader reads), the rest by every rank
        into its own files (the manifest's ``per_rank`` lists it).
        """
        committer = is_committer(net)
        partial = self.storage.partial_path(request.name)
        # the registries swapped once for both steps (unwrapping a module
        # costs a package lookup in accelerate), inside the first agreement,
        # so that a rank whose swap fails fails the save on every rank
        with ExitStack() as registries:
            with sync.agree(net, f"preparing {partial}"):
                registries.enter_context(own_registries(net))
                if committer:
                    self.storage.start(request.name)
                states = encode_rank_states(net, warn=sync.is_main_process(net))
            # one copy of what every rank holds alike, every rank's own of the rest
            per_rank = per_rank_items(sync.gather(net, states.digests()))
            with sync.agree(net, f"writing checkpoint {partial}"):
                large = None
                if stager is None:
                    split = state_files.save_state(
                        net.accelerator, partial, self.safe_serialization,
                        None if early is None else early.begin, self._frozen)
                else:
                    large = stager.stage(net.accelerator, partial, self.safe_serialization,
                                         committer, self._frozen)
                    split = no_split([], []) if large is None else large.split
                rank = sync.process_index(net)
                save_rank_state(partial, rank, request.train_loader, request.workers_drew)
                write_rank_states(partial, states, rank, per_rank, committer)
                if request.batches:
                    save_position(partial, rank, request.epoch_start, request.batches,
                                  request.read_ahead)
                    save_epoch_caches(partial, rank, net)
                if not committer:
                    if early is not None:
                        early.wait()  # its failure fails the save on every rank
                    return StagedSave(None, large)
                record = checkpoint_record(
                    net, request.name, request.best, request.finished, request.stopped_early,
                    request.data, request.position(), request.train_loader, per_rank)
                content = with_frozen_parts(manifest_content(record), *split.manifest_fields())
                return StagedSave(content, large, tuple(split.parts))

    def commit(self, request: SaveRequest, content: dict, started: float,
               early: EarlyFlush | None = None,
               frozen: tuple[FrozenPart, ...] = ()) -> SaveReport:
        """Commit the staged checkpoint of ``request`` and retire old ones;
        ``early``: the fsyncs begun as its files were written; ``frozen``:
        its frozen parts, which the next save links while unchanged.

        Runs on the committing process only; it touches no net and runs no
        collective, so it runs in the background too.
        """
        written = self.storage.commit(request.name, content, durable=self.durable,
                                      best=request.best, started=started, early=early)
        if self._frozen is not None:
            self._frozen.committed(request.name, self.storage.path(request.name), written,
                                   frozen)
        self.storage.retire(self.retention.keep_last, self.retention.keep_best,
                            keep=request.keep)
        return SaveReport(self.storage.url(request.name), request.finished,
                          written['bytes'], written['save_seconds'],
                          written.get('blocked_seconds'),
                          sum(written['files'][rel] for rel in linked_of(written)))


class _InFlight(NamedTuple):
    #: what every rank knows of the save: its path
    report: SaveReport
    #: the write and commit, on the committing process only
    future: Future | None


class BackgroundWriter:
    """Writes the large states and commits in the background.

    Training waits while the model and optimizer states are copied into host
    buffers (:class:`~skorch_accel_callbacks.engine._stager.HostStager`); one worker
    thread of the committing process writes and commits them. At most one
    save is in flight: the callback waits for it (:meth:`wait`) before the
    next save and at the end of training, which raises on every rank if it
    failed. A copy (pickle, deepcopy) has no save in flight and no buffers.

    Parameters
    ----------
    writer : SyncWriter
      The writer whose staging and commit run here, in two halves.
    """

    def __init__(self, writer: SyncWriter) -> None:
        self.writer = writer
        self.storage = writer.storage
        self._stager = HostStager()
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: _InFlight | None = None

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _executor=None, _in_flight=None)

    def save(self, net: Any, request: SaveRequest) -> None:
        if self._in_flight is not None:
            raise RuntimeError("the previous background save was not waited for")
        started = time.monotonic()
        staged = self.writer.stage(net, request, self._stager)
        content = staged.content
        future = None
        # every other rank's files are complete: the others agreed in stage()
        if content is not None:
            content = dict(content, blocked_seconds=round(
                time.monotonic() - request.requested_at, 3))
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix='checkpoint-writer')
            future = self._executor.submit(
                self._write_and_commit, request, content, staged.large, started, staged.frozen)
        self._in_flight = _InFlight(
            SaveReport(self.storage.url(request.name), request.finished), future)

    def _write_and_commit(self, request: SaveRequest, content: dict,
                          staged: Staged | None, started: float,
                          frozen: tuple[FrozenPart, ...]) -> SaveReport:
        with _early_flush(self.writer.durable) as early:
            if staged is not None:
                staged.write(self.storage.partial_path(request.name),
                             None if early is None else early.begin)
            return self.writer.commit(request, content, started, early, frozen)

    def wait(self, net: Any, before_save: bool = False) -> SaveReport | None:
        report, future = self._in_flight or (None, None)
        self._in_flight = None
        what = (f"writing checkpoint {report.path} in the background" if report is not None
                else f"finishing the background work of {self.storage.dirname}")
        with sync.agree(net, what):
            if future is not None:
                report = future.result()
            # after the commit: it starts them (removals, an upload)
            said = _wait_for_storage(self.storage, before_save)
        if said:
            say(net, self.writer.sink, said)
        return report

    def busy(self) -> bool:
        return (self._in_flight is not None and self._in_flight.future is not None
                and not self._in_flight.future.done())

    def close(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        try:
            if in_flight is not None and in_flight.future is not None:
                in_flight.future.result()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._stager.free()
            self.storage.wait()



def _early_flush(durable: bool) -> AbstractContextManager[EarlyFlush | None]:
    """The fsyncs of a save's large files begun as each is written, for a
    durable save (:class:`~skorch_accel_callbacks.format._atomic.EarlyFlush`);
    None for another."""
    return EarlyFlush() if durable else nullcontext()


def _wait_for_storage(storage: CheckpointStorage, before_save: bool) -> str | None:
    """The storage's background work waited for: before a save only until it
    has room for it, else all of it; what to tell the user of it."""
    return storage.wait_for_room() if before_save else storage.wait()
