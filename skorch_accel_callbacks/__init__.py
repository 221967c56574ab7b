"""skorch callbacks that save, checkpoint and resume training correctly under
Hugging Face accelerate, in one process or many."""

from skorch_accel_callbacks.mixin import AccelerateFixesMixin
from skorch_accel_callbacks.sync import RankError
from skorch_accel_callbacks.wrapping import unwrapped

__all__ = [
    'AccelerateFixesMixin',
    'RankError',
    'unwrapped',
]

__version__ = '0.1.0'
