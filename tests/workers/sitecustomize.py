"""Imported at start-up by every process the tests launch (this folder is
first on their ``PYTHONPATH``): a rank that the launcher has to kill, still
running at its deadline or after another rank failed, first prints the
stack of each of its threads (and each of its loader workers its own), so
that a stall shows where it stood (``tests/support/launcher.py``)."""

import faulthandler
import os

if 'TESTS_STACKS_SIGNAL' in os.environ:
    faulthandler.register(int(os.environ['TESTS_STACKS_SIGNAL']), all_threads=True)
