"""Resuming on another number of processes: refused by default, or with
``on_world_size_change='reseed'`` the saved state loaded exactly and new
random states derived, the same at every resume on that many processes.

The launched case goes 2 processes -> 1 -> 2, each resume done twice from
copies of the same checkpoint.
"""

import shutil

import pytest
import torch
from skorch.callbacks import Callback

import checkpointed
from common import NotTrainingState, make_accelerator, make_net
from resume_runs import run
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState, CheckpointError
from testutil import assert_identical, edit_manifest, final_state, read_results

RESEED = '{"on_world_size_change": "reseed"}'


class FirstEpochState(NotTrainingState, Callback):
    """The parameters and the global torch random state that the first epoch
    of a fit begins with (after the resume callback restored them)."""

    def initialize(self):
        self.params_ = None
        self.rng_ = None
        return self

    def on_epoch_begin(self, net, **kwargs):
        if self.params_ is None:
            self.params_ = {k: v.clone() for k, v in net.module_.state_dict().items()}
            self.rng_ = torch.get_rng_state()


def fit(dirname, max_epochs, **load_kwargs):
    """The net and its :class:`FirstEpochState`."""
    first = FirstEpochState()
    net, _, _ = checkpointed.fit(dirname, first, max_epochs=max_epochs, load_kwargs=load_kwargs)
    return net, first


def losses(net):
    return [(row['train_loss'], row['valid_loss']) for row in net.history]


# ---------------------------------------------------------------- in process

def test_world_size_change_is_validated_at_initialize():
    cp = AccelerateCheckpoint(dirname='unused')
    net = make_net(make_accelerator(),
                   callbacks=[cp, AccelerateLoadInitState(cp, on_world_size_change='ignore')])
    with pytest.raises(ValueError, match="on_world_size_change must be one of"):
        net.initialize()


def test_reseed_resumes_a_checkpoint_of_2_processes_in_1(tmp_path):
    """A one-process checkpoint whose manifest says 2 processes stands in for
    one written by 2 (rank 0's files are what a reseed reads)."""
    saved, _ = fit(tmp_path / 'ck', max_epochs=2)
    edit_manifest(tmp_path / 'ck' / 'epoch-0002', world_size=2)
    for copy in ('a', 'b', 'exact'):
        shutil.copytree(tmp_path / 'ck', tmp_path / copy)
    edit_manifest(tmp_path / 'exact' / 'epoch-0002', world_size=1)

    with pytest.raises(CheckpointError, match=r"written by 2 processes, this run has 1.*"
                                              r"on_world_size_change='reseed'"):
        fit(tmp_path / 'ck', max_epochs=4)

    resumed = []
    for copy in ('a', 'b'):
        with pytest.warns(UserWarning, match="written by 2 processes, this run has 1.*"
                                             "statistically, not bitwise"):
            resumed.append(fit(tmp_path / copy, max_epochs=4, on_world_size_change='reseed'))
    exact = fit(tmp_path / 'exact', max_epochs=4, on_world_size_change='reseed')

    (a, first_a), (b, first_b), (e, first_e) = resumed + [exact]
    for net, first in (resumed[0], resumed[1], exact):
        assert losses(net)[:2] == losses(saved)
        for key, tensor in saved.module_.state_dict().items():
            assert torch.equal(first.params_[key], tensor), key
    # two resumes on one process draw the same numbers and end identical
    assert torch.equal(first_a.rng_, first_b.rng_)
    assert losses(a) == losses(b)
    for key, tensor in a.module_.state_dict().items():
        assert torch.equal(tensor, b.module_.state_dict()[key]), key
    # ... which are not the saved rank 0's: the exact resume restores those
    assert not torch.equal(first_a.rng_, first_e.rng_)
    assert losses(a)[2:] != losses(e)[2:]


# ---------------------------------------------------------------- launched

def resume_twice(folder, source, tag, nproc, max_epochs):
    """Resume copies of checkpoint folder ``source`` twice with reseeding."""
    results = []
    for copy in ('1', '2'):
        shutil.copytree(folder / source, folder / f'{tag}{copy}')
        results.append(run(folder, f'{tag}{copy}', nproc, dirname=f'{tag}{copy}',
                           LOAD_OPTIONS=RESEED, MAX_EPOCHS=str(max_epochs)))
    return results


@pytest.mark.slow
def test_a_checkpoint_inside_an_epoch_on_another_number_of_processes(tmp_path):
    """2 processes, 4 batches an epoch each, a checkpoint every 3 steps,
    killed after batch 4 of epoch 4: its last checkpoint is 3 batches into
    epoch 4. One process resumes it 6 of its 8 batches into that epoch."""
    killed = run(tmp_path, 'killed', 2, expect_ok=False, dirname='two',
                 CKPT_OPTIONS='{"every_n_steps": 3}', KILL='batch:4:4')
    assert killed.returncodes == [-9, -9], killed.report()
    started = read_results(tmp_path, 'killed-started', 2)
    assert [res['num_processes'] for res in started] == [2, 2]
    ones = resume_twice(tmp_path, 'two', 'one', 1, max_epochs=6)
    for (res,) in ones:
        assert res['num_processes'] == 1
        assert res['loaded_from'].endswith('epoch-0003-step-00000015')
        epoch4 = res['history'][3]
        assert epoch4['epoch'] == 4 and epoch4['train_batch_count'] == 8
    assert ones[0][0]['at_resume'] == ones[1][0]['at_resume']
    assert_identical(final_state(tmp_path, 'one1'), final_state(tmp_path, 'one2'))


@pytest.mark.slow
def test_two_processes_to_one_and_back_to_two(tmp_path):
    first = run(tmp_path, 'two', 2, dirname='two', MAX_EPOCHS='2')
    assert [res['num_processes'] for res in first] == [2, 2]

    refused = run(tmp_path, 'refused', 1, expect_ok=False, dirname='two', MAX_EPOCHS='4')
    assert refused.returncodes != [0]
    assert "on_world_size_change='reseed'" in refused.outputs[0], refused.report()

    # 2 -> 1, twice
    ones = resume_twice(tmp_path, 'two', 'one', 1, max_epochs=4)
    for (res,) in ones:
        assert res['num_processes'] == 1
        assert res['loaded_from'].endswith('epoch-0002')
    [saved, _] = final_state(tmp_path, 'two')
    for tag in ('one1', 'one2'):
        # model, optimizer and history loaded exactly
        assert_identical(final_state(tmp_path, f'{tag}-resumed')[0], saved)
    assert ones[0][0]['at_resume'] == ones[1][0]['at_resume']
    assert_identical(final_state(tmp_path, 'one1'), final_state(tmp_path, 'one2'))

    # 1 -> 2, twice, from the first 1-process run's checkpoints
    twos = resume_twice(tmp_path, 'one1', 'again', 2, max_epochs=6)
    for ranks in twos:
        assert [res['num_processes'] for res in ranks] == [2, 2]
        assert all(res['loaded_from'].endswith('epoch-0004') for res in ranks)
        rng = [res['at_resume'] for res in ranks]
        # every rank its own random state, one shuffling order for all
        assert rng[0]['torch'] != rng[1]['torch'] and rng[0]['numpy'] != rng[1]['numpy']
        assert rng[0]['loader'] is not None and rng[0]['loader'] == rng[1]['loader']
        assert len({res['digest'] for res in ranks}) == 1
    assert [res['at_resume'] for res in twos[0]] == [res['at_resume'] for res in twos[1]]
    [one] = final_state(tmp_path, 'one1')
    for tag in ('again1', 'again2'):
        assert_identical(final_state(tmp_path, f'{tag}-resumed')[0], one)
    assert_identical(final_state(tmp_path, 'again1'), final_state(tmp_path, 'again2'))
    history = final_state(tmp_path, 'again1')[0]['history']
    assert [row['epoch'] for row in history] == [1, 2, 3, 4, 5, 6]
    assert history[:4] == one['history']
    # the run saved its checkpoints as a 2-process run, resumable exactly
    written = read_results(tmp_path, 'again1', 2)[0]['committed']
    assert written[-1] == 'epoch-0006'
