"""When AccelerateCheckpoint saves, in one process (cheap): arguments,
steps, best checkpoints, signal handlers, and data sets that cannot skip."""

import json
import os
import pickle
import signal
import warnings

import pytest
import torch
from skorch.callbacks import Callback

from checkpointed import fit
from common import CountBatches, make_accelerator, make_data, make_net
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    TrainingPreempted,
)


def manifest_of(folder):
    return json.loads((folder / 'manifest.json').read_text())


@pytest.mark.parametrize('kwargs, message', [
    ({'every_n_steps': 0}, 'every_n_steps must be None or an int >= 1'),
    ({'every_n_steps': 2.0}, 'every_n_steps must be None or an int >= 1'),
    ({'every_n_seconds': -1}, 'every_n_seconds must be None or a number of seconds'),
    ({'every_n_seconds': float('nan')}, 'every_n_seconds must be None or a number'),
    ({'save_on_signal': ('SIGKILL',)}, "entry 'SIGKILL' is not a signal that can be caught"),
    ({'save_on_signal': ('SIGNOPE',)}, "entry 'SIGNOPE'"),
    ({'save_on_signal': 15}, 'save_on_signal must be a tuple of signal names'),
    ({'keep_best': 2}, 'keep_best keeps the checkpoints that monitor marks best'),
    ({'keep_best': 0, 'monitor': 'valid_loss_best'}, 'keep_best must be None or an int'),
])
def test_bad_arguments_fail_at_initialize(kwargs, message):
    cp = AccelerateCheckpoint(dirname='unused', **kwargs)
    net = make_net(make_accelerator(), callbacks=[cp])
    with pytest.raises(ValueError, match=message):
        net.initialize()


def test_signals_are_names_or_signals():
    cp = AccelerateCheckpoint(save_on_signal=('SIGUSR1', signal.SIGTERM, 'SIGUSR1'))
    make_net(make_accelerator(), callbacks=[cp]).initialize()
    assert cp.signals_ == (signal.SIGUSR1, signal.SIGTERM)


def test_steps_are_counted_and_named_in_training_order(tmp_path):
    # 128 training rows, batches of 32: 4 steps an epoch
    net, cp, _ = fit(tmp_path / 'ck', max_epochs=3, every_n_steps=3, keep_last=10)
    assert cp.global_step_ == 12
    # step 12 is epoch 3's last batch: its end saves it
    assert cp.committed() == ['epoch-0000-step-00000003', 'epoch-0001',
                              'epoch-0001-step-00000006', 'epoch-0002',
                              'epoch-0002-step-00000009', 'epoch-0003']
    assert sorted(cp.committed()) == cp.committed()
    inside = manifest_of(tmp_path / 'ck' / 'epoch-0001-step-00000006')
    assert inside['epoch'] == 1
    assert inside['position'] == {'step': 6, 'batches': 2, 'fit_calls': [[0, 3]]}
    assert manifest_of(tmp_path / 'ck' / 'epoch-0003')['position'] == {
        'step': 12, 'batches': 0, 'fit_calls': [[0, 3]]}
    # a longer run goes on counting
    _, cp, load = fit(tmp_path / 'ck', max_epochs=4, every_n_steps=3, keep_last=10)
    assert load.loaded_from_.endswith('epoch-0003') and cp.global_step_ == 16


class Crash(Callback):
    """Fail the fit at the end of epoch ``epoch`` (before its checkpoint:
    the checkpoint runs after the net's other callbacks)."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) == self.epoch:
            raise RuntimeError('crash')


def best_at_epoch_2(net):
    return len(net.history) == 2


def test_keep_best_saves_every_epoch_and_keeps_the_best(tmp_path):
    crash = Crash(5)
    with pytest.raises(RuntimeError, match='crash'):
        fit(tmp_path / 'ck', crash, max_epochs=8, monitor=best_at_epoch_2,
            keep_best=1, keep_last=1)
    folder = tmp_path / 'ck'
    assert AccelerateCheckpoint(dirname=str(folder)).committed() == ['epoch-0002', 'epoch-0004']
    assert json.loads((folder / 'best.json').read_text()) == {'name': 'epoch-0002'}
    assert manifest_of(folder / 'epoch-0002')['best']
    assert not manifest_of(folder / 'epoch-0004')['best']
    # the epochs that did not improve are not lost
    net, _, load = fit(folder, max_epochs=6, monitor=best_at_epoch_2, keep_best=1,
                       keep_last=1)
    assert load.loaded_from_.endswith('epoch-0004') and len(net.history) == 6
    _, _, load = fit(folder, max_epochs=6, resume='best', monitor=best_at_epoch_2,
                     keep_best=1, keep_last=1)
    assert load.loaded_from_.endswith('epoch-0002')


def test_without_keep_best_the_monitor_decides(tmp_path):
    fit(tmp_path / 'ck', max_epochs=4, monitor=best_at_epoch_2)
    assert AccelerateCheckpoint(dirname=str(tmp_path / 'ck')).committed() == [
        'epoch-0002', 'epoch-0004']  # epoch 4: the end of training


class SignalAt(Callback):
    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, epoch, batch, sig):
        self.epoch, self.batch, self.sig = epoch, batch, sig

    def on_batch_end(self, net, training=False, **kwargs):
        batches = [b for b in net.history[-1]['batches'] if 'train_loss' in b]
        if training and (len(net.history), len(batches)) == (self.epoch, self.batch):
            os.kill(os.getpid(), self.sig)


def test_handlers_are_set_while_fit_runs_and_put_back(tmp_path):
    seen = []

    def users_handler(signum, frame):
        seen.append(signum)

    before = signal.signal(signal.SIGUSR1, users_handler)
    try:
        with pytest.raises(TrainingPreempted) as info:
            fit(tmp_path / 'ck', SignalAt(2, 1, signal.SIGUSR1),
                save_on_signal=('SIGUSR1',))
        # the user's handler ran too, and is back
        assert seen == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is users_handler
        assert info.value.signal == signal.SIGUSR1
        assert info.value.checkpoint.endswith('epoch-0001-step-00000005')
        assert pickle.loads(pickle.dumps(info.value)).checkpoint == info.value.checkpoint
        # a fit that ends normally puts it back too
        net, _, _ = fit(tmp_path / 'other', save_on_signal=('SIGUSR1',))
        assert signal.getsignal(signal.SIGUSR1) is users_handler
        # the preempted fit left nothing in accelerate's shared state that
        # would make a later net unpicklable
        assert pickle.loads(pickle.dumps(net)).history[-1]['epoch'] == 3
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_save_on_signal_empty_catches_nothing(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    _, cp, _ = fit(tmp_path / 'ck', max_epochs=1, save_on_signal=())
    assert cp.signals_ == () and signal.getsignal(signal.SIGTERM) is before


def test_a_callback_that_watches_signals_pickles(tmp_path):
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), every_n_seconds=60)
    net = make_net(make_accelerator(), callbacks=[cp], max_epochs=1)
    net.fit(*make_data(n=64))
    copy = pickle.loads(pickle.dumps(cp))
    assert copy.signals_ == (signal.SIGTERM,) and copy.global_step_ == cp.global_step_


class Rows(torch.utils.data.IterableDataset):
    def __iter__(self):
        X, y = make_data(n=64)
        return iter(zip(X, y, strict=True))


def test_iterable_dataset_cannot_save_inside_an_epoch(tmp_path):
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), every_n_steps=2)
    net = make_net(make_accelerator(), callbacks=[cp], train_split=None, max_epochs=1,
                   iterator_train__shuffle=False)
    with pytest.raises(ValueError, match='map-style training data set'):
        net.fit(Rows(), None)
    # a signal stops it without a checkpoint inside the epoch
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'signal'), save_on_signal=('SIGUSR1',))
    net = make_net(make_accelerator(), callbacks=[cp, SignalAt(1, 1, signal.SIGUSR1)],
                   train_split=None, max_epochs=1, iterator_train__shuffle=False)
    with pytest.raises(TrainingPreempted, match='no checkpoint could be taken') as info:
        net.fit(Rows(), None)
    assert info.value.checkpoint is None and cp.committed() == []
    # epoch-end checkpoints work with it
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ok'))
    net = make_net(make_accelerator(), callbacks=[cp], train_split=None, max_epochs=1,
                   iterator_train__shuffle=False)
    net.fit(Rows(), None)
    assert cp.committed() == ['epoch-0001']


def test_a_resume_inside_an_epoch_names_callbacks_it_cannot_vouch_for(tmp_path):
    with pytest.raises(RuntimeError, match='crash'):
        # 4 steps an epoch: step 6 is saved, the fit fails after batch 7
        fit(tmp_path / 'ck', CountBatches(fail_at=7), every_n_steps=3)
    with pytest.warns(UserWarning, match=r"taken inside an epoch; the callback\(s\) "
                                         r"'CountBatches' act on every batch"):
        net, _, load = fit(tmp_path / 'ck', CountBatches(), every_n_steps=3)
    assert load.loaded_from_.endswith('epoch-0001-step-00000006')
    # its fitted attribute came back as saved: 6 batches, then the other 6
    assert dict(net.callbacks_)['CountBatches'].seen_ == 12


def test_a_resume_inside_an_epoch_vouches_for_gradient_norm_clipping(tmp_path):
    """GradientNormClipping acts on every batch and holds no state: nothing
    to warn about (the contract fuzzer saw the warning name it)."""
    from skorch.callbacks import GradientNormClipping
    with pytest.raises(RuntimeError, match='crash'):
        fit(tmp_path / 'ck', CountBatches(fail_at=7), GradientNormClipping(1.0),
            every_n_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        _, _, load = fit(tmp_path / 'ck', CountBatches(), GradientNormClipping(1.0),
                         every_n_steps=3)
    assert load.loaded_from_.endswith('epoch-0001-step-00000006')
    unknown = [str(w.message) for w in caught if 'act on every batch' in str(w.message)]
    assert len(unknown) == 1 and "'CountBatches'" in unknown[0], unknown
    assert 'GradientNormClipping' not in unknown[0]
