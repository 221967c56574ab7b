"""The exceptions a user of this package may want to catch.

Every one is a :class:`SkorchAccelError`, and also the builtin class of its
kind: a checkpoint that cannot be used (bad input) is a ``ValueError``, as
skorch's own errors of bad input are; an outage of a store a
``ConnectionError``; a folder held by another job, a failed step of
another rank and ranks that decided apart are each a ``RuntimeError``.
"""

from __future__ import annotations

import signal
from typing import Any

__all__ = ['CheckpointError', 'CorruptCheckpointError', 'DivergedDecisionError',
           'FolderInUseError', 'LeaseLostError', 'RankError', 'SkorchAccelError',
           'StoreUnavailableError', 'TrainingPreempted']


class SkorchAccelError(Exception):
    """The root of this package's exceptions: ``except SkorchAccelError``
    catches every error the package raises of its own."""


class CheckpointError(SkorchAccelError, ValueError):
    """A checkpoint cannot be used by this run; the message says why."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint folder or file is incomplete, damaged or not a checkpoint.

    The message names the file at fault.
    """


class StoreUnavailableError(SkorchAccelError, ConnectionError):
    """An object store failed or did not answer a request of an upload for
    longer than ``outage_seconds``; the message names the request and how
    long it failed. The checkpoint stays staged: the next job uploads it.

    An outage, not bad input: no ``CheckpointError``."""


class TrainingPreempted(SkorchAccelError):
    """Training stopped on a signal, after its checkpoint was committed.

    Raised by ``fit`` on every process, so that the job exits with a
    failure a scheduler or ``torchrun`` can see (and requeue), not as a run
    that finished. Run the same command again to resume.

    Attributes
    ----------
    signal : signal.Signals
      The signal that stopped training (the first one any process got).

    checkpoint : str or None
      Path of the checkpoint taken when it stopped; None inside an epoch of
      an ``IterableDataset``, which a resume cannot skip into.
    """

    def __init__(self, signal: signal.Signals, checkpoint: str | None) -> None:
        super().__init__(
            f"training stopped on {signal.name}; "
            + (f"checkpoint {checkpoint} was saved: run the same command again to "
               "resume from it" if checkpoint else
               "no checkpoint could be taken inside this epoch (its data cannot skip "
               "batches by index): the last one stands"))
        self.signal = signal
        self.checkpoint = checkpoint

    def __reduce__(self) -> tuple[type, tuple[signal.Signals, str | None]]:
        return type(self), (self.signal, self.checkpoint)


class DivergedDecisionError(SkorchAccelError, RuntimeError):
    """A callback stopped training on some processes and not on the others.

    skorch's callbacks stop training by raising ``KeyboardInterrupt`` from a
    hook (``EarlyStopping`` at the end of an epoch). Where the processes
    decide on numbers of their own (each rank's own losses, a score over
    its own shard of the data), one rank may stop while another trains on,
    and both would wait in the next collective until the process group's
    timeout. :class:`~skorch_accel_callbacks.AccelerateFixesMixin` raises
    this on every process instead, right after the hook.

    Not a :class:`CheckpointError`: no checkpoint is at fault, and the run
    cannot go on as it is set up (a relaunch decides the same way).

    Attributes
    ----------
    callback : str
      The callback's name in ``net.callbacks_``, with its class.

    hook : str
      The hook it stopped in, such as ``'on_epoch_end'``.

    epoch : int
      The epoch (``len(net.history)``) the hook ran in.

    stopped, went_on : tuple of int
      The ranks on which the callback stopped training, and those on which
      it did not.
    """

    def __init__(self, callback: str, hook: str, epoch: int, stopped: tuple[int, ...],
                 went_on: tuple[int, ...], advice: str) -> None:
        super().__init__(
            f"callback {callback} stopped training (KeyboardInterrupt) in {hook} of "
            f"epoch {epoch} on rank(s) {list(stopped)} but not on rank(s) "
            f"{list(went_on)}: the ranks decided on different numbers, and the ones "
            f"that went on would wait in a collective for the others. {advice}")
        self.callback = callback
        self.hook = hook
        self.epoch = epoch
        self.stopped = tuple(stopped)
        self.went_on = tuple(went_on)
        self.advice = advice

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return type(self), (self.callback, self.hook, self.epoch, self.stopped,
                            self.went_on, self.advice)


class FolderInUseError(SkorchAccelError, RuntimeError):
    """Another running job holds the lock of a checkpoint folder."""


class LeaseLostError(FolderInUseError):
    """Another job took over the lease of a folder while this job held it."""


class RankError(SkorchAccelError, RuntimeError):
    """A step failed on another process.

    Raised on the processes where the step succeeded, so that every rank
    leaves the step with an exception instead of waiting in the next
    collective until the process-group timeout.
    """
