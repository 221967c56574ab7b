"""Helpers of the fault suite (tests/faults): the fault job's launches and its
reference run. Not a conftest.py: tests/conftest.py already owns that module
name; the test modules import the fixtures from here.

The uninterrupted reference run is launched once per test session, also
under pytest-xdist (the first worker that needs it launches it while holding
a lock; the others read its result), since every launch costs seconds.
"""

import fcntl
import json
import os
import sys
from pathlib import Path

import pytest
import torch

WORKERS = Path(__file__).parent / 'workers'
sys.path.insert(0, str(WORKERS))

from launcher import launch  # noqa: E402

# a hung collective fails a launch after this many seconds, not 30 minutes
COLLECTIVE_TIMEOUT = 20


def run_job(script, folder, dirname, tag, *, nproc=2, timeout=180, grace=10.0,
            preexec_fn=None, **env):
    """Launch ``tests/faults/workers/<script>`` on ``dirname``; results go to ``folder``."""
    env = dict(env, RESULT_DIR=str(folder))
    env.setdefault('COLLECTIVE_TIMEOUT', str(COLLECTIVE_TIMEOUT))
    return launch(WORKERS / script, dirname, tag, nproc=nproc, timeout=timeout,
                  grace=grace, preexec_fn=preexec_fn, env=env)


def final_state(folder, tag):
    return torch.load(os.path.join(folder, f'{tag}-rank0.pt'), weights_only=False)


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


def read_json(path):
    return json.loads(Path(path).read_text())
