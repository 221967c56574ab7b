"""Shared pieces of the scripts that the tests run in several processes."""

import atexit
import json
import os
import random
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import InitProcessGroupKwargs
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback
from skorch.dataset import Dataset
from skorch.hf import AccelerateMixin
from torch.utils.data import BatchSampler, RandomSampler, WeightedRandomSampler

from skorch_accel_callbacks import AccelerateFixesMixin

# a hang in a collective fails the run after this many seconds instead of 30 minutes
COLLECTIVE_TIMEOUT = int(os.environ.get('COLLECTIVE_TIMEOUT', '60'))
# 'cuda' runs one-process tests on a GPU (a GPU machine checks the CUDA random
# states and the grad scaler with them); CI has none, and gloo needs the CPU
TEST_DEVICE = os.environ.get('SKORCH_ACCEL_TEST_DEVICE', 'cpu')
# see settle_gloo
_GLOO_SETTLE_S = 0.2


class FixedNet(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    """The net most tests use: skorch's mixin with this package's fixes."""


class StockNet(AccelerateMixin, NeuralNetClassifier):
    """skorch's own mixin, unchanged."""


class MLP(torch.nn.Module):
    def __init__(self, n_in=20, hidden=32, n_out=2, dropout=0.2):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, hidden)
        self.drop = torch.nn.Dropout(dropout)
        self.out = torch.nn.Linear(hidden, n_out)

    def forward(self, X):
        return torch.softmax(self.out(self.drop(torch.relu(self.lin(X)))), dim=-1)


class FrozenBaseMLP(MLP):
    """The MLP with its first layer frozen as it is built (before DDP wraps
    it), as a pretrained base is: its checkpoints hold that layer in a file
    of its own, linked while unchanged."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lin.requires_grad_(False)


class FreezeBaseAfterFirstStep(Callback):
    """Freezes the MLP's first layer after the first training step, in one
    process (a layer frozen after DDP wrapped it would hold DDP's reduction
    up): the optimizer keeps that layer's state (SGD's momentum), which its
    checkpoints hold in a file of their own beside the optimizer's, linked
    while unchanged, as the layer's weights are beside the model's. The step
    is the run's first: a relaunch after it restores the frozen flags."""

    def on_batch_end(self, net, training=False, **kwargs):
        if training and len(net.history) == 1 and len(net.history[-1]['batches']) == 1:
            net.module_.lin.requires_grad_(False)


def log_nll(y_pred, y):
    return torch.nn.functional.nll_loss(torch.log(y_pred), y)


def plain_criterion():
    # skorch calls the criterion to build it; a function is not an nn.Module,
    # so skorch's stock mixin does not wrap it in DDP (which refuses skorch's
    # default NLLLoss: it has no parameters)
    return log_nll


@atexit.register
def _destroy_process_group():
    # a clean end of every launch; the abort at interpreter exit
    # (pytorch/pytorch#190489) is prevented in skorch_accel_callbacks._core.sync
    # (also for a FixedNet's predictions) and, after a StockNet's
    # predictions, by settle_gloo, not here
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def make_accelerator(handlers=(), **kwargs):
    AcceleratorState._reset_state(True)
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT)),
                *handlers]
    accelerator = Accelerator(cpu=TEST_DEVICE == 'cpu', kwargs_handlers=handlers, **kwargs)
    # a launched worker that fell back to one process would pass its test
    # without exercising DDP
    launched = int(os.environ.get('WORLD_SIZE', '1'))
    if accelerator.num_processes != launched:
        raise RuntimeError(f"launched with WORLD_SIZE={launched}, but the accelerator "
                           f"runs {accelerator.num_processes} process(es)")
    return accelerator


def make_data(n=256, n_features=20, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.randn(n, n_features).astype(np.float32)
    w = rng.randn(n_features)
    y = (X @ w + 0.5 * rng.randn(n) > 0).astype(np.int64)
    return X, y


def plain_net(callbacks=(), **kwargs):
    """A skorch net of :class:`MLP` without accelerate, not fitted:
    ``callbacks`` and ``kwargs`` over quiet defaults, no validation split."""
    params = dict(module=MLP, max_epochs=2, lr=0.1, callbacks=list(callbacks),
                  train_split=None, verbose=0)
    params.update(kwargs)
    return NeuralNetClassifier(**params)


def history_rows(history, drop=('dur',), keep=None):
    """The rows of a skorch history as plain dicts, to compare runs: every
    column but ``drop`` (the times, which no two runs share), or only the
    columns ``keep`` (None where a row lacks one)."""
    if keep is not None:
        return [{key: row.get(key) for key in keep} for row in history]
    return [{key: value for key, value in row.items() if key not in drop} for row in history]


def make_net(accelerator, net_cls=FixedNet, **kwargs):
    params = dict(
        module=MLP, max_epochs=2, lr=0.1, batch_size=32,
        optimizer=torch.optim.SGD, optimizer__momentum=0.9,
        iterator_train__shuffle=True, accelerator=accelerator, verbose=0,
    )
    if kwargs.get('optimizer', torch.optim.SGD) is not torch.optim.SGD:
        del params['optimizer__momentum']  # SGD's
    params.update(kwargs)
    return net_cls(**params)


class Augmented(Dataset):
    """skorch's Dataset whose rows get noise drawn from a global generator
    (``augment``: torch, numpy or python) each time they are read, as
    random augmentation does (torchvision's transforms draw from torch's)."""

    def __init__(self, X, y=None, length=None, augment='torch'):
        super().__init__(X, y, length=length)
        self.augment = augment

    def __getitem__(self, i):
        Xi, yi = super().__getitem__(i)
        if self.augment == 'torch':
            noise = torch.rand(Xi.shape).numpy()
        elif self.augment == 'numpy':
            noise = np.random.rand(*Xi.shape)
        else:
            noise = np.array([random.random() for _ in range(Xi.shape[0])])
        return (Xi + 0.1 * noise).astype(np.float32), yi


def data_pipeline(options, train_rows=None):
    """The net's arguments for the training data pipeline that ``options``
    (the DATA environment variable, decoded) describes; ``train_rows``, the
    number of training rows, is needed by its samplers."""
    kwargs = {f'iterator_train__{key}': options[key] for key in
              ('num_workers', 'persistent_workers', 'pin_memory', 'prefetch_factor',
               'multiprocessing_context') if key in options}
    if options.get('generator') is not None:
        kwargs['iterator_train__generator'] = torch.Generator().manual_seed(options['generator'])
    if options.get('sampler') == 'weighted':
        weights = torch.linspace(0.2, 1.0, train_rows, dtype=torch.float64)
        kwargs.update(iterator_train__shuffle=False, iterator_train__sampler=WeightedRandomSampler(
            weights, train_rows, generator=kwargs.get('iterator_train__generator')))
    elif options.get('sampler') == 'batch':
        sampler = RandomSampler(range(train_rows),
                                generator=kwargs.get('iterator_train__generator'))
        kwargs.update(iterator_train__shuffle=False, iterator_train__batch_size=1,
                      iterator_train__batch_sampler=BatchSampler(sampler, 32, drop_last=False))
    if options.get('augment'):
        kwargs.update(dataset=Augmented, dataset__augment=options['augment'])
    return kwargs


class Counter:
    """A custom object registered for checkpointing
    (``accelerator.register_for_checkpointing``)."""

    def __init__(self):
        self.count = 3

    def state_dict(self):
        return {'count': self.count}

    def load_state_dict(self, state):
        self.count = state['count']


class NotTrainingState:
    """Mixin for a test callback whose attributes record what happened, not
    training state: a checkpoint holds nothing of it, a resume restores
    nothing, and its settings are not recorded (it may come, go and change
    between launches)."""

    unrecorded_params = True

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class CountBatches(Callback):
    """Counts the fit's training batches (``seen_``) and fails the fit with
    ``RuntimeError('crash')`` after batch ``fail_at`` (None: never). It acts
    on every batch and has no ``state_dict``: what a resume inside an epoch
    cannot vouch for."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def initialize(self):
        self.seen_ = 0
        return self

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.seen_ += 1
            if self.seen_ == self.fail_at:
                raise RuntimeError('crash')


class FailAt(NotTrainingState, CountBatches):
    """:class:`CountBatches` that says it holds no training state, which a
    resume inside an epoch then vouches for."""


class Snapshot(NotTrainingState, Callback):
    """The module's parameters at the end of every epoch, by epoch."""

    def initialize(self):
        self.params_ = {}
        return self

    def on_epoch_end(self, net, **kwargs):
        module = net.accelerator.unwrap_model(net.module_)
        self.params_[len(net.history)] = {
            key: value.detach().clone() for key, value in module.state_dict().items()}


class UploadsEnded(Callback):
    """At the beginning of each epoch of ``epochs``, on the process that uploads,
    wait (up to ``timeout`` s) until the uploads to the store queued so far
    ended: a save does not wait for a running upload, so a failure among
    them is raised by the next save only once it ended; this makes it so.
    Raises if they did not end in time."""

    # observes, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, epochs, timeout=30):
        self.epochs = epochs
        self.timeout = timeout

    def on_epoch_begin(self, net, **kwargs):
        from concurrent import futures
        if len(net.history) not in self.epochs:
            return
        storage = dict(net.callbacks_)['AccelerateCheckpoint'].folder_
        pending = list(getattr(storage, '_pending', []))
        if futures.wait(pending, timeout=self.timeout).not_done:
            raise RuntimeError(f"the uploads to {storage.dirname} did not end in "
                               f"{self.timeout} s")


class BatchEnds(Callback):
    """Counts the training batches of each epoch: ``at_batch(net, batch)``
    runs at the end of each, with its number in the epoch (from 1). The
    jobs' kill points at batch ends subclass it."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def initialize(self):
        self.batches_ = 0
        return self

    def on_epoch_begin(self, net, **kwargs):
        self.batches_ = 0

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.batches_ += 1
            self.at_batch(net, self.batches_)

    def at_batch(self, net, batch):
        raise NotImplementedError


def rank():
    return int(os.environ.get('RANK', '0'))


def write_result(name, obj):
    """Write this rank's result for the test to read."""
    out = os.environ.get('RESULT_DIR', '.')
    with open(os.path.join(out, f'{name}-rank{rank()}.json'), 'w') as f:
        json.dump(obj, f)


def settle_gloo():
    """End a launch whose last collective was skorch's own gather: the
    predictions of a ``StockNet``.

    skorch's ``evaluation_step`` gathers every batch of ``predict`` through
    accelerate, which lets go of the gathered tensors while a gloo worker
    thread still holds them; when that thread frees them after the
    interpreter began to exit, the process aborts (pytorch/pytorch#190489).
    A ``FixedNet`` gathers through ``sync.gather_for_metrics``, which holds
    them until gloo let go (test_mixin counts them), as the package's other
    exchanges do (test_foundation): its launches need no settling. gloo
    offers no way to wait for its threads: one more collective does not do
    (a probe found the gather still held after it in 11 of 600 predicts, by
    a thread the two busy cores had not scheduled yet), so the main thread
    lets go of the GIL long enough for any such thread to run (0 of 600
    held after it). Call it as the last step of a launch that succeeded.
    """
    if dist.is_initialized() and dist.get_backend() == 'gloo':
        time.sleep(_GLOO_SETTLE_S)


def params_digest(module):
    """A rank-comparable fingerprint of a module's parameters."""
    return float(sum(p.detach().double().sum() * (i + 1)
                     for i, p in enumerate(module.parameters())))


def random_states(net):
    """The states of every random generator training draws from: torch's,
    numpy's and Python's global ones, and each ``torch.Generator`` among the
    net's loader arguments (a loader's or a sampler's own), by argument."""
    name, mt, pos, has_gauss, gauss = np.random.get_state()
    states = {
        'torch': torch.get_rng_state(),
        'numpy': [name, torch.from_numpy(mt.copy()), pos, has_gauss, gauss],
        'python': random.getstate(),
    }
    for key, value in net.get_params(deep=False).items():
        if not key.startswith('iterator_'):
            continue
        # the generator itself, a sampler's, a batch sampler's sampler's
        for path, obj in (('', value), ('.generator', getattr(value, 'generator', None)),
                          ('.sampler.generator',
                           getattr(getattr(value, 'sampler', None), 'generator', None))):
            if isinstance(obj, torch.Generator):
                states[key + path] = obj.get_state()
    return states


def write_final_state(net, tag, history_keys=('epoch', 'train_loss', 'valid_loss', 'event_lr')):
    """This rank's parameters, optimizer states, history (its ``history_keys``)
    and random states at the end of training, to RESULT_DIR's
    ``<TAG>-rank<r>.pt`` (testutil.final_state reads every rank's)."""
    accelerator = net.accelerator
    torch.save({
        'params': {name: accelerator.unwrap_model(getattr(net, name + '_')).state_dict()
                   for name in net._modules},
        'optimizers': {name: getattr(net, name + '_').state_dict() for name in net._optimizers},
        'history': [{key: row.get(key) for key in history_keys} for row in net.history],
        'random': random_states(net),
    }, os.path.join(os.environ.get('RESULT_DIR', '.'), f'{tag}-rank{rank()}.pt'))
