"""How the loaders' worker processes start, and the hang that a fork can
meet there on Python 3.11 before 3.11.10.

CPython gh-112275: a process forked while another thread of its parent
holds the interpreter's thread-list lock waits for that lock forever, in
``PyOS_AfterFork_Child``, before any of its code runs. A thread that Python
did not start takes that lock, without the GIL, each time it creates a
thread state to call into Python; torch.distributed's threads do, when they
let go of a tensor that Python holds (gloo's, at every collective, seen in
this project's tests). accelerate's loader broadcasts the random states
right before a pass creates its iterator, which forks the workers: in a
run of several processes a rank then waits for its first batch forever, and
the other ranks time out in their next collective.

Python 3.11.10 (and 3.12) reset the lock in the child. Workers started by
``forkserver`` or ``spawn`` are forked from a process without such threads.
The resume is exact with either (``tests/state/test_data_pipeline.py``).
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from typing import Any

from skorch_accel_callbacks._core import sync

__all__ = ['forking_loaders', 'python_can_hang_at_fork', 'start_method',
           'warn_forked_workers_can_hang']

# the loaders skorch builds for a fit, by the prefix of their parameters
LOADERS = ('iterator_train', 'iterator_valid')


def python_can_hang_at_fork(version: tuple[int, ...] = tuple(sys.version_info)) -> bool:
    """Whether this Python (``version``: its ``sys.version_info``) can hang
    a forked child on the thread-list lock (CPython gh-112275): every 3.11
    before 3.11.10 of the releases the package supports."""
    return version[0] == 3 and version[1] == 11 and version[2] < 10


def start_method(context: Any) -> str:
    """The start method of a loader's ``multiprocessing_context``: a name, a
    context, or None for the process's default, which this does not fix
    (``multiprocessing.get_context()`` would)."""
    if context is None:
        return (multiprocessing.get_start_method(allow_none=True)
                or multiprocessing.get_all_start_methods()[0])
    if isinstance(context, str):
        return context
    return context.get_start_method()


def forking_loaders(net: Any) -> list[str]:
    """The loaders of ``net`` whose workers are forked from the training
    process, as ``"iterator_train (2 workers, at every epoch)"``."""
    found = []
    for prefix in LOADERS:
        params = net.get_params_for(prefix)
        workers = params.get('num_workers', 0)
        if not workers or start_method(params.get('multiprocessing_context')) != 'fork':
            continue
        when = 'once a fit' if params.get('persistent_workers') else 'at every epoch'
        found.append(f"{prefix} ({workers} worker{'s' if workers > 1 else ''}, {when})")
    return found


def warn_forked_workers_can_hang(net: Any, owner: str) -> None:
    """Warn (on the main process of a run of several processes) when this
    Python can hang a loader's worker at its fork and ``net`` forks them,
    naming the loaders and the ways out; ``owner`` begins the message."""
    if not (sync.num_processes(net) > 1 and sync.is_main_process(net)
            and python_can_hang_at_fork()):
        return
    loaders = forking_loaders(net)
    if not loaders:
        return
    version = '.'.join(map(str, sys.version_info[:3]))
    warnings.warn(
        f"{owner}: this net forks loader workers from the training process "
        f"({', '.join(loaders)}), and on Python {version} a worker forked while one "
        f"of torch.distributed's threads calls into Python waits forever for a lock "
        f"(CPython gh-112275, fixed in 3.11.10): that rank waits for its batch and the "
        f"other ranks time out in their next collective. Use Python 3.11.10 or later, "
        f"or start the workers with iterator_train__multiprocessing_context="
        f"'forkserver' (iterator_valid__ likewise), with which a resume is as exact",
        UserWarning, stacklevel=4)
