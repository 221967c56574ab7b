"""Checkpoints inside an epoch (``every_n_steps``) and an exact resume there.

Each case trains uninterrupted, then the same command SIGKILLed on every rank
in the middle of an epoch, after the batch that follows a step checkpoint,
and launched again unchanged: the resume skips the batches trained, goes on
in that epoch, and ends bit-identical to the uninterrupted run.
"""

import pytest

from resume_runs import run
from skorch_accel_callbacks.format import batches_into_epoch
from testutil import assert_identical, final_state, read_json

# (scenario, processes, every_n_steps, kill after batch B of epoch E,
#  the checkpoint resumed from, the batches of that epoch it had trained)
CASES = [
    # 8 batches an epoch: steps 3, 6 in epoch 1; epoch 4 holds steps 25-32
    ('basic', 1, 3, '4:5', 'epoch-0003-step-00000027', 3),
    # 4 batches an epoch on each rank: epoch 4 holds steps 13-16
    ('basic', 2, 3, '4:4', 'epoch-0003-step-00000015', 3),
    # a step every 2 batches, 2 steps an epoch: epoch 4 holds steps 7-8
    ('midepoch', 2, 1, '4:4', 'epoch-0003-step-00000007', 2),
    # 4 steps an epoch: epoch 4 holds steps 13-16, step 15 at batch 6
    ('midepoch', 1, 3, '4:7', 'epoch-0003-step-00000015', 6),
]


# make test-extended: in make test the midepoch case resumes inside an epoch
# in 2 processes, and the basic scenario does in 1
EXTENDED = [CASES[1]]


def case_param(case):
    scenario, nproc, every, kill, *_ = case
    name = f'{scenario}-{nproc}proc-every{every}-kill{kill.replace(":", "_")}'
    # one case in the quick subset (make test-quick)
    marks = [] if case is CASES[0] else [pytest.mark.slow]
    if case in EXTENDED:
        marks.append(pytest.mark.extended)
    return pytest.param(case, id=name, marks=marks)


@pytest.fixture(scope='module', params=[case_param(case) for case in CASES])
def case(request, tmp_path_factory):
    scenario, nproc, every, kill, resumed_from, batches = request.param
    folder = tmp_path_factory.mktemp(f'mid-{scenario}{nproc}')
    options = f'{{"every_n_steps": {every}}}'
    env = dict(SCENARIO=scenario, CKPT_OPTIONS=options)
    full = run(folder, 'full', nproc, dirname='full', **env)
    killed = run(folder, 'killed', nproc, expect_ok=False, KILL=f'batch:{kill}', **env)
    resumed = run(folder, 'resumed', nproc, **env)
    return dict(nproc=nproc, folder=folder, full=full, killed=killed, resumed=resumed,
                expected_from=resumed_from, batches=batches)


def test_runs_are_really_distributed(case):
    for res in case['full'] + case['resumed']:
        assert res['num_processes'] == case['nproc']


def test_the_kill_was_a_sigkill(case):
    assert case['killed'].returncodes == [-9] * case['nproc'], case['killed'].report()


def test_resumed_inside_the_epoch(case):
    for res in case['resumed']:
        assert res['loaded_from'].endswith(case['expected_from'])
    saved = read_json(f"{case['resumed'][0]['loaded_from']}/manifest.json")
    assert batches_into_epoch(saved) == case['batches']
    assert saved['epoch'] == 3 and not saved['finished']


def test_resumed_run_is_bit_identical(case):
    assert_identical(final_state(case['folder'], 'full'),
                     final_state(case['folder'], 'resumed'))
    full, resumed = case['full'][0]['history'], case['resumed'][0]['history']
    for row_full, row_resumed in zip(full, resumed, strict=True):
        # the epoch's whole count, scores over all its batches
        for key in ('train_batch_count', 'train_acc', 'event_acp'):
            assert row_full.get(key) == row_resumed.get(key), (row_full['epoch'], key)


def test_ranks_agree(case):
    assert len({res['digest'] for res in case['resumed']}) == 1
