"""How a checkpoint is written and read back: the writer (in the fit's thread
or a background one), the files of accelerate's ``save_state`` it writes,
the stager (host copies that let a background save return), the
restore, and the page cache filled with a checkpoint's files before it.

What the other subpackages use of it, and nothing else of it, is named
here (``__all__``); its modules are its own.
"""

from skorch_accel_callbacks.engine._consolidate import (
    is_sharded_model,
    loadable,
    model_files,
    read_checkpoint_model,
    read_sharded_model,
)
from skorch_accel_callbacks.engine._prefetch import PageCacheFill, fills_on_this_process
from skorch_accel_callbacks.engine._restore import (
    InsideEpoch,
    Restored,
    ResumeChecks,
    choose_checkpoint,
    load_best_models,
    read_checkpoint,
)
from skorch_accel_callbacks.engine._writer import (
    BackgroundWriter,
    Retention,
    SaveRequest,
    SyncWriter,
)

__all__ = [
    'BackgroundWriter',
    'choose_checkpoint',
    'fills_on_this_process',
    'InsideEpoch',
    'is_sharded_model',
    'load_best_models',
    'loadable',
    'model_files',
    'PageCacheFill',
    'read_checkpoint',
    'read_checkpoint_model',
    'read_sharded_model',
    'Restored',
    'ResumeChecks',
    'Retention',
    'SaveRequest',
    'SyncWriter',
]
