"""Run a script in several processes on CPU, as ``torchrun`` would.

Each rank is started directly with the environment contract of
``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_PORT``, ...)
so that every rank's exit code and output can be told apart. Every launch has
a free port of its own and a deadline: a deadlock fails the test with every
rank's output instead of hanging CI.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
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
            parts.append(f"----- rank {rank} (exit {self.returncodes[rank]}) -----\n"
                         f"{out[-6000:]}")
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


def _kill(procs):
    """End the process group of each of ``procs`` still running, after it
    printed its stacks; the indexes of those that were running."""
    running = [i for i, proc in enumerate(procs) if proc.poll() is None]
    if running:
        stalled = [procs[i] for i in running]
        _signal_groups(stalled, STACKS_SIGNAL)
        time.sleep(STACKS_WAIT)
        _signal_groups(stalled, signal.SIGKILL)
    for proc in procs:
        proc.wait()
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
            killed = _kill(procs)
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
    if not result.ok and port_clash and _retries > 0:
        return launch(script, *args, nproc=nproc, nnodes=nnodes, timeout=timeout,
                      env=env, grace=grace, preexec_fn=preexec_fn,
                      _retries=_retries - 1)
    return result
