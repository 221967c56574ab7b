"""The checkpoint and resume callbacks (AccelerateCheckpoint,
AccelerateLoadInitState), the net mixin they need (AccelerateFixesMixin),
and their policies: when to save (triggers) and the signals that make a run
save and stop (preemption); how a net with an accelerator pickles (pickling).

What the other subpackages use of it, and nothing else of it, is named
here (``__all__``); its modules are its own.
"""

from skorch_accel_callbacks.callbacks._loadable import (
    checkpoint_files,
    f_argument,
)
from skorch_accel_callbacks.callbacks._pickling import (
    dump_net,
)
from skorch_accel_callbacks.callbacks._triggers import (
    monitor_says,
)

__all__ = [
    'checkpoint_files',
    'dump_net',
    'f_argument',
    'monitor_says',
]
