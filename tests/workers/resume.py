"""Train with AccelerateCheckpoint + AccelerateLoadInitState; optionally die.

usage: resume.py DIRNAME TAG

Environment:
- SCENARIO: ``basic`` (StepLR, dropout, momentum), ``earlystop`` (plus
  EarlyStopping and ReduceLROnPlateau), ``accumulate`` (gradient
  accumulation over 2 batches), ``midepoch`` (accumulation, plus a scheduler
  stepped every batch, EpochScoring on the training data and EarlyStopping),
  ``twomodules`` (two modules, two optimizers), ``novalid`` (no validation
  data), ``stock`` (skorch's own AccelerateMixin without this package's
  fixes), ``frozen`` (the first layer frozen as the module is built, before
  DDP wraps it: its checkpoints hold it in a file of its own, linked while
  unchanged), ``frozenlater`` (the first layer trains in epoch 1 and
  skorch's ``Freezer`` freezes it from epoch 2 on: the optimizer's momentum
  of it lies in a file of its own too);
- KILL: ``batch:E:B`` SIGKILLs every rank after batch B of epoch E (before
  the checkpoint callback's end of that batch); ``before:E:B`` when batch B
  of epoch E begins (after everything of the batch before); each rank
  first writes ``<TAG>-killed-rank<r>.json`` (where it died);
  ``save:E`` SIGKILLs the committing rank inside the save at the end of
  epoch E, after every file is written and before the commit (the other
  ranks then fail in the next collective);
- SIGNAL: ``E:B:WHO[:NAME]`` after batch B of epoch E sends signal NAME
  (default SIGTERM): WHO ``parent`` is rank 0 signalling its parent (the
  ``torchrun`` agent, which passes it on to every worker), ``group`` rank 0
  signalling its parent's process group (as a terminal's Ctrl-C does),
  ``rank<R>`` is rank R signalling itself;
- FAIL: ``R:E`` makes rank R's write of its own checkpoint file fail with
  ENOSPC at the end of epoch E;
- CKPT_OPTIONS: JSON of extra AccelerateCheckpoint arguments;
- LOAD_OPTIONS: JSON of extra AccelerateLoadInitState arguments;
- MAX_EPOCHS: the epochs to train in total, instead of the scenario's;
- DATA: JSON of the training data pipeline (:func:`data_pipeline`): the
  loader's ``num_workers``, ``persistent_workers``, ``pin_memory``,
  ``prefetch_factor``, ``multiprocessing_context``, ``generator`` (a seed:
  the loader shuffles with a generator of its own), ``sampler``
  (``weighted``: a WeightedRandomSampler; ``batch``: a BatchSampler over a
  RandomSampler) and ``augment`` (``torch``, ``numpy``, ``python``:
  ``__getitem__`` adds noise drawn from that module's global generator, as
  random augmentation does);
- PER_NODE=1: ``save_on_each_node=True`` and a folder per node
  (``DIRNAME/node<k>``), as on machines without a shared filesystem;
  SHARED_PER_NODE=1: ``save_on_each_node=True`` with one shared folder (an error).

Every rank writes ``<TAG>-rank<r>.pt`` (parameters, optimizer state, history,
random states) and ``<TAG>-rank<r>.json`` to RESULT_DIR when training ends.
A resumed run's rank 0 also writes ``<TAG>-resumed-rank0.pt``, the same when
its first epoch begins, and every rank's JSON has the digests of its random
states then (``at_resume``), the folders whose optimizers' files it read
ahead, on which thread and whether it began before the checkpoint was
chosen (``read_ahead``), how many optimizer states
each load was handed instead of reading its files (``loaded_read_ahead``),
the folders whose files it read into the page cache while the net
initialized (``page_cache_fills``) and the warnings it showed (``warnings``).
"""

import errno
import hashlib
import json
import os
import random
import signal
import sys
import threading
import warnings

import numpy as np
import torch
from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration
from skorch.callbacks import Callback, EarlyStopping, EpochScoring, Freezer, LRScheduler
from skorch.dataset import ValidSplit
from torch.optim.lr_scheduler import CyclicLR, ReduceLROnPlateau, StepLR

from common import (
    MLP,
    BatchEnds,
    FixedNet,
    FrozenBaseMLP,
    NotTrainingState,
    StockNet,
    data_pipeline,
    history_rows,
    make_accelerator,
    make_data,
    make_net,
    params_digest,
    plain_criterion,
    rank,
    write_final_state,
    write_result,
)
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState, TrainingPreempted
from skorch_accel_callbacks._core import accelerate_io, sync
from skorch_accel_callbacks.callbacks import load_state as load_state_callback
from skorch_accel_callbacks.engine import PageCacheFill, _writer as writer
from skorch_accel_callbacks.engine._read_ahead import OptimizerReadAhead
from skorch_accel_callbacks.state import find_train_loader
from skorch_accel_callbacks.storage import _local as local_storage


class KillBefore(Callback):
    """Die like a preempted node when batch ``batch`` of ``epoch`` begins,
    after every callback finished the batch before (its checkpoint too)."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, epoch, batch, tag):
        self.epoch = epoch
        self.batch = batch
        self.tag = tag

    def on_batch_begin(self, net, training=False, **kwargs):
        if not training:
            return
        # skorch added this batch's row already
        batch = len([b for b in net.history[-1]['batches'] if 'train_loss' in b]) + 1
        if (len(net.history), batch) == (self.epoch, self.batch):
            write_result(f'{self.tag}-killed', {'epoch': self.epoch, 'batch': self.batch})
            os.kill(os.getpid(), signal.SIGKILL)


class KillAt(BatchEnds):
    """Die like a preempted node after batch ``batch`` of ``epoch``: SIGKILL,
    no cleanup, no Python exit."""

    def __init__(self, epoch, batch):
        self.epoch = epoch
        self.batch = batch

    def at_batch(self, net, batch):
        if len(net.history) == self.epoch and batch == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_inside_save(epoch):
    """SIGKILL the committer after the checkpoint files are written, before
    commit (replaced where the local folder's commit looks it up)."""
    original = local_storage.write_manifest

    def commit_then_die(folder, sealed, *args, **kwargs):
        if sealed['epoch'] == epoch:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(folder, sealed, *args, **kwargs)

    local_storage.write_manifest = commit_then_die


def fail_upload(epoch):
    """Make this rank's upload of ``epoch-<epoch>`` fail, as with the network
    down; ``failed-upload`` in RESULT_DIR proves it fired."""
    import s3fs
    put_file = s3fs.S3FileSystem._put_file

    async def network_down(self, lpath, rpath, *args, **kwargs):
        if f'/epoch-{epoch:04d}/' in rpath:
            write_result('failed-upload', {'path': rpath})
            raise OSError(errno.ENETUNREACH, 'Network is unreachable', rpath)
        return await put_file(self, lpath, rpath, *args, **kwargs)

    s3fs.S3FileSystem._put_file = network_down


def fail_save(failing_rank, epoch):
    """Make one rank's write fail as on a full disk (replaced where the
    writer looks it up)."""
    original = writer.save_rank_state

    def no_space(folder, rank_, *args, **kwargs):
        if rank_ == failing_rank and folder.endswith(f'epoch-{epoch:04d}.partial'):
            raise OSError(errno.ENOSPC, 'No space left on device', folder)
        return original(folder, rank_, *args, **kwargs)

    writer.save_rank_state = no_space


def record_read_ahead():
    """What each resume read ahead, whether it began that read before the
    checkpoint was chosen (while the committer checked it), and what it
    handed to the load, as it happens (replaced where the read ahead, the
    resume and the load look them up); returns the lists that fill."""
    reads, handed = [], []
    read, load = accelerate_io.read_optimizer_states, accelerate_io.load_state
    begin, choose = OptimizerReadAhead.begin, load_state_callback.choose_checkpoint
    choosing = threading.local()

    def recorded_begin(self, folder):
        reads.append({'folder': os.fspath(folder),
                      'while_choosing': getattr(choosing, 'now', False)})
        begin(self, folder)

    def recorded_choose(*args, **kwargs):
        choosing.now = True
        try:
            return choose(*args, **kwargs)
        finally:
            choosing.now = False

    def recorded_read(folder, *args):
        begun = [entry for entry in reads
                 if entry['folder'] == os.fspath(folder) and 'thread' not in entry]
        entry = begun[0] if begun else {'folder': os.fspath(folder), 'while_choosing': None}
        entry['thread'] = threading.current_thread().name
        if not begun:  # a read that no read ahead began
            reads.append(entry)
        return read(folder, *args)

    def recorded_load(accelerator, folder, frozen_parts=None, optimizer_states=None):
        if optimizer_states is None:
            handed.append(None)
            return load(accelerator, folder, frozen_parts)

        def take():
            states = optimizer_states()
            handed.append(None if states is None else len(states))
            return states

        return load(accelerator, folder, frozen_parts, take)

    OptimizerReadAhead.begin = recorded_begin
    load_state_callback.choose_checkpoint = recorded_choose
    accelerate_io.read_optimizer_states = recorded_read
    accelerate_io.load_state = recorded_load
    return reads, handed


def record_page_cache_fills():
    """The folders of the page cache fills this process begins; returns
    the list that fills."""
    folders = []
    begin = PageCacheFill.__init__

    def recorded(self, folder):
        folders.append(os.fspath(folder))
        begin(self, folder)

    PageCacheFill.__init__ = recorded
    return folders


def record_warnings():
    """The text of each warning this process shows, shown as before;
    returns the list that fills."""
    shown = []
    show = warnings.showwarning

    def recorded(message, category, *args, **kwargs):
        shown.append(f'{category.__name__}: {message}')
        show(message, category, *args, **kwargs)

    warnings.showwarning = recorded
    return shown


class SendSignal(BatchEnds):
    """Signal a process after batch ``batch`` of ``epoch``, as a scheduler
    about to preempt the job would."""

    def __init__(self, epoch, batch, who, name):
        self.epoch = epoch
        self.batch = batch
        self.who = who
        self.name = name

    def at_batch(self, net, batch):
        if len(net.history) != self.epoch or batch != self.batch:
            return
        sig = getattr(signal, self.name)
        if self.who == 'parent' and rank() == 0:
            os.kill(os.getppid(), sig)
        elif self.who == 'group' and rank() == 0:
            os.killpg(os.getpgid(os.getppid()), sig)
        elif self.who == f'rank{rank()}':
            os.kill(os.getpid(), sig)


class Trained(NotTrainingState, Callback):
    """Where training is: epoch and training batches of it (``where``)."""

    def initialize(self):
        self.where = None
        return self

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            batches = [b for b in net.history[-1]['batches'] if 'train_loss' in b]
            self.where = [len(net.history), len(batches)]


class RecordWrapping(Callback):
    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def on_epoch_end(self, net, **kwargs):
        self.module_type_ = type(net.module_).__name__


def _digest(*tensors):
    digest = hashlib.blake2b(digest_size=8)
    for tensor in tensors:
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


class RecordResume(NotTrainingState, Callback):
    """What a resumed run starts its first epoch with: the loaded state
    (rank 0 writes it to ``<TAG>-resumed-rank0.pt``) and the digests of
    each rank's random states (``rng_`` for the JSON result)."""

    def __init__(self, tag):
        self.tag = tag

    def initialize(self):
        self.rng_ = None
        return self

    def on_epoch_begin(self, net, dataset_train=None, **kwargs):
        loaded = any(getattr(cb, 'loaded_from_', None) for _, cb in net.callbacks_)
        if not loaded or self.rng_ is not None:
            return
        loader = find_train_loader(net, dataset_train)
        generator = getattr(loader, 'synchronized_generator', None)
        self.rng_ = {
            'torch': _digest(torch.get_rng_state()),
            'numpy': _digest(torch.from_numpy(np.random.get_state()[1].copy())),
            'python': hashlib.blake2b(repr(random.getstate()).encode()).hexdigest(),
            'loader': None if generator is None else _digest(generator.get_state()),
        }
        if rank() == 0:
            save_state(net, net.history[:-1], f'{self.tag}-resumed-rank0.pt')


HISTORY_KEYS = ('epoch', 'train_loss', 'valid_loss', 'event_acp', 'event_lr', 'train_acc',
                'train_batch_count')


def save_state(net, history, name):
    """Rank 0's parameters, optimizer states and ``history`` to RESULT_DIR."""
    modules = {name: getattr(net, name + '_') for name in net._modules}
    torch.save({
        'params': {name: net.accelerator.unwrap_model(m).state_dict()
                   for name, m in modules.items()},
        'optimizers': {name: getattr(net, name + '_').state_dict()
                       for name in net._optimizers},
        'history': history_rows(history, keep=HISTORY_KEYS),
    }, os.path.join(os.environ.get('RESULT_DIR', '.'), name))


class TwoModuleNet(FixedNet):
    """A second module with its own optimizer, as in skorch's docs."""

    def initialize_module(self):
        super().initialize_module()
        self.head2_ = MLP(n_in=2, hidden=4, n_out=2, dropout=0.0)
        return self

    def initialize_optimizer(self, *args, **kwargs):
        super().initialize_optimizer(*args, **kwargs)
        self.optimizer2_ = torch.optim.SGD(self.head2_.parameters(), lr=0.05, momentum=0.9)
        return self

    def infer(self, x, **fit_params):
        return self.head2_(super().infer(x, **fit_params))


def build(dirname, scenario, ckpt_options):
    accelerator_kwargs = {}
    if os.environ.get('PER_NODE') == '1' or os.environ.get('SHARED_PER_NODE') == '1':
        accelerator_kwargs['project_config'] = ProjectConfiguration(save_on_each_node=True)
    if os.environ.get('PER_NODE') == '1':
        dirname = os.path.join(dirname, f"node{os.environ['GROUP_RANK']}")
    if os.environ.get('STAGING_PER_NODE'):
        # a store's staging folder on each node's own disk
        ckpt_options = dict(ckpt_options, local_dir=os.path.join(
            os.environ['STAGING_PER_NODE'], f"node{os.environ['GROUP_RANK']}"))
    if os.environ.get('OUTAGE_SECONDS'):
        # how long a store's failing requests are sent again
        ckpt_options = dict(ckpt_options, outage_seconds=float(os.environ['OUTAGE_SECONDS']))
    if scenario in ('accumulate', 'midepoch'):
        accelerator_kwargs['gradient_accumulation_steps'] = 2
    if scenario == 'frozenlater':
        # DDP waits for a gradient of every parameter that trained when it
        # wrapped the module, unless told that some may have none
        accelerator_kwargs['handlers'] = [DistributedDataParallelKwargs(
            find_unused_parameters=True)]
    accelerator = make_accelerator(**accelerator_kwargs)
    cp = AccelerateCheckpoint(dirname=dirname, **ckpt_options)
    load_options = json.loads(os.environ.get('LOAD_OPTIONS', '{}'))
    callbacks = [AccelerateLoadInitState(cp, **load_options), cp]
    kwargs = dict(max_epochs=6, train_split=ValidSplit(5))
    if scenario == 'earlystop':
        # listed before the checkpoint's own hooks on purpose: the callbacks
        # reorder themselves so that the saved state is the end-of-epoch one
        callbacks = [
            AccelerateLoadInitState(cp, **load_options),
            cp,
            LRScheduler(policy=ReduceLROnPlateau, monitor='valid_loss',
                        patience=0, factor=0.5),
            EarlyStopping(patience=2, threshold=0.02),
        ]
        kwargs.update(max_epochs=30, lr=0.5)
    else:
        # step_size=3: a scheduler rebuilt at resume after epoch 3 would step the lr
        callbacks.append(LRScheduler(policy=StepLR, step_size=3, gamma=0.5))
    if scenario == 'midepoch':
        # state within an epoch: cached training predictions, a scheduler
        # stepped every batch, and EarlyStopping's counters
        callbacks += [
            EpochScoring('accuracy', on_train=True, name='train_acc'),
            ('batch_lr', LRScheduler(policy=CyclicLR, base_lr=0.01, max_lr=0.1,
                                     step_size_up=3, step_every='batch')),
            EarlyStopping(patience=3, threshold=0.0),
        ]
    if scenario == 'novalid':
        kwargs['train_split'] = None
    if scenario == 'frozen':
        kwargs['module'] = FrozenBaseMLP
    if scenario == 'frozenlater':
        # a DDP-wrapped module's parameters are named module.lin.*
        callbacks.append(Freezer('*lin.*', at=2))
    net_cls = TwoModuleNet if scenario == 'twomodules' else FixedNet
    if scenario == 'stock':
        net_cls = StockNet
        kwargs['criterion'] = plain_criterion
    if os.environ.get('MAX_EPOCHS'):
        kwargs['max_epochs'] = int(os.environ['MAX_EPOCHS'])
    # ValidSplit(5) of the 320 rows main() fits
    kwargs.update(data_pipeline(json.loads(os.environ.get('DATA', '{}')), train_rows=256))
    net = make_net(accelerator, net_cls=net_cls, callbacks=callbacks, **kwargs)
    return net, accelerator, cp


def main():
    dirname, tag = sys.argv[1], sys.argv[2]
    scenario = os.environ.get('SCENARIO', 'basic')
    kill = os.environ.get('KILL', '')
    ckpt_options = json.loads(os.environ.get('CKPT_OPTIONS', '{}'))
    # every global generator a data set may draw from (DATA's augment), the
    # validation rows' too, which are read in this process
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    net, accelerator, cp = build(dirname, scenario, ckpt_options)
    # written before training, so a launch that ends in an expected error
    # still shows how many processes it ran in
    write_result(f'{tag}-started', {'num_processes': accelerator.num_processes})
    recorder = RecordWrapping()
    at_resume = RecordResume(tag)
    trained = Trained()
    reads, handed = record_read_ahead()
    fills = record_page_cache_fills()
    shown = record_warnings()
    net.callbacks.extend([recorder, at_resume, trained])
    if kill.startswith('batch:'):
        _, epoch, batch = kill.split(':')
        net.callbacks.append(KillAt(int(epoch), int(batch)))
    elif kill.startswith('before:'):
        _, epoch, batch = kill.split(':')
        net.callbacks.append(KillBefore(int(epoch), int(batch), tag))
    elif kill.startswith('save:'):
        kill_inside_save(int(kill.split(':')[1]))
    if os.environ.get('FAIL_UPLOAD'):
        failing_rank, epoch = map(int, os.environ['FAIL_UPLOAD'].split(':'))
        if rank() == failing_rank:
            fail_upload(epoch)
    if os.environ.get('FAIL'):
        fail_save(*map(int, os.environ['FAIL'].split(':')))
    if os.environ.get('SIGNAL'):
        epoch, batch, who, *name = os.environ['SIGNAL'].split(':')
        net.callbacks.append(SendSignal(int(epoch), int(batch), who,
                                        name[0] if name else 'SIGTERM'))

    X, y = make_data(n=320)
    try:
        net.fit(X, y)
    except TrainingPreempted as exc:
        write_result(tag, {
            'num_processes': sync.num_processes(net),
            'preempted': {'signal': exc.signal.name, 'checkpoint': exc.checkpoint,
                          'trained': trained.where},
        })
        raise

    write_result(tag, {
        'num_processes': sync.num_processes(net),
        'module_type': getattr(recorder, 'module_type_', None),
        'digest': params_digest(net.module_),
        'history': history_rows(net.history, keep=HISTORY_KEYS),
        'registry': [len(accelerator._models), len(accelerator._optimizers)],
        'committed': cp.committed(),
        'loaded_from': [cb.loaded_from_ for _, cb in net.callbacks_
                        if isinstance(cb, AccelerateLoadInitState)][0],
        'max_epochs_after': net.max_epochs,
        'at_resume': at_resume.rng_,
        'read_ahead': reads,
        'loaded_read_ahead': handed,
        'page_cache_fills': fills,
        'warnings': shown,
    })
    write_final_state(net, tag, HISTORY_KEYS)

if __name__ == '__main__':
    main()
