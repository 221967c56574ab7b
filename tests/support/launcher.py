"""Run a script in several processes on CPU, as ``torchrun`` would.

Each rank is started directly with the environment contract of
``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_PORT``, ...)
so that every rank's exit code and output can be told apart. Every launch has
a free port of its own and a deadline: a deadlock fails the test with every
rank's output instead of hanging CI.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

WORKERS = Path(__file__).parent.parent / 'workers'
REPO = Path(__file__).parent.parent.parent
# on it, each launched process prints every thread's stack
# (tests/workers/sitecustomize.py): a signal that neither torch nor the
# package catches, so that it reaches faulthandler
STACKS_SIGNAL = signal.SIGRTMIN + 7
# how long the processes get to print their stacks before they are killed
STACKS_WAIT = 0.5
# how much of a rank's output a failed launch's report shows
OUTPUT_KEPT = 6000
KILLED_OUTPUT_KEPT = 40000
# how long gdb may take to print one stalled process's C stacks
GDB_TIMEOUT = 20
# how long the other processes of a killed rank's group get to end
GROUP_EXIT_WAIT = 10
# what begins each stalled process's native state in its rank's output
NATIVE_HEADER = '----- native state of pid '
# the libraries whose symbols gdb reads (each a pattern of their paths)
GDB_SYMBOLS = ('^/lib', '^/usr', 'libpython', 'libgomp', 'libc10', 'libtorch_python', 'libshm',
               'libuv')


def free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


@dataclass
class LaunchResult:
    returncodes: list
    outputs: list
    timed_out: bool
    duration: float
    args: list = field(default_factory=list)
    # the ranks still running at the end, which the launch killed
    killed: list = field(default_factory=list)

    def report(self):
        parts = [f"launch of {self.args} (timed out: {self.timed_out}, "
                 f"{self.duration:.1f} s), exit codes {self.returncodes}"]
        for rank, out in enumerate(self.outputs):
            # a killed rank's end is its stacks, Python's and the native ones
            kept = KILLED_OUTPUT_KEPT if rank in self.killed else OUTPUT_KEPT
            parts.append(f"----- rank {rank} (exit {self.returncodes[rank]}) -----\n"
                         f"{out[-kept:]}")
        return '\n'.join(parts)

    def check(self):
        """Assert that every rank exited 0 before the deadline."""
        assert not self.timed_out and all(rc == 0 for rc in self.returncodes), \
            self.report()
        return self

    @property
    def ok(self):
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)


def _signal_groups(procs, signum):
    for proc in procs:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass


def _group_members(pgid, live=False):
    """The pids of the processes of the process group ``pgid`` (with
    ``live``, those not ended yet: no zombies)."""
    members = []
    for entry in Path('/proc').iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / 'stat').read_text()
        except OSError:
            continue
        # the fields after the command name, which may hold spaces: state,
        # ppid, pgrp
        state, _, pgrp = stat[stat.rindex(')') + 2:].split()[:3]
        if int(pgrp) == pgid and not (live and state in 'ZX'):
            members.append(int(entry.name))
    return sorted(members)


def _await_groups_ended(pgids):
    """Wait, at most ``GROUP_EXIT_WAIT`` s, until no process of the groups
    ``pgids`` is alive. A rank's own children (a fork of its own, loader
    workers) get the group's SIGKILL too, but end on their own time:
    reaping the rank does not wait for them."""
    deadline = time.monotonic() + GROUP_EXIT_WAIT
    while any(_group_members(pgid, live=True) for pgid in pgids):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _native_stacks(pgid):
    """Where each process of the group ``pgid`` waits, below Python: its
    threads' kernel waits (``/proc``) and, where gdb is installed, their C
    stacks. A process stuck before Python runs again (in a library's fork
    handler, on a lock) cannot print its own stacks."""
    parts = []
    for pid in _group_members(pgid):
        lines = [f'{NATIVE_HEADER}{pid} (process group {pgid}) -----']
        task = Path(f'/proc/{pid}/task')
        try:
            for tid in sorted(task.iterdir(), key=lambda path: int(path.name)):
                wchan = (tid / 'wchan').read_text().strip() or '-'
                syscall = (tid / 'syscall').read_text().split()[0]
                lines.append(f'thread {tid.name}: waits in {wchan}, syscall {syscall}')
        except OSError as error:
            lines.append(f'/proc unreadable: {error}')
        if shutil.which('gdb'):
            try:
                gdb = subprocess.run(
                    # the symbols of the system's libraries, Python's and the
                    # small ones of torch read, not libtorch_cpu's: 1 s a
                    # process, not 4; a frame in it still names its library
                    ['gdb', '-p', str(pid), '-batch', '-nx', '-iex', 'set auto-solib-add off',
                     *(arg for name in GDB_SYMBOLS for arg in ('-ex', f'sharedlibrary {name}')),
                     '-ex', 'thread apply all bt 40'],
                    capture_output=True, text=True, timeout=GDB_TIMEOUT)
                lines.extend(line for line in gdb.stdout.splitlines()
                             if line.startswith(('Thread ', '#')))
            except subprocess.TimeoutExpired:
                lines.append(f'gdb took more than {GDB_TIMEOUT} s')
        parts.append('\n'.join(lines))
    return '\n'.join(parts)


def _kill(procs, logdir):
    """End the process group of each of ``procs`` still running, after it
    printed its stacks and its native state was read; the indexes of those
    that were running."""
    running = [i for i, proc in enumerate(procs) if proc.poll() is None]
    native = {i: _native_stacks(procs[i].pid) for i in running}
    if running:
        stalled = [procs[i] for i in running]
        _signal_groups(stalled, STACKS_SIGNAL)
        time.sleep(STACKS_WAIT)
        _signal_groups(stalled, signal.SIGKILL)
    for proc in procs:
        proc.wait()
    _await_groups_ended([procs[i].pid for i in running])
    # once the group is dead: a rank writes its log at its own offset, over
    # what was appended while it ran
    for i, text in native.items():
        with open(logdir / f'rank{i}.log', 'a', encoding='utf-8') as log:
            log.write('\n' + text + '\n')
    return running


def _wait(procs, deadline, grace):
    """Wait until every process ended, the deadline passed (returns True),
    or ``grace`` seconds passed since the first one failed."""
    first_failure = None
    while any(proc.poll() is None for proc in procs):
        now = time.monotonic()
        if first_failure is None and any(
                proc.poll() not in (None, 0) for proc in procs):
            first_failure = now
        if now > deadline:
            return True
        if first_failure is not None and now > first_failure + grace:
            break
        time.sleep(0.05)
    return False


def rank_environments(nproc, nnodes=1, env=None):
    """The environment of each rank of a launch: this process's, with the
    contract of ``torchrun`` (a free ``MASTER_PORT`` of its own) and ``env``."""
    world_size = nproc * nnodes
    base_env = dict(os.environ)
    distributed = {
        'MASTER_ADDR': '127.0.0.1',
        'MASTER_PORT': str(free_port()),
        'WORLD_SIZE': str(world_size),
        'LOCAL_WORLD_SIZE': str(nproc),
    }
    if world_size == 1:
        # one process is a plain `python script.py`, as a user runs it
        distributed = {}
        for key in ('MASTER_ADDR', 'MASTER_PORT', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE',
                    'RANK', 'LOCAL_RANK', 'GROUP_RANK', 'NODE_RANK'):
            base_env.pop(key, None)
    base_env.update(distributed)
    base_env.update({
        'OMP_NUM_THREADS': '1',
        'PYTHONUNBUFFERED': '1',
        'TESTS_STACKS_SIGNAL': str(int(STACKS_SIGNAL)),
        'PYTHONPATH': os.pathsep.join(
            [str(WORKERS), str(REPO), base_env.get('PYTHONPATH', '')]),
    })
    base_env.update(env or {})
    environments = []
    for rank in range(world_size):
        rank_env = dict(base_env)
        if distributed:
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank % nproc),
                            GROUP_RANK=str(rank // nproc), NODE_RANK=str(rank // nproc))
        environments.append(rank_env)
    return environments


def launch(script, *args, nproc=2, nnodes=1, timeout=180, env=None,
           grace=10.0, preexec_fn=None, _retries=1):
    """Run ``script`` in ``nnodes * nproc`` processes and wait for them.

    ``script`` is a path, or a name of a file in ``tests/workers``. When a
    rank fails, the others get ``grace`` seconds to end (as torchrun would
    stop them) before they are killed. ``preexec_fn`` runs in each rank's
    process before the script starts (e.g. to drop privileges). Returns a
    :class:`LaunchResult`.
    """
    script = Path(script)
    if not script.is_absolute() and not script.exists():
        script = WORKERS / script
    world_size = nproc * nnodes
    environments = rank_environments(nproc, nnodes, env)
    # the ranks' output goes to files (a pipe could fill up and block a
    # rank); the folder is removed once they are read, on error paths too
    with tempfile.TemporaryDirectory(prefix='launch-') as tmp:
        logdir = Path(tmp)
        procs, logs = [], []
        start = time.monotonic()
        try:
            for rank, rank_env in enumerate(environments):
                log = open(logdir / f'rank{rank}.log', 'wb')
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, str(script), *map(str, args)], env=rank_env,
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, preexec_fn=preexec_fn))
            timed_out = _wait(procs, start + timeout, grace)
        finally:
            # also when a rank failed to start or the test was interrupted:
            # no rank outlives its launch
            killed = _kill(procs, logdir)
            for log in logs:
                log.close()
        outputs = [(logdir / f'rank{rank}.log').read_text(errors='replace')
                   for rank in range(world_size)]
    result = LaunchResult(
        returncodes=[proc.returncode for proc in procs], outputs=outputs,
        timed_out=timed_out, duration=time.monotonic() - start,
        args=[script.name, *args], killed=killed)
    port_clash = any('EADDRINUSE' in out or 'address already in use' in out
                     for out in outputs)
    fork_deadlock = any(map(forked_into_cpython_deadlock, outputs))
    if not result.ok and (port_clash or fork_deadlock) and _retries > 0:
        if fork_deadlock:
            warnings.warn(f"launch of {result.args}: a forked process hung in "
                          "PyOS_AfterFork_Child (CPython gh-112275, "
                          "tests/workers/sitecustomize.py); launched again", RuntimeWarning)
        return launch(script, *args, nproc=nproc, nnodes=nnodes, timeout=timeout,
                      env=env, grace=grace, preexec_fn=preexec_fn,
                      _retries=_retries - 1)
    return result


def forked_into_cpython_deadlock(output):
    """Whether a process of this rank's output hung right after a fork on
    the thread-list lock that CPython 3.11 before 3.11.10 does not reset in
    the child (gh-112275; tests/workers/sitecustomize.py): its native stack,
    read by gdb, waits in ``_PyThreadState_DeleteExcept`` called from
    ``PyOS_AfterFork_Child``."""
    for section in output.split(NATIVE_HEADER)[1:]:
        frames = [line for line in section.splitlines() if line.startswith('#')]
        names = [name for name in ('_PyThreadState_DeleteExcept', 'PyOS_AfterFork_Child')
                 if any(f' {name} ' in frame for frame in frames)]
        if len(names) == 2:
            return True
    return False
