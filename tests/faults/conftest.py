"""Fixtures of the fault suite (tests/faults).

The uninterrupted reference run is launched once per test session, also
under pytest-xdist (the first worker that needs it launches it while holding
a lock; the others read its result), since every launch costs seconds. The
suites that launch their job dozens of times launch it through a fork
server (``zygote``) that imported torch, accelerate and skorch once.
"""

import fcntl
import os
from pathlib import Path

import pytest

from crashpoints import Zygote
from faultsuite import run_job


def shared_folder(tmp_path_factory, name):
    """A folder shared by the xdist workers of this test run, and its lock."""
    uid = os.environ.get('PYTEST_XDIST_TESTRUNUID')
    if uid is None:
        return tmp_path_factory.mktemp(name), None
    base = tmp_path_factory.getbasetemp().parent / f'{name}-{uid}'
    return base, Path(f'{base}.lock')


@pytest.fixture(scope='session')
def reference(tmp_path_factory):
    """Folder holding ``ref-rank0.pt``: the fault job, never interrupted, in 2
    processes; and its checkpoints in ``<folder>/ckpt``."""
    folder, lock_path = shared_folder(tmp_path_factory, 'faults-reference')
    lock = open(lock_path, 'w') if lock_path else None
    try:
        if lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / 'ref-rank0.pt').exists():
            folder.mkdir(parents=True, exist_ok=True)
            run_job('killable.py', folder, folder / 'ckpt', 'ref').check()
    finally:
        if lock:
            lock.close()
    return folder


@pytest.fixture(scope='module')
def zygote(tmp_path_factory):
    """The fork server of the module's launches (tests/faults/workers/zygote.py):
    each launch a fork of one interpreter that imported the job's modules,
    one process a rank with the environment of tests/support/launcher.py, killed
    ``grace`` s after the first rank fails, as a launch of its own is."""
    server = Zygote(tmp_path_factory.mktemp('zygote'))
    server.warm_up()
    yield server
    server.close()
