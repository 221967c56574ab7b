"""skorch callbacks that save, checkpoint and resume training correctly under
Hugging Face accelerate, in one process or many.

The public API is what this module exports; every public exception is in
:mod:`skorch_accel_callbacks.errors`. The subpackages, from the top down
(a module imports only from its own subpackage and those below it;
tests/project/test_structure.py checks it): ``tools`` (the command line,
inspection, export), ``params`` (the skorch drop-ins), ``callbacks`` (the
checkpoint and resume callbacks, what they read, the net mixin, triggers,
preemption), ``engine`` (writing and restoring a checkpoint, merging FSDP
shards), ``state`` (what a checkpoint holds and who may resume it),
``storage`` (where checkpoints live: the interface and its policy, a local
folder, an fsspec store), ``format`` (the on-disk format) and ``_core``
(process sync, accelerate's internals, unwrapping). Modules whose names
start with ``_`` are not supported API.

Two places differ from the plain "callbacks on top" reading, because of
what imports what: ``params`` sits above ``callbacks`` (its callbacks reuse
the triggers and the mixin's net pickling); the mixin is in ``callbacks``,
not ``_core`` (it installs the preemption signal watch), and ``base`` (what
the callbacks and the engine share) is in ``_core``.
"""

from skorch_accel_callbacks._core.wrapping import unwrapped
from skorch_accel_callbacks.callbacks.checkpoint import AccelerateCheckpoint
from skorch_accel_callbacks.callbacks.load_state import AccelerateLoadInitState
from skorch_accel_callbacks.callbacks.mixin import AccelerateFixesMixin
from skorch_accel_callbacks.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DivergedDecisionError,
    FolderInUseError,
    RankError,
    SkorchAccelError,
    StoreUnavailableError,
    TrainingPreempted,
)
from skorch_accel_callbacks.params.checkpoint import ParamsCheckpoint
from skorch_accel_callbacks.params.load import LoadInitParams
from skorch_accel_callbacks.params.train_end import TrainEndParamsCheckpoint
from skorch_accel_callbacks.tools.export import export

__all__ = [
    'AccelerateCheckpoint',
    'AccelerateFixesMixin',
    'AccelerateLoadInitState',
    'CheckpointError',
    'CorruptCheckpointError',
    'DivergedDecisionError',
    'FolderInUseError',
    'LoadInitParams',
    'ParamsCheckpoint',
    'RankError',
    'SkorchAccelError',
    'StoreUnavailableError',
    'TrainEndParamsCheckpoint',
    'TrainingPreempted',
    'export',
    'unwrapped',
]

__version__ = '0.2.0'
