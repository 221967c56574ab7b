"""Imported at start-up by every process the tests launch (this folder is
first on their ``PYTHONPATH``).

- A rank that the launcher has to kill, still running at its deadline or
  after another rank failed, first prints the stack of each of its threads
  (and each of its loader workers its own), so that a stall shows where it
  stood (``tests/support/launcher.py``).
- A fork waits a moment for the threads that are taking the GIL. CPython
  3.11 before 3.11.10 (3.11.7 here) can deadlock a forked child: if
  another thread holds the interpreter's thread-list lock at the fork (it
  does while it creates its thread state, before it has the GIL), the
  child waits for that lock forever, before any of its Python code runs
  (CPython gh-112275, fixed in 3.12 and in 3.11.10). gloo's worker threads
  create one each time they free a tensor Python holds, right after a
  collective (torch 2.13). accelerate's loader broadcasts the random
  states just before its workers are forked, so a rank with loader workers
  (``fork``, the default on Linux) hung now and then at an epoch's start,
  its worker stuck in ``PyOS_AfterFork_Child``. Releasing the GIL before
  the fork lets such a thread finish; it narrows the window to one that
  another collective has to complete in, and the launcher relaunches once
  a launch stalled in exactly that way.
"""

import faulthandler
import os
import time

# long enough for a thread waiting on the GIL to take it, free its tensor
# and delete its thread state (a switch interval is 5 ms)
FORK_GRACE = 0.005

if 'TESTS_STACKS_SIGNAL' in os.environ:
    faulthandler.register(int(os.environ['TESTS_STACKS_SIGNAL']), all_threads=True)

os.register_at_fork(before=lambda: time.sleep(FORK_GRACE))
