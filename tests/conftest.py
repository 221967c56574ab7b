"""Fixtures and report hooks of the whole suite.

The tests mirror the package: tests/<subpackage>/ holds the tests of
skorch_accel_callbacks/<subpackage>/ (tests/core those of _core), with
tests/project for what the repository promises as a whole (docs, examples,
the release, the package's shape, the suite's own rules) and tests/faults
for the crash, kill and bad-input suite. The modules the tests import
(tests/support, tests/workers, tests/faults, tests/faults/workers) are on
``sys.path`` through ``pythonpath`` in setup.cfg; helpers shared by test
modules are in tests/support (a module named ``conftest`` cannot be
imported: pytest owns the name, and tests/faults has one of its own).
"""

import logging
import os
import signal
import tempfile
import uuid

# One intra-op thread in the test processes, as the launched ranks have
# (tests/support/launcher.py): each of make test's two workers trains beside
# the other's launches on 2 cores, where torch's second OpenMP thread mostly
# spins waiting. Set before anything imports torch, which reads it once.
# Measured alone on 2 cores: the in-process fuzz 23 s with one thread, 31 s
# with two (user time 20 s against 37 s).
os.environ.setdefault('OMP_NUM_THREADS', '1')

import pytest

from launcher import launch
from testutil import read_results


def pytest_configure(config):
    # a shell starts a background job (make test &, nohup) with SIGINT
    # ignored, which its children inherit through exec: the tests' Ctrl-C
    # would then interrupt nothing. Python's own handler is what an
    # interactive run has, and exec resets a handled signal for a child
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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


# The files that take longest, longest first (measured on 2 cores with
# --durations). pytest-xdist hands out whole files (--dist loadfile) in
# collection order (--no-loadscope-reorder; by default it orders them by
# their number of tests, which put these one-test files last, where one
# worker ran two of them in turn while the other had nothing left): each of
# the two workers starts on one of the longest.
LONGEST_FIRST = (
    'faults/test_mid_epoch_kills.py', 'faults/test_random_kills.py',
    'faults/test_crash_points.py', 'callbacks/test_contract_fuzz.py',
    'callbacks/test_preemption.py', 'tools/test_inspect.py', 'project/test_examples.py',
    'callbacks/test_resume_exact.py', 'callbacks/test_checkpoint.py', 'storage/test_remote.py',
    'callbacks/test_mid_epoch.py', 'faults/test_upload_kills.py', 'callbacks/test_fsdp.py',
    'callbacks/test_lifecycle.py', 'faults/test_params_kills.py', 'state/test_world_size.py',
    'engine/test_async_save.py', 'params/test_params.py', 'faults/test_one_rank_dies.py',
)


def pytest_collection_modifyitems(config, items):
    order = {name: index for index, name in enumerate(LONGEST_FIRST)}
    tests = config.rootpath / 'tests'

    def rank(item):
        return order.get(item.path.relative_to(tests).as_posix(), len(order))
    # a stable sort: the tests of a file keep their order
    items.sort(key=rank)


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


@pytest.fixture(scope='session')
def s3_endpoint():
    """A local S3 server (moto), the same for the whole session: its URL."""
    # imported here: only the object-store tests need moto
    from s3server import start_server
    # the server logs every request
    logging.getLogger('werkzeug').setLevel(logging.WARNING)
    server, endpoint = start_server()
    yield endpoint
    server.stop()


@pytest.fixture
def network(s3_endpoint, monkeypatch):
    """A network between the job and the S3 server that the test cuts or
    silences: a proxy (``s3server.Proxy``) that ``AWS_ENDPOINT_URL`` names
    (request the fixture after ``s3_bucket``, which names the server)."""
    from s3server import Proxy
    proxy = Proxy(int(s3_endpoint.rsplit(':', 1)[1]))
    monkeypatch.setenv('AWS_ENDPOINT_URL', proxy.endpoint)
    yield proxy
    proxy.cut()


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch, tmp_path):
    """A fresh, empty bucket of the local S3 server, its name; the test (and
    the processes it launches) reach the server through the ``AWS_*``
    environment, and stage checkpoints under its own temporary folder."""
    import fsspec

    from s3server import S3_ENV
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv('AWS_ENDPOINT_URL', s3_endpoint)
    temp = tmp_path / 'tmp'
    temp.mkdir()
    monkeypatch.setenv('TMPDIR', str(temp))
    monkeypatch.setattr(tempfile, 'tempdir', str(temp))
    name = f'test-{uuid.uuid4().hex[:12]}'
    fsspec.filesystem('s3').mkdir(name)
    return name

