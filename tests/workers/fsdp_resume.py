"""Checkpoint, kill and resume a FixedNet under FSDP2, for tests/callbacks/test_fsdp.py.

usage: fsdp_resume.py
  Environment RUNS: a JSON list of trainings to run one after the other in
  this launch, each the keyword arguments of :func:`run`: ``dirname``,
  ``tag``, ``state_dict`` (the FSDP2 plugin's ``state_dict_type``,
  ``SHARDED_STATE_DICT`` by default, or ``FULL_STATE_DICT``),
  ``every_n_steps`` (also a checkpoint every that many optimizer steps),
  ``kill`` (``[E, B]``: every rank is SIGKILLed when training batch B of
  epoch E begins, after the batch before and its checkpoint, and first
  writes ``<TAG>-killed-rank<r>.json``), ``kill_in_save`` (``[NAME, R]``:
  rank R is SIGKILLed once its shards of checkpoint NAME are written, before
  the commit, and first writes ``<TAG>-killed-in-save-rank<R>.json``; the
  other rank fails in the save's next collective), ``reseed``
  (``on_world_size_change='reseed'``) and ``resume`` (the checkpoint to
  resume, a path: by default the latest in ``dirname``).

Every rank writes ``<TAG>-rank<r>.json`` when its training ends (history,
checkpoint folders, what was resumed, warnings). Rank 0 writes
``<TAG>-rank0.pt``: the gathered model and optimizer states and the history
at the end (as testutil.final_state reads them); a resumed run also
``<TAG>-resumed-rank0.pt``, the same when its first epoch begins, right after
the checkpoint was loaded.
"""

import json
import os
import signal
import warnings

import torch
from skorch.callbacks import Callback, LRScheduler
from skorch.dataset import ValidSplit
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.optim.lr_scheduler import StepLR

from common import (
    NotTrainingState,
    history_rows,
    make_data,
    make_net,
    rank,
    settle_gloo,
    write_result,
)
from fsdp_backend import fsdp_accelerator
from resume import HISTORY_KEYS, KillBefore
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
from skorch_accel_callbacks._core import sync
from skorch_accel_callbacks.engine import _state_files as state_files


def save_full_state(net, history, name):
    """Rank 0 writes the gathered model and optimizer states and
    ``history`` (as testutil.final_state reads them); a collective of every
    rank."""
    model, optimizer = get_state_dict(net.module_, net.optimizer_.optimizer,
                                      options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=True))
    if rank() == 0:
        torch.save({'params': {'module': model}, 'optimizers': {'optimizer': optimizer},
                    'history': history_rows(history, keep=HISTORY_KEYS)},
                   os.path.join(os.environ.get('RESULT_DIR', '.'), name))


class RecordLoaded(NotTrainingState, Callback):
    """The state a resumed run begins training with, right after the load."""

    def __init__(self, tag):
        self.tag = tag

    def initialize(self):
        self.done_ = False
        return self

    def on_epoch_begin(self, net, **kwargs):
        loaded = any(getattr(cb, 'loaded_from_', None) for _, cb in net.callbacks_)
        if loaded and not self.done_:
            self.done_ = True
            save_full_state(net, net.history[:-1], f'{self.tag}-resumed-rank0.pt')


def kill_after_shards(name, who, tag):
    """Rank ``who`` dies once ``state_files.save_state`` (through which
    the writer saves the shards) returns for checkpoint ``name``."""
    save_state = state_files.save_state

    def saved_then_killed(accelerator, folder, *args, **kwargs):
        split = save_state(accelerator, folder, *args, **kwargs)
        if os.path.basename(folder).startswith(name + '.') and rank() == who:
            written = sorted(os.path.relpath(os.path.join(where, file), folder)
                             for where, _, files in os.walk(folder) for file in files)
            write_result(f'{tag}-killed-in-save', {'folder': os.path.basename(folder),
                                                   'written': written})
            os.kill(os.getpid(), signal.SIGKILL)
        return split

    state_files.save_state = saved_then_killed


def run(dirname, tag, state_dict='SHARDED_STATE_DICT', every_n_steps=None, kill=None,
        kill_in_save=None, reseed=False, resume='latest'):
    accelerator = fsdp_accelerator(state_dict_type=state_dict)
    cp = AccelerateCheckpoint(dirname=dirname, every_n_steps=every_n_steps)
    load = AccelerateLoadInitState(cp, resume=resume,
                                   on_world_size_change='reseed' if reseed else 'raise')
    callbacks = [load, cp, LRScheduler(policy=StepLR, step_size=2, gamma=0.5),
                 RecordLoaded(tag)]
    if kill:
        callbacks.append(KillBefore(*kill, tag))
    if kill_in_save:
        kill_after_shards(*kill_in_save, tag)
    torch.manual_seed(0)
    net = make_net(accelerator, callbacks=callbacks, max_epochs=3,
                   criterion=torch.nn.NLLLoss, train_split=ValidSplit(5))
    X, y = make_data(n=320)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        net.fit(X, y)
    write_result(tag, {
        'num_processes': sync.num_processes(net),
        'history': history_rows(net.history, keep=HISTORY_KEYS),
        'committed': cp.committed(),
        'loaded_from': load.loaded_from_ and os.path.basename(load.loaded_from_),
        'warnings': [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
    })
    save_full_state(net, net.history, f'{tag}-rank0.pt')


def run_all():
    for options in json.loads(os.environ.get('RUNS', '[]')):
        run(**options)


if __name__ == '__main__':
    run_all()
    # FSDP2's own gathers (its forward) leave tensors to gloo's threads
    settle_gloo()
