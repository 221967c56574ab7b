"""The exceptions a user of this package may want to catch."""

from __future__ import annotations

import signal

__all__ = ['CheckpointError', 'CorruptCheckpointError', 'StoreUnavailableError',
           'TrainingPreempted']


class CheckpointError(ValueError):
    """A checkpoint cannot be used by this run; the message says why."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint folder or file is incomplete, damaged or not a checkpoint.

    The message names the file at fault.
    """


class StoreUnavailableError(CheckpointError):
    """An object store failed or did not answer a request of an upload for
    longer than ``outage_seconds``; the message names the request and how
    long it failed. The checkpoint stays staged: the next job uploads it."""


class TrainingPreempted(Exception):
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
