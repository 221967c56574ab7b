"""A fork server for the crash-point suite (tests/faults/test_crash_points.py).

usage: zygote.py (reads one JSON command a line on stdin, answers one JSON
line on stdout)

The suite launches the fault job a few hundred times; importing torch,
accelerate and skorch takes most of each launch's 5 to 20 s on 2 busy cores.
This process imports them once; each launch is a ``fork`` of it that runs
a worker's ``main()`` with the launch's argv and environment, as
``tests/support/launcher.py`` would start it (one process a rank, ``RANK``,
``WORLD_SIZE``, ``MASTER_PORT``, ... set; its own session; output to a
file). The parent never trains, never initialises a process group, and
starts no thread, so every child starts from the state of a fresh
interpreter that imported the same modules.

A command: ``{"script": "killable.py", "args": [...], "env": {...},
"nproc": 1, "timeout": 120, "grace": 1.0, "pid_files": "<prefix>",
"strace": {"<rank>": [strace options], ...}}``. A rank named in
``strace`` is attached with ``strace -p`` (options and ``-o`` given by
the caller) before it runs a line of the worker, and its ``uuid.uuid4``
is seeded, so that the hidden names the package draws
(``.latest.json.tmp-<hex>``, ``.epoch-0001.discard-<hex>``) are the same in
every traced launch and ``strace -P`` can name them. The answer: the exit
code of each rank (``-9`` for a SIGKILL), each rank's output, whether the
launch ran past its timeout, its duration.
"""

import importlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid

# what the workers import, once, here
import accelerate  # noqa: F401
import s3fs  # noqa: F401
import skorch  # noqa: F401
import torch  # noqa: F401

import killable  # noqa: F401
import upload_killable  # noqa: F401


def seed_uuid4(seed):
    rng = random.Random(seed)
    uuid.uuid4 = lambda: uuid.UUID(int=rng.getrandbits(128), version=4)


def child(command, rank, go, log):
    """Run the worker as rank ``rank``; never returns."""
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(command['env'][rank])
    # read again from TMPDIR (a test's own): staging folders live there
    tempfile.tempdir = None
    script = command['script']
    sys.argv = [script, *command['args']]
    if go is not None:
        # the tracer attaches while this read blocks; nothing before it is traced
        os.read(go, 1)
        seed_uuid4(0)
    code = 0
    try:
        importlib.import_module(script[:-len('.py')]).main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # pylint: disable=broad-except
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def traced(pid):
    """Whether a tracer is attached to ``pid``."""
    with open(f'/proc/{pid}/status') as f:
        return any(line.startswith('TracerPid:') and line.split()[1] != '0' for line in f)


def attach(pid, options, go, deadline):
    """Start ``strace -p pid`` and let the child go once it is attached."""
    tracer = subprocess.Popen(['strace', *options, '-p', str(pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    while not traced(pid):
        if tracer.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"strace did not attach to {pid}: "
                               f"{tracer.stderr.read().decode(errors='replace')}")
        time.sleep(0.01)
    os.write(go, b'g')
    return tracer


def wait(pids, deadline, grace):
    """Exit codes of ``pids`` (``-signal`` for a signal); kills every
    process group left ``grace`` s after the first failure or at the deadline."""
    codes, first_failure, timed_out = {}, None, False
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = (-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                              else os.WEXITSTATUS(status))
                if codes[pid] != 0 and first_failure is None:
                    first_failure = time.monotonic()
        now = time.monotonic()
        timed_out = timed_out or now > deadline
        if timed_out or (first_failure is not None and now > first_failure + grace):
            for pid in pids:
                if pid not in codes:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        time.sleep(0.02)
    return [codes[pid] for pid in pids], timed_out


def launch(command):
    start = time.monotonic()
    deadline = start + command['timeout']
    pids, logs, tracers = [], [], []
    for rank in range(command['nproc']):
        log_path = f"{command['logs']}-rank{rank}.log"
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        options = command.get('strace', {}).get(str(rank))
        read_end, go = os.pipe() if options else (None, None)
        pid = os.fork()
        if pid == 0:
            child(command, rank, read_end, log)
        os.close(log)
        pids.append(pid)
        logs.append(log_path)
        with open(f"{command['pid_files']}-rank{rank}", 'w') as f:
            f.write(str(pid))
        if options:
            os.close(read_end)
            tracers.append(attach(pid, options, go, deadline))
            os.close(go)
    codes, timed_out = wait(pids, deadline, command['grace'])
    for tracer in tracers:
        # strace ends with its tracee
        tracer.wait(timeout=30)
    outputs = []
    for path in logs:
        with open(path, errors='replace') as f:
            outputs.append(f.read())
        os.remove(path)
    return {'returncodes': codes, 'outputs': outputs, 'timed_out': timed_out,
            'duration': time.monotonic() - start}


def main():
    for line in sys.stdin:
        answer = launch(json.loads(line))
        sys.stdout.write(json.dumps(answer) + '\n')
        sys.stdout.flush()


if __name__ == '__main__':
    main()
