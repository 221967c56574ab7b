"""ParamsCheckpoint, TrainEndParamsCheckpoint and LoadInitParams in real processes.

One launch runs every check (launches cost seconds); each rank writes what
it saw to ``params-rank<r>.json`` and the test compares across ranks.

Usage: params_main.py FOLDER KILLED_FOLDER
"""

import json
import os
import pickle
import shutil
import sys
import time
import warnings

import numpy as np
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback
from skorch.dataset import Dataset
from skorch.exceptions import DeviceWarning
from skorch.helper import predefined_split
from skorch.hf import AccelerateMixin
from torch.nn.parallel import DistributedDataParallel

from common import (
    MLP,
    make_accelerator,
    make_data,
    make_net,
    params_digest,
    plain_criterion,
    rank,
    write_result,
)
from skorch_accel_callbacks import (
    LoadInitParams,
    ParamsCheckpoint,
    TrainEndParamsCheckpoint,
    unwrapped,
)
from skorch_accel_callbacks._core import sync
from skorch_accel_callbacks._core.wrapping import is_wrapped

SLOW_WRITE_S = 0.3
AUDIT = {'root': None, 'events': []}


def audit(event, args):
    """Record file writes and renames under AUDIT['root'] (sys.addaudithook)."""
    root = AUDIT['root']
    if root is None:
        return
    if event == 'open':
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in 'wax+')) or (
            mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR))
        if isinstance(path, str) and writes and path.startswith(root):
            AUDIT['events'].append(['write', os.path.relpath(path, root)])
    elif event == 'os.rename':
        src, dst = os.fspath(args[0]), os.fspath(args[1])
        if isinstance(dst, str) and dst.startswith(root):
            AUDIT['events'].append(['rename', os.path.relpath(src, root),
                                    os.path.relpath(dst, root)])



def never(net):
    return False


class SlowWrite:
    """Below AccelerateMixin in the MRO: runs only where the bytes are written
    (main process, after skorch's barrier). A rank that left the save before
    the main process finished would read a stale or missing file."""

    def save_params(self, **kwargs):
        # skorch's Checkpoint passes the params file as f_module
        if 'every' in str(kwargs.get('f_module')):
            time.sleep(SLOW_WRITE_S)
        return super().save_params(**kwargs)


class SlowStockNet(AccelerateMixin, SlowWrite, NeuralNetClassifier):
    """skorch's own mixin, unchanged, with a slow writer."""



def same_state(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def own_state(net):
    with unwrapped(net):
        return net.module_.state_dict()


class ReadBack(Callback):
    """On every rank, right after the checkpoints: read what was just saved,
    and keep this rank's own view of the epoch."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, folder):
        self.folder = folder

    def initialize(self):
        self.reads_ = []
        self.registries_ = []
        self.own_best_ = []
        self.event_cp_ = []
        return self

    def on_train_begin(self, net, **kwargs):
        self.registries_.append(registries(net.accelerator))

    def on_epoch_end(self, net, **kwargs):
        epoch = len(net.history)
        self.registries_.append(registries(net.accelerator))
        self.own_best_.append(bool(net.history[-1, 'valid_loss_best']))
        self.event_cp_.append(net.history[-1, 'event_cp'])
        try:
            state = torch.load(os.path.join(self.folder, f'params_{epoch}.pt'))
            with open(os.path.join(self.folder, 'history.json')) as f:
                history = json.load(f)
            with open(os.path.join(self.folder, f'net_{epoch}.pkl'), 'rb') as f, \
                    warnings.catch_warnings():
                # unpickling a net with device=None warns; the callbacks' own
                # loads are what must not
                warnings.simplefilter('ignore', DeviceWarning)
                pickled = pickle.load(f)
            self.reads_.append({
                'keys': list(state),
                'same_params': same_state(state, own_state(net)),
                'history_epochs': len(history),
                'pickle_same_params': same_state(pickled.module_.state_dict(), own_state(net)),
                'pickle_is_wrapped': is_wrapped(pickled),
            })
        except Exception as exc:  # pylint: disable=broad-except
            self.reads_.append(f"{type(exc).__name__}: {exc}")


def warning_texts(caught, category=Warning):
    return [f"{w.category.__name__}: {w.message}" for w in caught
            if issubclass(w.category, category)]


def registries(accelerator):
    return [len(accelerator._models), len(accelerator._optimizers)]


def check_decision(accelerator, X, y, folder, out):
    """Ranks with different validation data decide once, on the main process;
    skorch's stock AccelerateMixin; only the main process writes."""
    best, every = os.path.join(folder, 'best'), os.path.join(folder, 'every')
    Xv, yv = X[256:], y[256:]
    X, y = X[:256], y[:256]
    if rank() == 1:
        yv = 1 - yv  # its valid loss gets worse as training improves
    sink = []
    cp_best = ParamsCheckpoint(dirname=best, f_criterion=None, load_best=True,
                               sink=sink.append)
    cp_every = ParamsCheckpoint(
        monitor=None, dirname=every, f_params='params_{last_epoch[epoch]}.pt',
        f_criterion=None, f_pickle='net_{last_epoch[epoch]}.pkl',
        event_name='event_every', sink=sink.append)
    reader = ReadBack(every)
    net = make_net(
        accelerator, net_cls=SlowStockNet, criterion=plain_criterion,
        unwrap_after_train=False, max_epochs=4,
        train_split=predefined_split(Dataset(Xv, yv)),
        callbacks=[('cp_best', cp_best), ('cp_every', cp_every), ('reader', reader)])
    AUDIT['root'] = folder + os.sep
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        net.fit(X, y)
    AUDIT['root'] = None
    with open(os.path.join(best, 'history.json')) as f:
        saved_history = json.load(f)
    out['decision'] = {
        'num_processes': sync.num_processes(net),
        'is_ddp': isinstance(net.module_, DistributedDataParallel),
        'own_valid_loss_best': reader.own_best_,
        'event_cp': reader.event_cp_,
        # load_best replaced the history by the main process's saved one
        'saved_event_cp': [row['event_cp'] for row in saved_history],
        'reads': reader.reads_,
        'registries': reader.registries_ + [registries(accelerator)],
        'audit': AUDIT['events'],
        'files': {name: sorted(os.listdir(os.path.join(folder, name)))
                  for name in ('best', 'every')},
        'sink': sink,
        'warnings': warning_texts(caught),
        'loaded_best': same_state(
            own_state(net), torch.load(os.path.join(best, 'params.pt'))),
        'still_wrapped': is_wrapped(net),
    }


class WrappedAt(Callback):
    """Records whether the net is wrapped when training begins and ends."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def initialize(self):
        self.states_ = []
        return self

    def on_train_begin(self, net, **kwargs):
        self.states_.append(is_wrapped(net))

    def on_train_end(self, net, **kwargs):
        self.states_.append(is_wrapped(net))


def proba_diff(net, X, reference):
    return float(np.abs(net.predict_proba(X) - reference).max())


def check_combinations(accelerator, X, y, folder, out):
    """Saved from wrapped/unwrapped x loaded into wrapped/unwrapped/plain net."""
    res = out['combinations'] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for source, unwrap in (('wrapped', False), ('unwrapped', True)):
            src = os.path.join(folder, f'from_{source}')
            probe = WrappedAt()
            net = make_net(accelerator, unwrap_after_train=unwrap, callbacks=[
                probe, TrainEndParamsCheckpoint(dirname=src)])
            net.fit(X, y)
            reference = net.predict_proba(X)
            res[f'{source}/saved_wrapped'] = probe.states_[-1]
            res[f'{source}/keys'] = list(torch.load(os.path.join(src, 'train_end_params.pt')))

            def cp(**kwargs):
                # a train-end history has no event column to pick an epoch by
                return ParamsCheckpoint(dirname=src, fn_prefix='train_end_',
                                        event_name=None, **kwargs)

            targets = {
                # LoadInitParams loads when training begins: always wrapped
                'init_wrapped': (False, [WrappedAt(), LoadInitParams(cp())]),
                # load_best loads when training ends, after unwrap_after_train
                'best_wrapped': (False, [WrappedAt(), cp(monitor=never, load_best=True)]),
                'best_unwrapped': (True, [WrappedAt(), cp(monitor=never, load_best=True)]),
            }
            for target, (unwrap_target, callbacks) in targets.items():
                loaded = make_net(accelerator, unwrap_after_train=unwrap_target,
                                  max_epochs=0, callbacks=callbacks)
                loaded.fit(X, y)
                state = callbacks[0].states_[0 if target.startswith('init') else -1]
                res[f'{source}/{target}'] = [state, proba_diff(loaded, X, reference)]
            plain = NeuralNetClassifier(MLP, max_epochs=0, callbacks=[LoadInitParams(cp())])
            plain.fit(X, y)
            res[f'{source}/plain'] = [False, proba_diff(plain, X, reference)]
    res['warnings'] = warning_texts(caught)


class RemoveFolder(Callback):
    """On the main process, in the given epoch, remove the checkpoint folder
    (the disk is gone) before the checkpoint saves."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, folder, epoch):
        self.folder = folder
        self.epoch = epoch

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) == self.epoch and sync.is_main_process(net):
            shutil.rmtree(self.folder)


class Unpicklable(MLP):
    def __init__(self):
        super().__init__()
        self.activation = lambda x: x


def describe(exc):
    return {'type': type(exc).__name__, 'text': str(exc),
            'notes': getattr(exc, '__notes__', [])}


def check_errors(accelerator, X, y, folder, out):
    res = out['errors'] = {}
    # a save fails in epochs 2 and 3: warn, go on training
    gone = os.path.join(folder, 'gone_warn')
    sink = []
    net = make_net(accelerator, max_epochs=3, callbacks=[
        RemoveFolder(gone, 2), ParamsCheckpoint(monitor=None, dirname=gone, sink=sink.append)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        net.fit(X, y)
    res['warn'] = {'epochs': len(net.history), 'event_cp': net.history[:, 'event_cp'],
                   'warnings': warning_texts(caught, UserWarning), 'sink': sink}

    # the same with on_error='raise': every rank raises, none hangs
    gone = os.path.join(folder, 'gone_raise')
    net = make_net(accelerator, max_epochs=3, callbacks=[
        RemoveFolder(gone, 2), ParamsCheckpoint(monitor=None, dirname=gone, on_error='raise')])
    try:
        net.fit(X, y)
        res['raise'] = None
    except Exception as exc:  # pylint: disable=broad-except
        res['raise'] = dict(describe(exc), epochs=len(net.history))
    # the ranks are still in step: a collective after the failure works
    res['after_raise_gather'] = sync.gather(net, rank())

    # problems visible before training raise before the first epoch
    if os.geteuid() == 0:
        unwritable = '/sys/kernel'  # root may create files anywhere else
    else:
        unwritable = os.path.join(folder, f'readonly{rank()}')
        os.makedirs(unwritable)
        os.chmod(unwritable, 0o500)
    blocker = os.path.join(folder, 'a_file')
    if sync.is_main_process(net):
        with open(blocker, 'w') as f:
            f.write('not a folder')
    sync.barrier(net)
    for name, callback in [
            ('unwritable', ParamsCheckpoint(dirname=unwritable)),
            ('uncreatable', TrainEndParamsCheckpoint(dirname=os.path.join(blocker, 'sub'))),
            ('bad_on_error', ParamsCheckpoint(on_error='ignore'))]:
        net = make_net(accelerator, callbacks=[callback])
        try:
            net.initialize()
            res[name] = None
        except Exception as exc:  # pylint: disable=broad-except
            res[name] = describe(exc)

    pickles = os.path.join(folder, 'pickles')
    net = make_net(accelerator, module=Unpicklable, callbacks=[
        TrainEndParamsCheckpoint(dirname=pickles, f_pickle='net.pkl')])
    try:
        net.fit(X, y)
        res['unpicklable'] = None
    except Exception as exc:  # pylint: disable=broad-except
        res['unpicklable'] = dict(describe(exc), epochs=len(net.history),
                                  files=sorted(os.listdir(pickles)))


def check_load_init(accelerator, X, y, folder, killed, out):
    res = out['load_init'] = {}
    # nothing saved yet: as skorch, nothing is loaded and training goes on
    empty = os.path.join(folder, 'empty')
    net = make_net(accelerator, callbacks=[LoadInitParams(ParamsCheckpoint(dirname=empty))])
    net.fit(X, y)
    res['missing_everywhere_epochs'] = len(net.history)

    # files only on rank 0 (rank-dependent folder): every rank raises
    own = os.path.join(folder, f'only_rank{rank()}')
    if rank() == 0:
        # a net without accelerate: saving on one rank alone is fine
        NeuralNetClassifier(MLP, max_epochs=1, callbacks=[TrainEndParamsCheckpoint(
            dirname=own, fn_prefix='')]).fit(X, y)
    net = make_net(accelerator, callbacks=[LoadInitParams(ParamsCheckpoint(
        dirname=own, event_name=None))])
    try:
        net.fit(X, y)
        res['missing_on_some'] = None
    except Exception as exc:  # pylint: disable=broad-except
        res['missing_on_some'] = describe(exc)

    # the folder of a run killed in the middle of a save: the previous
    # checkpoint loads
    net = make_net(accelerator, max_epochs=0, callbacks=[
        LoadInitParams(ParamsCheckpoint(monitor=None, dirname=killed))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        net.fit(X, y)
    with unwrapped(net):
        res['killed_digest'] = params_digest(net.module_)
    res['killed_history_epochs'] = len(net.history)
    res['warnings'] = warning_texts(caught)


def main():
    folder, killed = sys.argv[1], sys.argv[2]
    sys.addaudithook(audit)
    # every launch trains the same path, so a failure can be replayed
    torch.manual_seed(0)
    accelerator = make_accelerator()
    X, y = make_data()
    out = {}
    check_decision(accelerator, *make_data(n=384), folder, out)
    check_combinations(accelerator, X, y, folder, out)
    check_errors(accelerator, X, y, folder, out)
    check_load_init(accelerator, X, y, folder, killed, out)
    out['num_processes'] = accelerator.num_processes
    write_result('params', out)


if __name__ == '__main__':
    main()
