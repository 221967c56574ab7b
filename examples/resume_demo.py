"""Kill a distributed skorch run, preempt another, relaunch both, get the same model.

The main job of this project (``make demo``). It trains a small network on
scikit-learn's digits in 2 processes (``torchrun``; CPU unless CUDA is there),
with a checkpoint every ``EVERY_N_STEPS`` optimizer steps besides every epoch:

1. uninterrupted, for ``--epochs`` epochs;
2. the same command again, SIGKILLed (every rank and ``torchrun``, like a
   machine that dies) in the middle of epoch ``--kill-epoch``;
3. exactly the same command as 2, which resumes from the last complete
   checkpoint (a step checkpoint inside that epoch) and trains what is left;
4. the same command again in a third folder, sent SIGTERM (to ``torchrun``,
   as a scheduler preempting the job does) in the middle of epoch
   ``--sigterm-epoch``: every rank saves at the next step the ranks agree
   on the signal and stops (torchrun then reports the signal with a
   traceback of its own, which is expected and shown as one line);
5. exactly the same command as 4, which resumes at the batch it stopped at.

The ranks agree on a signal about every 0.5 s, and this network trains an
epoch in a fraction of that: so that the SIGTERM lands inside an epoch, as
it does in a real training, runs 4 and 5 take ``SLOW_BATCH_SECONDS`` longer
per batch (a sleep, which changes no number).

Then it prints the per-epoch log of the three runs side by side with the work
each interruption lost (in batches: since the last step checkpoint for the
SIGKILL, none for the SIGTERM), compares the final parameters and optimizer
state of run 1 with runs 2+3 and 4+5 with ``torch.equal``, and plots the loss
curves with the interruptions marked (``<out>/loss_curves.png``). Last, it
lists the checkpoint folder of run 2+3 with the package's command,
``python -m skorch_accel_callbacks list``. The exit code is 0 when everything
is bit-identical and 1 when anything differs.

With ``--store s3`` (``make demo-s3``) the checkpoints go to an S3 bucket
instead, on a local S3 server (moto's) that this script starts and that
outlives its launches; their processes reach it through the ``AWS_*``
variables. It runs 1, 4 and 5: the preempted run's checkpoint taken on the
signal is uploaded before it exits, its local staging folder is deleted (a
new machine has none), and the relaunch resumes from the bucket. Last, it
lists the run's checkpoints in the bucket.

usage: python examples/resume_demo.py [--nproc 2] [--epochs 10] [--out runs/demo]
       [--store local|s3]

With ``--nproc 1`` it runs one process. On a machine with CUDA each process
uses a GPU (``--nproc`` at most the number of GPUs) unless ``--cpu`` is given.
"""

import argparse
import contextlib
import itertools
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, LRScheduler
from skorch.dataset import ValidSplit
from skorch.hf import AccelerateMixin
from torch.optim.lr_scheduler import CosineAnnealingLR

from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateFixesMixin,
    AccelerateLoadInitState,
    TrainingPreempted,
)

SEED = 0
# Lines a worker writes for this script to act on; they are not echoed.
MARK = '@demo '
# A checkpoint every this many optimizer steps (about 23 an epoch with 2
# processes), besides the one at the end of every epoch.
EVERY_N_STEPS = 10
# The SIGKILL comes after this many training batches of the kill epoch, the
# SIGTERM after this many of its epoch, so that both land inside an epoch.
KILL_AFTER_BATCH = 12
SIGTERM_AFTER_BATCH = 3
# Runs 4 and 5 sleep this long after each training batch: the ranks agree on
# signals about every 0.5 s, and a signal is acted on within about two such
# intervals, which is ~10 of these batches, well inside an epoch's 23.
SLOW_BATCH_SECONDS = 0.1
# What torchrun ends with when it is sent SIGTERM: a traceback of its own
# SignalException (it forwarded the signal and the ranks stopped as meant).
TORCHRUN_SIGNAL_EXCEPTION = 'torch.distributed.elastic.multiprocessing.api.SignalException'
FINAL_STATE = 'final_state.pt'
HISTORY = 'history.json'
PLOT = 'loss_curves.png'
SUMMARY = 'summary.json'
RUNS = {'uninterrupted': 'uninterrupted', 'killed': 'killed-and-relaunched',
        'preempted': 'preempted-and-relaunched'}
# --store s3: the bucket on the local S3 server, and each run's staging
# folder (in the run's folder)
BUCKET = 'skorch-demo'
STAGING = 'staging'
ANSI = re.compile(r'\x1b\[[0-9;]*m')


class DemoError(RuntimeError):
    """A launch failed or took too long; the message says which and why."""


# ---------------------------------------------------------------- training
# Everything in this section runs in each torchrun process.

class Net(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    """skorch's accelerate support with this package's fixes."""


class MLP(torch.nn.Module):
    def __init__(self, n_in=64, hidden=128, n_out=10, dropout=0.3):
        super().__init__()
        self.hidden = torch.nn.Linear(n_in, hidden)
        self.dropout = torch.nn.Dropout(dropout)
        self.out = torch.nn.Linear(hidden, n_out)

    def forward(self, X):
        # NeuralNetClassifier's default criterion, NLLLoss, takes probabilities
        return torch.softmax(self.out(self.dropout(torch.relu(self.hidden(X)))), dim=-1)


class Progress(Callback):
    """Tell the demo where training is, and which launch trained each epoch."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, is_main, batch_seconds=0.0):
        self.is_main = is_main
        self.batch_seconds = batch_seconds

    # a checkpoint inside an epoch holds where in it training is
    def state_dict(self):
        return {'batches': getattr(self, 'batches_', 0)}

    def load_state_dict(self, state):
        self.batches_ = state['batches']

    def on_epoch_begin(self, net, **kwargs):
        self.batches_ = 0

    def on_batch_end(self, net, training=False, **kwargs):
        if training and self.batch_seconds:
            time.sleep(self.batch_seconds)
        if training and self.is_main:
            self.batches_ += 1
            _tell('batch', epoch=len(net.history), batch=self.batches_)

    def on_epoch_end(self, net, **kwargs):
        # the checkpoint saves the history, so a resumed run knows which
        # launch trained the epochs before the kill
        net.history.record('launch_pid', os.getpid())
        # skorch unwraps the module after training; this is what trained
        self.module_type_ = type(net.module_).__name__


def _tell(kind, **values):
    # one write call per line: both ranks share the pipe
    sys.stdout.write(MARK + kind + ' ' + json.dumps(values) + '\n')
    sys.stdout.flush()


def load_digits_data():
    """Digits (1797 images of 8x8 pixels), scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    return (X / 16.0).astype(np.float32), y.astype(np.int64)


def checkpoint_location(run_dir, store):
    """Where a run keeps its checkpoints: ``dirname`` and ``local_dir``."""
    if store == 's3':
        # staged in the run's folder, so that the demo can delete it as a
        # new machine would not have it
        return f"s3://{BUCKET}/{os.path.basename(run_dir)}", os.path.join(run_dir, STAGING)
    return os.path.join(run_dir, 'checkpoints'), None


def build_net(run_dir, epochs, accelerator, batch_seconds=0.0, store='local'):
    dirname, local_dir = checkpoint_location(run_dir, store)
    checkpoint = AccelerateCheckpoint(
        dirname=dirname, local_dir=local_dir, sink=print, every_n_steps=EVERY_N_STEPS)
    return Net(
        MLP,
        accelerator=accelerator,
        max_epochs=epochs,
        lr=0.1,
        batch_size=32,
        optimizer=torch.optim.SGD,
        optimizer__momentum=0.9,
        iterator_train__shuffle=True,
        train_split=ValidSplit(5, stratified=True),
        callbacks=[
            checkpoint,
            AccelerateLoadInitState(checkpoint, sink=print),
            LRScheduler(policy=CosineAnnealingLR, T_max=epochs),
            Progress(accelerator.is_main_process, batch_seconds),
        ],
        # skorch's AccelerateMixin prints the epoch log on the main process only
        callbacks__print_log__keys_ignored=['launch_pid'],
    )


def train(run_dir, epochs, cpu, batch_seconds=0.0, store='local'):
    """Train (or resume) one run; rank 0 writes its final state to ``run_dir``."""
    _tell('pid', rank=int(os.environ.get('RANK', '0')), pid=os.getpid())
    if not cpu:
        # bit-identical on GPUs too: no nondeterministic kernels
        torch.use_deterministic_algorithms(True)
    set_seed(SEED)
    accelerator = Accelerator(cpu=cpu)
    net = build_net(run_dir, epochs, accelerator, batch_seconds, store)
    try:
        net.fit(*load_digits_data())
    except TrainingPreempted as exc:
        if accelerator.is_main_process:
            print(f"TrainingPreempted: {exc}", flush=True)
        # a failure, as a scheduler that requeues the job expects
        sys.exit(1)

    if accelerator.is_main_process:
        callbacks = dict(net.callbacks_)
        loader = next(cb for cb in callbacks.values()
                      if isinstance(cb, AccelerateLoadInitState))
        progress = next(cb for cb in callbacks.values() if isinstance(cb, Progress))
        module = accelerator.unwrap_model(net.module_)
        torch.save({'module': module.state_dict(), 'optimizer': net.optimizer_.state_dict()},
                   os.path.join(run_dir, FINAL_STATE))
        keys = ('epoch', 'train_loss', 'valid_loss', 'valid_acc', 'event_lr', 'launch_pid',
                'train_batch_count')
        with open(os.path.join(run_dir, HISTORY), 'w') as f:
            json.dump({
                'history': [{key: row.get(key) for key in keys} for row in net.history],
                'resumed_from': loader.loaded_from_,
                'num_processes': accelerator.num_processes,
                'module_type': getattr(progress, 'module_type_', None),
                'device': str(accelerator.device),
            }, f)
    # ends the trackers and the process group, as accelerate asks a script to
    accelerator.end_training()


# ---------------------------------------------------------------- launching

class Launch:
    """One ``torchrun`` job of this script, its output echoed as it comes."""

    def __init__(self, args, run_dir, label, slow=False):
        self.label = label
        self.run_dir = run_dir
        self.nproc = args.nproc
        command = [
            sys.executable, '-m', 'torch.distributed.run', '--standalone',
            '--nproc_per_node', str(args.nproc), os.path.abspath(__file__),
            '--worker', run_dir, '--epochs', str(args.epochs), '--store', args.store,
        ] + (['--cpu'] if args.cpu else []) + (
            ['--batch-seconds', str(SLOW_BATCH_SECONDS)] if slow else [])
        env = dict(os.environ, PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1',
                   CUBLAS_WORKSPACE_CONFIG=':4096:8', **args.store_env)
        self.worker_pids = {}
        self.last_batch = None
        self.killed = False
        self.signalled = False
        self.signalled_at = None
        self.tail = []
        # a traceback held back until its last line says whose it is
        self.traceback = []
        self.color = sys.stdout.isatty()
        # torchrun starts every rank in a session of its own: a kill of the
        # job has to name the ranks as well as torchrun's process group
        self.proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip('\n'))
        self.lines.put(None)

    def run(self, timeout, kill_epoch=None, sigterm_epoch=None):
        """Echo the job's output until it ends; SIGKILL it in ``kill_epoch``,
        or send torchrun SIGTERM in ``sigterm_epoch``.

        Returns the exit code of torchrun (-9 when killed here).
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise DemoError(
                    f"{self.label}: no end after {timeout} s (--timeout); killed it. "
                    "Last output:\n" + '\n'.join(self.tail)) from None
            if line is None:
                break
            if line.startswith(MARK):
                self._act(line, kill_epoch, sigterm_epoch)
                continue
            self.tail = (self.tail + [line])[-40:]
            self._echo(line)
        self._echo_lines(self.traceback)
        return self.proc.wait()

    def _echo(self, line):
        """Print a line of the job's output; after the SIGTERM, torchrun's
        traceback of the signal as one line (any other traceback in full)."""
        if self.signalled and (self.traceback or line.startswith('Traceback (most recent')):
            self.traceback.append(line)
            if line[:1].isspace() or line.startswith('Traceback (most recent'):
                return
            if line.startswith(TORCHRUN_SIGNAL_EXCEPTION):
                self._echo_lines([f"expected: torchrun reports the signal "
                                  f"({line.rsplit('.', 1)[-1]}; its traceback of "
                                  f"{len(self.traceback)} lines left out)"])
            else:
                self._echo_lines(self.traceback)
            self.traceback = []
            return
        self._echo_lines([line])

    def _echo_lines(self, lines):
        for line in lines:
            print(f"  {self.label} | {line if self.color else ANSI.sub('', line)}",
                  flush=True)

    def _act(self, line, kill_epoch, sigterm_epoch):
        kind, _, payload = line[len(MARK):].partition(' ')
        values = json.loads(payload)
        if kind == 'pid':
            self.worker_pids[values['rank']] = values['pid']
        elif kind == 'batch':
            self.last_batch = (values['epoch'], values['batch'])
            if (not self.signalled and values['epoch'] == sigterm_epoch
                    and values['batch'] == SIGTERM_AFTER_BATCH):
                self.signalled = True
                self.signalled_at = self.last_batch
                self.proc.send_signal(signal.SIGTERM)
                print(f"  {self.label} | >>> SIGTERM to torchrun after batch "
                      f"{SIGTERM_AFTER_BATCH} of epoch {sigterm_epoch}", flush=True)
            if (not self.killed and values['epoch'] == kill_epoch
                    and values['batch'] == KILL_AFTER_BATCH):
                self._check_checkpoint_exists()
                if len(self.worker_pids) != self.nproc:
                    self.kill()
                    raise DemoError(
                        f"{self.label}: {len(self.worker_pids)} of {self.nproc} ranks "
                        "reported their pid; a kill would miss the others")
                self.kill()
                self.killed = True
                print(f"  {self.label} | >>> SIGKILL to torchrun and every rank "
                      f"(pids {sorted(self.worker_pids.values())}) after batch "
                      f"{KILL_AFTER_BATCH} of epoch {kill_epoch}", flush=True)

    def _check_checkpoint_exists(self):
        folder = os.path.join(self.run_dir, 'checkpoints')
        if not os.path.isfile(os.path.join(folder, 'latest.json')):
            self.kill()
            raise DemoError(
                f"{self.label}: the kill is due, but {folder} holds no committed "
                "checkpoint; use a later --kill-epoch")

    def kill(self):
        """SIGKILL every rank and torchrun at one instant, as a machine that
        dies: each is stopped first, so that no rank sees another's end (a
        closed connection in a collective) and reports it before its own."""
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in self.worker_pids.values():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        self.proc.wait()


def _launch(args, run_dir, label, kill_epoch=None, sigterm_epoch=None, slow=False):
    job = Launch(args, run_dir, label, slow=slow)
    returncode = job.run(args.timeout, kill_epoch=kill_epoch, sigterm_epoch=sigterm_epoch)
    if job.killed:
        return job
    if job.signalled:
        if returncode == 0:
            raise DemoError(f"{label}: torchrun exited 0 after the SIGTERM; a preempted "
                            "run must fail, so that a scheduler requeues it")
        return job
    if returncode != 0:
        raise DemoError(f"{label}: torchrun exited with code {returncode}; its last "
                        "output:\n" + '\n'.join(job.tail))
    if kill_epoch is not None or sigterm_epoch is not None:
        raise DemoError(f"{label}: the run ended before it was to be interrupted; use a "
                        "smaller --kill-epoch or --sigterm-epoch")
    return job


# ---------------------------------------------------------------- reporting

def _load(run_dir):
    with open(os.path.join(run_dir, HISTORY)) as f:
        result = json.load(f)
    result['state'] = torch.load(os.path.join(run_dir, FINAL_STATE), weights_only=True)
    return result


def _tensors(obj, prefix=''):
    """Every tensor in a nested state dict, by a dotted path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key in obj:
            yield from _tensors(obj[key], f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{prefix}[{i}]")


def compare(full, resumed):
    """What differs between two runs' final states and losses; empty if nothing.

    Returns the differences and how many tensors were compared.
    """
    differences = []
    a = dict(_tensors(full['state']))
    b = dict(_tensors(resumed['state']))
    if a.keys() != b.keys():
        differences.append(f"the saved states hold different tensors: "
                           f"{sorted(a.keys() ^ b.keys())}")
    for key in sorted(a.keys() & b.keys()):
        if not torch.equal(a[key], b[key]):
            diff = (a[key].double() - b[key].double()).abs().max().item()
            differences.append(f"{key} differs (max |difference| {diff:.3g})")
    if full['state']['optimizer']['param_groups'] != resumed['state']['optimizer']['param_groups']:
        differences.append("optimizer settings (lr, momentum, ...) differ")
    rows_a, rows_b = full['history'], resumed['history']
    if len(rows_a) != len(rows_b):
        differences.append(f"{len(rows_a)} epochs uninterrupted, {len(rows_b)} after the kill")
    for row_a, row_b in zip(rows_a, rows_b, strict=False):
        for key in ('train_loss', 'valid_loss'):
            if row_a[key] != row_b[key]:
                differences.append(f"epoch {row_a['epoch']}: {key} {row_a[key]!r} "
                                   f"vs {row_b[key]!r}")
    return differences, len(a.keys() & b.keys())


def _launch_numbers(history):
    """Launch number (1, 2, ...) of every epoch, from the pids in the history."""
    numbers, seen = [], {}
    for row in history:
        numbers.append(seen.setdefault(row['launch_pid'], len(seen) + 1))
    return numbers


def interruption(kind, epoch, job, resumed, batches_per_epoch, saved):
    """What an interruption cost: where training was when it stopped (the
    last batch the main process reported), the checkpoint the relaunch
    resumed from (whose manifest is ``saved``), and the batches trained in
    between, which were lost."""
    resumed_from = resumed['resumed_from']
    stopped_epoch, stopped_batch = job.last_batch
    info = {'kind': kind, 'epoch': epoch, 'stopped_at': list(job.last_batch),
            'signalled_at': list(job.signalled_at) if job.signalled_at else None,
            # on the plot's axis, where epoch e ends at e
            'stopped_at_epochs': stopped_epoch - 1 + stopped_batch / batches_per_epoch,
            'resumed_from': resumed_from, 'lost_batches': None}
    if resumed_from is None:
        return info
    saved_batches = saved['epoch'] * batches_per_epoch + saved['position']['batches']
    trained = (stopped_epoch - 1) * batches_per_epoch + stopped_batch
    info.update(lost_batches=trained - saved_batches, saved_epoch=saved['epoch'],
                saved_batches=saved['position']['batches'])
    return info


def _describe_interruption(info):
    epoch, batch = info['stopped_at']
    name = os.path.basename(info['resumed_from'] or 'nothing')
    sent = (f"sent after batch {info['signalled_at'][1]}, " if info['signalled_at'] else '')
    return (f">>> {info['kind']} during epoch {info['epoch']} ({sent}trained up to batch "
            f"{batch} of epoch {epoch}); relaunch resumed from {name}: "
            f"{info['lost_batches']} batch(es) lost")


def print_table(full, runs):
    """The per-epoch losses of the uninterrupted run and of each interrupted
    and relaunched one, side by side, with where each was interrupted."""
    head = f"{'':>5} | {'uninterrupted':^21} |"
    cols = f"{'epoch':>5} | {'train_loss':>10} {'valid_loss':>10} |"
    for label, _, _ in runs:
        head += f" {label:^28} |"
        cols += f" {'train_loss':>10} {'valid_loss':>10} {'launch':>6} |"
    cols += ' same'
    print(head)
    print(cols)
    print('-' * len(cols))
    launches = [_launch_numbers(run['history']) for _, run, _ in runs]
    for index, row_a in enumerate(full['history']):
        line = f"{row_a['epoch']:>5} | {row_a['train_loss']:>10.6f} {row_a['valid_loss']:>10.6f} |"
        same = True
        for (_, run, _), numbers in zip(runs, launches, strict=True):
            row_b = run['history'][index] if index < len(run['history']) else None
            if row_b is None:
                line += f" {'-':>28} |"
                same = False
                continue
            line += (f" {row_b['train_loss']:>10.6f} {row_b['valid_loss']:>10.6f} "
                     f"{numbers[index]:>6} |")
            same &= (row_a['train_loss'] == row_b['train_loss']
                     and row_a['valid_loss'] == row_b['valid_loss'])
        print(line + (' yes' if same else ' NO'))
        for _, _, info in runs:
            if info['epoch'] == row_a['epoch']:
                print(f"{'':>5} | {_describe_interruption(info)}")


def plot(full, runs, verdict, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), sharey=True)
    epochs = np.array([row['epoch'] for row in full['history']])
    for ax, (label, run, info) in zip(np.atleast_1d(axes), runs, strict=True):
        launches = np.array(_launch_numbers(run['history']))
        for key, color in (('train_loss', 'C0'), ('valid_loss', 'C1')):
            ax.plot(epochs, [row[key] for row in full['history']], color=color, lw=5,
                    alpha=0.35, label=f"{key}, uninterrupted")
            values = np.array([row[key] for row in run['history']])
            for launch, marker in ((1, 'o'), (2, 'x')):
                mask = launches == launch
                ax.plot(epochs[mask], values[mask], marker, color=color,
                        label=f"{key}, launch {launch}")
        # epoch e's point is at its end, x = e: training stopped this far
        # into its epoch
        x_cut = info['stopped_at_epochs']
        stopped_epoch, stopped_batch = info['stopped_at']
        ax.axvline(x_cut, color='red', ls='--', lw=1.5)
        sent = f" after batch {info['signalled_at'][1]}" if info['signalled_at'] else ''
        ax.annotate(f"{info['kind']}{sent}: stopped at batch {stopped_batch}\nof epoch "
                    f"{stopped_epoch}, {info['lost_batches']} batch(es) lost",
                    xy=(x_cut, 0.95),
                    xycoords=('data', 'axes fraction'), ha='left', va='top', color='red',
                    xytext=(6, 0), textcoords='offset points')
        ax.set_xlabel('epoch')
        ax.set_title(label)
        ax.legend(fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel('loss (NLL)')
    fig.suptitle(f"Interrupted and relaunched vs uninterrupted: {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def list_checkpoints(folder, store_env):
    """Run ``python -m skorch_accel_callbacks list FOLDER`` (a path or a
    URL, reached with the variables ``store_env``) and echo it.

    The command runs with the package this script imported (a checkout
    not installed in the environment, too).
    """
    import skorch_accel_callbacks
    root = os.path.dirname(os.path.dirname(os.path.abspath(skorch_accel_callbacks.__file__)))
    env = dict(os.environ, **store_env, PYTHONPATH=os.pathsep.join(
        [root] + ([os.environ['PYTHONPATH']] if os.environ.get('PYTHONPATH') else [])))
    print(f"  $ python -m skorch_accel_callbacks list {folder}", flush=True)
    proc = subprocess.run(
        [sys.executable, '-m', 'skorch_accel_callbacks', 'list', folder], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    for line in proc.stdout.splitlines():
        print(f"  {line}")
    if proc.returncode != 0:
        raise DemoError(f"python -m skorch_accel_callbacks list {folder} exited with "
                        f"code {proc.returncode}")


# ---------------------------------------------------------------- main

def _check_devices(args):
    if args.cpu or not torch.cuda.is_available():
        args.cpu = True
        return 'CPU'
    gpus = torch.cuda.device_count()
    if args.nproc > gpus:
        raise DemoError(f"--nproc {args.nproc} needs {args.nproc} GPUs, this machine has "
                        f"{gpus}; use --nproc {gpus} or --cpu")
    return f"{args.nproc} GPU(s)"


@contextlib.contextmanager
def s3_server(args):
    """With ``--store s3``: a local S3 server (moto's) in this process, for
    as long as the demo runs, with an empty bucket ``BUCKET``; sets
    ``args.store_env`` to the ``AWS_*`` variables that reach it. Without,
    nothing."""
    args.store_env = {}
    if args.store != 's3':
        yield
        return
    try:
        import fsspec
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise DemoError(f"--store s3 needs moto[server] and s3fs ({exc}); "
                        "pip install -r requirements-dev.txt") from exc
    # the server logs every request otherwise
    logging.getLogger('werkzeug').setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        args.store_env = {
            'AWS_ENDPOINT_URL': f'http://{host}:{port}', 'AWS_ACCESS_KEY_ID': 'demo',
            'AWS_SECRET_ACCESS_KEY': 'demo', 'AWS_DEFAULT_REGION': 'us-east-1'}
        args.store_fs = fsspec.filesystem(
            's3', key='demo', secret='demo', skip_instance_cache=True,
            client_kwargs={'endpoint_url': args.store_env['AWS_ENDPOINT_URL']})
        args.store_fs.mkdir(BUCKET)
        yield
    finally:
        server.stop()


def _read_json(args, run_dir, rel):
    """The JSON file ``rel`` of a run's checkpoints, in its folder or bucket."""
    dirname, _ = checkpoint_location(run_dir, args.store)
    if args.store == 's3':
        return json.loads(args.store_fs.cat_file(f"{dirname}/{rel}"))
    with open(os.path.join(dirname, rel)) as f:
        return json.load(f)


def demo(args):
    for name, epoch, first in (('--kill-epoch', args.kill_epoch, 2),
                               ('--sigterm-epoch', args.sigterm_epoch, 1)):
        if not first <= epoch <= args.epochs:
            raise DemoError(f"{name} must be between {first} and --epochs ({args.epochs}), "
                            f"got {epoch}")
    where = _check_devices(args)
    os.makedirs(args.out, exist_ok=True)
    dirs = {key: os.path.join(args.out, name) for key, name in RUNS.items()}
    for folder in dirs.values():
        # a checkpoint left by an earlier demo would be resumed from
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    with s3_server(args):
        return _demo(args, dirs, where)


def _demo(args, dirs, where):
    # in a bucket the preempted run shows what a store adds: the relaunch
    # on a new machine
    interrupted = ('killed', 'preempted') if args.store == 'local' else ('preempted',)
    started = time.monotonic()
    numbers = itertools.count(1)
    n_phases = 3 + 2 * len(interrupted)

    def phase(text):
        print(f"\n[{time.monotonic() - started:5.1f} s] {next(numbers)}/{n_phases} {text}",
              flush=True)

    stored = (f"in s3://{BUCKET}/ on a local S3 server ({args.store_env['AWS_ENDPOINT_URL']}), "
              "staged in each run's folder " if args.store == 's3' else "")
    phase(f"Uninterrupted run: {args.epochs} epochs in {args.nproc} process(es) "
          f"on {where}, a checkpoint every {EVERY_N_STEPS} steps and every epoch "
          f"{stored}-> {dirs['uninterrupted']}")
    _launch(args, dirs['uninterrupted'], 'run 1')
    jobs = {}

    if 'killed' in interrupted:
        phase(f"The same training in {dirs['killed']}, SIGKILLed during epoch "
              f"{args.kill_epoch} (after batch {KILL_AFTER_BATCH})")
        killed = jobs['killed'] = _launch(args, dirs['killed'], 'run 2',
                                          kill_epoch=args.kill_epoch)
        checkpoints = os.path.join(dirs['killed'], 'checkpoints')
        print(f"  left in {checkpoints}: {sorted(os.listdir(checkpoints))}")
        print(f"  torchrun exit code {killed.proc.returncode}; the last batch it reported: "
              f"epoch {killed.last_batch[0]}, batch {killed.last_batch[1]}")

        phase("Relaunch, the same command unchanged")
        _launch(args, dirs['killed'], 'run 2, relaunched')

    phase(f"The same training in {dirs['preempted']}, sent SIGTERM (to torchrun, "
          f"as a scheduler does) during epoch {args.sigterm_epoch} (after batch "
          f"{SIGTERM_AFTER_BATCH}); its batches take {SLOW_BATCH_SECONDS} s longer, so "
          "that the signal lands inside the epoch")
    preempted = jobs['preempted'] = _launch(args, dirs['preempted'], 'run 3',
                                            sigterm_epoch=args.sigterm_epoch, slow=True)
    taken = _read_json(args, dirs['preempted'], 'latest.json')['name']
    print(f"  torchrun exit code {preempted.proc.returncode}; the last batch it reported: "
          f"epoch {preempted.last_batch[0]}, batch {preempted.last_batch[1]}; the "
          f"checkpoint taken on the signal: {taken}")
    if args.store == 's3':
        dirname, staging = checkpoint_location(dirs['preempted'], args.store)
        print(f"  uploaded before the job exited: {dirname}/latest.json names {taken}")
        # a relaunch on another machine has the bucket only
        shutil.rmtree(staging)
        print(f"  deleted the staging folder {staging}, as on a new machine")

    phase("Relaunch, the same command unchanged"
          + (", resuming from the bucket" if args.store == 's3' else ''))
    _launch(args, dirs['preempted'], 'run 3, relaunched', slow=True)

    phase("Comparison")
    full = _load(dirs['uninterrupted'])
    batches_per_epoch = full['history'][0]['train_batch_count']
    runs, differences, n_tensors = [], [], 0
    for key, label, epoch in (
            ('killed', 'SIGKILL, relaunched', args.kill_epoch),
            ('preempted', 'SIGTERM, relaunched', args.sigterm_epoch)):
        if key not in interrupted:
            continue
        resumed = _load(dirs[key])
        saved = resumed['resumed_from'] and _read_json(
            args, dirs[key], f"{os.path.basename(resumed['resumed_from'])}/manifest.json")
        info = interruption(label.split(',')[0], epoch, jobs[key], resumed,
                            batches_per_epoch, saved)
        found, n_tensors = compare(full, resumed)
        if resumed['resumed_from'] is None:
            found.insert(0, "the relaunch did not resume from a checkpoint")
        differences += [f"{label}: {line}" for line in found]
        runs.append((label, resumed, info))
    print_table(full, runs)
    verdict = 'identical' if not differences else 'differs'
    path = os.path.join(args.out, PLOT)
    plot(full, runs, verdict.upper(), path)
    infos = {info['kind']: info for _, _, info in runs}
    kill, sigterm = infos.get('SIGKILL'), infos['SIGTERM']
    listed = checkpoint_location(dirs[interrupted[0]], args.store)[0]
    with open(os.path.join(args.out, SUMMARY), 'w') as f:
        json.dump({'verdict': verdict, 'differences': differences, 'kill': kill,
                   'sigterm': sigterm, 'every_n_steps': EVERY_N_STEPS,
                   'batches_per_epoch': batches_per_epoch,
                   'nproc': args.nproc, 'num_processes': full['num_processes'],
                   'epochs': args.epochs, 'device': full['device'],
                   'module_type': full['module_type'], 'tensors_compared': n_tensors,
                   'store': args.store, 'listed': listed}, f,
                  indent=1)
    print()
    print("Work lost: "
          + (f"SIGKILL {kill['lost_batches']} batch(es) (trained since the last "
             f"checkpoint, every {EVERY_N_STEPS} steps), " if kill else '')
          + f"SIGTERM {sigterm['lost_batches']} (saved at the batch it stopped at).")
    if differences:
        print("VERDICT: DIFFERS. An interrupted and relaunched run does not end where the "
              "uninterrupted one does:")
        for line in differences[:20]:
            print(f"  - {line}")
    else:
        which = 'both interrupted runs' if kill else 'the preempted run'
        print(f"VERDICT: IDENTICAL. For {which}, all {n_tensors} tensors of the final "
              "parameters and optimizer state (momentum buffers) are bit-identical "
              "(torch.equal), and so is every per-epoch loss.")
    print(f"Plot: {path}")

    phase(f"The checkpoints of the {'killed' if kill else 'preempted'} and relaunched "
          "run, as the package's command lists them")
    list_checkpoints(listed, args.store_env)
    print(f"\n({time.monotonic() - started:.1f} s in all)")
    return 0 if not differences else 1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Kill a distributed skorch run with SIGKILL and preempt another "
                    "with SIGTERM, relaunch both unchanged, and check that they end "
                    "bit-identical to an uninterrupted run.")
    parser.add_argument('--nproc', type=int, default=2, help="processes (default 2)")
    parser.add_argument('--epochs', type=int, default=10, help="epochs (default 10)")
    parser.add_argument('--kill-epoch', type=int, default=None,
                        help="epoch during which run 2 is killed (default: the middle one)")
    parser.add_argument('--sigterm-epoch', type=int, default=None,
                        help="epoch during which run 3 gets SIGTERM (default: the one "
                             "before --kill-epoch)")
    parser.add_argument('--out', default=os.path.join('runs', 'demo'),
                        help="output folder (default runs/demo)")
    parser.add_argument('--cpu', action='store_true', help="train on CPU even if CUDA is there")
    parser.add_argument('--store', choices=('local', 's3'), default='local',
                        help="where the checkpoints go: a local folder (default) or a "
                             "bucket on a local S3 server that the demo starts")
    parser.add_argument('--timeout', type=float, default=300,
                        help="seconds each launch may take (default 300)")
    parser.add_argument('--worker', metavar='RUN_DIR', help=argparse.SUPPRESS)
    parser.add_argument('--batch-seconds', type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.kill_epoch is None:
        args.kill_epoch = args.epochs // 2 + 1
    if args.sigterm_epoch is None:
        args.sigterm_epoch = max(1, args.kill_epoch - 1)
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        train(args.worker, args.epochs, cpu=args.cpu or not torch.cuda.is_available(),
              batch_seconds=args.batch_seconds, store=args.store)
        return 0
    try:
        return demo(args)
    except DemoError as exc:
        print(f"\nresume_demo: {exc}", file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
