"""Preemption for real: SIGTERM to ``torchrun``, to one worker, SIGUSR1 on
request, and time-based checkpoints.

Each preempted run must commit a checkpoint at the batch it stopped at (no
batch trained is lost), exit non-zero, and its relaunch must end
bit-identical to an uninterrupted run (no batch trained twice or skipped).
"""

import os
import subprocess
import sys

import pytest

from launcher import REPO, WORKERS
from resume_runs import run
from skorch_accel_callbacks.format import batches_into_epoch
from testutil import assert_identical, final_state, read_json, read_results

pytestmark = pytest.mark.slow


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    """The run every preempted one is compared with, in 1 and 2 processes."""
    folder = tmp_path_factory.mktemp('uninterrupted')
    return {nproc: (run(folder, f'full{nproc}', nproc, dirname=f'full{nproc}'), folder)
            for nproc in (1, 2)}


def assert_same_as_uninterrupted(uninterrupted, nproc, folder, tag):
    _, full_folder = uninterrupted[nproc]
    assert_identical(final_state(full_folder, f'full{nproc}'), final_state(folder, tag))


def assert_saved_where_it_stopped(preempted, signal_name):
    """Every rank raised TrainingPreempted for ``signal_name`` with the same
    checkpoint, which holds exactly the batches trained."""
    infos = [res['preempted'] for res in preempted]
    assert {info['signal'] for info in infos} == {signal_name}
    assert len({info['checkpoint'] for info in infos}) == 1
    assert len({tuple(info['trained']) for info in infos}) == 1
    epoch, batches = infos[0]['trained']
    saved = read_json(os.path.join(infos[0]['checkpoint'], 'manifest.json'))
    assert not saved['finished']
    if batches_into_epoch(saved):
        assert (saved['epoch'] + 1, batches_into_epoch(saved)) == (epoch, batches)
    else:  # stopped at an epoch's last batch: the epoch's end saved it
        assert saved['epoch'] == epoch
    return infos[0]['checkpoint']


@pytest.mark.parametrize('signal_name, who', [
    ('SIGTERM', 'parent'),
    # a terminal's Ctrl-C: SIGINT to torchrun's process group (its workers
    # have sessions of their own), which torchrun passes on
    ('SIGINT', 'group'),
])
def test_a_signal_to_torchrun_saves_stops_and_resumes(uninterrupted, tmp_path, signal_name,
                                                      who):
    """torchrun passes its SIGTERM or SIGINT on to every worker; they save at
    the next batch boundary and fail, so torchrun fails too."""
    env = dict(os.environ, RESULT_DIR=str(tmp_path), OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([str(WORKERS), str(REPO)]),
               SIGNAL=f'3:2:{who}:{signal_name}')
    proc = subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone',
         '--nproc_per_node', '2', str(WORKERS / 'resume.py'), str(tmp_path / 'ckpt'),
         'preempted'],
        env=env, capture_output=True, text=True, timeout=240, start_new_session=True)
    assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    preempted = read_results(tmp_path, 'preempted', 2)
    assert [res['num_processes'] for res in preempted] == [2, 2]
    checkpoint = assert_saved_where_it_stopped(preempted, signal_name)

    resumed = run(tmp_path, 'resumed', 2)
    assert all(res['loaded_from'] == checkpoint for res in resumed)
    assert [res['num_processes'] for res in resumed] == [2, 2]
    assert_same_as_uninterrupted(uninterrupted, 2, tmp_path, 'resumed')


@pytest.mark.parametrize('signal_name', [
    'SIGTERM',
    # a Ctrl-C that reaches one rank: a KeyboardInterrupt there would leave
    # the other waiting in a collective until the timeout
    'SIGINT',
])
def test_a_signal_to_one_worker_stops_both(uninterrupted, tmp_path, signal_name):
    preempted = run(tmp_path, 'preempted', 2, expect_ok=False,
                    SIGNAL=f'3:2:rank1:{signal_name}')
    assert not preempted.timed_out and all(rc != 0 for rc in preempted.returncodes), \
        preempted.report()
    results = read_results(tmp_path, 'preempted', 2)
    assert [res['num_processes'] for res in results] == [2, 2]
    checkpoint = assert_saved_where_it_stopped(results, signal_name)
    # rank 1 got it after batch 2 of epoch 3; the ranks vote every ~0.5 s
    # and at each epoch's end, so they stop in that epoch at the latest
    epoch, batches = results[0]['preempted']['trained']
    assert epoch == 3 and batches >= 2

    resumed = run(tmp_path, 'resumed', 2)
    assert all(res['loaded_from'] == checkpoint for res in resumed)
    assert_same_as_uninterrupted(uninterrupted, 2, tmp_path, 'resumed')


def test_sigusr1_when_asked(uninterrupted, tmp_path):
    options = '{"save_on_signal": ["SIGUSR1"]}'
    preempted = run(tmp_path, 'preempted', 1, expect_ok=False, SIGNAL='2:5:rank0:SIGUSR1',
                    CKPT_OPTIONS=options)
    assert preempted.returncodes == [1], preempted.report()
    checkpoint = assert_saved_where_it_stopped(
        read_results(tmp_path, 'preempted', 1), 'SIGUSR1')
    # one process: the signal is seen at the batch it came in
    assert os.path.basename(checkpoint) == 'epoch-0001-step-00000013'

    resumed = run(tmp_path, 'resumed', 1, CKPT_OPTIONS=options)
    assert resumed[0]['loaded_from'] == checkpoint
    assert_same_as_uninterrupted(uninterrupted, 1, tmp_path, 'resumed')


def test_signal_not_asked_for_is_not_caught(tmp_path):
    # SIGUSR1's default action ends the process, without a checkpoint
    killed = run(tmp_path, 'killed', 1, expect_ok=False, SIGNAL='2:5:rank0:SIGUSR1')
    assert killed.returncodes == [-10], killed.report()
    assert not (tmp_path / 'killed-rank0.json').exists()


@pytest.mark.parametrize('nproc', [1, 2])
def test_every_n_seconds_then_a_kill(uninterrupted, tmp_path, nproc):
    """A time interval shorter than a step saves at every step (in 2
    processes from the step after the first, when the vote is counted)."""
    options = '{"every_n_seconds": 0.000001}'
    killed = run(tmp_path, 'killed', nproc, expect_ok=False, KILL='batch:4:3',
                 CKPT_OPTIONS=options)
    assert killed.returncodes == [-9] * nproc, killed.report()
    started = read_results(tmp_path, 'killed-started', nproc)
    assert [res['num_processes'] for res in started] == [nproc] * nproc
    resumed = run(tmp_path, 'resumed', nproc, CKPT_OPTIONS=options)
    assert [res['num_processes'] for res in resumed] == [nproc] * nproc
    saved = read_json(os.path.join(resumed[0]['loaded_from'], 'manifest.json'))
    # killed after batch 3 of epoch 4: the last checkpoint is batch 2's
    assert (saved['epoch'], batches_into_epoch(saved)) == (3, 2)
    assert_same_as_uninterrupted(uninterrupted, nproc, tmp_path, 'resumed')
