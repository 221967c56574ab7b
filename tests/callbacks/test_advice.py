"""Advice that works, and what retention keeps for it.

A refusal to continue a checkpoint taken inside an epoch (another batch
size) advises a checkpoint of an epoch's end: it names one that exists, by
its path or URL, and resuming that one with the new setting works;
retention keeps the newest epoch-end checkpoint while step checkpoints
rotate, in a folder and in a store; with none, the advice says what to do,
and doing it works. Also: ``load_params(checkpoint=...)`` warns once about
a damaged newest checkpoint, and the checkpoint a fit resumed from is
retired once that fit is over.
"""

import functools
import os
import re
import warnings

import fsspec
import pytest
from skorch import NeuralNetClassifier

import checkpointed
from common import MLP, make_data
from fit_calls import Interrupt
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    CheckpointError,
    TrainingPreempted,
)

# 256 rows, 205 trained on: 7 batches of 32 an epoch, 13 of 16


fit = functools.partial(checkpointed.fit, data=make_data())


def preempt_inside_epoch(dirname, epoch, batch, **cp_kwargs):
    """SIGTERM after batch ``batch`` of epoch ``epoch``: saved there."""
    with pytest.raises(TrainingPreempted) as preempted:
        fit(dirname, Interrupt('sigterm', epoch, batch, 'advice'), **cp_kwargs)
    return os.path.basename(preempted.value.checkpoint)


def advised(error):
    """The checkpoint a refusal advises, by path or URL, and its name."""
    match = re.search(r"resume from (\S+), taken at an epoch's end: pass "
                      r"resume='([^']+)'", str(error))
    assert match, str(error)
    return match.groups()


def test_a_refused_batch_size_names_an_epoch_end_checkpoint_that_exists(tmp_path):
    dirname = tmp_path / 'ck'
    # steps 15 and 18 inside epoch 3, then 19 at its batch 5: the step
    # checkpoints rotated epoch-0002 (step 14) out of keep_last=2
    assert preempt_inside_epoch(dirname, 3, 5, every_n_steps=3) == 'epoch-0002-step-00000019'
    with pytest.raises(CheckpointError, match='batch_size') as refused:
        fit(dirname, net_kwargs={'batch_size': 16}, every_n_steps=3)
    path, name = advised(refused.value)
    assert (path, name) == (str(dirname / 'epoch-0002'), 'epoch-0002')
    assert os.path.isfile(os.path.join(path, 'manifest.json'))
    # the advice works: the epoch-end checkpoint resumes with the new batch size
    net, _, load = fit(dirname, net_kwargs={'batch_size': 16}, resume=name, every_n_steps=3)
    assert load.loaded_from_ == path and len(net.history) == 3
    assert net.history[-1, 'train_batch_count'] == 13


def test_retention_keeps_the_newest_epoch_end_checkpoint(tmp_path):
    _, cp, _ = fit(tmp_path / 'ck', max_epochs=2, every_n_steps=3, keep_last=2)
    # steps 9 and 12 of epoch 2 rotated out; epoch 1's end (step 7) went
    # when epoch 2's end came
    assert cp.committed() == ['epoch-0001-step-00000012', 'epoch-0002']
    preempt_inside_epoch(tmp_path / 'cut', 2, 6, every_n_steps=3, keep_last=2)
    assert AccelerateCheckpoint(str(tmp_path / 'cut')).committed() == [
        'epoch-0001', 'epoch-0001-step-00000012', 'epoch-0001-step-00000013']


def test_without_an_epoch_end_checkpoint_the_advice_says_what_to_do(tmp_path):
    dirname = tmp_path / 'ck'
    assert preempt_inside_epoch(dirname, 1, 4, every_n_steps=3) == 'epoch-0000-step-00000004'
    with pytest.raises(CheckpointError, match='batch_size') as refused:
        fit(dirname, net_kwargs={'batch_size': 16}, every_n_steps=3)
    assert ("there is no checkpoint taken at an epoch's end to resume instead: resume it "
            "as it was saved, with max_epochs=1") in str(refused.value)
    # doing so saves the end of epoch 1, which the new batch size resumes
    fit(dirname, max_epochs=1, every_n_steps=3)
    net, _, load = fit(dirname, net_kwargs={'batch_size': 16}, every_n_steps=3)
    assert load.loaded_from_.endswith('epoch-0001') and len(net.history) == 3


@pytest.mark.slow
def test_a_store_keeps_and_advises_its_newest_epoch_end_checkpoint(s3_bucket, tmp_path):
    url = f's3://{s3_bucket}/run'
    options = dict(every_n_steps=3, local_dir=str(tmp_path / 'staging'))
    preempt_inside_epoch(url, 3, 5, **options)
    fs = fsspec.filesystem('s3')
    fs.invalidate_cache()
    assert fs.exists(f'{s3_bucket}/run/epoch-0002/manifest.json')
    with pytest.raises(CheckpointError, match='batch_size') as refused:
        fit(url, net_kwargs={'batch_size': 16}, **options)
    path, name = advised(refused.value)
    assert (path, name) == (f'{url}/epoch-0002', 'epoch-0002')
    net, _, load = fit(url, net_kwargs={'batch_size': 16}, resume=name, **options)
    assert load.loaded_from_ == path and len(net.history) == 3


def damage(folder):
    """One byte more in the model file: its size is not the listed one."""
    with open(os.path.join(folder, 'model.safetensors'), 'ab') as f:
        f.write(b'\0')


def test_load_params_warns_once_about_a_damaged_newest_checkpoint(tmp_path):
    _, cp, _ = fit(tmp_path / 'ck', max_epochs=2)
    damage(tmp_path / 'ck' / 'epoch-0002')
    net = NeuralNetClassifier(MLP).initialize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        net.load_params(checkpoint=AccelerateCheckpoint(str(tmp_path / 'ck')))
    skipped = [w for w in caught if 'skipping checkpoint' in str(w.message)]
    assert len(skipped) == 1 and 'epoch-0002' in str(skipped[0].message)
    # epoch 1's model and history
    assert len(net.history) == 1


def test_the_checkpoint_resumed_from_is_retired_after_that_fit(tmp_path):
    dirname = tmp_path / 'ck'
    fit(dirname, max_epochs=4, keep_last=1)
    # kept while the fit that resumed from it runs
    net, cp, _ = fit(dirname, max_epochs=6, keep_last=1, resume='epoch-0004')
    assert cp.committed() == ['epoch-0004', 'epoch-0006']
    net.set_params(max_epochs=2)
    net.partial_fit(*make_data())
    assert cp.committed() == ['epoch-0008']
