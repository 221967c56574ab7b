"""Jobs for tests/params/test_params_parity.py.

usage: params_parity.py hold FN_PREFIX MARKERS
  One process, a plain skorch net whose ParamsCheckpoint keeps the default
  ``dirname=''`` (the working directory) and uses FN_PREFIX. After its first
  epoch's save it writes ``MARKERS/held`` and waits (holding the lock of its
  files) until ``MARKERS/go`` exists, then trains its second epoch and ends.

usage: params_parity.py pickle FOLDER
  Launched in several processes: trains a net with this package's mixin
  (left wrapped in DDP) and one with skorch's own mixin, each pickled by
  ParamsCheckpoint(f_pickle='net.pkl') into FOLDER/<kind>; rank 0 also
  pickles the wrapped net with pickle.dump (FOLDER/fixed/direct.pkl) and
  saves the job's predictions of X[:20] (FOLDER/<kind>/proba.npy). Every
  rank unpickles net.pkl inside the job and predicts with it.
"""

import os
import pickle
import sys
import time
import warnings

import numpy as np
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback
from skorch.exceptions import DeviceWarning
from torch.nn.parallel import DistributedDataParallel

from common import (
    MLP,
    FixedNet,
    StockNet,
    make_accelerator,
    make_data,
    make_net,
    plain_criterion,
    rank,
    settle_gloo,
    write_result,
)
from skorch_accel_callbacks import ParamsCheckpoint
from skorch_accel_callbacks._core import sync

HOLD_TIMEOUT_S = 300


class Hold(Callback):
    """After epoch 1 (and its save): say so, then wait for the go."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, markers):
        self.markers = markers

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) != 1:
            return
        with open(os.path.join(self.markers, 'held'), 'w') as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not os.path.exists(os.path.join(self.markers, 'go')):
            if time.monotonic() > deadline:
                sys.exit("the test never said go")
            time.sleep(0.05)


def hold(prefix, markers):
    X, y = make_data(n=64)
    cp = ParamsCheckpoint(monitor=None, fn_prefix=prefix)
    NeuralNetClassifier(MLP, max_epochs=2, train_split=None, verbose=0,
                        callbacks=[cp, Hold(markers)]).fit(X, y)


def pickles(folder):
    accelerator = make_accelerator()
    X, y = make_data(n=128)
    out = {'num_processes': accelerator.num_processes}
    jobs = {
        # this package's mixin, still wrapped in DDP when pickled by hand
        'fixed': {'net_cls': FixedNet, 'unwrap_after_train': False},
        # skorch's own mixin; its DDP refuses a criterion without parameters
        'stock': {'net_cls': StockNet, 'criterion': plain_criterion},
    }
    for kind, kwargs in jobs.items():
        target = os.path.join(folder, kind)
        cp = ParamsCheckpoint(monitor=None, dirname=target, f_criterion=None,
                              f_pickle='net.pkl')
        net = make_net(accelerator, max_epochs=2, train_split=None, callbacks=[cp], **kwargs)
        net.fit(X, y)
        proba = net.predict_proba(X[:20])
        res = out[kind] = {'rows': len(proba),
                           'is_ddp': isinstance(net.module_, DistributedDataParallel)}
        if sync.is_main_process(net):
            np.save(os.path.join(target, 'proba.npy'), proba)
            if kind == 'fixed':
                with open(os.path.join(target, 'direct.pkl'), 'wb') as f:
                    pickle.dump(net, f)
        # inside the job, an unpickled net belongs to the job
        with open(os.path.join(target, 'net.pkl'), 'rb') as f, warnings.catch_warnings():
            warnings.simplefilter('ignore', DeviceWarning)
            loaded = pickle.load(f)
        res['in_job'] = {'num_processes': loaded.accelerator.num_processes,
                         'rows': len(loaded.predict_proba(X[:20]))}
    write_result('pickle', out)
    settle_gloo()


if __name__ == '__main__':
    if sys.argv[1] == 'hold':
        hold(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == 'pickle':
        pickles(sys.argv[2])
        print(f"rank {rank()} done")
    else:
        sys.exit(f"unknown job {sys.argv[1]!r}")
