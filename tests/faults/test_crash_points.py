"""SIGKILL at every file-system call of a save, its commit and a retirement,
enumerated, not sampled (issue 30).

One uninterrupted launch of the fault job (tests/faults/workers/faultjob.py:
3 epochs, ``keep_last=1``, so that the commit of epoch 2 retires epoch 1)
runs under ``strace -f -y``; every call that changes the checkpoint folder
(create, write, fsync, rename, unlink, mkdir, rmdir, chmod, truncate) from
the first that names ``epoch-0002`` up to the first that names
``epoch-0003``, and every removal inside the retired ``epoch-0001``, is a
crash point (tests/faults/crashpoints.py). For each, a launch of the same
job runs under ``strace -P PATH -e inject=SYSCALL:signal=SIGKILL:when=K``
and dies on entering that call; the test then asserts that

- the kill fired there: the rank died of SIGKILL, and strace's log shows
  that very call (syscall and paths) entered and never returned;
- nothing committed is lost: ``latest.json`` names a complete checkpoint,
  the newest one committed before the call (``epoch-0002`` once the rename
  of ``latest.json`` naming it is done, else ``epoch-0001``);
- a relaunch without strace resumes from exactly that checkpoint, on every
  rank, and ends bit-identical to an uninterrupted launch (parameters,
  optimizer state, losses), with no partial folder left.

In 2 processes the points of each rank's process are enumerated (rank 0
commits; rank 1 writes its own files). The launches go through a fork
server (tests/faults/workers/zygote.py) that imported torch once: each
costs seconds instead of tens of seconds on 2 busy cores; the traced
uninterrupted launch is checked bit-identical to a real launch
(tests/launcher.py), so forking changes nothing the test compares.

``make test`` runs a seeded subset (one point of each syscall kind per
process); ``make test-crash`` (marker ``crash``) every point.
"""

import os
import random

import pytest

from crashpoints import MUTATING, Zygote, describe, kinds, parse, plan, require_strace
from faultsuite import pointed, run_job
from skorch_accel_callbacks.format._manifest import PARTIAL_SUFFIX
from testutil import assert_identical, final_state, read_json

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SUBSET_SEED = 30


@pytest.fixture(scope='module')
def zygote(tmp_path_factory):
    require_strace()
    server = Zygote(tmp_path_factory.mktemp('zygote'))
    yield server
    server.close()


def traced_run(zygote, folder, nproc, reference):
    """The plan of each rank: crash points from an uninterrupted traced launch."""
    root = folder / 'ckpt'
    options = {rank: ['-f', '-qq', '-y', '-e', 'signal=none', '-o', str(folder / f'trace{rank}'),
                      '-e', 'trace=' + ','.join(MUTATING)] for rank in range(nproc)}
    zygote.launch('killable.py', folder, root, 'dry', nproc=nproc, strace=options).check()
    # the fork server and strace change nothing that the test compares
    assert_identical(final_state(reference, 'ref'), final_state(folder, 'dry'))
    return {rank: plan((folder / f'trace{rank}').read_text(), str(root))
            for rank in range(nproc)}


@pytest.fixture(scope='module')
def one_process(zygote, tmp_path_factory):
    """The 1-process reference (a real launch) and the plan of its save."""
    folder = tmp_path_factory.mktemp('crash-1proc')
    run_job('killable.py', folder, folder / 'ref-ckpt', 'ref', nproc=1).check()
    return folder, traced_run(zygote, folder, 1, folder)


@pytest.fixture(scope='module')
def two_processes(zygote, reference, tmp_path_factory):
    """The plans of both ranks' processes in 2 processes."""
    folder = tmp_path_factory.mktemp('crash-2proc')
    return reference, traced_run(zygote, folder, 2, reference)


def crash_at(zygote, point, folder, reference, nproc, rank):
    """Kill rank ``rank`` at ``point``, relaunch, check that nothing is lost."""
    ckpt = folder / 'ckpt'
    trace = folder / 'kill.trace'
    where = f"crash point {point.number} of rank {rank} in {nproc} process(es): {point.what}"
    result = zygote.launch('killable.py', folder, ckpt, 'killed', nproc=nproc, strace={
        rank: point.strace_options(str(ckpt), trace)})
    assert not result.timed_out, f"{where}: hung\n{result.report()}"
    fired = [call for call in parse(trace.read_text())
             if call.killed and describe(call, str(ckpt)) == point.what]
    assert result.returncodes[rank] == -9 and fired, \
        f"{where}: the kill did not fire there\n{trace.read_text()[-3000:]}\n{result.report()}"
    expected = str(ckpt / point.committed)
    assert pointed(ckpt) == expected, f"{where}: a committed checkpoint was lost"
    relaunch = zygote.launch('killable.py', folder, ckpt, 'relaunch', nproc=nproc, grace=10.0)
    relaunch.check()
    for other in range(nproc):
        resumed = read_json(folder / f'resumed-relaunch-rank{other}.json')
        assert (resumed['loaded_from'], resumed['num_processes']) == (expected, nproc), where
    assert_identical(final_state(reference, 'ref'), final_state(folder, 'relaunch'))
    assert not [name for name in os.listdir(ckpt) if name.endswith(PARTIAL_SUFFIX)], where


def subset(points):
    """One point of each syscall kind, drawn with a fixed seed."""
    rng = random.Random(SUBSET_SEED)
    return [rng.choice([point for point in points if point.call.name == name])
            for name in sorted(kinds(points))]


def enumerate_points(zygote, plans, reference, nproc, tmp_path, pick):
    counts = {}
    for rank, points in plans.items():
        chosen = pick(points)
        for point in chosen:
            folder = tmp_path / f'rank{rank}-point{point.number}'
            folder.mkdir()
            crash_at(zygote, point, folder, reference, nproc, rank)
        counts[rank] = (len(chosen), len(points))
    return counts


def summary(nproc, counts):
    ranks = ', '.join(f'rank {rank}: {done} of {total}'
                      for rank, (done, total) in counts.items())
    return (f'crash points, {nproc} process(es): {sum(c[0] for c in counts.values())} '
            f'file-system calls of a local save killed ({ranks}); every relaunch '
            'bit-identical, no committed checkpoint lost')


def test_subset_of_the_crash_points_of_a_save_in_1_process(zygote, one_process, tmp_path,
                                                           record_property):
    reference, plans = one_process
    counts = enumerate_points(zygote, plans, reference, 1, tmp_path, subset)
    record_property('summary', summary(1, counts) + ' (seeded subset)')


@pytest.mark.crash
def test_every_crash_point_of_a_save_in_1_process(zygote, one_process, tmp_path,
                                                  record_property):
    reference, plans = one_process
    counts = enumerate_points(zygote, plans, reference, 1, tmp_path, list)
    record_property('summary', summary(1, counts) + f'; kinds {dict(kinds(plans[0]))}')


def test_subset_of_the_crash_points_of_a_save_in_2_processes(zygote, two_processes, tmp_path,
                                                             record_property):
    reference, plans = two_processes
    counts = enumerate_points(zygote, plans, reference, 2, tmp_path, subset)
    record_property('summary', summary(2, counts) + ' (seeded subset)')


@pytest.mark.crash
def test_every_crash_point_of_a_save_in_2_processes(zygote, two_processes, tmp_path,
                                                    record_property):
    reference, plans = two_processes
    counts = enumerate_points(zygote, plans, reference, 2, tmp_path, list)
    record_property('summary', summary(2, counts))
