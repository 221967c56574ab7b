"""Helpers of the fault suite (tests/faults): the fault job's launches.

Its fixtures (the reference run) are in tests/faults/conftest.py.
"""

from pathlib import Path

from launcher import launch
from skorch_accel_callbacks.format import _manifest
from testutil import read_json

WORKERS = Path(__file__).parent / 'workers'

# a hung collective fails a launch after this many seconds, not 30 minutes
COLLECTIVE_TIMEOUT = 20


def run_job(script, folder, dirname, tag, *, nproc=2, timeout=180, grace=10.0,
            preexec_fn=None, **env):
    """Launch ``tests/faults/workers/<script>`` on ``dirname``; results go to ``folder``."""
    env = dict(env, RESULT_DIR=str(folder))
    env.setdefault('COLLECTIVE_TIMEOUT', str(COLLECTIVE_TIMEOUT))
    return launch(WORKERS / script, dirname, tag, nproc=nproc, timeout=timeout,
                  grace=grace, preexec_fn=preexec_fn, env=env)


def pointed(ckpt):
    """The checkpoint that latest.json names, checked complete; None if none."""
    try:
        name = read_json(ckpt / 'latest.json')['name']
    except FileNotFoundError:
        return None
    path = ckpt / name
    _manifest.read(path)  # raises naming the file if it is not complete
    return str(path)
