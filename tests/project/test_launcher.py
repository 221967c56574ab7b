"""The tests' launcher leaves nothing behind: no log folder, no process."""

import os
import subprocess
import tempfile

import pytest

from launcher import launch


@pytest.fixture
def tempdir(tmp_path, monkeypatch):
    """The launcher's temporary folders go below ``tmp_path/tmp``."""
    folder = tmp_path / 'tmp'
    folder.mkdir()
    monkeypatch.setattr(tempfile, 'tempdir', str(folder))
    return folder


def running(token):
    """Pids of the live processes whose command line holds ``token``."""
    found = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_logs_are_read_then_removed(tmp_path, tempdir):
    script = tmp_path / 'hello.py'
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    result = launch(script, nproc=2, timeout=60).check()
    assert [out.strip() for out in result.outputs] == ['hello from 0', 'hello from 1']
    assert list(tempdir.iterdir()) == []


def test_failed_start_kills_started_ranks_and_removes_logs(tmp_path, tempdir):
    script = tmp_path / 'sleeper.py'
    script.write_text("import time\ntime.sleep(120)\n")
    started = tmp_path / 'started'

    def second_start_fails():
        # runs in each rank's process before exec: the first one starts
        if started.exists():
            raise OSError('no second rank')
        started.touch()

    with pytest.raises(subprocess.SubprocessError):
        launch(script, nproc=2, timeout=60, preexec_fn=second_start_fails)
    assert started.exists()
    assert running(str(script)) == []
    assert list(tempdir.iterdir()) == []


def test_a_rank_killed_at_the_deadline_prints_where_each_thread_stood(tmp_path, tempdir):
    script = tmp_path / 'stalled.py'
    script.write_text(
        "import threading, time\n"
        "def background_stalled_here():\n"
        "    time.sleep(120)\n"
        "def main_stalled_here():\n"
        "    threading.Thread(target=background_stalled_here, daemon=True).start()\n"
        "    print('started', flush=True)\n"
        "    time.sleep(120)\n"
        "main_stalled_here()\n")
    result = launch(script, nproc=2, timeout=10)
    assert result.timed_out and result.killed == [0, 1], result.report()
    # the stacks were printed, and SIGKILL still ended each rank
    assert result.returncodes == [-9, -9], result.report()
    for out in result.outputs:
        assert out.startswith('started'), out
        assert 'in main_stalled_here' in out and 'in background_stalled_here' in out, out
