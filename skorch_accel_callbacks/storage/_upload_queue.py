"""The checkpoints committed into a staging folder whose upload has not begun.

A store takes longer for a checkpoint than the local save that staged it,
so saves due faster than uploads (``every_n_steps`` on a large model) would
each wait for the upload before. Instead they queue: the upload thread
takes the oldest waiting checkpoint once the upload before it is done, in
training order. When a newer one is committed, each waiting one that
retention would not keep in the store once the newer ones are there
(:func:`~skorch_accel_callbacks.storage._interface.retained`: the
``keep_last`` newest, the newest at an epoch's end, the best ones) is
dropped: it is never uploaded. What retention keeps is bounded, and so is
the queue: a save waits only when more than :attr:`UploadQueue.room`
checkpoints wait (best ones kept with ``keep_best``).

The queue knows no threads: its owner
(:class:`~skorch_accel_callbacks.storage._remote.RemoteStorage`) calls it under
its lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from skorch_accel_callbacks.format import check_manifest, training_order
from skorch_accel_callbacks.storage._interface import retained

__all__ = ['UploadQueue', 'newest_complete', 'told', 'upload_next', 'wait_for']


@dataclass
class UploadQueue:
    """The waiting checkpoints, oldest first, and the one being uploaded.

    Examples
    --------
    >>> queue = UploadQueue()
    >>> queue.add('epoch-0001', best=False)
    >>> queue.take()
    ('epoch-0001', False)
    >>> for step in (10, 20, 30):
    ...     queue.add(f'epoch-0001-step-{step:08d}', best=False)
    >>> queue.supersede(known=set(), keep_last=2, keep_best=None)
    ['epoch-0001-step-00000010']
    >>> [name for name, _ in queue.waiting], queue.has_room()
    (['epoch-0001-step-00000020', 'epoch-0001-step-00000030'], True)
    """

    #: the committed checkpoints whose upload has not begun: (name, best)
    waiting: list[tuple[str, bool]] = field(default_factory=list)
    #: the checkpoint being uploaded
    uploading: str | None = None
    #: the checkpoint committed last
    newest: str | None = None
    #: an upload failed: the ones waiting stay staged, none is uploaded
    halted: bool = False
    #: how many may wait before a save waits for an upload; retire sets it
    room: int = 1
    #: checkpoints dropped unuploaded since the owner last said so
    dropped: list[str] = field(default_factory=list)

    def add(self, name: str, best: bool) -> None:
        """Queue the upload of the checkpoint ``name``, just committed."""
        self.waiting.append((name, best))
        self.newest = name

    def busy(self) -> set[str]:
        """The staged checkpoints that an upload still needs."""
        return {name for name, _ in self.waiting} | {self.uploading} - {None}

    def take(self) -> tuple[str, bool] | None:
        """The oldest waiting checkpoint, now being uploaded; None if none
        waits, or an upload failed."""
        if self.halted or not self.waiting:
            return None
        name, best = self.waiting.pop(0)
        self.uploading = name
        return name, best

    def done(self, failed: bool) -> None:
        """The upload taken ended; after a failure none more is taken: the
        store is out of reach, or another job took it."""
        self.uploading = None
        if failed:
            self.halted = True
            self.waiting.clear()

    def supersede(self, known: Collection[str], keep_last: int,
                  keep_best: int | None) -> list[str]:
        """Drop the waiting checkpoints that retention would not keep with
        the newer ones in the store (``known``: the names in the store);
        their names. Sets :attr:`room` to what retention keeps of a stream
        of saves: the ``keep_last`` newest and the newest at an epoch's end."""
        self.room = keep_last + 1
        if len(self.waiting) < 2:
            return []
        pending = [name for name, _ in self.waiting]
        names = sorted(set(known) | set(pending) | {self.uploading} - {None},
                       key=training_order)
        bests = [name for name, best in self.waiting if best]
        # the newest best is what best.json would name; keep_best more of them
        keeps = retained(names, keep_last, bests[-1:] + (bests[-keep_best:] if keep_best
                                                         else []), ())
        dropped = [name for name in pending[:-1] if name not in keeps]
        self.waiting = [entry for entry in self.waiting if entry[0] not in dropped]
        self.dropped += dropped
        return dropped

    def has_room(self) -> bool:
        """Whether a save may go on without waiting for an upload."""
        return len(self.waiting) <= self.room


def upload_next(lock: Any, queue: UploadQueue, upload: Callable[[str, bool], float]
                ) -> tuple[str, float, bool] | None:
    """Take the oldest waiting checkpoint of ``queue`` (under ``lock``) and
    ``upload(name, best)`` it: its name, the seconds it took, and whether a
    newer one was committed meanwhile (its staged copy is not needed any
    more); None if none waits. A failure halts the queue and is raised."""
    with lock:
        taken = queue.take()
    if taken is None:
        return None
    failed = True
    try:
        seconds = upload(*taken)
        failed = False
    finally:
        with lock:
            queue.done(failed)
            superseded = taken[0] != queue.newest
    return taken[0], seconds, superseded


def wait_for(pending: list[futures.Future], enough: Callable[[], bool]
             ) -> tuple[BaseException | None, list[str], float | None]:
    """Take the ended work from the front of ``pending`` (in place), waiting
    for more until a failure ended, none is pending or ``enough()``; the
    first failure, what each upload that ended says (its future's result:
    its URL and seconds, or None), and how long it waited (None: not)."""
    began, waited, error, said = time.monotonic(), None, None, []
    while True:
        while pending and pending[0].done():
            future = pending.pop(0)
            if future.exception() is not None:
                error = error or future.exception()
            elif future.result() is not None:
                said.append("Uploaded {} in {:.2f} s".format(*future.result()))
        if error is not None or not pending or enough():
            return error, said, waited
        futures.wait(pending, return_when=futures.FIRST_COMPLETED)
        waited = time.monotonic() - began


def told(said: list[str], dropped: list[str], waited: float | None) -> str | None:
    """What to tell the user: the uploads ``said``, the URLs ``dropped``
    unuploaded, how long training waited for the uploads; None if nothing."""
    if dropped:
        said = [*said, f"Not uploaded, superseded while waiting: {', '.join(dropped)}"]
    if not said:
        return None
    return '; '.join(said) + (f" (training waited {waited:.2f} s for it)"
                              if waited is not None else '')


def newest_complete(staging: Any) -> tuple[str, bool] | None:
    """The newest complete checkpoint of the folder ``staging`` (a
    ``CheckpointFolder``) and whether it is a best one. Those older were
    superseded in the queue, or are in the store."""
    for name in reversed(staging.committed()):
        manifest, problems = check_manifest(staging.path(name))
        if not problems:
            return name, bool(manifest.get('best'))
    return None
