"""Trainings whose ranks' states differ, uninterrupted and resumed, for
tests/state/test_per_rank.py.

usage: per_rank.py
  Environment RUNS: a JSON list of trainings to run one after the other in
  this launch, each the keyword arguments of :func:`run`: ``dirname``,
  ``tag``, ``backend`` (``'ddp'`` or ``'fsdp2'``: FSDP2 forced on CPU, a
  model with BatchNorm), ``agree`` (every row of the data alike, no dropout
  and no clock: the ranks' histories and callbacks' states agree),
  ``every_n_steps``, ``async_save``, ``max_epochs``, ``resume`` (a
  checkpoint path, or ``'latest'``) and ``reseed``
  (``on_world_size_change='reseed'``).

Every rank writes ``<TAG>-rank<r>.json`` when its training ends: its
history (without durations), the states of its EarlyStopping and of a
callback whose fitted attribute differs between ranks, the warnings, what
was resumed and what the resume said; and ``<TAG>-rank<r>.pt``: its own parameters, optimizer
state and buffers (its shards under FSDP2) and its predictions.
"""

import json
import os
import warnings

import torch
from skorch.callbacks import Callback, EarlyStopping
from skorch.dataset import ValidSplit

from common import (
    history_rows,
    make_accelerator,
    make_data,
    make_net,
    rank,
    settle_gloo,
    write_result,
)
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
from skorch_accel_callbacks._core import sync


class RankLosses(Callback):
    """A fitted attribute of this rank's own: the sum of the training losses
    it logged and its rank, which a resume must give back to the same rank."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def initialize(self):
        self.total_ = 0.0
        return self

    def on_train_begin(self, net, **kwargs):
        self.total_ = float(sync.process_index(net)) * 1000.0

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.total_ += net.history[-1, 'batches', -1, 'train_loss']


class BatchNormMLP(torch.nn.Module):
    """Running statistics that each rank gathers from its own batches under FSDP2."""

    def __init__(self, n_in=20, hidden=32, n_out=2):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, hidden)
        self.bn = torch.nn.BatchNorm1d(hidden)
        self.out = torch.nn.Linear(hidden, n_out)

    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.bn(self.lin(X)))), dim=-1)


def _local(value):
    """A DTensor's shard of this rank, recursively; other values as they are."""
    if hasattr(value, 'to_local'):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _local(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(item) for item in value)
    return value


def _accelerator(backend):
    if backend == 'fsdp2':
        from fsdp_backend import fsdp_accelerator
        return fsdp_accelerator()
    return make_accelerator()


def _data(agree):
    X, y = make_data(n=320)
    if agree:
        X[:] = X[0]
        y[:] = 0
    return X, y


def run(dirname, tag, backend='ddp', agree=False, every_n_steps=None, async_save=False,
        max_epochs=4, resume='latest', reseed=False):
    accelerator = _accelerator(backend)
    cp = AccelerateCheckpoint(dirname=dirname, every_n_steps=every_n_steps, keep_last=100,
                              async_save=async_save)
    said = []
    load = AccelerateLoadInitState(cp, resume=resume, sink=said.append,
                                   on_world_size_change='reseed' if reseed else 'raise')
    callbacks = [load, cp, ('early', EarlyStopping(patience=100))]
    kwargs = {}
    if agree:
        kwargs.update(module__dropout=0.0, callbacks__epoch_timer=None)
    else:
        # each rank logs its own losses, as stock skorch does: the ranks'
        # histories and EarlyStopping states differ
        kwargs.update(reduce_metrics=False)
        callbacks.append(('rank_losses', RankLosses()))
    if backend == 'fsdp2':
        kwargs.update(module=BatchNormMLP, criterion=torch.nn.NLLLoss)
    torch.manual_seed(0)
    net = make_net(accelerator, callbacks=callbacks, max_epochs=max_epochs,
                   train_split=ValidSplit(5), **kwargs)
    X, y = _data(agree)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        net.fit(X, y)
        proba = net.predict_proba(X)
    early = dict(net.callbacks_)['early']
    write_result(tag, {
        'num_processes': sync.num_processes(net),
        'history': history_rows(net.history),
        'early': {'misses_': early.misses_, 'dynamic_threshold_': early.dynamic_threshold_,
                  'best_epoch_': early.best_epoch_},
        'rank_losses': None if agree else dict(net.callbacks_)['rank_losses'].total_,
        'committed': cp.committed(),
        'loaded_from': load.loaded_from_ and os.path.basename(load.loaded_from_),
        'said': said,
        'warnings': [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
    })
    module = net.accelerator.unwrap_model(net.module_)
    torch.save({'params': _local({key: value for key, value in module.named_parameters()}),
                'buffers': _local(dict(module.named_buffers())),
                'optimizer': _local(net.optimizer_.state_dict()),
                'proba': torch.as_tensor(proba)},
               os.path.join(os.environ.get('RESULT_DIR', '.'), f'{tag}-rank{rank()}.pt'))


def run_all():
    for options in json.loads(os.environ.get('RUNS', '[]')):
        run(**options)


if __name__ == '__main__':
    run_all()
    # FSDP2's own gathers (its forward) leave tensors to gloo's threads
    settle_gloo()
