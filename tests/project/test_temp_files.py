"""The tests' workers leave nothing in the system's temporary folder."""

import os
import subprocess
import sys

import pytest

from launcher import launch
from testutil import read_results


@pytest.mark.slow
def test_foundation_worker_leaves_no_temporary_folder(tmp_path):
    """The worker that saves files into a temporary folder, in 2 processes,
    with ``TMPDIR`` a fresh folder: that folder is empty afterwards (today's
    main left one folder a rank)."""
    tmpdir = tmp_path / 'tmpdir'
    tmpdir.mkdir()
    results_dir = tmp_path / 'results'
    results_dir.mkdir()
    # torch keeps its compiler's cache in <tmp>/torchinductor_<user>, one
    # folder reused by every run: not what this test looks for
    env = {'TMPDIR': str(tmpdir), 'TORCHINDUCTOR_CACHE_DIR': str(tmp_path / 'inductor')}
    # the folder is the one Python's tempfile uses under this environment
    said = subprocess.run([sys.executable, '-c', 'import tempfile; print(tempfile.gettempdir())'],
                          env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=60, check=True)
    assert said.stdout.strip() == str(tmpdir)
    launch('foundation.py', nproc=2, env=dict(env, RESULT_DIR=str(results_dir))).check()
    results = read_results(results_dir, 'foundation', 2)
    assert [result['num_processes'] for result in results] == [2, 2]
    assert list(tmpdir.iterdir()) == []
