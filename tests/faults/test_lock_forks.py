"""A folder's lock belongs to the job that took it, never to what it forked.

A ``flock`` belongs to the open file, and a fork shares open files with the
child: DataLoader workers (forked when a pass over the loader begins, after
the lock was taken) and a user's fork pool would keep the folder locked after
the job was SIGKILLed, and its relaunch was refused for a few seconds, naming
the dead job as "another running job". Each holder here runs in a process of
its own and is SIGKILLed for real; its child is checked to be alive while the
folder is taken again.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from launcher import REPO
from skorch_accel_callbacks.errors import FolderInUseError
from skorch_accel_callbacks.storage import _lock as lock, probe

pytestmark = [pytest.mark.faults]

DEADLINE_S = 60


def start(script, *args):
    """Run ``script`` (Python source) in a process of its own."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, '-c', textwrap.dedent(script), *map(str, args)],
                            env=env)


def wait_for_file(path, proc):
    """Wait until ``path`` exists while the holder ``proc`` runs."""
    deadline = time.monotonic() + DEADLINE_S
    while not os.path.exists(path):
        assert proc.poll() is None, f"the holder ended with {proc.returncode}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def wait_for(path, proc):
    """The JSON the holder ``proc`` writes to ``path``, once it is there."""
    wait_for_file(path, proc)
    with open(path) as f:
        return json.load(f)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has ended too: only its parent has not reaped it yet
    with open(f'/proc/{pid}/stat') as f:
        return f.read().rsplit(')', 1)[1].split()[0] != 'Z'


HOLDER_THAT_FORKS = """
    import json, multiprocessing, os, sys, time
    from skorch_accel_callbacks.storage._lock import FolderLock

    def child(lock_held_by_child):
        # what a DataLoader worker does: train nothing, live on
        lock_held_by_child.value = int(lock.held)
        time.sleep(120)

    folder, ready = sys.argv[1], sys.argv[2]
    lock = FolderLock(folder).acquire()
    held_in_child = multiprocessing.get_context('fork').Value('i', -1)
    worker = multiprocessing.get_context('fork').Process(target=child, args=(held_in_child,))
    worker.start()
    while held_in_child.value == -1:
        time.sleep(0.01)
    with open(ready + '.tmp', 'w') as f:
        json.dump({'child': worker.pid, 'held_in_child': held_in_child.value}, f)
    os.rename(ready + '.tmp', ready)
    time.sleep(120)
"""


def test_a_forked_child_of_a_killed_job_keeps_no_lock(tmp_path):
    folder = tmp_path / 'ckpt'
    folder.mkdir()
    holder = start(HOLDER_THAT_FORKS, folder, tmp_path / 'ready.json')
    child = None
    try:
        ready = wait_for(tmp_path / 'ready.json', holder)
        child = ready['child']
        # the child's copy of the lock holds nothing
        assert ready['held_in_child'] == 0
        assert probe(folder / '.lock')['held']
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(DEADLINE_S) == -signal.SIGKILL
        # the relaunch: the worker the killed job forked still runs
        relaunched = lock.FolderLock(folder).acquire()
        assert alive(child), "the child ended before the folder was taken again"
        relaunched.release()
    finally:
        holder.kill()
        holder.wait()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)


ORPHAN_HOLDER = """
    import fcntl, json, os, socket, sys, time
    lock_path, ready = sys.argv[1], sys.argv[2]
    dead_pid, hold_s = int(sys.argv[3]), float(sys.argv[4])
    # a process that holds the lock file open and locked, in the record of a
    # job that has ended: as a child forked before the at-fork hook existed,
    # or one handed the descriptor on purpose
    f = open(lock_path, 'a+')
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.truncate(0)
    json.dump({'pid': dead_pid, 'host': socket.gethostname(),
               'pid_ns': os.readlink('/proc/self/ns/pid')}, f)
    f.flush()
    open(ready, 'w').close()
    time.sleep(hold_s)
"""


def ended_pid():
    proc = subprocess.Popen(['true'])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize('hold_s', [1.0, 120.0], ids=['exits-in-time', 'stays'])
def test_a_lock_whose_recorded_job_ended_is_waited_for_never_called_running(
        tmp_path, monkeypatch, hold_s):
    folder = tmp_path / 'ckpt'
    folder.mkdir()
    dead = ended_pid()
    orphan = start(ORPHAN_HOLDER, folder / '.lock', tmp_path / 'ready', dead, hold_s)
    try:
        wait_for_file(tmp_path / 'ready', orphan)
        assert probe(folder / '.lock')['held']
        monkeypatch.setattr(lock, '_ORPHAN_GRACE_S', 6.0)
        if hold_s < 6.0:
            taken = lock.FolderLock(folder).acquire()
            # it was the orphan's exit that let it through (the flock is
            # released as its files close, before its exit can be reaped)
            assert orphan.wait(DEADLINE_S) == 0
            taken.release()
        else:
            with pytest.raises(FolderInUseError) as refused:
                lock.FolderLock(folder).acquire()
            message = str(refused.value)
            assert 'another running job' not in message
            assert f'pid {dead} on host {socket.gethostname()}, ended' in message
            assert str(folder / '.lock') in message
    finally:
        orphan.kill()
        orphan.wait()
