"""Callbacks that decide on the epoch's metrics, in every process of a
launch, for tests/callbacks/test_decisions.py.

usage: mixin_decisions.py FOLDER
  Runs every scenario of :data:`SCENARIOS` in turn in one launch and
  writes this rank's results in ``decisions-rank<r>.json``.

The validation data is the same on every rank, and accelerate shards it:
batch ``i`` of 32 rows goes to rank ``i % 2``. The labels of rank 1's rows
are flipped, so that as training goes on rank 0's own valid loss falls and
rank 1's rises: without the reduction of the metrics the ranks' decisions
part.
"""

import os
import signal
import sys
import time

import numpy as np
import torch
from skorch.callbacks import Callback, EarlyStopping, EpochScoring, LRScheduler
from skorch.dataset import Dataset
from skorch.helper import predefined_split

from common import (
    NotTrainingState,
    history_rows,
    make_accelerator,
    make_data,
    make_net,
    plain_criterion,
    rank,
    write_result,
)
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    DivergedDecisionError,
    TrainingPreempted,
)

BATCH = 32
TRAIN_ROWS = 256
VALID_ROWS = 128


def all_data():
    return make_data(n=TRAIN_ROWS + VALID_ROWS)


def train_data():
    X, y = all_data()
    return X[:TRAIN_ROWS], y[:TRAIN_ROWS]


def valid_data(n=VALID_ROWS):
    X, y = all_data()
    X, y = X[TRAIN_ROWS:TRAIN_ROWS + n], y[TRAIN_ROWS:TRAIN_ROWS + n]
    rows = np.arange(n)
    # the rows of the batches that rank 1 validates
    flipped = (rows // BATCH) % 2 == 1
    y = np.where(flipped, 1 - y, y)
    return X, y


class Losses(NotTrainingState, Callback):
    """This rank's own batch losses and sizes, before any reduction."""

    def initialize(self):
        self.rows_ = []
        return self

    def on_batch_end(self, net, batch=None, training=False, loss=None, **kwargs):
        self.rows_.append({'training': training, 'loss': loss.item(),
                           'size': len(batch[0]), 'epoch': len(net.history)})


class LearningRates(NotTrainingState, Callback):
    """The optimizer's learning rate at each epoch's end, after the
    scheduler's step."""

    def initialize(self):
        self.lrs_ = []
        return self

    def on_epoch_end(self, net, **kwargs):
        self.lrs_.append(net.optimizer_.param_groups[0]['lr'])


class StopOnRank(NotTrainingState, Callback):
    """A user's callback that stops training on one rank only, at the
    beginning of epoch ``epoch``."""

    def __init__(self, epoch, on_rank):
        self.epoch = epoch
        self.on_rank = on_rank

    def on_epoch_begin(self, net, **kwargs):
        if len(net.history) == self.epoch and rank() == self.on_rank:
            raise KeyboardInterrupt


class CtrlCOnRank(NotTrainingState, Callback):
    """A real Ctrl-C on one rank while this callback ends epoch ``epoch``:
    SIGINT to this process, which Python turns into a KeyboardInterrupt
    right here."""

    def __init__(self, epoch, on_rank):
        self.epoch = epoch
        self.on_rank = on_rank

    def initialize(self):
        self.sent_ = False
        return self

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) == self.epoch and rank() == self.on_rank:
            self.sent_ = True
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the KeyboardInterrupt comes before this ends
            raise AssertionError("SIGINT did not interrupt")


class SigtermOnRank(NotTrainingState, Callback):
    """A preemption at the end of epoch ``epoch``: SIGTERM to one rank,
    which the checkpoint (the last callback) saves and stops every rank on."""

    def __init__(self, epoch, on_rank):
        self.epoch = epoch
        self.on_rank = on_rank

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) == self.epoch and rank() == self.on_rank:
            os.kill(os.getpid(), signal.SIGTERM)


def fit(accelerator, *callbacks, reduce_metrics, max_epochs=15, valid_rows=VALID_ROWS):
    torch.manual_seed(0)
    X, y = train_data()
    Xv, yv = valid_data(valid_rows)
    net = make_net(accelerator, criterion=plain_criterion, max_epochs=max_epochs,
                   batch_size=BATCH, lr=0.05, reduce_metrics=reduce_metrics,
                   train_split=predefined_split(Dataset(Xv, yv)),
                   callbacks=[('losses', Losses()), *callbacks])
    began = time.monotonic()
    try:
        net.fit(X, y)
        raised = None
    except DivergedDecisionError as exc:
        raised = {'type': type(exc).__name__, 'message': str(exc), 'callback': exc.callback,
                  'hook': exc.hook, 'epoch': exc.epoch, 'stopped': list(exc.stopped),
                  'went_on': list(exc.went_on)}
    return net, {'raised': raised, 'seconds': time.monotonic() - began,
                 'epochs': len(net.history), 'history': history_rows(net.history),
                 'own_losses': dict(net.callbacks_)['losses'].rows_}


def early_stopping(accelerator, reduce_metrics, valid_rows=VALID_ROWS):
    net, out = fit(accelerator,
                   ('train_acc', EpochScoring('accuracy', on_train=True, name='train_acc')),
                   ('early_stopping', EarlyStopping(patience=2)),
                   reduce_metrics=reduce_metrics, valid_rows=valid_rows)
    if out['raised'] is None:
        # the loss of the trained module over the whole validation data
        Xv, yv = valid_data(valid_rows)
        proba = net.predict_proba(Xv).astype(np.float64)
        out['loss_by_hand'] = float(-np.mean(np.log(proba[np.arange(len(yv)), yv])))
        out['predicted_rows'] = len(proba)
        out['acc_by_hand'] = float(np.mean(proba.argmax(axis=1) == yv))
    return out


def plateau(accelerator, reduce_metrics):
    scheduler = LRScheduler(policy=torch.optim.lr_scheduler.ReduceLROnPlateau,
                            monitor='valid_loss', patience=0, factor=0.5)
    net, out = fit(accelerator, ('lr_scheduler', scheduler), ('lrs', LearningRates()),
                   reduce_metrics=reduce_metrics, max_epochs=6)
    out['lrs'] = dict(net.callbacks_)['lrs'].lrs_
    return out


def monitor(accelerator, reduce_metrics, folder):
    dirname = os.path.join(folder, f'monitor-{reduce_metrics}')
    checkpoint = AccelerateCheckpoint(dirname=dirname, monitor='valid_loss_best')
    net, out = fit(accelerator, ('checkpoint', checkpoint), reduce_metrics=reduce_metrics,
                   max_epochs=5)
    out['committed'] = checkpoint.committed()
    return out


def with_checkpoint(dirname, *callbacks):
    checkpoint = AccelerateCheckpoint(dirname=dirname)
    return [*callbacks, ('early_stopping', EarlyStopping(patience=2)),
            ('load', AccelerateLoadInitState(checkpoint)), ('checkpoint', checkpoint)]


def resume(accelerator, folder):
    """The issue's case: EarlyStopping goes on deciding after a resume. A
    run preempted at the end of epoch 1 and resumed stops where the
    uninterrupted one did, with its history, on both ranks."""
    full, out = fit(accelerator, *with_checkpoint(os.path.join(folder, 'full')),
                    reduce_metrics=True)
    dirname = os.path.join(folder, 'cut')
    try:
        fit(accelerator, *with_checkpoint(dirname, ('sigterm', SigtermOnRank(1, on_rank=1))),
            reduce_metrics=True)
        preempted = False
    except TrainingPreempted:
        preempted = True
    resumed, again = fit(accelerator, *with_checkpoint(dirname), reduce_metrics=True)
    return {'preempted': preempted, 'uninterrupted': out, 'resumed': again,
            'loaded_from': os.path.basename(dict(resumed.callbacks_)['load'].loaded_from_),
            'same_params': all(torch.equal(a, b) for a, b in zip(
                full.module_.state_dict().values(), resumed.module_.state_dict().values(),
                strict=True))}


def user_stop(accelerator):
    _, out = fit(accelerator, ('stop_on_rank', StopOnRank(epoch=2, on_rank=1)),
                 reduce_metrics=True)
    return out


def ctrl_c(accelerator):
    net, out = fit(accelerator, ('ctrl_c', CtrlCOnRank(epoch=2, on_rank=0)),
                   reduce_metrics=True)
    out['sent'] = dict(net.callbacks_)['ctrl_c'].sent_
    out['sigint_handler_restored'] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return out


def main():
    folder = sys.argv[1]
    accelerator = make_accelerator()
    out = {
        'num_processes': accelerator.num_processes,
        # first: the first fit of a launch takes longer (DDP's set-up), and
        # the one that raises is timed
        'early_stopping_on': early_stopping(accelerator, True),
        'early_stopping_off': early_stopping(accelerator, False),
        # 120 rows: accelerate fills rank 1's last batch up with 8 repeated rows
        'early_stopping_uneven': early_stopping(accelerator, True, valid_rows=120),
        'plateau_off': plateau(accelerator, False),
        'plateau_on': plateau(accelerator, True),
        'monitor_off': monitor(accelerator, False, folder),
        'monitor_on': monitor(accelerator, True, folder),
        'resume': resume(accelerator, folder),
        'user_stop': user_stop(accelerator),
        'ctrl_c': ctrl_c(accelerator),
    }
    write_result('decisions', out)


if __name__ == '__main__':
    main()
