"""Random SIGKILLs in the middle of epochs, with a checkpoint every 3 steps.

Each seeded trial launches the resume job (tests/workers/resume.py) with
``every_n_steps=3``, SIGKILLs every rank when a drawn batch of a drawn epoch
begins (after the batch before, and its checkpoint, ended), and launches the
same command again (both through the fork server of
tests/faults/conftest.py; the references are launches of their own). The
trial passes when the kill fired (each rank left a marker just before its
SIGKILL), the relaunch resumed from a checkpoint fewer than 3 steps behind
the kill, and it ended bit-identical to the uninterrupted run. Trials
alternate between 1 and 2 processes.
"""

import os
import random

import pytest

from faultsuite import sampled
from resume_runs import run
from skorch_accel_callbacks.format import MANIFEST_NAME, batches_into_epoch
from testutil import assert_identical, final_state, read_json, read_results

pytestmark = [pytest.mark.faults, pytest.mark.slow]

# 10 trials: 6 resume inside an epoch; 20 (make test-crash): 13
TRIALS = sampled(10, 20)
EVERY_N_STEPS = 3
OPTIONS = f'{{"every_n_steps": {EVERY_N_STEPS}}}'
EPOCHS = 6
# 256 training rows in batches of 32 on each process
BATCHES = {1: 8, 2: 4}


@pytest.fixture(scope='module')
def references(tmp_path_factory):
    folder = tmp_path_factory.mktemp('mid-reference')
    for nproc in BATCHES:
        run(folder, f'ref{nproc}', nproc, dirname=f'ref{nproc}', CKPT_OPTIONS=OPTIONS)
    return folder


def forked_run(zygote, folder, tag, nproc, **env):
    """A launch of the resume job through the fork server."""
    return zygote.launch('resume.py', folder, folder / 'ckpt', tag, nproc=nproc, timeout=180,
                         grace=10.0, **env)


def one_trial(zygote, seed, folder, references):
    rng = random.Random(seed)
    nproc = 1 + seed % 2
    epoch, batch = rng.randint(1, EPOCHS), rng.randint(1, BATCHES[nproc])
    where = f"trial {seed}: {nproc} process(es), killed as batch {batch} of epoch {epoch} began"
    killed = forked_run(zygote, folder, 'killed', nproc, CKPT_OPTIONS=OPTIONS,
                        KILL=f'before:{epoch}:{batch}')
    assert killed.returncodes == [-9] * nproc, f"{where}\n{killed.report()}"
    markers = read_results(folder, 'killed-killed', nproc)
    assert markers == [{'epoch': epoch, 'batch': batch}] * nproc, where

    forked_run(zygote, folder, 'resumed', nproc, CKPT_OPTIONS=OPTIONS).check()
    resumed = read_results(folder, 'resumed', nproc)
    assert [res['num_processes'] for res in resumed] == [nproc] * nproc, where
    trained = (epoch - 1) * BATCHES[nproc] + batch - 1
    loaded = resumed[0]['loaded_from']
    if loaded is None:
        saved_steps = 0
    else:
        saved = read_json(os.path.join(loaded, MANIFEST_NAME))
        saved_steps = saved['position']['step']
    assert 0 <= trained - saved_steps < EVERY_N_STEPS, (where, loaded)
    assert_identical(final_state(references, f'ref{nproc}'), final_state(folder, 'resumed'))
    return trained - saved_steps, loaded is not None and batches_into_epoch(saved) > 0


def test_random_kills_inside_epochs_lose_less_than_a_save_interval(
        zygote, references, tmp_path, record_property):
    redone, inside = [], 0
    for seed in range(TRIALS):
        folder = tmp_path / f'trial{seed}'
        folder.mkdir()
        steps, mid_epoch = one_trial(zygote, seed, folder, references)
        redone.append(steps)
        inside += mid_epoch
    # most resumes start inside an epoch
    assert inside >= TRIALS // 2, inside
    record_property('summary', f'kills inside epochs: {TRIALS} trials, {inside} resumed inside '
                               f'an epoch, steps redone {sorted(redone)}; every trial '
                               'bit-identical to the uninterrupted one')
