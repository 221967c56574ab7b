"""A script of several fit calls, run again after it was interrupted in a
later call: ``fit`` (4 epochs) then ``partial_fit`` (4 more), or ``fit``
twice with ``warm_start=True``.

The relaunched script's first call loads the newest checkpoint; written by
the second call, the first trains nothing and the second goes on where the
checkpoint stands and ends where the uninterrupted script's did. Each
relaunch ends bit-identical to the uninterrupted script (parameters,
optimizer, history, optimizer steps). Before calls were recorded, the
relaunch crashed (``TypeError`` in ``on_batch_begin``) or trained 2 epochs
too many.
"""

import json
import os
import re

import pytest
import torch

from common import make_accelerator, make_data, make_net
from fit_calls import CountBatches, Interrupt, state
from launcher import launch
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    CheckpointError,
    TrainingPreempted,
)
from testutil import assert_nested_equal, read_results

# make_data()'s 256 rows, 205 of them trained on: 7 batches of 32 an epoch
# in 1 process, 4 on each of 2
LAST_BATCH = {1: 7, 2: 4}


def script(dirname, *extra, warm=False, **cp_kwargs):
    """The script, in this process: its end state and the training batches it ran."""
    cp = AccelerateCheckpoint(dirname=str(dirname), **cp_kwargs)
    counter = CountBatches()
    torch.manual_seed(0)
    net = make_net(make_accelerator(), max_epochs=4,
                   callbacks=[cp, AccelerateLoadInitState(cp), counter, *extra])
    X, y = make_data()
    net.fit(X, y)
    if warm:
        net.set_params(warm_start=True)
        net.fit(X, y)
    else:
        net.partial_fit(X, y)
    return state(net, cp), counter.trained


def assert_same_end(full, relaunched):
    """Bit-identical parameters and optimizer, the same steps and history."""
    assert len(relaunched['history']) == len(full['history']) == 8
    assert relaunched['step'] == full['step']
    assert_nested_equal(full, relaunched)


def assert_same_ends(full, relaunched):
    """:func:`assert_same_end` on every rank, each rank's own history too."""
    for a, b in zip(full, relaunched, strict=True):
        assert_same_end(a, b)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp('uninterrupted')
    return {warm: (script(folder / f'warm{warm}', warm=warm), folder / f'warm{warm}')
            for warm in (False, True)}


@pytest.mark.parametrize('warm, batch, taken', [
    # the last batch of epoch 6: the epoch's end saves and stops
    (False, 7, 'epoch-0006'),
    pytest.param(True, 7, 'epoch-0006', marks=pytest.mark.slow),
    # inside epoch 6, after its batch 3 (step 38)
    pytest.param(False, 3, 'epoch-0005-step-00000038', marks=pytest.mark.slow),
    pytest.param(True, 3, 'epoch-0005-step-00000038', marks=pytest.mark.slow),
], ids=['partial_fit-epoch_end', 'warm_start-epoch_end', 'partial_fit-inside',
        'warm_start-inside'])
def test_a_sigterm_in_the_second_call_resumes_there(uninterrupted, tmp_path, warm, batch,
                                                    taken):
    (full, _), _ = uninterrupted[warm]
    with pytest.raises(TrainingPreempted) as preempted:
        script(tmp_path / 'ck', Interrupt('sigterm', 6, batch, 'in-process'), warm=warm)
    assert os.path.basename(preempted.value.checkpoint) == taken
    relaunched, trained = script(tmp_path / 'ck', warm=warm)
    assert_same_end(full, relaunched)
    # only what the interrupted script had not trained
    assert trained == (7 - batch) + 2 * 7
    saved = json.loads((tmp_path / 'ck' / taken / 'manifest.json').read_text())
    # taken in the second call, which began after epoch 4 and ends after 8
    assert saved['position']['fit_calls'] == [[0, 4], [4, 8]]


def test_a_finished_script_run_again_trains_nothing(uninterrupted):
    (full, _), folder = uninterrupted[False]
    relaunched, trained = script(folder)
    assert trained == 0
    assert_same_end(full, relaunched)


def test_a_checkpoint_without_fit_calls_counts_as_the_first_calls(tmp_path):
    # written before the calls were recorded: resumed as before, by the first call
    script(tmp_path / 'ck')
    manifest = tmp_path / 'ck' / 'epoch-0008' / 'manifest.json'
    saved = json.loads(manifest.read_text())
    del saved['position']['fit_calls']
    manifest.write_text(json.dumps(saved))
    relaunched, trained = script(tmp_path / 'ck')
    assert trained == 4 * 7 and len(relaunched['history']) == 12


def run_script(folder, dirname, tag, nproc, expect_ok=True, **env):
    """One launch of the script on the checkpoints of ``folder/dirname``."""
    result = launch('fit_calls.py', os.path.join(folder, dirname), tag, nproc=nproc,
                    env=dict(env, RESULT_DIR=str(folder)))
    if expect_ok:
        result.check()
    return result


def end_states(folder, tag, nproc):
    return [torch.load(os.path.join(folder, f'{tag}-rank{r}.pt'), weights_only=False)
            for r in range(nproc)]


def sigkill_inside_the_second_call(folder, nproc):
    """SIGKILL on every rank inside epoch 6, the batch after a step
    checkpoint (every 3 steps), then the script again: the relaunch's rank
    results."""
    options = json.dumps({'every_n_steps': 3})
    # 1 process: step 39 after batch 4 of epoch 6; 2: step 21 after batch 1
    batch = {1: 5, 2: 2}[nproc]
    killed = run_script(folder, 'killed', 'killed', nproc, expect_ok=False,
                        INTERRUPT=f'sigkill:6:{batch}', CKPT_OPTIONS=options)
    assert killed.returncodes == [-9] * nproc, killed.report()
    assert len(read_results(folder, 'killed-killed', nproc)) == nproc
    run_script(folder, 'killed', 'after-kill', nproc, CKPT_OPTIONS=options)
    return read_results(folder, 'after-kill', nproc)


@pytest.mark.slow
def test_a_sigkill_inside_an_epoch_of_the_second_call_resumes_there(tmp_path):
    run_script(tmp_path, 'full', 'full', 1)
    resumed, = sigkill_inside_the_second_call(tmp_path, 1)
    assert resumed['num_processes'] == 1
    assert resumed['loaded_from'] == 'epoch-0005-step-00000039'
    assert resumed['trained'] == 3 + 2 * 7
    assert_same_end(end_states(tmp_path, 'full', 1)[0],
                    end_states(tmp_path, 'after-kill', 1)[0])


# make test-extended: make test resumes later fit calls in 2 processes in the
# contract's fixed examples (tests/callbacks/test_contract_fuzz.py: a SIGKILL
# inside an epoch of partial_fit, a SIGTERM in a warm start's second fit),
# and here in 1
@pytest.mark.slow
@pytest.mark.extended
def test_the_second_call_resumes_there_in_two_processes(tmp_path):
    nproc = 2
    run_script(tmp_path, 'full', 'full', nproc)
    full = end_states(tmp_path, 'full', nproc)
    # (a) SIGTERM at the end of epoch 6, in the partial_fit
    preempted = run_script(tmp_path, 'termed', 'preempted', nproc, expect_ok=False,
                           INTERRUPT=f'sigterm:6:{LAST_BATCH[nproc]}')
    assert preempted.returncodes == [3] * nproc, preempted.report()
    assert [res['preempted'] for res in read_results(tmp_path, 'preempted', nproc)] == [
        'epoch-0006'] * nproc
    run_script(tmp_path, 'termed', 'after-term', nproc)
    for res in read_results(tmp_path, 'after-term', nproc):
        assert res['num_processes'] == nproc and res['loaded_from'] == 'epoch-0006'
        assert res['trained'] == 2 * LAST_BATCH[nproc]
    assert_same_ends(full, end_states(tmp_path, 'after-term', nproc))
    # (b) SIGKILL inside epoch 6, after a step checkpoint
    for res in sigkill_inside_the_second_call(tmp_path, nproc):
        assert res['num_processes'] == nproc
        assert res['loaded_from'] == 'epoch-0005-step-00000021'
        assert res['trained'] == 3 + 2 * LAST_BATCH[nproc]
    assert_same_ends(full, end_states(tmp_path, 'after-kill', nproc))


def test_a_checkpoint_inside_an_epoch_this_fit_does_not_reach_is_refused(tmp_path):
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    torch.manual_seed(0)
    net = make_net(make_accelerator(), max_epochs=4,
                   callbacks=[cp, AccelerateLoadInitState(cp), Interrupt('sigterm', 3, 2, 'x')])
    with pytest.raises(TrainingPreempted):
        net.fit(*make_data())
    # a fit of 2 epochs ends before the epoch the checkpoint goes on in
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    net = make_net(make_accelerator(), max_epochs=2, callbacks=[cp, AccelerateLoadInitState(cp)])
    with pytest.raises(CheckpointError, match=r"taken inside epoch 3, which this fit call .*"
                                              r"raise max_epochs to 3 or more, or resume from "
                                              + re.escape(str(tmp_path / 'ck' / 'epoch-0002'))):
        net.fit(*make_data())
    cp.close()
