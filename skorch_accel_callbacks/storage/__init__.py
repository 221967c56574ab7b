"""Where checkpoints live: the storage interface and its policy, written once
(which checkpoints, in what order, the pointers, retention, best); the
backends, a local folder and its lock, an object store through fsspec
(transfers, the lease, the upload of each node's files); and the function
that opens the one a ``dirname`` names.

What the other subpackages use of it, and nothing else of it, is named
here (``__all__``); its modules are its own.
"""

from skorch_accel_callbacks.storage._interface import (
    CheckpointStorage,
    Found,
    is_committer,
)
from skorch_accel_callbacks.storage._lock import (
    PrefixLock,
    probe,
)
from skorch_accel_callbacks.storage._open import (
    check_tested_store,
    open_storage,
)

__all__ = [
    'check_tested_store',
    'CheckpointStorage',
    'Found',
    'is_committer',
    'open_storage',
    'PrefixLock',
    'probe',
]
