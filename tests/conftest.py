"""Fixtures and report hooks of the whole suite.

The modules the tests import (tests/, tests/workers, tests/faults,
tests/faults/workers) are on ``sys.path`` through ``pythonpath`` in
setup.cfg; helpers shared by test modules are in testutil.py (a module
named ``conftest`` cannot be imported: pytest owns the name, and
tests/faults has one of its own).
"""

import pytest

from launcher import launch
from testutil import read_results


@pytest.fixture
def run_workers(tmp_path):
    """Launch a worker script in ``nproc`` processes; return each rank's result.

    Fails with every rank's output when a rank fails or the launch times out.
    """
    def run(script, name, nproc=2, timeout=180, env=None, args=()):
        out = tmp_path / f'results-{name}-{nproc}'
        out.mkdir(exist_ok=True)
        result = launch(script, *args, nproc=nproc, timeout=timeout,
                        env=dict(env or {}, RESULT_DIR=str(out)))
        result.check()
        return read_results(out, name, nproc)
    return run


def pytest_terminal_summary(terminalreporter):
    """Print what tests recorded with ``record_property('summary', text)``.

    Works with and without ``-s`` and under pytest-xdist (the reports carry
    their user properties to the controlling process), so figures such as
    the fault suite's trial counts can be read from a CI log.
    """
    lines = [value for category in ('passed', 'failed')
             for report in terminalreporter.stats.get(category, [])
             if getattr(report, 'when', None) == 'call'
             for name, value in getattr(report, 'user_properties', ())
             if name == 'summary']
    if lines:
        terminalreporter.section('figures recorded by tests')
        for line in lines:
            terminalreporter.write_line(line)
