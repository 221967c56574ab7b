"""The exceptions a user of this package may want to catch."""

__all__ = ['CheckpointError', 'CorruptCheckpointError']


class CheckpointError(ValueError):
    """A checkpoint cannot be used by this run; the message says why."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint folder or file is incomplete, damaged or not a checkpoint.

    The message names the file at fault.
    """
