"""Run tests/workers/resume.py uninterrupted, killed and resumed."""

import os

from launcher import launch
from testutil import read_results


def run(folder, tag, nproc=2, nnodes=1, expect_ok=True, dirname='ckpt', **env):
    """One launch of resume.py writing into ``folder``; returns rank results."""
    env = dict(env, RESULT_DIR=str(folder))
    result = launch('resume.py', os.path.join(folder, dirname), tag,
                    nproc=nproc, nnodes=nnodes, env=env)
    if expect_ok:
        result.check()
        return read_results(folder, tag, nproc * nnodes)
    return result
