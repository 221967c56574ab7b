"""A training's life around its checkpoints on ordinary paths: a Ctrl-C, a
callback's own stop, ``partial_fit``, a failed fit, a signal during the end
of training, a resumed epoch's duration. Each test failed before these
were fixed; those that need processes run in 1 and 2, launched."""

import functools
import json
import os
import signal
import time

import pytest
import torch
from sklearn.base import clone
from skorch.callbacks import Callback

import checkpointed
from common import NotTrainingState, make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState, TrainingPreempted
from skorch_accel_callbacks.callbacks._triggers import STOPPED_EARLY
from skorch_accel_callbacks.tools import cli

DATA = dict(n=96)


fit = functools.partial(checkpointed.fit, data=make_data(**DATA))


def manifest_of(folder):
    return json.loads((folder / 'manifest.json').read_text())


def params(net):
    return {key: value.clone() for key, value in net.module_.state_dict().items()}


def assert_same_params(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ---------------------------------------------------------------- Ctrl-C or a decision

class SigintAtEpochEnd(NotTrainingState, Callback):
    """A real Ctrl-C while this callback ends epoch ``epoch``: SIGINT to this
    process, which Python turns into a KeyboardInterrupt right here."""

    def __init__(self, epoch):
        self.epoch = epoch

    def initialize(self):
        self.sent_ = False
        return self

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) == self.epoch:
            self.sent_ = True
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the KeyboardInterrupt comes before this ends
            raise AssertionError("SIGINT did not interrupt")


class RaiseAtEpochEnd(NotTrainingState, Callback):
    """A bare KeyboardInterrupt in this callback's end of epoch ``epoch``,
    optionally after recording the decision to stop."""

    def __init__(self, epoch, decided=False):
        self.epoch = epoch
        self.decided = decided

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) == self.epoch:
            if self.decided:
                net.history.record(STOPPED_EARLY, True)
            raise KeyboardInterrupt


@pytest.mark.parametrize('interrupt', [SigintAtEpochEnd, RaiseAtEpochEnd])
def test_a_ctrl_c_in_another_callbacks_epoch_end_ends_nothing(tmp_path, interrupt):
    full, _, _ = fit(tmp_path / 'full', max_epochs=3)
    stopper = interrupt(2)
    net, cp, _ = fit(tmp_path / 'ck', stopper, max_epochs=3)
    assert len(net.history) == 2 and getattr(stopper, 'sent_', True)
    # the end of epoch 2 was cut short: epoch 1 stands, and nothing says finished
    assert cp.committed() == ['epoch-0001']
    saved = manifest_of(tmp_path / 'ck' / 'epoch-0001')
    assert not saved['finished'] and not saved['stopped_early']
    # the same command again goes on, and lands where the uninterrupted run did
    again, _, load = fit(tmp_path / 'ck', max_epochs=3)
    assert load.loaded_from_.endswith('epoch-0001') and len(again.history) == 3
    assert_same_params(params(full), params(again))


def test_a_callback_that_records_its_decision_stops_the_run_for_good(tmp_path):
    net, cp, _ = fit(tmp_path / 'ck', RaiseAtEpochEnd(2, decided=True), max_epochs=5)
    assert cp.committed()[-1] == 'epoch-0002'
    saved = manifest_of(tmp_path / 'ck' / 'epoch-0002')
    assert saved['finished'] and saved['stopped_early']
    again, _, load = fit(tmp_path / 'ck', max_epochs=8)
    assert load.loaded_from_.endswith('epoch-0002') and len(again.history) == 2


# in one process in this process too: test_a_ctrl_c_in_another_callbacks_epoch_end_ends_nothing
@pytest.mark.slow
@pytest.mark.parametrize('nproc', [1, 2])
def test_an_interrupted_epoch_end_is_replayed_in_processes(run_workers, tmp_path, nproc):
    results = run_workers('lifecycle.py', 'epoch_end_interrupt', nproc=nproc,
                          args=(tmp_path, 'epoch_end_interrupt'))
    for res in results:
        assert res['num_processes'] == nproc
        assert res['interrupted'] == {'epochs': 2, 'committed': ['epoch-0001']}
        assert res['resumed_from'] == 'epoch-0001' and res['epochs'] == 3
        assert res['same_as_uninterrupted']


# ---------------------------------------------------------------- partial_fit

@pytest.mark.parametrize('nproc', [1, pytest.param(2, marks=pytest.mark.slow)])
def test_partial_fit_after_a_resume_counts_steps_and_batches_on(run_workers, tmp_path, nproc):
    results = run_workers('lifecycle.py', 'partial_fit', nproc=nproc,
                          args=(tmp_path, 'partial_fit'))
    for res in results:
        assert res['num_processes'] == nproc
        # each checkpoint records the optimizer steps and the batches of
        # its epoch that its history shows: of a fit that resumed inside an
        # epoch, and of a partial_fit after it
        for preempted in (res['first'], res['second']):
            assert preempted['recorded'] == preempted['trained']
        step = res['second']['recorded'][0]
        assert res['second']['checkpoint'] in (f'epoch-0002-step-{step:08d}', 'epoch-0003')
        assert res['epochs'] == 4 and len(set(res['train_batch_count'])) == 1
        assert res['same_as_uninterrupted']


def test_partial_fit_and_warm_start_continue_the_step_count(tmp_path):
    net, cp, _ = fit(tmp_path / 'ck', max_epochs=2)
    per_epoch = net.history[-1, 'train_batch_count']
    assert cp.global_step_ == 2 * per_epoch
    net.partial_fit(*make_data(**DATA))
    assert cp.global_step_ == 4 * per_epoch
    net.set_params(warm_start=True)
    net.fit(*make_data(**DATA))
    assert cp.global_step_ == 6 * per_epoch
    assert manifest_of(tmp_path / 'ck' / 'epoch-0006')['position']['step'] == 6 * per_epoch


# ---------------------------------------------------------------- the net is left as it was

class RefuseToTrain(NotTrainingState, Callback):
    def on_train_begin(self, net, **kwargs):
        raise RuntimeError("refused")


class RecordMaxEpochs(NotTrainingState, Callback):
    def initialize(self):
        self.seen_ = []
        return self

    def on_train_begin(self, net, **kwargs):
        self.seen_.append(net.max_epochs)

    def on_epoch_begin(self, net, **kwargs):
        self.seen_.append(net.max_epochs)


def test_resuming_never_changes_max_epochs(tmp_path):
    fit(tmp_path / 'ck', max_epochs=3)
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    recorder = RecordMaxEpochs()
    net = make_net(make_accelerator(), max_epochs=10,
                   callbacks=[cp, AccelerateLoadInitState(cp), recorder, RefuseToTrain()])
    with pytest.raises(RuntimeError, match='refused'):
        net.fit(*make_data(**DATA))
    assert net.max_epochs == 10 and clone(net).max_epochs == 10
    # a retry, and every callback all along, see the number the user set
    net.set_params(callbacks=[cp, AccelerateLoadInitState(cp), recorder])
    net.fit(*make_data(**DATA))
    assert len(net.history) == 10 and net.max_epochs == 10
    assert set(recorder.seen_) == {10}


# ---------------------------------------------------------------- a signal at the end

@pytest.mark.slow
@pytest.mark.parametrize('nproc, who', [(1, 0), (2, 1)])
def test_a_sigterm_during_the_end_of_training_stops_with_the_last_save(
        run_workers, tmp_path, nproc, who):
    results = run_workers('lifecycle.py', 'sigterm_at_train_end', nproc=nproc,
                          args=(tmp_path, 'sigterm_at_train_end'),
                          env={'SIGNAL_RANK': str(who)})
    for res in results:
        assert res['num_processes'] == nproc
        # every rank raised, naming the finished checkpoint of the last epoch
        assert res['at_end'] == {'signal': 'SIGTERM', 'checkpoint': 'epoch-0002'}
        # the next fit watches anew: its first SIGTERM saves and stops
        assert res['second']['checkpoint'].startswith('epoch-0002-step-')
    manifest = json.loads((tmp_path / 'cut' / 'epoch-0002' / 'manifest.json').read_text())
    assert manifest['finished'] and not manifest['stopped_early']


@pytest.mark.slow
def test_signals_after_a_fit_that_failed_save_and_stop(run_workers, tmp_path):
    # the failed fit's watch stays set; a later fit's must not hand a signal
    # on to it (it took the next for a second one and ended the process)
    result, = run_workers('lifecycle.py', 'after_a_failed_fit', nproc=1,
                          args=(tmp_path, 'after_a_failed_fit'))
    assert result['num_processes'] == 1
    assert result['stopped'] == ['epoch-0000-step-00000002'] * 2


# ---------------------------------------------------------------- what a user sees

def test_the_last_epoch_of_a_run_is_saved_finished(tmp_path, capsys):
    fit(tmp_path / 'ck', max_epochs=3)
    assert manifest_of(tmp_path / 'ck' / 'epoch-0003')['finished']
    assert not manifest_of(tmp_path / 'ck' / 'epoch-0002')['finished']
    assert cli.main(['list', str(tmp_path / 'ck')]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()
            if line.strip().startswith('epoch-')}
    assert ' yes ' in rows['epoch-0003'] and ' no ' in rows['epoch-0002']


class PreemptInEpoch(NotTrainingState, Callback):
    """SIGTERM after batch ``batch`` of epoch ``epoch``; notes how long the
    epoch had run by then."""

    def __init__(self, epoch, batch):
        self.epoch = epoch
        self.batch = batch

    def initialize(self):
        self.batches_ = 0
        self.started_ = None
        self.ran_ = None
        return self

    def on_epoch_begin(self, net, **kwargs):
        self.batches_ = 0
        self.started_ = time.time()

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.batches_ += 1
            if len(net.history) == self.epoch and self.batches_ == self.batch:
                self.ran_ = time.time() - self.started_
                os.kill(os.getpid(), signal.SIGTERM)


def test_a_resumed_epoch_lasts_the_time_it_trained(tmp_path):
    preempt = PreemptInEpoch(2, 2)
    with pytest.raises(TrainingPreempted):
        fit(tmp_path / 'ck', preempt, max_epochs=2)
    down = 1.0
    time.sleep(down)  # the job is down
    began = time.time()
    net, _, load = fit(tmp_path / 'ck', max_epochs=2)
    resumed_for = time.time() - began
    assert '-step-' in load.loaded_from_
    # the epoch trained before the signal and after the resume, not while down
    assert net.history[-1, 'dur'] <= preempt.ran_ + resumed_for
