"""ParamsCheckpoint + LoadInitParams, SIGKILLed at a numbered point.

usage: params_killable.py DIRNAME TAG

Each launch loads what the previous one left (skorch's LoadInitState
semantics) and trains 2 epochs, saving params, optimizer and history every
epoch. KILL=EPOCH:POINT:RANK (or HOLD=..., to wait there until killed) as
in killable.py, with the points of PARAMS_POINTS: batch ends, a half-written
params file, before and after the journal of the save's moves, before and
after each file's move. Rank 0 appends what it is about to save (history length, digests of the
parameters and of the optimizer state) to ``saves.jsonl``; every rank writes
the same of what it loaded to ``loaded-<TAG>-rank<r>.json`` when training
begins.
"""

import json
import os
import sys

from skorch import NeuralNetClassifier
from skorch.callbacks import Callback
from skorch.hf import AccelerateMixin

from common import BatchEnds, make_accelerator, make_data, make_net, params_digest, rank
from faultjob import EpochTracker, die, hold
from skorch_accel_callbacks import AccelerateFixesMixin, LoadInitParams, ParamsCheckpoint, unwrapped
from skorch_accel_callbacks.format import TEMP_MARK, _atomic as atomic

FILES = ('params.pt', 'optimizer.pt', 'history.json')
PARAMS_POINTS = ('batch-1', 'batch-2', 'params-half', 'before-journal',
                 'after-journal') + tuple(
    f'{when}-rename-{name}' for name in FILES for when in ('before', 'after'))
KILL = (os.environ.get('KILL') or os.environ.get('HOLD') or '::').split(':')
# epochs in the loaded history, set when training begins
LOADED = {'epochs': 0}


def stop(point):
    """Die at ``point``, or with HOLD, stay there until killed."""
    (hold if os.environ.get('HOLD') else die)(point)


def due(point):
    return (point == KILL[1] and str(EpochTracker.epoch - LOADED['epochs']) == KILL[0]
            and str(rank()) == KILL[2])


class HalfWrite:
    """Below AccelerateMixin: runs where the bytes are written (rank 0, the
    temporary path); writes half of the params file and dies."""

    def save_params(self, **kwargs):
        target = kwargs.get('f_module')
        if target is not None and due('params-half'):
            super().save_params(**kwargs)
            with open(target, 'r+b') as f:
                f.truncate(os.path.getsize(target) // 2)
            stop('params-half')
        return super().save_params(**kwargs)


class Net(AccelerateFixesMixin, AccelerateMixin, HalfWrite, NeuralNetClassifier):
    pass


def install_rename_points():
    replace = os.replace

    def os_replace(src, dst):
        name = os.path.basename(str(dst))
        ours = TEMP_MARK in str(src) and name in FILES
        if ours and due(f'before-rename-{name}'):
            stop(f'before-rename-{name}')
        replace(src, dst)
        if ours and due(f'after-rename-{name}'):
            stop(f'after-rename-{name}')

    os.replace = os_replace

    write_json = atomic.write_json

    def journal_write(path, obj, **kwargs):
        journal = path.endswith('commit.json')
        if journal and due('before-journal'):
            stop('before-journal')
        write_json(path, obj, **kwargs)
        if journal and due('after-journal'):
            stop('after-journal')

    atomic.write_json = journal_write


def snapshot(net):
    """What a save of this net holds: epochs, parameters, optimizer state."""
    with unwrapped(net):
        params = params_digest(net.module_)
    buffers = [state['momentum_buffer'] for state in net.optimizer_.state_dict()['state'].values()
               if state.get('momentum_buffer') is not None]
    optimizer = float(sum(b.double().sum() * (i + 1) for i, b in enumerate(buffers)))
    return {'history_len': len(net.history), 'params': params, 'optimizer': optimizer}


class LogSave(Callback):
    """Before the checkpoint's save: what it is about to save."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def on_epoch_end(self, net, **kwargs):
        if rank() == 0:
            with open(os.path.join(os.environ['RESULT_DIR'], 'saves.jsonl'), 'a') as f:
                f.write(json.dumps(snapshot(net)) + '\n')


class RecordLoad(Callback):
    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def on_train_begin(self, net, **kwargs):
        LOADED['epochs'] = len(net.history)
        path = os.path.join(os.environ['RESULT_DIR'], f'loaded-{sys.argv[2]}-rank{rank()}.json')
        with open(path, 'w') as f:
            json.dump(snapshot(net), f)


class BatchKiller(BatchEnds):
    def at_batch(self, net, batch):
        if due(f'batch-{batch}'):
            stop(f'batch-{batch}')


def main():
    dirname = sys.argv[1]
    install_rename_points()
    cp = ParamsCheckpoint(monitor=None, dirname=dirname, f_criterion=None, on_error='raise')
    net = make_net(make_accelerator(), net_cls=Net, max_epochs=2, batch_size=16,
                   train_split=None, callbacks=[
                       EpochTracker(), LoadInitParams(cp), RecordLoad(), BatchKiller(),
                       LogSave(), cp])
    net.fit(*make_data(n=64))


if __name__ == '__main__':
    main()
