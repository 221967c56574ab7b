"""What a checkpoint records so that a resume that would silently be wrong
is refused: the settings the position inside an epoch depends on, the
net's hyper-parameters, and a data fingerprint that augmentation does not
change (issue 19, items 3, 4 and 8)."""

import functools
import json
import random
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sklearn.base import clone
from skorch.callbacks import Callback
from skorch.dataset import ValidSplit

from common import FailAt, NotTrainingState, make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState, CheckpointError
from skorch_accel_callbacks.state import _fingerprint as fingerprint, data_fingerprint

# 160 rows: 128 training rows, 4 batches of 32 an epoch
N_ROWS = 160


class OptimizerSettings(NotTrainingState, Callback):
    """Records the first param group's lr and momentum at every training batch."""

    def initialize(self):
        self.seen_ = []
        return self

    def on_batch_begin(self, net, training=False, **kwargs):
        if training:
            group = net.optimizer_.param_groups[0]
            self.seen_.append((group['lr'], group['momentum']))


def build(dirname, callbacks=(), load_kwargs=None, accelerator=None, every_n_steps=None,
          **net_kwargs):
    cp = AccelerateCheckpoint(dirname=str(dirname), every_n_steps=every_n_steps, keep_last=5)
    load = AccelerateLoadInitState(cp, **(load_kwargs or {}))
    torch.manual_seed(0)
    net_kwargs.setdefault('max_epochs', 2)
    return make_net(accelerator or make_accelerator(), callbacks=[cp, load, *callbacks],
                    **net_kwargs)


def saved_inside_epoch(dirname):
    """A checkpoint at step 3 of epoch 1 (of 4 batches), then a crash."""
    net = build(dirname, callbacks=[FailAt(4)], every_n_steps=3)
    with pytest.raises(RuntimeError, match='crash'):
        net.fit(*make_data(n=N_ROWS))
    assert callback(net, 'AccelerateCheckpoint').committed() == ['epoch-0000-step-00000003']
    return dirname / 'epoch-0000-step-00000003'


def callback(net, name):
    return dict(net.callbacks_)[name]


def loaded_from(net):
    return callback(net, 'AccelerateLoadInitState').loaded_from_


def weights(net):
    return {key: value.clone() for key, value in net.module_.state_dict().items()}


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def refused_before_training(net, match, X=None, y=None):
    """Fit ``net`` and expect a refusal in on_train_begin: nothing trained
    (fit initializes the net again, from the same seed)."""
    torch.manual_seed(0)
    before = weights(net.initialize())
    if X is None:
        X, y = make_data(n=N_ROWS)
    torch.manual_seed(0)
    with pytest.raises(CheckpointError, match=match) as info:
        net.fit(X, y)
    assert_same_weights(before, weights(net))
    assert len(net.history) == 0
    return str(info.value)


# ---------------------------------------------------------------- item 3

# gradient accumulation is refused at any checkpoint (an accelerator setting)
# unless check_params names it; inside an epoch, also then
ACCUMULATION_ALLOWED = {'check_params': ('accelerator.gradient_accumulation_steps',)}


@pytest.mark.parametrize('kwargs, accelerator_kwargs, said', [
    ({'batch_size': 16}, {}, 'batch_size: 32 in the checkpoint, 16 now'),
    ({'iterator_train__batch_size': 64}, {}, 'batch_size: 32 in the checkpoint, 64 now'),
    ({'load_kwargs': ACCUMULATION_ALLOWED}, {'gradient_accumulation_steps': 3},
     'accumulation_steps: 1 in the checkpoint, 3 now'),
])
def test_a_change_that_moves_the_data_inside_an_epoch_is_refused(
        tmp_path, kwargs, accelerator_kwargs, said):
    path = saved_inside_epoch(tmp_path / 'ck')
    net = build(tmp_path / 'ck', every_n_steps=3,
                accelerator=make_accelerator(**accelerator_kwargs), **kwargs)
    message = refused_before_training(net, said)
    assert str(path) in message and 'inside an epoch, after 3 training batches' in message
    assert "checkpoint taken at an epoch's end" in message


def test_another_number_of_training_rows_inside_an_epoch_is_refused(tmp_path):
    path = saved_inside_epoch(tmp_path / 'ck')
    # other data on purpose: 160 training rows instead of 128
    trained = []
    net = build(tmp_path / 'ck', every_n_steps=3, callbacks=[StepsTaken(trained)],
                load_kwargs={'check_data': False})
    with pytest.raises(CheckpointError, match='train_rows: 128 in the checkpoint, 160 now'):
        net.fit(*make_data(n=200))
    # refused when the first epoch began: the weights are the checkpoint's
    assert trained == []
    saved = load_file(str(path / 'model.safetensors'))
    assert_same_weights(saved, weights(net))


class StepsTaken(NotTrainingState, Callback):
    def __init__(self, steps):
        self.steps = steps

    def on_batch_begin(self, net, training=False, **kwargs):
        if training:
            self.steps.append(len(net.history))


def test_an_epoch_end_checkpoint_resumes_with_a_new_batch_size(tmp_path):
    build(tmp_path / 'ck', max_epochs=1, every_n_steps=3).fit(*make_data(n=N_ROWS))
    net = build(tmp_path / 'ck', every_n_steps=3, batch_size=16)
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net).endswith('epoch-0001')
    assert [row['train_batch_count'] for row in net.history] == [4, 8]


def test_a_checkpoint_without_the_new_fields_still_resumes(tmp_path):
    # what 0.2 wrote: no params, no epoch_settings (the same format version)
    path = saved_inside_epoch(tmp_path / 'ck')
    manifest_file = path / 'manifest.json'
    saved = json.loads(manifest_file.read_text())
    assert {'params', 'epoch_settings'} <= saved.keys()
    del saved['params'], saved['epoch_settings']
    manifest_file.write_text(json.dumps(saved))
    net = build(tmp_path / 'ck', every_n_steps=3)
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net) == str(path)
    assert [row['train_batch_count'] for row in net.history] == [4, 4]


# ---------------------------------------------------------------- item 4

def test_a_hyper_parameter_loop_on_one_folder_is_refused(tmp_path):
    build(tmp_path / 'ck', lr=0.05).fit(*make_data(n=N_ROWS))
    net = build(tmp_path / 'ck', lr=0.5)
    message = refused_before_training(net, 'lr: 0.05 in the checkpoint, 0.5 now')
    assert "check_params=('lr',)" in message and 'epoch-0002' in message
    # more than one, each named; the optimizer's class by its name
    net = build(tmp_path / 'ck', lr=0.5, optimizer__momentum=0.5, iterator_train__shuffle=False,
                load_kwargs={'check_params': ('iterator_train__shuffle',)})
    message = refused_before_training(net, 'lr: 0.05 in the checkpoint, 0.5 now')
    assert 'optimizer__momentum: 0.9 in the checkpoint, 0.5 now' in message
    assert 'shuffle: ' not in message
    assert "check_params=('iterator_train__shuffle', 'lr', 'optimizer__momentum')" in message


def test_max_epochs_and_verbosity_may_change(tmp_path):
    build(tmp_path / 'ck', max_epochs=1).fit(*make_data(n=N_ROWS))
    net = build(tmp_path / 'ck', max_epochs=2, verbose=1, iterator_valid__batch_size=7)
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net).endswith('epoch-0001') and len(net.history) == 2


@pytest.mark.parametrize('check_params', [('lr',), ['lr', 'optimizer__momentum'], False])
def test_an_allowed_new_value_takes_effect(tmp_path, check_params):
    build(tmp_path / 'ck', lr=0.05, max_epochs=1).fit(*make_data(n=N_ROWS))
    settings = OptimizerSettings()
    net = build(tmp_path / 'ck', lr=0.5, callbacks=[settings],
                load_kwargs={'check_params': check_params})
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net).endswith('epoch-0001')
    # the second epoch trained with the new lr, the momentum resumed
    assert settings.seen_ == [(0.5, 0.9)] * 4
    assert net.optimizer_.param_groups[0]['lr'] == 0.5
    # a finished checkpoint trains nothing and ends with the new value too
    net = build(tmp_path / 'ck', lr=0.25, load_kwargs={'check_params': check_params})
    net.fit(*make_data(n=N_ROWS))
    assert len(net.history) == 2 and net.optimizer_.param_groups[0]['lr'] == 0.25


def test_an_allowed_optimizer_setting_takes_effect(tmp_path):
    build(tmp_path / 'ck', max_epochs=1).fit(*make_data(n=N_ROWS))
    settings = OptimizerSettings()
    net = build(tmp_path / 'ck', optimizer__momentum=0.5, callbacks=[settings],
                load_kwargs={'check_params': ('optimizer__momentum',)})
    net.fit(*make_data(n=N_ROWS))
    assert settings.seen_ == [(0.1, 0.5)] * 4


def test_parameter_values_are_described_without_addresses():
    split = ValidSplit(3)
    values = [np.float32(0.5), np.float32(0.25), torch.float16, torch.float32, split,
              ValidSplit(4), functools.partial(max, 1), float('nan'), torch.tensor([1., 2.]),
              torch.tensor([1., 3.]), torch.optim.SGD, torch.optim.Adam]
    described = [fingerprint.describe(value) for value in values]
    # JSON, the same after a round trip, and every value told apart
    assert json.loads(json.dumps(described)) == described
    assert len({json.dumps(d, sort_keys=True) for d in described}) == len(values)
    assert '0x' not in json.dumps(described)
    assert fingerprint.describe(split) == fingerprint.describe(ValidSplit(3))


@pytest.mark.parametrize('check_params', ['lr', 1, None, ('lr', 2)])
def test_bad_check_params_fail_at_initialize(tmp_path, check_params):
    net = build(tmp_path / 'ck', load_kwargs={'check_params': check_params})
    with pytest.raises(ValueError, match=re.escape(
            'check_params must be True, False or a tuple of parameter names, '
            f'got {check_params!r}')):
        net.initialize()


def test_check_params_survives_clone(tmp_path):
    net = build(tmp_path / 'ck', load_kwargs={'check_params': ('lr',)})
    load = clone(net.callbacks[1])
    assert load.check_params == ('lr',)
    copy = clone(net).initialize()
    assert dict(copy.callbacks_)['AccelerateLoadInitState'].check_params == ('lr',)


@pytest.mark.slow
def test_the_hyper_parameter_loop_is_refused_on_every_rank(run_workers, tmp_path):
    results = run_workers('compat.py', 'compat', nproc=2, args=[str(tmp_path / 'ck')])
    assert [res['num_processes'] for res in results] == [2, 2]
    messages = {res['message'] for res in results}
    assert len(messages) == 1
    message, = messages
    assert message is not None and 'lr: 0.05 in the checkpoint, 0.5 now' in message
    assert all(res['params_unchanged'] and res['history_length'] == 0 for res in results)


# ---------------------------------------------------------------- item 8

class Noisy(torch.utils.data.Dataset):
    """Rows with noise from all three global generators (augmentation)."""

    def __init__(self, X, y):
        self.X, self.y = X, y

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        noise = (0.01 * torch.randn(self.X.shape[1]) + 0.01 * np.random.randn()
                 + 0.01 * random.random())
        return torch.as_tensor(self.X[i]) + noise.float(), self.y[i]


def random_states():
    return (random.getstate(), np.random.get_state()[1].tolist(),
            torch.get_rng_state().tolist())


def test_the_fingerprint_of_noisy_data_is_stable_and_draws_nothing():
    data = Noisy(*make_data(n=N_ROWS))
    fingerprints = []
    for seed in (1, 2):
        # another launch: other random states
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        before = random_states()
        fingerprints.append(data_fingerprint(data))
        assert random_states() == before
    assert fingerprints[0] == fingerprints[1]


def test_noisy_data_resumes(tmp_path):
    data = Noisy(*make_data(n=N_ROWS))
    build(tmp_path / 'ck', max_epochs=1, train_split=None).fit(data, None)
    net = build(tmp_path / 'ck', train_split=None)
    net.fit(data, None)
    assert loaded_from(net).endswith('epoch-0001') and len(net.history) == 2
