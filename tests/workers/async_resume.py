"""resume.py with ``AccelerateCheckpoint(async_save=True)``, with hooks in
its background writer.

usage: async_resume.py DIRNAME TAG

Environment, beside resume.py's:
- SLOW_WRITE=E:S: the background write of epoch E sleeps S seconds after
  the model file, before the optimizer file; a KILL=batch:... waits until
  that model file is on disk, so the SIGKILL hits a write in flight however
  slowly the machine runs;
- BG_FAIL=E: the background write of epoch E fails with ENOSPC.

Every rank also writes ``<TAG>-threads-rank<r>.json``: the names of the
threads that called a torch.distributed collective from Python.
"""

import errno
import json
import os
import re
import sys
import threading
import time

import torch.distributed as dist

import resume
from common import write_result
from skorch_accel_callbacks._core import accelerate_io

COLLECTIVES = ('barrier', 'broadcast', 'broadcast_object_list', 'all_gather',
               'all_gather_object', 'gather_object', 'all_reduce', 'reduce', 'gather')


def epoch_of(path):
    return int(re.search(r'epoch-(\d+)\.partial', str(path)).group(1))


def hook_writer():
    original = accelerate_io.save
    slow_epoch, seconds = map(float, os.environ.get('SLOW_WRITE', '0:0').split(':'))
    fail_epoch = int(os.environ.get('BG_FAIL', '0'))

    def save(obj, f, **kwargs):
        if epoch_of(f) == fail_epoch:
            raise OSError(errno.ENOSPC, 'No space left on device', str(f))
        original(obj, f, **kwargs)
        if epoch_of(f) == slow_epoch and str(f).endswith('model.safetensors'):
            time.sleep(seconds)

    accelerate_io.save = save


def kill_only_after_model_file(dirname):
    """Hold KillAt's SIGKILL until the slow epoch's model file exists.

    Every rank polls the file, rank 0 writes it: without this, a loaded
    machine can reach the kill batch before the writer thread has started.
    """
    slow_epoch = int(os.environ['SLOW_WRITE'].split(':')[0])
    model_file = os.path.join(dirname, f'epoch-{slow_epoch:04d}.partial', 'model.safetensors')
    original = resume.KillAt.at_batch

    def at_batch(self, net, batch):
        if len(net.history) == self.epoch and batch == self.batch:
            deadline = time.monotonic() + 120
            while not os.path.exists(model_file) and time.monotonic() < deadline:
                time.sleep(0.05)
        original(self, net, batch)

    resume.KillAt.at_batch = at_batch


def record_collective_threads():
    threads = set()

    def wrap(fn):
        def collective(*args, **kwargs):
            threads.add(threading.current_thread().name)
            return fn(*args, **kwargs)
        return collective

    for name in COLLECTIVES:
        setattr(dist, name, wrap(getattr(dist, name)))
    return threads


def main():
    options = json.loads(os.environ.get('CKPT_OPTIONS', '{}'))
    os.environ['CKPT_OPTIONS'] = json.dumps(dict(options, async_save=True))
    hook_writer()
    if 'SLOW_WRITE' in os.environ:
        kill_only_after_model_file(sys.argv[1])
    threads = record_collective_threads()
    try:
        resume.main()
    finally:
        write_result(f"{sys.argv[2]}-threads", sorted(threads))


if __name__ == '__main__':
    main()
