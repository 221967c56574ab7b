"""Interrupt, refit and resume a training in one process of a launch.

usage: lifecycle.py DIRNAME SCENARIO

Each scenario trains a reference run uninterrupted (in ``DIRNAME/full``)
and the same training interrupted and resumed (in ``DIRNAME/cut``), each
net in turn from the same seed, and writes every rank's result:

- ``partial_fit``: ``fit`` preempted (SIGTERM) inside epoch 2, resumed by a
  new net to 2 epochs, then ``partial_fit`` preempted inside epoch 3 and
  resumed by a new net to 4 epochs in total; the reference is ``fit`` then
  ``partial_fit``. The result has each checkpoint's recorded position and
  the one its history shows (optimizer steps, batches of the epoch under
  way; 0 at an epoch's end, where a vote may have deferred the save to).
- ``epoch_end_interrupt``: a KeyboardInterrupt in another callback's end of
  epoch 2 (as a Ctrl-C there), then the same command again.
- ``sigterm_at_train_end``: SIGTERM to rank ``SIGNAL_RANK`` (default 0) in
  another callback's ``on_train_end``, then a ``partial_fit`` that gets a
  SIGTERM inside its first epoch.
- ``after_a_failed_fit``: a fit that fails inside an epoch (its signal
  handlers stay set: no ``on_train_end``), then two nets in turn that each
  get a SIGTERM inside an epoch.
"""

import json
import os
import signal
import sys

import torch
from skorch.callbacks import Callback

from common import NotTrainingState, make_accelerator, make_data, make_net, rank, write_result
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState, TrainingPreempted


class SignalAt(NotTrainingState, Callback):
    """SIGTERM to this process after batch ``batch`` of the ``epoch``-th
    epoch of the history (on rank ``who``), once."""

    def __init__(self, epoch, batch, who=0):
        self.epoch = epoch
        self.batch = batch
        self.who = who

    def initialize(self):
        self.batches = 0
        self.sent = False
        return self

    def on_epoch_begin(self, net, **kwargs):
        self.batches = 0

    def on_batch_end(self, net, training=False, **kwargs):
        if not training:
            return
        self.batches += 1
        if (not self.sent and len(net.history) == self.epoch and self.batches == self.batch
                and rank() == self.who):
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


class InterruptEpochEnd(NotTrainingState, Callback):
    """A KeyboardInterrupt in this callback's end of the ``epoch``-th epoch,
    before the checkpoint callback's, which runs last."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) == self.epoch:
            raise KeyboardInterrupt


class SignalAtTrainEnd(NotTrainingState, Callback):
    def __init__(self, who):
        self.who = who

    def on_train_end(self, net, **kwargs):
        if rank() == self.who:
            os.kill(os.getpid(), signal.SIGTERM)


def new_net(dirname, *extra, **kwargs):
    cp = AccelerateCheckpoint(dirname=dirname)
    load = AccelerateLoadInitState(cp)
    net = make_net(make_accelerator(), callbacks=[cp, load, *extra], **kwargs)
    return net, cp


def params(net):
    return {key: value.clone() for key, value in
            net.accelerator.unwrap_model(net.module_).state_dict().items()}


def position(checkpoint):
    with open(os.path.join(checkpoint, 'manifest.json')) as f:
        saved = json.load(f)
    return [saved['position']['step'], saved['position']['batches']]


def trained_batches(row):
    """This rank's training batches of an epoch's history row: an ended
    epoch's rows are every rank's (the mixin's reduce_metrics), its count
    this rank's."""
    if 'train_batch_count' in row:
        return row['train_batch_count']
    return sum('train_loss' in batch for batch in row['batches'])


def preempted(net, fit):
    """Run ``fit`` (which must be preempted); the checkpoint's recorded
    position and the one of the history (a step every batch)."""
    try:
        fit()
    except TrainingPreempted as exc:
        history = net.history
        inside = 'train_loss' not in history[-1]
        return {'checkpoint': os.path.basename(exc.checkpoint),
                'recorded': position(exc.checkpoint),
                'trained': [sum(map(trained_batches, history)),
                            trained_batches(history[-1]) if inside else 0]}
    raise AssertionError("training was not preempted")


def same(a, b):
    return all(torch.equal(a[key], b[key]) for key in a)


def partial_fit(dirname, X, y):
    torch.manual_seed(0)
    full, _ = new_net(os.path.join(dirname, 'full'), max_epochs=2)
    full.fit(X, y)
    full.partial_fit(X, y)
    reference = params(full)

    cut = os.path.join(dirname, 'cut')
    torch.manual_seed(0)
    net, _ = new_net(cut, SignalAt(2, 2), max_epochs=2)
    first = preempted(net, lambda: net.fit(X, y))
    # a new process would resume it; so does a new net
    net, _ = new_net(cut, SignalAt(3, 3), max_epochs=2)
    net.fit(X, y)
    second = preempted(net, lambda: net.partial_fit(X, y))
    net, _ = new_net(cut, max_epochs=4)
    net.fit(X, y)
    return {'first': first, 'second': second,
            'same_as_uninterrupted': same(reference, params(net)),
            'epochs': len(net.history),
            'train_batch_count': [row['train_batch_count'] for row in net.history]}


def epoch_end_interrupt(dirname, X, y):
    torch.manual_seed(0)
    full, _ = new_net(os.path.join(dirname, 'full'), max_epochs=3)
    full.fit(X, y)

    cut = os.path.join(dirname, 'cut')
    torch.manual_seed(0)
    net, cp = new_net(cut, InterruptEpochEnd(2), max_epochs=3)
    net.fit(X, y)
    interrupted = {'epochs': len(net.history), 'committed': cp.committed()}
    net, cp = new_net(cut, max_epochs=3)
    net.fit(X, y)
    load = next(cb for _, cb in net.callbacks_ if isinstance(cb, AccelerateLoadInitState))
    return {'interrupted': interrupted, 'resumed_from': os.path.basename(load.loaded_from_),
            'epochs': len(net.history),
            'same_as_uninterrupted': same(params(full), params(net))}


def sigterm_at_train_end(dirname, X, y):
    who = int(os.environ.get('SIGNAL_RANK', '0'))
    net, _ = new_net(os.path.join(dirname, 'cut'), SignalAtTrainEnd(who), max_epochs=2)
    try:
        net.fit(X, y)
    except TrainingPreempted as exc:
        at_end = {'signal': exc.signal.name, 'checkpoint': os.path.basename(exc.checkpoint)}
    else:
        at_end = None
    # the signal of the first fit is not taken for a second one
    net.callbacks_ = [(name, cb) for name, cb in net.callbacks_
                      if not isinstance(cb, SignalAtTrainEnd)] + [
        ('signal_at', SignalAt(3, 1, who).initialize())]
    second = preempted(net, lambda: net.partial_fit(X, y))
    return {'at_end': at_end, 'second': second}


class FailInEpoch(NotTrainingState, Callback):
    def on_batch_end(self, net, training=False, **kwargs):
        if training and len(net.history) == 2:
            raise RuntimeError("crash")


def after_a_failed_fit(dirname, X, y):
    net, _ = new_net(os.path.join(dirname, 'failed'), FailInEpoch(), max_epochs=2)
    try:
        net.fit(X, y)
    except RuntimeError:
        pass
    stopped = []
    for run in ('first', 'second'):
        net, _ = new_net(os.path.join(dirname, run), SignalAt(1, 2), max_epochs=2)
        stopped.append(preempted(net, lambda: net.fit(X, y))['checkpoint'])
    return {'stopped': stopped}


def main():
    dirname, scenario = sys.argv[1], sys.argv[2]
    X, y = make_data(n=320)
    result = {'partial_fit': partial_fit, 'epoch_end_interrupt': epoch_end_interrupt,
              'sigterm_at_train_end': sigterm_at_train_end,
              'after_a_failed_fit': after_a_failed_fit}[scenario](dirname, X, y)
    result['num_processes'] = make_accelerator().num_processes
    write_result(scenario, result)


if __name__ == '__main__':
    main()
