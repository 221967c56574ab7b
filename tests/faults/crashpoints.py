"""Helpers of the crash-point suite (tests/faults/test_crash_points.py): the
fork server's client, the parse of an ``strace -f -y`` log, and the plan
that names each file-system call of a save by what ``strace -P PATH -e
inject=SYSCALL:signal=SIGKILL:when=K`` kills there.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

from faultsuite import COLLECTIVE_TIMEOUT, WORKERS
from launcher import LaunchResult, rank_environments
from skorch_accel_callbacks.format import SHARED_FOLDER

STRACE = shutil.which('strace')

# the calls that change a folder; openat only with a flag that writes
MUTATING = ('open', 'openat', 'creat', 'write', 'writev', 'pwrite64', 'pwritev', 'pwritev2',
            'fsync', 'fdatasync', 'rename', 'renameat', 'renameat2', 'unlink', 'unlinkat',
            'mkdir', 'mkdirat', 'rmdir', 'ftruncate', 'truncate', 'link', 'linkat',
            'symlink', 'symlinkat', 'chmod', 'fchmod', 'fchmodat')
WRITING_FLAGS = ('O_CREAT', 'O_WRONLY', 'O_RDWR', 'O_TRUNC', 'O_APPEND')
# calls whose first argument is a file descriptor and the rest data, not paths
FD_CALLS = ('write', 'writev', 'pwrite64', 'pwritev', 'pwritev2', 'fsync', 'fdatasync',
            'ftruncate', 'fchmod')
# strace 6.1's -P matches a rename by its source only (seen; renameat by either)
SOURCE_ONLY = ('rename',)
# a descriptor's path as ``-y`` shows it (not the working folder of AT_FDCWD);
# a string argument
FD_PATH = r'(?<!AT_FDCWD)<([^<>]*)>'
STRING = r'"((?:[^"\\]|\\.)*)"'
# safetensors writes through a private temporary file (Rust's tempfile
# crate) whose name no option can know in advance: such a call is killed by
# its number among the main thread's calls of its kind
RANDOM_NAME = re.compile(r'/\.tmp[A-Za-z0-9]{6}$')


def require_strace():
    """Fail (never skip) where strace is missing: the suite would test nothing."""
    assert STRACE, ("the crash-point suite needs strace (Debian package strace; "
                    ".ci/run installs it as root): `apt-get install strace`")


@dataclass
class Call:
    """One system call of an strace log, in the order calls were entered."""
    tid: int
    name: str
    args: str
    killed: bool = False

    @property
    def raw_paths(self):
        """The paths ``strace -P`` matches against: string arguments as
        given and the paths of file descriptor arguments."""
        fds = re.findall(FD_PATH, self.args)
        if self.name in FD_CALLS:
            return fds[:1]
        strings = re.findall(STRING, self.args)
        # rename's source, not its target (renameat: both)
        return fds + (strings[:1] if self.name in SOURCE_ONLY else strings)

    @property
    def paths(self):
        """Every path the call names, relative names joined to their folder."""
        out, folder = [], None
        for fd, string in re.findall(f'{FD_PATH}|{STRING}', self.args):
            if fd:
                folder = fd
                out.append(fd)
            elif self.name not in FD_CALLS:
                out.append(string if string.startswith('/') or folder is None
                           else os.path.join(folder, string))
        return out[:1] if self.name in FD_CALLS else out

    @property
    def mutating(self):
        if self.name in ('open', 'openat'):
            return any(flag in self.args for flag in WRITING_FLAGS)
        return self.name in MUTATING


# strace pads a short line (a resumed call's tail, always) with spaces up to
# the column of the result; the result of an openat names the file it opened
RESULT = re.compile(r'\)\s+= ')


def _arguments(text):
    """``text`` without the call's closing parenthesis and its result."""
    results = list(RESULT.finditer(text))
    return text[:results[-1].start()] if results else text


def parse(text):
    """The calls of an ``strace -f -y -o`` log, in the order they were
    entered; ``killed`` for a call that never returned (``= ?``)."""
    calls, pending = [], {}
    for line in text.splitlines():
        # no thread id without -f
        found = re.match(r'^(?:(\d+) +)?(.*)$', line)
        tid, rest = int(found.group(1) or 0), found.group(2)
        if rest.startswith('<... '):
            call = pending.pop(tid, None)
            if call is not None:
                call.args += _arguments(rest.split('resumed>', 1)[1])
                call.killed = rest.rstrip().endswith('= ?')
            continue
        name = re.match(r'([a-z0-9_]+)\((.*)$', rest)
        if not name:
            continue
        call = Call(tid, name.group(1), name.group(2))
        if rest.endswith('<unfinished ...>'):
            call.args = call.args[:-len('<unfinished ...>')]
            pending[tid] = call
        else:
            call.killed = rest.rstrip().endswith('= ?')
            call.args = _arguments(call.args)
        calls.append(call)
    for call in pending.values():
        call.killed = True
    return calls


@dataclass
class Point:
    """A crash point: the call, what it does (for the reader), and how
    strace is told to kill there."""
    number: int
    call: Call
    what: str
    path: str | None     # ``-P`` (relative to the checkpoint folder), or None: all calls
    when: int
    committed: str       # the checkpoint latest.json names after a kill here
    occurrence: int      # how many calls read ``what`` up to this one, it included

    def landed(self, calls, root):
        """Whether the kill landed on this point in a log of ``calls``; if
        not and the call went through, its number among the calls of its
        kind in the log (what ``when`` should have been), else None."""
        same = [call for call in calls if describe(call, root) == self.what]
        if len(same) < self.occurrence:
            return False, None
        target = same[self.occurrence - 1]
        if target.killed:
            return True, None
        return False, [call for call in calls if call.name == self.call.name].index(target) + 1

    def strace_options(self, root, trace, when=None):
        # without -f, only the main thread is traced and counted
        follow = ['-f'] if self.path is not None else []
        options = [*follow, '-qq', '-y', '-e', 'signal=none', '-o', str(trace),
                   '-e', f'trace={self.call.name}',
                   '-e', f'inject={self.call.name}:signal=SIGKILL:when={when or self.when}']
        if self.path is not None:
            options += ['-P', os.path.join(root, self.path) if self.path else root]
        return options


def relative(path, root):
    return '' if path == root else os.path.relpath(path, root)


def describe(call, root):
    """The call with its paths relative to ``root``, random names masked."""
    paths = [RANDOM_NAME.sub('/.tmpXXXXXX', relative(path, root) and '/' + relative(path, root))
             for path in call.paths]
    return f"{call.name}({', '.join(path.lstrip('/') or '.' for path in paths)})"


def first_to_reach(calls, index, matches):
    """The number K such that the K-th call of ``calls[index]``'s kind
    matching ``matches``, counted per thread as strace counts, is first
    reached at ``index``; None if another thread reaches its K-th earlier."""
    target = calls[index]
    k = sum(1 for call in calls[:index + 1]
            if call.tid == target.tid and call.name == target.name and matches(call))
    counts = Counter()
    for position, call in enumerate(calls):
        if call.name == target.name and matches(call):
            counts[call.tid] += 1
            if counts[call.tid] == k:
                return k if position == index else None
    return None


def selector(calls, index, root):
    """``(path, K)`` for ``strace -f -P path ... when=K`` killing at exactly
    ``calls[index]``: a path of its own if one is known in advance, else
    ``(None, K)``: the K-th call of its kind in the main thread, which
    strace counts alone when it does not follow threads (-f counts each
    thread's calls, and gloo's threads write to their sockets at their pace)."""
    call = calls[index]
    for path in call.raw_paths:
        if (path == root or path.startswith(root + '/')) and not RANDOM_NAME.search(path):
            k = first_to_reach(calls, index, lambda other, path=path: path in other.raw_paths)
            if k is not None:
                return relative(path, root), k
    # the first traced call is the main thread's: it was the only one at attach
    main = calls[0].tid
    k = first_to_reach(calls, index, lambda other: other.tid == main)
    if call.tid != main or k is None:
        raise AssertionError(f"no strace selector kills at {describe(call, root)} alone")
    return None, k


def under(call, root):
    return any(path == root or path.startswith(root + '/') for path in call.paths)


def save_window(calls, root, epoch):
    """Indices of the mutating calls under ``root`` from the first that
    names checkpoint ``epoch`` (its save) up to the first that names the
    next one, and those inside the folder it retires (named ``.discard-``),
    wherever they fall."""
    name, following = f'epoch-{epoch:04d}', f'epoch-{epoch + 1:04d}'
    retired = f'.epoch-{epoch - 1:04d}.discard-'
    mine = [i for i, call in enumerate(calls) if call.mutating and under(call, root)]
    start = next(i for i in mine if any(name in path for path in calls[i].paths))
    end = next((i for i in mine if any(following in path for path in calls[i].paths)),
               len(calls))
    return [i for i in mine if start <= i < end
            or any(retired in path for path in calls[i].paths)]


def plan(trace_text, root, epoch=2):
    """The crash points of the save of checkpoint ``epoch``, its commit and
    the retirement of the one before, from the log of an uninterrupted
    traced launch in ``root``."""
    calls = parse(trace_text)
    window = save_window(calls, root, epoch)
    latest = os.path.join(root, 'latest.json')
    commits = [i for i in window if calls[i].name.startswith('rename')
               and calls[i].paths[-1:] == [latest]]
    points = []
    for number, index in enumerate(window, 1):
        path, when = selector(calls, index, root)
        committed = epoch if commits and index > commits[0] else epoch - 1
        what = describe(calls[index], root)
        occurrence = sum(describe(call, root) == what for call in calls[:index + 1])
        points.append(Point(number, calls[index], what, path, when, f'epoch-{committed:04d}',
                            occurrence))
    return points


def kinds(points):
    return Counter(point.call.name for point in points)


class Zygote:
    """The fork server (tests/faults/workers/zygote.py) and its launches."""

    def __init__(self, folder):
        self.folder = folder
        self.log = open(folder / 'zygote.log', 'wb')
        env = rank_environments(1)[0]
        self.process = subprocess.Popen(
            [sys.executable, str(WORKERS / 'zygote.py')], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)

    def warm_up(self):
        """One launch, untraced: modules that the first launch loads lazily
        stay loaded here, so that the traced launches after it (the plan's
        and the kills') open the same files."""
        folder = self.folder / 'warm-up'
        folder.mkdir()
        self.launch('killable.py', folder, folder / 'ckpt', 'warm-up').check()

    def launch(self, script, folder, dirname, tag, *, nproc=1, timeout=120, grace=1.0,
               strace=None, **env):
        """Like faultsuite.run_job, through the fork server; ``strace`` maps
        a rank to its strace options (``-p`` added here)."""
        env = dict(env, RESULT_DIR=str(folder))
        env.setdefault('COLLECTIVE_TIMEOUT', str(COLLECTIVE_TIMEOUT))
        command = {'script': script, 'args': [str(dirname), tag], 'nproc': nproc,
                   'env': rank_environments(nproc, env=env), 'timeout': timeout,
                   'grace': grace, 'logs': str(folder / f'log-{tag}'),
                   'pid_files': str(folder / f'pid-{tag}'),
                   'strace': {str(rank): options for rank, options in (strace or {}).items()}}
        self.process.stdin.write(json.dumps(command) + '\n')
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the fork server died: {(self.folder / 'zygote.log').read_text()}"
        answer = json.loads(line)
        return LaunchResult(answer['returncodes'], answer['outputs'], answer['timed_out'],
                            answer['duration'], [script, str(dirname), tag])

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=30)
        self.log.close()


def request_what(line, run, checkpoint):
    """A request's method and key, the bucket and the run's folder ``run``
    left out; the files of ``checkpoint`` (sent side by side, in any order)
    as one."""
    method, target = line.decode().split(' ')[:2]
    target = re.sub(r'^/[^/?]+', '', target)
    target = target.replace(f'/{run}/', '/', 1).replace(f'prefix={run}%2F', 'prefix=')
    target = target.lstrip('/')
    name = target.rsplit('/', 1)[-1]
    # a frozen part sent into the shared folder goes with the checkpoint's files
    if method == 'PUT' and target.startswith(f'{SHARED_FOLDER}/'):
        target = f'{checkpoint}/{name}'
    if f'{checkpoint}/' in target and name != 'manifest.json' and method == 'PUT':
        target = target.replace(name, '<file>')
    return f'{method} {target}'


def upload_points(counted, run, epoch=2):
    """``(number, what, committed)`` for each request of the upload of
    checkpoint ``epoch``, its commit and the retirement of the one before,
    from the requests counted after the commit of ``epoch - 1`` (from the
    first, for epoch 1) up to the first naming ``epoch + 1``: ``committed``
    is the checkpoint that must be committed once the store has done that
    request (None: none yet)."""
    name, following = f'epoch-{epoch:04d}', f'epoch-{epoch + 1:04d}'.encode()
    end = next(i for i, line in enumerate(counted) if following in line)
    whats = [request_what(line, run, name) for line in counted[:end]]
    pointer = whats.index('PUT latest.json') + 1
    before = f'epoch-{epoch - 1:04d}' if epoch > 1 else None
    return [(number, what, name if number >= pointer else before)
            for number, what in enumerate(whats, 1)]


class KillAtRequest:
    """The proxy's ``on_request``: counts the requests after the PUT of the
    ``skip``-th ``latest.json`` and SIGKILLs the job once the store has
    answered the ``number``-th (before the job sees the answer); records
    every request it counts."""

    def __init__(self, pid_file, skip, number=None):
        self.pid_file, self.skip, self.number = pid_file, skip, number
        self.pointers = 0
        self.counted = []
        self.fired = None

    def __call__(self, line):
        if self.pointers < self.skip:
            self.pointers += line.startswith(b'PUT ') and b'/latest.json ' in line
            return None
        self.counted.append(line)
        if len(self.counted) != self.number:
            return None
        return lambda: self.kill(line)

    def kill(self, line):
        self.fired = line
        os.kill(int(open(self.pid_file).read()), 9)


class KillAtNth(KillAtRequest):
    """The proxy's ``on_request``: SIGKILLs the job once the store has
    answered the ``occurrence``-th request that :func:`request_what` names
    ``what``, the files of ``checkpoint`` named as in ``run`` (s3fs sends a
    checkpoint's files side by side, so a request's number among all of
    them varies from launch to launch; its number among those alike does
    not)."""

    def __init__(self, pid_file, run, checkpoint, what, occurrence):
        super().__init__(pid_file, skip=0)
        self.run, self.checkpoint = run, checkpoint
        self.what, self.occurrence = what, occurrence

    def __call__(self, line):
        if request_what(line, self.run, self.checkpoint) != self.what:
            return None
        self.counted.append(line)
        if len(self.counted) != self.occurrence:
            return None
        return lambda: self.kill(line)
