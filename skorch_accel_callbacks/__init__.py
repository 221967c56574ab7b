"""skorch callbacks that save, checkpoint and resume training correctly under
Hugging Face accelerate, in one process or many.

The package, from the callbacks down (data flows one way, downwards):

- ``checkpoint`` (:class:`AccelerateCheckpoint`: when to save, and the save),
  ``load_state`` (:class:`AccelerateLoadInitState`), the skorch drop-ins
  ``params`` (:class:`ParamsCheckpoint`), ``params_train_end``
  (:class:`TrainEndParamsCheckpoint`) and ``params_load``
  (:class:`LoadInitParams`) on ``params_files`` (the files of a save),
  ``mixin`` (:class:`AccelerateFixesMixin`);
- ``triggers`` (when to save: pure policy), ``preemption`` (the signals that
  make a run save and stop), ``base`` (what the callbacks share);
- ``folder`` (a folder of checkpoints: lock, leftovers, commit, pointers,
  retirement), ``compat`` (who can resume a checkpoint: the net as its
  manifest describes it, and the checks against it);
- ``training_state`` (what a resume needs beside ``save_state``),
  ``epoch_position`` (where a checkpoint is inside an epoch, and how a
  resume gets back there), ``rng_state`` (random and loader states, and
  those derived for another number of processes), ``fingerprint`` (the
  data and settings a checkpoint records), ``json_tensors`` (a JSON and
  safetensors pair of files),
  ``background`` (saves written by a thread), ``accelerate_io`` (every use
  of accelerate's internals);
- ``lock`` (one job per folder, or per file prefix), ``readers`` (files
  read without executing code, and the one at fault named), ``sync`` (the
  only module that talks across processes), ``wrapping`` (:func:`unwrapped`);
- ``format`` (the on-disk format: the name of every file and folder, and
  the manifest that seals a checkpoint), ``atomic`` (atomic files),
  ``errors``.

Beside them, reading a folder of checkpoints after training: ``cli`` (the
command ``python -m skorch_accel_callbacks list|verify|export``) on
``inspection`` (what a folder holds, whether every file loads) and
``export`` (a checkpoint's models as files for skorch's ``load_params``,
which ``checkpoint`` also uses).
"""

from skorch_accel_callbacks._core.sync import RankError
from skorch_accel_callbacks._core.wrapping import unwrapped
from skorch_accel_callbacks.callbacks.checkpoint import AccelerateCheckpoint
from skorch_accel_callbacks.callbacks.load_state import AccelerateLoadInitState
from skorch_accel_callbacks.callbacks.mixin import AccelerateFixesMixin
from skorch_accel_callbacks.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DivergedDecisionError,
    StoreUnavailableError,
    TrainingPreempted,
)
from skorch_accel_callbacks.params.checkpoint import ParamsCheckpoint
from skorch_accel_callbacks.params.load import LoadInitParams
from skorch_accel_callbacks.params.train_end import TrainEndParamsCheckpoint
from skorch_accel_callbacks.storage._lock import FolderInUseError

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
    'StoreUnavailableError',
    'TrainEndParamsCheckpoint',
    'TrainingPreempted',
    'unwrapped',
]

__version__ = '0.1.0'
