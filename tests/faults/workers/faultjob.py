"""The small training job that every fault test runs, and its kill points.

Three epochs of 2 batches per rank, checkpointed every epoch with
``keep_last=1`` (so that retention discards a folder from the second epoch
on), with dropout, momentum and an LR scheduler: a resume that restored any
of them wrongly would not end bit-identical.
"""

import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch
from skorch.callbacks import Callback, LRScheduler
from torch.optim.lr_scheduler import StepLR

from common import make_accelerator, make_data, make_net, rank, write_final_state, write_result
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState

EPOCHS = 3

# Where a kill can land, in the order they happen within an epoch. ``rank``
# is who dies there: the committer (rank 0) for the commit, either rank for
# a batch end or for the rank's own files.
BATCH_POINTS = ('batch-1', 'batch-2')
SAVE_POINTS = (
    'model-half',        # accelerate wrote half of model.safetensors
    'optimizer-half',    # ... half of optimizer.bin
    'rng-half',          # ... half of this rank's random_states_<r>.pkl
    'rank-state',        # this rank wrote its loader state file
    'before-manifest',
    'after-manifest',
    'before-rename',     # epoch-NNNN.partial -> epoch-NNNN
    'after-rename',
    'before-pointer',    # latest.json
    'after-pointer',
    'before-discard',    # retention starts removing an old folder
    'in-discard',        # ... and has removed part of it
)
RANK_POINTS = BATCH_POINTS + ('rng-half', 'rank-state')


def build(dirname, callbacks=(), resume='latest', async_save=False, **net_kwargs):
    """The job's net and its checkpoint; the same in every test and launch."""
    accelerator = make_accelerator()
    cp = AccelerateCheckpoint(dirname=dirname, keep_last=1, async_save=async_save)
    # every global generator, as a script that wants its runs repeatable
    # seeds them: the tests compare the random states at the end too
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    params = dict(max_epochs=EPOCHS, batch_size=16, train_split=None)
    params.update(net_kwargs)
    net = make_net(
        accelerator, callbacks=[
            AccelerateLoadInitState(cp, resume=resume), cp,
            LRScheduler(policy=StepLR, step_size=2, gamma=0.5), *callbacks],
        **params)
    return net, cp


def data():
    return make_data(n=64)


def note(what, point, epoch=None):
    """Leave ``<WHAT>-<TAG>-<POINT>-rank<R>`` in RESULT_DIR for the test
    (TAG: the launch's tag), holding JSON: the point, its epoch, the rank."""
    out = os.environ.get('RESULT_DIR', '.')
    path = os.path.join(out, f'{what}-{sys.argv[2]}-{point}-rank{rank()}')
    with open(path, 'w') as f:
        json.dump({'point': point, 'epoch': epoch, 'rank': rank()}, f)
        # on disk before the SIGKILL that follows
        f.flush()
        os.fsync(f.fileno())


def die(point, epoch=None):
    """SIGKILL this process, after leaving a note of where for the test."""
    note('killed', point, epoch)
    os.kill(os.getpid(), signal.SIGKILL)


def hold(point, epoch=None):
    """Stay at ``point`` (a job that is busy there) until the test kills it."""
    note('held', point, epoch)
    time.sleep(600)


class EpochTracker(Callback):
    """Knows the current epoch, so that a kill point fires in its epoch only."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    epoch = 0

    def on_epoch_begin(self, net, **kwargs):
        type(self).epoch = len(net.history)


def loaded_from(net):
    for _, callback in net.callbacks_:
        if isinstance(callback, AccelerateLoadInitState):
            return callback.loaded_from_
    return None


def finish(net, tag, **extra):
    write_final_state(net, tag)
    write_result(tag, dict(loaded_from=loaded_from(net), epochs=len(net.history), **extra))
