"""The fault job saving into an object store, killed with SIGKILL at a
numbered point of an upload.

usage: upload_killable.py URL TAG

Environment:
- KILL=EPOCH:POINT: the upload of checkpoint ``epoch-<EPOCH>`` SIGKILLs its
  process at POINT: ``files-K`` once K of its files are in the store,
  ``before-manifest`` (every file is there), ``after-manifest`` (before
  ``latest.json``), ``after-pointer``; before it dies it leaves
  ``killed-<TAG>-<POINT>-rank0`` in RESULT_DIR, the proof that the point
  was reached. The points wrap s3fs's own coroutines (``_put_file``,
  ``_pipe_file``), which the upload goes through.

FROZEN_BASE=1: the module's first layer is frozen (common.FrozenBaseMLP):
its part is sent once into the store's shared folder; FROZEN_BASE=trained
(one process): the layer is frozen after the first step
(common.FreezeBaseAfterFirstStep), and the optimizer's frozen part (its
momentum) is sent once too.

Every rank writes ``resumed-<TAG>-rank<r>.json`` (the folder it resumed
from, the number of processes) when its first epoch begins, then
``<TAG>-rank<r>.json``: the folder it resumed from, the epochs, the
optimizer steps it took, the number of processes and the error it ended
with (its type and message, or None); every rank ``<TAG>-rank<r>.pt``
(final state) when training ends.
Each epoch begins once the uploads queued before it ended, so that every
checkpoint is uploaded, one at a time (none is superseded in the queue).
"""

import json
import os
import re
import sys

import s3fs
from skorch.callbacks import Callback

import faultjob
from common import FreezeBaseAfterFirstStep, FrozenBaseMLP, UploadsEnded, write_result
from faultjob import EpochTracker, die
from killable import RecordResume
from skorch_accel_callbacks.format import MANIFEST_NAME, checkpoint_name, pointer_name


def checkpoint_of(path):
    """The epoch of the checkpoint a store path belongs to, or None."""
    found = re.search(r'/epoch-(\d+)/', path)
    return int(found.group(1)) if found else None


def install(epoch, point):
    """Wrap s3fs's coroutines so that the upload of ``epoch`` dies at ``point``."""
    put_file, pipe_file = s3fs.S3FileSystem._put_file, s3fs.S3FileSystem._pipe_file
    sent = []

    async def counted_put_file(self, lpath, rpath, *args, **kwargs):
        result = await put_file(self, lpath, rpath, *args, **kwargs)
        if checkpoint_of(rpath) == epoch:
            sent.append(rpath)
            if point == f'files-{len(sent)}':
                die(point, epoch)
        return result

    async def pointed_pipe_file(self, path, data, *args, **kwargs):
        manifest = (checkpoint_of(path) == epoch
                    and path.endswith('/' + MANIFEST_NAME))
        pointer = (path.endswith('/' + pointer_name('latest'))
                   and json.loads(data) == {'name': checkpoint_name(epoch)})
        if manifest and point == 'before-manifest':
            die(point, epoch)
        result = await pipe_file(self, path, data, *args, **kwargs)
        if (manifest and point == 'after-manifest') or (pointer and point == 'after-pointer'):
            die(point, epoch)
        return result

    s3fs.S3FileSystem._put_file = counted_put_file
    s3fs.S3FileSystem._pipe_file = pointed_pipe_file


class CountSteps(Callback):
    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    steps = 0

    def on_batch_end(self, net, training=False, **kwargs):
        type(self).steps += training


def main():
    url, tag = sys.argv[1], sys.argv[2]
    if os.environ.get('KILL'):
        epoch, point = os.environ['KILL'].split(':')
        install(int(epoch), point)
    # each epoch's checkpoint uploaded before the next epoch trains: saves
    # due faster than uploads would supersede a waiting one (never uploaded,
    # its kill points never reached), and the points are of one upload
    uploaded = UploadsEnded(epochs=range(1, faultjob.EPOCHS + 1))
    module = {'module': FrozenBaseMLP} if os.environ.get('FROZEN_BASE') == '1' else {}
    freeze = [FreezeBaseAfterFirstStep()] if os.environ.get('FROZEN_BASE') == 'trained' else []
    net, _ = faultjob.build(url, callbacks=[EpochTracker(), RecordResume(), CountSteps(),
                                            uploaded, *freeze], **module)
    try:
        net.fit(*faultjob.data())
    except Exception as exc:  # pylint: disable=broad-except
        write_result(tag, {'error': type(exc).__name__, 'message': str(exc),
                           'steps': CountSteps.steps,
                           'num_processes': net.accelerator.num_processes})
        return
    faultjob.finish(net, tag, error=None, steps=CountSteps.steps,
                    num_processes=net.accelerator.num_processes)


if __name__ == '__main__':
    main()
