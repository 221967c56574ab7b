"""The fault job, killed with SIGKILL at a numbered point.

usage: killable.py DIRNAME TAG

Environment:
- KILL=EPOCH:POINT:RANK: rank RANK SIGKILLs itself at POINT (one of
  faultjob.BATCH_POINTS or SAVE_POINTS) of epoch EPOCH; before it dies it
  leaves ``killed-<TAG>-<POINT>-rank<RANK>`` in RESULT_DIR (JSON: point,
  epoch, rank), the proof that the point was reached;
- HOLD=EPOCH:POINT:RANK: as KILL, but the rank waits there (notes
  ``held-...``) until it is killed;
- ASYNC=1: ``AccelerateCheckpoint(async_save=True)`` (the kill points of the
  commit then fire in its writer thread);
- FREEZE=EPOCH:RANK: rank RANK stops itself (SIGSTOP) after batch 1 of
  EPOCH, as a hung node would, instead of dying;
- FROZEN_BASE=1: the module's first layer is frozen (common.FrozenBaseMLP):
  each save after the first links its frozen part instead of writing it;
  FROZEN_BASE=trained (one process): the layer is frozen after the first
  step (common.FreezeBaseAfterFirstStep), and each save after the first
  links the optimizer's frozen part (its momentum) too.

Every rank writes ``<TAG>-rank<r>.json`` (the folder it resumed from), and
every rank ``<TAG>-rank<r>.pt`` (final state) when training ends; each rank writes
``resumed-<TAG>-rank<r>.json`` (the folder it resumed from, the epoch, the
number of processes) as soon as its first epoch begins.
"""

import json
import os
import re
import signal
import sys

import accelerate.checkpointing
import torch
from skorch.callbacks import Callback

import faultjob
from common import BatchEnds, FreezeBaseAfterFirstStep, FrozenBaseMLP, rank
from faultjob import EpochTracker, die, hold
from skorch_accel_callbacks._core import accelerate_io, sync
from skorch_accel_callbacks.engine import _state_files as state_files
from skorch_accel_callbacks.format import MANIFEST_NAME, PARTIAL_SUFFIX, _atomic as atomic
from skorch_accel_callbacks.state import _training_state as training_state
from skorch_accel_callbacks.storage import _local as local_storage


def half_written(path, write):
    """Write the file aside and put only its first half at ``path``."""
    tmp = f'{path}.whole'
    write(tmp)
    with open(tmp, 'rb') as f:
        data = f.read()
    os.remove(tmp)
    with open(path, 'wb') as f:
        f.write(data[:len(data) // 2])
        f.flush()
        os.fsync(f.fileno())


class Instrument:
    """Wraps the functions that the save goes through; ``fire`` dies at the
    chosen point of the chosen epoch on the chosen rank.

    Each is replaced where the code that calls it looks it up:
    ``accelerate.checkpointing.save`` and ``accelerate_io.save`` (model),
    ``state_files.save_without_crc`` (optimizer), ``torch.save`` (random
    states), ``training_state.save_file``
    (loader state), ``write_json`` (manifest: ``atomic``'s, ``latest.json``:
    the local folder's), ``os.replace`` (the commit's rename), the local
    folder's ``discard_in_background`` (retention) and ``atomic.remove_path``
    (the removal it starts). A package
    function that moves or is renamed must be followed here: a hook that is
    never called leaves its kill point unfired, which test_random_kills
    reports.
    """

    def __init__(self, epoch, point, who, action=die):
        self.epoch, self.point, self.who = epoch, point, who
        self.action = action
        # the epoch whose latest.json was written last: retention runs after
        self.committed = None

    def due(self, point, path=None):
        """Whether to act at ``point``. The epoch of a save point is read from
        the checkpoint path it writes (with async_save the commit of epoch E
        runs while epoch E+1 trains); a batch end's is the current epoch."""
        if path is not None:
            found = re.search(r'epoch-(\d+)', os.fspath(path))
            epoch = int(found.group(1)) if found else None
        elif 'discard' in point:
            epoch = self.committed
        else:
            epoch = EpochTracker.epoch
        return point == self.point and epoch == self.epoch and rank() == self.who

    def fire(self, point, path=None):
        if self.due(point, path):
            self.action(point, self.epoch)

    def install(self):
        instrument, fire, due = self, self.fire, self.due

        def die(point):
            instrument.action(point, instrument.epoch)

        save = accelerate.checkpointing.save

        # the partly written file, for the points inside save_state
        def accelerate_save(obj, f, **kwargs):
            name = os.path.basename(str(f))
            point = {'model.safetensors': 'model-half',
                     'optimizer.bin': 'optimizer-half'}.get(name)
            if point is not None and due(point, f):
                half_written(f, lambda tmp: save(obj, tmp, **kwargs))
                die(point)
            return save(obj, f, **kwargs)

        accelerate.checkpointing.save = accelerate_save
        accelerate_io.save = accelerate_save

        # the package writes the optimizer file itself (without CRCs)
        save_without_crc = state_files.save_without_crc

        def optimizer_save(obj, path):
            if due('optimizer-half', path):
                half_written(path, lambda tmp: save_without_crc(obj, tmp))
                die('optimizer-half')
            return save_without_crc(obj, path)

        state_files.save_without_crc = optimizer_save

        torch_save = torch.save

        def rng_save(obj, f, *args, **kwargs):
            if 'random_states_' in str(f) and due('rng-half', f):
                half_written(f, lambda tmp: torch_save(obj, tmp, *args, **kwargs))
                die('rng-half')
            return torch_save(obj, f, *args, **kwargs)

        accelerate.checkpointing.torch.save = rng_save

        save_file = training_state.save_file

        def rank_state_save(tensors, path, **kwargs):
            save_file(tensors, path, **kwargs)
            if 'loader_state' not in str(path):
                return
            fire('rank-state', path)

        training_state.save_file = rank_state_save

        write_json = atomic.write_json

        def json_write(path, obj, **kwargs):
            name = os.path.basename(path)
            which = {MANIFEST_NAME: 'manifest', 'latest.json': 'pointer'}.get(name)
            # the manifest's path names the epoch; the pointer's content does
            epoch_path = path if which == 'manifest' else obj.get('name', '')
            if which:
                fire(f'before-{which}', epoch_path)
            write_json(path, obj, **kwargs)
            if which == 'pointer':
                instrument.committed = int(obj['name'].split('-')[1])
            if which:
                fire(f'after-{which}', epoch_path)

        atomic.write_json = json_write
        local_storage.write_json = json_write

        replace = os.replace

        def os_replace(src, dst):
            # the commit's rename, not a leftover partial folder marked discarded
            renaming = (str(src).endswith(PARTIAL_SUFFIX)
                        and atomic.DISCARD_MARK not in str(dst))
            if renaming:
                fire('before-rename', src)
            replace(src, dst)
            if renaming:
                fire('after-rename', src)

        os.replace = os_replace

        # what retention (CheckpointFolder.retire) calls
        discard_in_background = local_storage.discard_in_background

        def discard_folder(path):
            fire('before-discard')
            return discard_in_background(path)

        local_storage.discard_in_background = discard_folder

        remove = atomic.remove_path

        def remove_part(path):
            if atomic.DISCARD_MARK in path and due('in-discard'):
                # remove some of the files, as rmtree would before the kill
                for name in sorted(os.listdir(path))[:3]:
                    os.remove(os.path.join(path, name))
                die('in-discard')
            return remove(path)

        atomic.remove_path = remove_part


class BatchKiller(BatchEnds):
    def __init__(self, instrument):
        self.instrument = instrument

    def at_batch(self, net, batch):
        self.instrument.fire(f'batch-{batch}')


class Freeze(Callback):
    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, epoch, who):
        self.epoch, self.who = epoch, who

    def on_batch_end(self, net, training=False, **kwargs):
        if training and len(net.history) == self.epoch and rank() == self.who:
            os.kill(os.getpid(), signal.SIGSTOP)


class RecordResume(Callback):
    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def on_epoch_begin(self, net, **kwargs):
        tag = sys.argv[2]
        out = os.environ.get('RESULT_DIR', '.')
        path = os.path.join(out, f'resumed-{tag}-rank{rank()}.json')
        if not os.path.exists(path):
            with open(path, 'w') as f:
                json.dump({'loaded_from': faultjob.loaded_from(net),
                           'epoch': len(net.history),
                           'num_processes': sync.num_processes(net)}, f)


def main():
    dirname, tag = sys.argv[1], sys.argv[2]
    callbacks = [EpochTracker(), RecordResume()]
    for name, action in (('KILL', die), ('HOLD', hold)):
        if os.environ.get(name):
            epoch, point, who = os.environ[name].split(':')
            instrument = Instrument(int(epoch), point, int(who), action)
            instrument.install()
            callbacks.append(BatchKiller(instrument))
    if os.environ.get('FREEZE'):
        callbacks.append(Freeze(*map(int, os.environ['FREEZE'].split(':'))))
    module = {'module': FrozenBaseMLP} if os.environ.get('FROZEN_BASE') == '1' else {}
    if os.environ.get('FROZEN_BASE') == 'trained':
        callbacks.append(FreezeBaseAfterFirstStep())
    net, _ = faultjob.build(dirname, callbacks=callbacks,
                            async_save=os.environ.get('ASYNC') == '1', **module)
    net.fit(*faultjob.data())
    faultjob.finish(net, tag)


if __name__ == '__main__':
    main()
