"""The tests' launcher leaves nothing behind: no log folder, no process."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings

import pytest

from launcher import forked_into_cpython_deadlock, launch
from skorch_accel_callbacks.state._worker_start import python_can_hang_at_fork
from testutil import machine_lacks


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


def thread_list_lock_offset():
    """Where this interpreter keeps the thread-list lock that CPython takes
    in a forked child (``_PyRuntime.interpreters.mutex``), as its debug
    information gives it to gdb; None where that is not known."""
    library = sys.executable
    if sysconfig.get_config_var('Py_ENABLE_SHARED'):
        library = os.path.join(sysconfig.get_config_var('LIBDIR'),
                               sysconfig.get_config_var('INSTSONAME'))
    gdb = subprocess.run(
        ['gdb', '-batch', '-nx', '-ex',
         'print (long)&((struct pyruntimestate *)0)->interpreters.mutex', library],
        capture_output=True, text=True, timeout=60)
    found = re.search(r'^\$1 = (\d+)$', gdb.stdout, re.M)
    return int(found.group(1)) if found else None


# every start is counted, and the first one forks: 'held', holding the lock
# that the child needs, which on this interpreter waits for it forever, and
# the rank for the child (the deadlock that the fork grace of
# tests/workers/sitecustomize.py narrows); 'free', a child that stalls in a
# sleep instead. A second start ends at once.
FORKS_HOLDING_THE_LOCK = """\
import ctypes, os, sys
starts, offset, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(starts, 'a') as f:
    f.write('start\\n')
if open(starts).read().count('start') > 1:
    print('relaunched', flush=True)
    sys.exit(0)
api = ctypes.pythonapi
api.PyThread_acquire_lock.argtypes = [ctypes.c_void_p, ctypes.c_int]
api.PyThread_release_lock.argtypes = [ctypes.c_void_p]
runtime = ctypes.addressof(ctypes.c_char.in_dll(api, '_PyRuntime'))
lock = ctypes.c_void_p.from_address(runtime + offset).value
if how == 'held':
    api.PyThread_acquire_lock(lock, 1)
child = os.fork()
if child == 0:
    if how == 'held':
        os._exit(0)
    import time
    time.sleep(120)
if how == 'held':
    api.PyThread_release_lock(lock)
print('forked', child, flush=True)
os.waitpid(child, 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not python_can_hang_at_fork(),
                    reason=f'Python {sys.version.split()[0]} resets the thread-list lock '
                           'in a forked child (gh-112275 fixed in 3.11.10 and 3.12)')
@pytest.mark.parametrize('how', ['held', 'free'])
def test_a_launch_that_hung_in_cpythons_fork_is_launched_again_once(tmp_path, tempdir, how):
    # a real fork into the deadlock: the launcher reads the child's C stack
    # and relaunches; a child that stalls elsewhere fails the launch
    if not shutil.which('gdb'):
        machine_lacks('gdb: without it the launcher cannot see the C stack it relaunches on')
    offset = thread_list_lock_offset()
    if offset is None:
        machine_lacks("the interpreter's debug information, where gdb finds the lock")
    script = tmp_path / 'forks.py'
    script.write_text(FORKS_HOLDING_THE_LOCK)
    starts = tmp_path / 'starts'
    if how == 'held':
        with pytest.warns(RuntimeWarning, match='gh-112275') as caught:
            result = launch(script, starts, offset, how, nproc=1, timeout=5)
        assert len(caught) == 1
        assert result.check().outputs == ['relaunched\n']
    else:
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            result = launch(script, starts, offset, how, nproc=1, timeout=5)
        assert result.timed_out and result.returncodes == [-9], result.report()
        assert forked_into_cpython_deadlock(result.outputs[0]) is False
        # the child was there to be looked at, waiting in its sleep
        assert re.search(r'^#0 .*(nanosleep|select|poll)', result.outputs[0], re.M), \
            result.report()
    assert starts.read_text().count('start') == (2 if how == 'held' else 1)
    assert not running(str(script))
