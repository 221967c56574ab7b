"""The tests' launcher leaves nothing behind: no log folder, no process."""

import os
import re
import shutil
import subprocess
import tempfile

import pytest

from launcher import forked_into_cpython_deadlock, launch


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
        # then the native state, whole: not written over by the stacks
        native = out[out.index('----- native state of pid '):]
        assert 'waits in' in native and 'main_stalled_here' not in native, out


def test_a_rank_that_cannot_print_its_stacks_still_shows_where_it_waits(tmp_path, tempdir):
    # the rank and its forked child (as a loader worker is) block the stacks
    # signal, as a process stuck in C before Python runs again cannot answer
    # it: the launcher reads where each waits from outside
    script = tmp_path / 'blocked.py'
    script.write_text(
        "import os, signal, time\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {int(os.environ['TESTS_STACKS_SIGNAL'])})\n"
        "child = os.fork()\n"
        "print('child' if child == 0 else f'parent of {child}', flush=True)\n"
        "time.sleep(120)\n")
    result = launch(script, nproc=1, timeout=5)
    assert result.timed_out and result.killed == [0] and result.returncodes == [-9], \
        result.report()
    out = result.outputs[0]
    assert 'Current thread' not in out, out
    child = int(next(line for line in out.splitlines()
                     if line.startswith('parent of ')).split()[-1])
    # both processes of the rank's group, each thread's kernel wait
    sections = out.split('----- native state of pid ')[1:]
    pids = [int(section.split()[0]) for section in sections]
    assert child in pids and len(pids) == 2, out
    for section in sections:
        assert 'waits in' in section, out
        if shutil.which('gdb'):
            # the C stack too: the sleep it stands in
            assert re.search(r'^#0 .*(nanosleep|select|poll)', section, re.M), out
    assert not running(str(script))


# the native state of a loader worker that hung right after its fork (the
# frames gdb printed, trimmed), and of its rank, waiting for it
FORKED_INTO_DEADLOCK = """\
----- native state of pid 12068 (process group 8837) -----
thread 12068: waits in futex_do_wait, syscall 202
Thread 1 (Thread 0x7fa6757fbb80 (LWP 12068) "python"):
#5  0x00007fa6750aedf9 in __new_sem_wait (...) at ./nptl/sem_wait.c:42
#6  0x00007fa6754a9370 in PyThread_acquire_lock_timed (...) at Python/thread_pthread.h:497
#7  0x00007fa6754a954c in PyThread_acquire_lock (...) at Python/thread_pthread.h:751
#8  0x00007fa6754972e2 in _PyThreadState_DeleteExcept (...) at Python/pystate.c:1163
#9  0x00007fa67544fc8f in _PyEval_ReInitThreads (...) at Python/ceval.c:488
#10 0x00007fa6754cf280 in PyOS_AfterFork_Child (...) at ./Modules/posixmodule.c:607
#11 0x00007fa6754cf45d in os_fork_impl (...) at ./Modules/posixmodule.c:6872
"""
WAITING_FOR_A_WORKER = """\
----- native state of pid 8837 (process group 8837) -----
thread 8837: waits in poll_schedule_timeout.constprop.0, syscall 7
Thread 1 (Thread 0x7fa6757fbb80 (LWP 8837) "python"):
#0  0x00007fa67511a26f in __GI___poll (...) at ../sysdeps/unix/sysv/linux/poll.c:29
"""


def test_a_process_hung_in_cpythons_fork_is_told_from_other_stalls():
    assert forked_into_cpython_deadlock('epoch 3\n' + WAITING_FOR_A_WORKER + FORKED_INTO_DEADLOCK)
    assert not forked_into_cpython_deadlock(WAITING_FOR_A_WORKER)
    # the Python stacks of faulthandler name no C function
    assert not forked_into_cpython_deadlock(
        'File "popen_fork.py", line 66 in _launch\n' + WAITING_FOR_A_WORKER)
