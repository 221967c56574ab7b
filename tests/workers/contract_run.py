"""Run the resume contract's drawn configurations (tests/callbacks/test_contract_fuzz.py).

A *configuration* is a JSON-able dict drawn by tests/support/contract_fuzz.py: a net
(an MLP, maybe with BatchNorm1d and dropout, on tiny random data), skorch's
own callbacks and a user callback with per-rank state, a schedule of saves,
a script (``fit``, ``fit`` then ``partial_fit``, or two ``fit`` calls with
``warm_start=True``), an interruption and a change between launches. A
*run* is one launch of the user's script for a configuration, in one of
three phases:

- ``reference``: the script uninterrupted, in its own folder;
- ``first``: the script with the interruption armed (a SIGTERM, SIGINT or
  SIGKILL of this process at a drawn training batch, a SIGKILL inside the
  first save after it, or an exception raised by a callback there);
- ``relaunch``: the script again on the first run's folder, with the drawn
  change applied (another hyper-parameter, callback setting, callback order
  or number of processes, with or without ``check_params`` naming it).

:func:`run` does one run in this process (the in-process examples call it);
``python contract_run.py`` does each run of the JSON list in the file
``CONTRACT_RUNS`` names, one after the other in this launch, and writes
each rank's :func:`final_state` to ``RESULT_DIR/<TAG>-rank<r>.pt``. A run
whose interruption is a SIGKILL ends the launch; an exception that is no
expected outcome is written down and ends it too (exit 1).

Every run begins as a fresh process would: the global random generators
seeded as a user's script seeds them, a new ``Accelerator``. The
interruption's callback and the recorder are in the net's callbacks in
every phase, with the same (no) settings: what arms the interruption is the
module's ``ARMED``, which no checkpoint sees.
"""

import json
import os
import random
import re
import signal
import sys
import traceback
import warnings

import numpy as np
import torch
import torch.distributed as dist
from sklearn.base import clone
from skorch.callbacks import (
    BatchScoring,
    Callback,
    EarlyStopping,
    EpochScoring,
    EpochTimer,
    Freezer,
    GradientNormClipping,
    LRScheduler,
    PrintLog,
)
from skorch.dataset import ValidSplit
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, ReduceLROnPlateau, StepLR

from common import (
    NotTrainingState,
    data_pipeline,
    history_rows,
    make_accelerator,
    make_data,
    make_net,
    random_states,
    rank,
    settle_gloo,
)
from fsdp_backend import fsdp_accelerator
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    CheckpointError,
    ParamsCheckpoint,
    TrainingPreempted,
)
from skorch_accel_callbacks._core import sync
from skorch_accel_callbacks.state import find_train_loader
from skorch_accel_callbacks.storage import _local as local_storage

# what arms the interruption of the run under way: {'kind', 'batch', 'who'}
# or None; set by run(), never part of a net's settings
ARMED = None
# the armed run's tag and interruption, kept for a kill inside a save, which
# happens after the batch that armed it
ARMED_TAG = ARMED_KIND = None
# the history's wall-clock time, which differs between any two runs
UNCOMPARED_COLUMNS = frozenset({'dur'})


class FuzzCrash(RuntimeError):
    """The exception a crashing callback raises."""


class MLP(torch.nn.Module):
    def __init__(self, n_in=20, hidden=16, batchnorm=False, dropout=0.0):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, hidden)
        self.norm = torch.nn.BatchNorm1d(hidden) if batchnorm else torch.nn.Identity()
        self.drop = torch.nn.Dropout(dropout)
        self.out = torch.nn.Linear(hidden, 2)

    def forward(self, X):
        hidden = self.drop(torch.relu(self.norm(self.lin(X))))
        # in float32 under bf16 autocast too: skorch's predict converts the
        # output to numpy, which has no bfloat16
        return torch.softmax(self.out(hidden).float(), dim=-1)


def decay(epoch):
    """LambdaLR's lr_lambda: module level, so that it pickles and is described by name."""
    return 0.8 ** epoch


POLICIES = {'StepLR': StepLR, 'CosineAnnealingLR': CosineAnnealingLR, 'LambdaLR': LambdaLR,
            'ReduceLROnPlateau': ReduceLROnPlateau}
LAMBDAS = {'decay': decay}


class PerRankTally(Callback):
    """A user's callback with state of its own rank: its training batches
    and the sum of their losses, as fitted attributes."""

    def __init__(self, scale=1.0):
        self.scale = scale

    def initialize(self):
        self.batches_ = 0
        self.loss_sum_ = 0.0
        return self

    def on_batch_end(self, net, training=False, loss=None, **kwargs):
        if training:
            self.batches_ += 1
            self.loss_sum_ += self.scale * loss.item()


class Interrupt(NotTrainingState, Callback):
    """Interrupt the run as ``ARMED`` says after its ``batch``-th training
    batch (counted over the script's fit calls); ``fired_`` says whether it did."""

    def initialize(self):
        self.seen_ = 0
        self.fired_ = False
        return self

    def on_batch_end(self, net, training=False, **kwargs):
        if not training or ARMED is None:
            return
        self.seen_ += 1
        if self.seen_ != ARMED['batch'] or self.fired_:
            return
        self.fired_ = True
        kind = ARMED['kind']
        everyone = ARMED.get('who', 'all') == 'all'
        write_marker('fired', kind)
        if kind == 'crash':
            raise FuzzCrash(f"fuzz crash after training batch {self.seen_}")
        if kind == 'sigkill':
            die_now()
        if kind == 'sigkill_in_save':
            arm_kill_in_save()
        if kind == 'sigterm' and (everyone or rank() == 0):
            os.kill(os.getpid(), signal.SIGTERM)
        if kind == 'sigint':
            os.kill(os.getpid(), signal.SIGINT)


class Recorder(NotTrainingState, Callback):
    """What the oracle needs beside the state: each epoch's training batches
    on this rank (the loader's length when the epoch begins)."""

    def initialize(self):
        self.loader_batches_ = []
        return self

    def on_epoch_begin(self, net, dataset_train=None, **kwargs):
        loader = find_train_loader(net, dataset_train)
        self.loader_batches_.append(None if loader is None else len(loader))


def write_marker(what, kind):
    """Proof for a launched run that dies by its interruption: ``fired``
    when it is armed, ``killed`` when this rank sends itself the SIGKILL
    (written through to the disk first, so that the test can tell a rank
    that died of its own SIGKILL from one the launcher killed)."""
    out = os.environ.get('RESULT_DIR')
    tag = ARMED_TAG
    if out and tag:
        with open(os.path.join(out, f'{tag}-{what}-rank{rank()}.json'), 'w') as f:
            json.dump({'kind': kind}, f)
            f.flush()
            os.fsync(f.fileno())


def die_now():
    write_marker('killed', ARMED_KIND)
    os.kill(os.getpid(), signal.SIGKILL)


def arm_kill_in_save():
    """SIGKILL the committing process in the next save, once its files are
    written and before the commit (the other ranks fail in a collective);
    replaced where the local folder's commit looks it up."""
    original = local_storage.write_manifest

    def commit_then_die(*args, **kwargs):
        die_now()
        return original(*args, **kwargs)

    local_storage.write_manifest = commit_then_die


# ---------------------------------------------------------------- building

def make_callback(spec, dirname):
    """The callback a drawn spec describes: {'kind', 'name', 'params'}."""
    kind, params = spec['kind'], dict(spec['params'])
    if kind == 'early_stopping':
        return EarlyStopping(**params)
    if kind == 'lr_scheduler':
        policy = POLICIES[params.pop('policy')]
        if 'lr_lambda' in params:
            params['lr_lambda'] = LAMBDAS[params['lr_lambda']]
        return LRScheduler(policy=policy, **params)
    if kind == 'grad_clip':
        return GradientNormClipping(**params)
    if kind == 'epoch_scoring':
        return EpochScoring(**params)
    if kind == 'batch_scoring':
        return BatchScoring(**params)
    if kind == 'freezer':
        return Freezer(**params)
    if kind == 'params_checkpoint':
        return ParamsCheckpoint(dirname=f'{dirname}-params', **params)
    if kind == 'tally':
        return PerRankTally(**params)
    raise ValueError(f"unknown callback kind {kind!r}")


def callback_specs(config, relaunch):
    """The config's callback specs in the order of this phase, with a
    callback setting changed in the relaunch."""
    specs = [dict(spec, index=i) for i, spec in enumerate(config['callbacks'])]
    change = config['change']
    if not relaunch:
        return specs
    if change['kind'] == 'callback':
        target = specs[change['index']]
        # all of the callback's params, drawn anew (contract_fuzz's
        # changed_callback_params): a swapped policy has none of the old's
        specs[change['index']] = dict(target, params=dict(change['params']))
    if change['kind'] == 'reorder':
        specs = [specs[i] for i in change['order']]
    return specs


def net_settings(config, relaunch):
    """The net's own settings of this phase."""
    settings = {key: config[key] for key in ('lr', 'batch_size', 'max_epochs')}
    settings['momentum'] = config['momentum']
    change = config['change']
    if relaunch and change['kind'] == 'net':
        settings[change['param']] = change['value']
    return settings


def check_params(config):
    change = config['change']
    if change.get('allow') and change['kind'] in ('net', 'accelerator'):
        return (change['name'],)
    if change.get('allow') and change['kind'] == 'callback':
        return tuple(change['names'])
    return True


def optimizer_arguments(config, momentum):
    """The net's optimizer and its arguments: SGD with ``momentum``, or Adam
    with it as beta1 (Adam's momentum), which keeps two moments a parameter
    and a step count."""
    if config.get('optimizer', 'sgd') == 'adam':
        return {'optimizer': torch.optim.Adam, 'optimizer__betas': (momentum, 0.999)}
    return {'optimizer': torch.optim.SGD, 'optimizer__momentum': momentum}


def build(config, dirname, relaunch, accelerator):
    """The net of one launch of the config's script, and its callbacks by
    spec index. A relaunch whose change is ``clone`` builds the net on
    another folder, clones it (sklearn's ``clone``, as a search does) and
    sets the folder through ``set_params``, as skorch changes a callback."""
    cloned = relaunch and config['change']['kind'] == 'clone'
    saves = config['saves']
    cp = AccelerateCheckpoint(dirname=dirname + '-other' if cloned else dirname,
                              every_n_epochs=saves['every_n_epochs'],
                              every_n_steps=saves['every_n_steps'],
                              async_save=saves['async_save'], keep_last=saves['keep_last'])
    reseed = relaunch and config['change']['kind'] == 'world_size'
    load = AccelerateLoadInitState(
        cp, check_params=check_params(config) if relaunch else True,
        on_world_size_change='reseed' if reseed else 'raise')
    indices = []
    callbacks = [cp, load]
    for spec in callback_specs(config, relaunch):
        callback = make_callback(spec, dirname)
        indices.append(spec['index'])
        callbacks.append((spec['name'], callback) if spec['name'] else callback)
    callbacks += [Interrupt(), Recorder()]
    settings = net_settings(config, relaunch)
    kwargs = optimizer_arguments(config, settings['momentum'])
    if config['batchnorm']:
        # a training batch of one row is an error of BatchNorm1d
        kwargs['iterator_train__drop_last'] = True
    if config.get('compile'):
        kwargs['compile'] = True
    # workers, the loader's own generator, random rows (contract_fuzz.data_pipelines)
    kwargs.update(data_pipeline(config.get('data', {})))
    net = make_net(
        accelerator, module=MLP, module__hidden=config['hidden'],
        module__batchnorm=config['batchnorm'], module__dropout=config['dropout'],
        lr=settings['lr'], batch_size=settings['batch_size'],
        max_epochs=settings['max_epochs'],
        train_split=ValidSplit(5) if config['valid'] else None,
        warm_start=config['script'] == 'warm_start', callbacks=callbacks, **kwargs)
    if cloned:
        net = clone(net).set_params(callbacks__AccelerateCheckpoint__dirname=dirname)
    built = [cb[1] if isinstance(cb, tuple) else cb for cb in net.callbacks]
    by_index = dict(zip(indices, built[2:2 + len(indices)], strict=True))
    return net, built[0], by_index


def accelerator_for(config, nproc, relaunch=False):
    if config.get('backend') == 'fsdp2' and nproc > 1:
        return fsdp_accelerator()
    return make_accelerator(**accelerator_settings(config, relaunch))


def accelerator_settings(config, relaunch=False):
    """The Accelerator's arguments of this phase (the drawn ones, a
    changed one in the relaunch)."""
    settings = dict(config.get('accelerator', {}))
    change = config['change']
    if relaunch and change['kind'] == 'accelerator':
        settings[change['param']] = change['value']
    return settings


def seed_everything():
    """Seed the global generators as a user's script does at its start."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


def script_calls(config, net):
    if config['script'] == 'fit':
        return [net.fit]
    if config['script'] == 'fit+partial_fit':
        return [net.fit, net.partial_fit]
    return [net.fit, net.fit]


def run(config, dirname, phase, nproc=1, tag=None):
    """One launch of the config's script in this process (every rank calls
    it): its outcome and this rank's final state (:func:`final_state`)."""
    global ARMED, ARMED_TAG, ARMED_KIND
    relaunch = phase == 'relaunch'
    seed_everything()
    accelerator = accelerator_for(config, nproc, relaunch)
    net, cp, by_index = build(config, dirname, relaunch, accelerator)
    X, y = make_data(n=config['rows'], seed=config.get('data_seed', 0))
    ARMED = dict(config['interrupt'], tag=tag) if phase == 'first' \
        and config['interrupt']['kind'] != 'none' else None
    ARMED_TAG, ARMED_KIND = (tag, ARMED['kind']) if ARMED else (None, None)
    outcome = {'status': 'finished', 'phase': phase}
    try:
        for call in script_calls(config, net):
            call(X, y)
            if fired(net) and ARMED['kind'] == 'sigint':
                # skorch ends the fit on a KeyboardInterrupt; the user's
                # Ctrl-C ended the script
                outcome['status'] = 'interrupted'
                break
    except TrainingPreempted as exc:
        outcome.update(status='preempted', checkpoint=exc.checkpoint)
    except FuzzCrash as exc:
        outcome.update(status='crashed', message=str(exc))
    except CheckpointError as exc:
        outcome.update(status='refused', message=str(exc), error=type(exc).__name__)
    finally:
        ARMED = None
        if outcome['status'] != 'finished':
            # as the process's end would: the folder and signal handlers let go
            cp.close()
    outcome['fired'] = fired(net)
    outcome['num_processes'] = sync.num_processes(net) if net.initialized_ else nproc
    outcome['callback_names'] = callback_names(net, by_index)
    outcome['loaded_from'] = next((cb.loaded_from_ for _, cb in getattr(net, 'callbacks_', [])
                                   if isinstance(cb, AccelerateLoadInitState)), None)
    outcome['state'] = final_state(net, cp, by_index) if outcome['status'] in (
        'finished', 'interrupted') else None
    return outcome


def fired(net):
    return any(isinstance(cb, Interrupt) and cb.fired_
               for _, cb in getattr(net, 'callbacks_', []))


def callback_names(net, by_index):
    """The name skorch gave each drawn callback (by spec index)."""
    names = {}
    for name, callback in getattr(net, 'callbacks_', []):
        for index, built in by_index.items():
            if built is callback:
                names[index] = name
    return names


# ---------------------------------------------------------------- state

def plain(value, where='', depth=0):
    """A fitted attribute as torch.equal and == compare it: an object of
    another class by its class and attributes, a callable by its name."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if depth > 6:
        raise ValueError(f"{where}: nested too deep to compare")
    if isinstance(value, dict):
        return {str(key): plain(item, f'{where}.{key}', depth + 1)
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item, f'{where}[{i}]', depth + 1) for i, item in enumerate(value)]
    if hasattr(value, 'state_dict') and not isinstance(value, type):
        return {'state_dict': plain(value.state_dict(), where, depth + 1)}
    if callable(value) or isinstance(value, type):
        return f'<callable {getattr(value, "__qualname__", type(value).__qualname__)}>'
    if hasattr(value, '__dict__'):
        return {'class': type(value).__qualname__,
                **plain(vars(value), where, depth + 1)}
    return f'<{type(value).__qualname__} {value!r}>'


def comparable_history(net):
    """The history's rows as the oracle compares them: without the columns
    no two runs share, every batch's row a plain dict."""
    return [plain(dict(row, batches=[dict(batch) for batch in row.get('batches', [])]))
            for row in history_rows(net.history, drop=UNCOMPARED_COLUMNS)]


def callback_states(net):
    """Each callback's fitted attributes (names ending in ``_``), but the
    checkpoint's own callbacks', the test's and the clocks'."""
    skipped = (AccelerateCheckpoint, AccelerateLoadInitState, Interrupt, Recorder,
               EpochTimer, PrintLog)
    states = {}
    for name, callback in net.callbacks_:
        if isinstance(callback, skipped):
            continue
        states[name] = {attr: plain(value, f'{name}.{attr}')
                        for attr, value in vars(callback).items()
                        if attr.endswith('_') and not attr.startswith('_')}
    return states


def model_and_optimizer(net):
    """The full parameters and optimizer state (under FSDP2 gathered: rank
    0 holds them, a collective) and this rank's own buffers."""
    module = net.module_
    buffers = {name: (buf.to_local() if hasattr(buf, 'to_local') else buf).detach().cpu().clone()
               for name, buf in net.accelerator.unwrap_model(module).named_buffers()}
    if getattr(net.accelerator, 'is_fsdp2', False):
        params, optimizer = get_state_dict(
            module, net.optimizer_.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return plain(params), plain(optimizer), buffers
    params = net.accelerator.unwrap_model(module).state_dict()
    return plain(params), plain(net.optimizer_.state_dict()), buffers


def settings_in_force(net, by_index):
    """The settings as training ran with them at the end: the optimizer's
    groups, a scheduler's base lrs and arguments, each drawn callback's."""
    groups = [{key: plain(value) for key, value in group.items() if key != 'params'}
              for group in net.optimizer_.param_groups]
    callbacks = {}
    for index, callback in by_index.items():
        entry = {key: plain(value) for key, value in callback.get_params(deep=False).items()}
        scheduler = getattr(callback, 'lr_scheduler_', None)
        if scheduler is not None:
            entry['scheduler'] = {key: plain(value) for key, value in vars(scheduler).items()
                                  if not key.startswith('_') and key != 'optimizer'}
        callbacks[index] = entry
    accelerator = {'mixed_precision': str(net.accelerator.mixed_precision),
                   'gradient_accumulation_steps': net.accelerator.gradient_accumulation_steps}
    return {'groups': groups, 'callbacks': callbacks, 'batch_size': net.batch_size,
            'accelerator': accelerator}


def final_state(net, cp, by_index):
    """This rank's state at the end of the script, as the oracle compares it."""
    params, optimizer, buffers = model_and_optimizer(net)
    recorder = next(cb for _, cb in net.callbacks_ if isinstance(cb, Recorder))
    return {
        'params': params, 'optimizer': optimizer, 'buffers': buffers,
        'random': plain(random_states(net)),
        'history': comparable_history(net), 'callbacks': callback_states(net),
        'settings': settings_in_force(net, by_index),
        'global_step': cp.global_step_, 'loader_batches': list(recorder.loader_batches_),
    }


# ---------------------------------------------------------------- load_params

def damage_model(checkpoint, how):
    """Damage the model file of ``checkpoint`` (a folder): ``'grown'`` by a
    byte more, ``'truncated'`` by one less; the file damaged."""
    path = os.path.join(checkpoint, 'model.safetensors')
    if how == 'grown':
        with open(path, 'ab') as f:
            f.write(b'\0')
    else:
        os.truncate(path, os.path.getsize(path) - 1)
    return path


def load_damaged(config, dirname, newest):
    """``net.load_params(checkpoint=...)`` of a plain net on ``dirname``
    after ``newest`` (its newest checkpoint's folder) is damaged as
    ``config['damage']`` says: the warnings that name it, what was loaded
    (the history's epochs) or the error."""
    damage_model(newest, config['damage'])
    seed_everything()
    net = make_net(make_accelerator(), module=MLP, module__hidden=config['hidden'],
                   module__batchnorm=config['batchnorm'], module__dropout=config['dropout'],
                   callbacks=[])
    net.initialize()
    outcome = {'damaged': newest}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            net.load_params(checkpoint=AccelerateCheckpoint(dirname=dirname))
            outcome['epochs'] = len(net.history)
        except CheckpointError as exc:
            outcome['error'] = str(exc)
    # the damaged one's name, not a step checkpoint's that begins with it
    named = re.compile(re.escape(os.path.basename(newest)) + r'(?![\w-])')
    outcome['warnings'] = [str(w.message) for w in caught if named.search(str(w.message))]
    return outcome


# ---------------------------------------------------------------- launched

def main():
    runs = json.loads(open(os.environ['CONTRACT_RUNS']).read())
    out = os.environ.get('RESULT_DIR', '.')
    nproc = int(os.environ.get('WORLD_SIZE', '1'))
    for spec in runs:
        try:
            outcome = run(spec['config'], spec['dirname'], spec['phase'], nproc=nproc,
                          tag=spec['tag'])
        except BaseException as exc:
            outcome = {'status': 'error', 'phase': spec['phase'],
                       'message': f'{type(exc).__name__}: {exc}',
                       'traceback': traceback.format_exc()}
            torch.save(outcome, os.path.join(out, f"{spec['tag']}-rank{rank()}.pt"))
            raise
        torch.save(outcome, os.path.join(out, f"{spec['tag']}-rank{rank()}.pt"))
        if dist.is_initialized():
            # the next run begins on every rank together
            dist.barrier()


if __name__ == '__main__':
    main()
    # the barriers between runs and FSDP2's own gathers leave tensors to
    # gloo's threads
    settle_gloo()
    sys.exit(0)
