"""skorch callbacks that save, checkpoint and resume training correctly under
Hugging Face accelerate, in one process or many."""

from skorch_accel_callbacks.checkpoint import AccelerateCheckpoint, CheckpointError
from skorch_accel_callbacks.load_state import AccelerateLoadInitState
from skorch_accel_callbacks.mixin import AccelerateFixesMixin
from skorch_accel_callbacks.params import (
    LoadInitParams, ParamsCheckpoint, TrainEndParamsCheckpoint)
from skorch_accel_callbacks.storage import CorruptCheckpointError
from skorch_accel_callbacks.sync import RankError
from skorch_accel_callbacks.wrapping import unwrapped

__all__ = [
    'AccelerateCheckpoint',
    'AccelerateFixesMixin',
    'AccelerateLoadInitState',
    'CheckpointError',
    'CorruptCheckpointError',
    'LoadInitParams',
    'ParamsCheckpoint',
    'RankError',
    'TrainEndParamsCheckpoint',
    'unwrapped',
]

__version__ = '0.1.0'
