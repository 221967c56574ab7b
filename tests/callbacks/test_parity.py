"""AccelerateCheckpoint and AccelerateLoadInitState wherever skorch works:
scikit-learn cloning and search, pickling, two nets on one accelerator, a
retried fit, what "finished" means, and clear errors at initialize. Each
test failed on 0.1.0. One process, in this process."""

import copy
import inspect
import os
import pickle
import threading
import warnings

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.model_selection import cross_validate
from skorch.callbacks import Callback, EarlyStopping
from skorch.exceptions import SkorchException

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    CheckpointError,
    CorruptCheckpointError,
    ParamsCheckpoint,
)
from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.engine import _state_files as state_files
from testutil import edit_manifest


def callbacks(dirname, **cp_kwargs):
    cp = AccelerateCheckpoint(dirname=str(dirname), **cp_kwargs)
    return cp, AccelerateLoadInitState(cp)


def fitted(dirname, max_epochs=2, accelerator=None, data=None, **cp_kwargs):
    cp, load = callbacks(dirname, **cp_kwargs)
    torch.manual_seed(0)
    net = make_net(accelerator or make_accelerator(), callbacks=[('acp', cp), ('load', load)],
                   max_epochs=max_epochs)
    net.fit(*(data or make_data(n=96)))
    return net


# ---------------------------------------------------------------- scikit-learn

def test_params_are_the_init_arguments_only(tmp_path):
    net = fitted(tmp_path / 'ck', async_save=True, keep_last=1)
    for name in ('acp', 'load'):
        callback = dict(net.callbacks_)[name]
        assert set(callback.get_params(deep=False)) == set(
            inspect.signature(type(callback)).parameters), name
    assert not [key for key in net.get_params() if '___' in key]


def test_clone_of_a_fitted_net_fits_and_resumes_in_its_own_folder(tmp_path):
    net = fitted(tmp_path / 'ck')
    twin = clone(net).set_params(callbacks__acp__dirname=str(tmp_path / 'twin'))
    twin.fit(*make_data(n=96))
    assert len(twin.history) == 2
    # the clone's loader holds its own copy of the checkpoint: it still
    # resumes from (and keeps) what the clone's checkpoint callback wrote
    again = clone(twin).set_params(max_epochs=3)
    again.fit(*make_data(n=96))
    loader = dict(again.callbacks_)['load']
    assert loader.loaded_from_.endswith('epoch-0002') and len(again.history) == 3
    assert os.listdir(tmp_path / 'ck')  # untouched by the clones
    assert dict(again.callbacks_)['acp'].committed()[-1] == 'epoch-0003'


def test_loader_whose_checkpoint_is_not_a_callback_of_the_net(tmp_path):
    # it would train on without saving where it resumes from: refused
    # (tests/callbacks/test_clones.py has the message)
    fitted(tmp_path / 'ck', max_epochs=2)
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))  # never initialized by a net
    net = make_net(make_accelerator(), callbacks=[AccelerateLoadInitState(cp)], max_epochs=3)
    with pytest.raises(CheckpointError, match="is not among the net's callbacks"):
        net.fit(*make_data(n=96))
    assert len(net.history) == 0


def test_two_nets_on_one_accelerator_checkpoint_their_own_modules(tmp_path):
    accelerator = make_accelerator()
    first = fitted(tmp_path / 'a', accelerator=accelerator)
    second = fitted(tmp_path / 'b', accelerator=accelerator, max_epochs=3)
    assert len(accelerate_io.models(accelerator)) == 2
    resumed = make_net(accelerator, callbacks=list(callbacks(tmp_path / 'b')), max_epochs=3)
    resumed.fit(*make_data(n=96))  # trains nothing: loads epoch 3 of `second`
    for (key, a), b in zip(second.module_.state_dict().items(),
                           resumed.module_.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    assert not torch.equal(first.module_.lin.weight, second.module_.lin.weight)


def test_cross_validation_sharing_a_folder_is_refused_not_silently_wrong(tmp_path):
    cp, load = callbacks(tmp_path / 'shared')
    net = make_net(make_accelerator(), callbacks=[('acp', cp), ('load', load)], max_epochs=2)
    X, y = make_data(n=120)
    with pytest.raises(CheckpointError, match=r"trained on other data: X\.sample is"):
        cross_validate(net, X, y, cv=2, error_score='raise')


def test_each_fold_in_its_own_folder_cross_validates(tmp_path):
    X, y = make_data(n=120)
    scores = []
    for fold, (train, test) in enumerate([(slice(0, 60), slice(60, 120)),
                                          (slice(60, 120), slice(0, 60))]):
        cp, load = callbacks(tmp_path / f'fold{fold}')
        net = make_net(make_accelerator(), callbacks=[cp, load], max_epochs=2)
        net.fit(X[train], y[train])
        scores.append(net.score(X[test], y[test]))
    assert len(scores) == 2


def test_other_training_data_is_refused_unless_asked(tmp_path):
    fitted(tmp_path / 'ck', max_epochs=1, data=make_data(n=96))
    cp, load = callbacks(tmp_path / 'ck')
    net = make_net(make_accelerator(), callbacks=[cp, load], max_epochs=2)
    with pytest.raises(CheckpointError, match=r"X\.len is 96 in the checkpoint, 80 now"):
        net.fit(*make_data(n=80))
    assert len(net.history) == 0
    load.set_params(check_data=False)
    net.fit(*make_data(n=80))
    assert load.loaded_from_.endswith('epoch-0001') and len(net.history) == 2


# ---------------------------------------------------------------- pickling

def test_fitted_net_with_every_callback_pickles_and_trains_on(tmp_path):
    net = fitted(tmp_path / 'ck', async_save=True, keep_last=1, max_epochs=3)
    X, y = make_data(n=96)
    for copied in (pickle.loads(pickle.dumps(net)), copy.deepcopy(net)):
        np.testing.assert_allclose(copied.predict_proba(X), net.predict_proba(X))
        copied.partial_fit(X, y)  # trains on, saving into the same folder
        assert len(copied.history) == 6
        assert dict(copied.callbacks_)['acp'].committed()[-1] == 'epoch-0006'


def test_f_pickle_beside_a_background_save_and_retention(tmp_path):
    """The net is pickled at every epoch while a save thread and a removal
    thread of AccelerateCheckpoint are alive."""
    cp, load = callbacks(tmp_path / 'ck', async_save=True, keep_last=1)
    params = ParamsCheckpoint(monitor=None, f_pickle='net.pkl', dirname=str(tmp_path / 'p'),
                              on_error='raise')
    net = make_net(make_accelerator(), callbacks=[cp, load, params], max_epochs=3)
    X, y = make_data(n=96)
    net.fit(X, y)
    assert all(net.history[:, 'event_cp'])
    with open(tmp_path / 'p' / 'net.pkl', 'rb') as f:
        pickled = pickle.load(f)
    assert len(pickled.history) == 3
    np.testing.assert_allclose(pickled.predict_proba(X), net.predict_proba(X))


# ---------------------------------------------------------------- a retried fit

class RaiseAtEpoch(Callback):
    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_begin(self, net, **kwargs):
        if len(net.history) == self.epoch:
            raise RuntimeError('interrupted on purpose')


def test_retry_after_a_fit_raised_during_a_background_save(tmp_path, monkeypatch):
    original = state_files.write_large_state
    fit_raised = threading.Event()

    def held(*args, **kwargs):
        # held until the fit has raised: the save is in flight then
        assert fit_raised.wait(60), "the test never let the write go on"
        return original(*args, **kwargs)

    monkeypatch.setattr(state_files, 'write_large_state', held)
    cp, load = callbacks(tmp_path / 'ck', async_save=True)
    net = make_net(make_accelerator(), max_epochs=3,
                   callbacks=[('acp', cp), ('load', load), ('raise', RaiseAtEpoch(2))])
    X, y = make_data(n=96)
    with pytest.raises(RuntimeError, match='on purpose'):
        net.fit(X, y)
    assert cp.writer_.busy()  # the save of epoch 1 is still being written
    fit_raised.set()
    net.set_params(callbacks__raise__epoch=-1)
    net.fit(X, y)  # the notebook retry
    assert load.loaded_from_.endswith('epoch-0001')
    assert len(net.history) == 3
    assert cp.committed()[-1] == 'epoch-0003'


def test_a_failed_background_save_of_the_fit_that_raised_is_reported(tmp_path, monkeypatch):
    fit_raised = threading.Event()

    def failing(*args, **kwargs):
        # fails once the fit has raised: a failure that no fit is left to raise
        assert fit_raised.wait(60), "the test never let the write go on"
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(state_files, 'write_large_state', failing)
    cp, load = callbacks(tmp_path / 'ck', async_save=True)
    net = make_net(make_accelerator(), max_epochs=3,
                   callbacks=[('acp', cp), ('load', load), ('raise', RaiseAtEpoch(2))])
    with pytest.raises(RuntimeError, match='on purpose'):
        net.fit(*make_data(n=96))
    fit_raised.set()
    with pytest.warns(UserWarning, match='written in the background failed: OSError'):
        net.initialize()


# ---------------------------------------------------------------- max_epochs, finished

class RaiseOnTrainBegin(Callback):
    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, active=True):
        self.active = active

    def on_train_begin(self, net, **kwargs):
        if self.active:
            raise RuntimeError('on_train_begin failed')


def test_max_epochs_is_the_users_after_a_fit_that_raised_before_its_first_epoch(tmp_path):
    fitted(tmp_path / 'ck', max_epochs=3)
    cp, load = callbacks(tmp_path / 'ck')
    net = make_net(make_accelerator(), max_epochs=10,
                   callbacks=[('acp', cp), ('load', load), ('boom', RaiseOnTrainBegin())])
    with pytest.raises(RuntimeError, match='on_train_begin failed'):
        net.fit(*make_data(n=96))
    net.set_params(callbacks__boom__active=False)
    assert net.max_epochs == 10
    net.fit(*make_data(n=96))
    assert len(net.history) == 10


def test_resuming_a_run_that_reached_max_epochs_trains_the_extra_epochs(tmp_path):
    for every in (1, 2, 3):
        dirname = tmp_path / f'every{every}'
        fitted(dirname, max_epochs=3, every_n_epochs=every)
        cp, load = callbacks(dirname, every_n_epochs=every)
        net = make_net(make_accelerator(), callbacks=[cp, load], max_epochs=6)
        net.fit(*make_data(n=96))
        assert load.loaded_from_.endswith('epoch-0003'), every
        assert len(net.history) == 6, every


def test_a_run_stopped_by_a_callback_stays_finished(tmp_path):
    def stopper():
        return EarlyStopping(monitor='train_loss', patience=1, threshold=10.0)

    cp, load = callbacks(tmp_path / 'ck')
    net = make_net(make_accelerator(), callbacks=[cp, load, stopper()], max_epochs=8)
    net.fit(*make_data(n=96))
    stopped_at = len(net.history)
    assert stopped_at < 8
    cp, load = callbacks(tmp_path / 'ck')
    again = make_net(make_accelerator(), callbacks=[cp, load, stopper()], max_epochs=12)
    again.fit(*make_data(n=96))
    assert len(again.history) == stopped_at


def test_a_keyboard_interrupt_inside_a_save_does_not_finish_the_run(tmp_path, monkeypatch):
    original = state_files.save_state
    calls = []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(state_files, 'save_state', interrupted_once)
    net = fitted(tmp_path / 'ck', max_epochs=6)
    assert len(net.history) == 2 and len(calls) == 3  # epoch 1, 2 (interrupted), 2 again
    monkeypatch.setattr(state_files, 'save_state', original)
    cp, load = callbacks(tmp_path / 'ck')
    again = make_net(make_accelerator(), callbacks=[cp, load], max_epochs=6)
    again.fit(*make_data(n=96))
    assert load.loaded_from_.endswith('epoch-0002') and len(again.history) == 6


# ---------------------------------------------------------------- clear errors

def test_another_optimizer_class_is_refused_before_training(tmp_path):
    fitted(tmp_path / 'ck', max_epochs=1)
    cp, load = callbacks(tmp_path / 'ck')
    net = make_net(make_accelerator(), callbacks=[cp, load], max_epochs=2,
                   optimizer=torch.optim.RMSprop)
    with pytest.raises(CheckpointError, match=r"optimizer\(s\) SGD .* the net has RMSprop"):
        net.fit(*make_data(n=96))
    assert len(net.history) == 0


@pytest.mark.parametrize('fmt', ['1', None, 1.5])
def test_a_manifest_with_a_malformed_format_version_is_a_damaged_checkpoint(tmp_path, fmt):
    fitted(tmp_path / 'ck', max_epochs=2)
    edit_manifest(tmp_path / 'ck' / 'epoch-0002', lambda m: m.update(format_version=fmt))
    cp, load = callbacks(tmp_path / 'ck')
    net = make_net(make_accelerator(), callbacks=[cp, load], max_epochs=3)
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*epoch-0002.* format_version"):
        net.fit(*make_data(n=96))
    assert load.loaded_from_.endswith('epoch-0001')
    edit_manifest(tmp_path / 'ck' / 'epoch-0002', lambda m: m.update(format_version=fmt))
    named = AccelerateCheckpoint(dirname=str(tmp_path / 'ck')).initialize()
    with pytest.raises(CorruptCheckpointError, match='format_version'):
        named.find(str(tmp_path / 'ck' / 'epoch-0002'))


@pytest.mark.parametrize('make, match', [
    (lambda: AccelerateLoadInitState('checkpoints'), 'needs an AccelerateCheckpoint'),
    (lambda: AccelerateLoadInitState(AccelerateCheckpoint(), sink=None), 'sink'),
    (lambda: AccelerateLoadInitState(AccelerateCheckpoint(), check_data='yes'), 'check_data'),
    (lambda: AccelerateCheckpoint(sink='print'), 'sink'),
    (lambda: AccelerateCheckpoint(event_name=123), 'event_name'),
    (lambda: AccelerateCheckpoint(safe_serialization='no'), 'safe_serialization'),
    (lambda: AccelerateCheckpoint(keep_last=True), 'keep_last'),
])
def test_bad_arguments_raise_at_initialize(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make().initialize()


def test_monitoring_a_score_instead_of_its_best_column_warns(tmp_path):
    with pytest.warns(UserWarning, match="Perhaps you meant to set the parameter to "
                                         "'valid_loss_best'"):
        fitted(tmp_path / 'ck', max_epochs=1, monitor='valid_loss')


def test_a_monitor_missing_from_the_history_is_one_error(tmp_path):
    with pytest.raises(SkorchException, match="monitor 'nope' is not in the history"):
        fitted(tmp_path / 'ck', max_epochs=1, monitor='nope')


def test_no_warning_for_a_clean_resume(tmp_path):
    fitted(tmp_path / 'ck', max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        fitted(tmp_path / 'ck', max_epochs=2)


def test_an_epoch_saved_again_replaces_its_folder_in_the_background(tmp_path):
    """Resumed from an older checkpoint, an epoch is saved over its old
    folder: the new one is in place when the save returns, the old one is
    removed by a thread that the end of training waits for."""
    fitted(tmp_path / 'ck', max_epochs=2, keep_last=5)
    old = (tmp_path / 'ck' / 'epoch-0002').stat().st_ino
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), keep_last=5)
    load = AccelerateLoadInitState(cp, resume=str(tmp_path / 'ck' / 'epoch-0001'))
    net = make_net(make_accelerator(), callbacks=[cp, load], max_epochs=2)
    net.fit(*make_data(n=96))
    assert load.loaded_from_.endswith('epoch-0001')
    assert cp.committed() == ['epoch-0001', 'epoch-0002']
    assert (tmp_path / 'ck' / 'epoch-0002').stat().st_ino != old
    assert sorted(os.listdir(tmp_path / 'ck')) == [
        '.lock', 'epoch-0001', 'epoch-0002', 'latest.json']
