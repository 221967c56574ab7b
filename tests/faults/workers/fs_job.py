"""Filesystem faults, run without the capabilities that let root ignore
permission bits.

usage: fs_job.py READONLY TAG

READONLY is a folder this process cannot write. With TMPFS set (a small
tmpfs), the disk-full scenarios run too: the disk is
filled in the middle of epoch 2, so the save at its end fails. Each
scenario's outcome on this rank (error type and message, epochs trained,
what is on disk) goes to ``<TAG>-rank<r>.json``.
"""

import errno
import os
import sys
import warnings

import torch
from skorch.callbacks import Callback

import faultjob
from common import MLP, make_accelerator, make_data, make_net, params_digest, rank, write_result
from skorch_accel_callbacks import ParamsCheckpoint, unwrapped


class FillDisk(Callback):
    """Rank 0 fills the filesystem of ``folder`` after batch 1 of ``epoch``."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, folder, epoch):
        self.folder, self.epoch = folder, epoch

    def on_batch_end(self, net, training=False, **kwargs):
        if not (training and rank() == 0 and len(net.history) == self.epoch):
            return
        path = os.path.join(self.folder, f'filler-{self.epoch}')
        if os.path.exists(path):
            return
        chunk = b'\0' * 65536
        with open(path, 'wb') as f:
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise


def attempt(fn):
    """Run a scenario; its outcome as JSON."""
    outcome = {'type': None, 'text': None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            outcome.update(fn() or {})
        except Exception as exc:  # pylint: disable=broad-except
            outcome.update(type=type(exc).__name__,
                           text='\n'.join([str(exc), *getattr(exc, '__notes__', ())]))
    outcome['warnings'] = [str(w.message) for w in caught]
    return outcome


def checkpoint_job(dirname, callbacks=()):
    net, _ = faultjob.build(dirname, callbacks=callbacks)
    try:
        net.fit(*faultjob.data())
    finally:
        checkpoint_job.epochs = len(net.history)


def params_job(dirname, on_error, fill=None):
    """A net with ParamsCheckpoint every epoch; ``params_job.digests`` holds
    the parameters' digest of each epoch, also when the fit raised."""
    digests = params_job.digests = {}

    class Digest(Callback):
        # observes or injects a fault, trains nothing: not recorded, may come and go
        unrecorded_params = True

        def on_epoch_end(self, net, **kwargs):
            with unwrapped(net):
                digests[len(net.history)] = params_digest(net.module_)

    callbacks = [Digest(), ParamsCheckpoint(monitor=None, dirname=dirname, on_error=on_error,
                                            f_optimizer=None, f_criterion=None)]
    if fill:
        callbacks.append(FillDisk(fill, 2))
    torch.manual_seed(0)
    net = make_net(make_accelerator(), callbacks=callbacks, max_epochs=2, batch_size=16,
                   train_split=None)
    try:
        net.fit(*make_data(n=64))
    finally:
        params_job.epochs = len(net.history)


def saved_digest(dirname):
    module = MLP()
    module.load_state_dict(torch.load(os.path.join(dirname, 'params.pt'), weights_only=True))
    return params_digest(module)


def effective_capabilities():
    with open('/proc/self/status', encoding='ascii') as f:
        for line in f:
            if line.startswith('CapEff:'):
                return int(line.split()[1], 16)
    raise RuntimeError('no CapEff in /proc/self/status')


def main():
    readonly, tag = sys.argv[1], sys.argv[2]
    tmpfs = os.environ.get('TMPFS')
    results = {'cap_eff': effective_capabilities()}
    results['readonly'] = attempt(lambda: checkpoint_job(readonly))
    results['readonly']['epochs'] = checkpoint_job.epochs
    results['params-readonly'] = attempt(lambda: ParamsCheckpoint(dirname=readonly).initialize())
    if tmpfs:
        ckpt = os.path.join(tmpfs, 'ckpt')
        results['full'] = attempt(lambda: checkpoint_job(ckpt, [FillDisk(tmpfs, 2)]))
        results['full']['epochs'] = checkpoint_job.epochs
        results['full']['listing'] = sorted(os.listdir(ckpt))
        # the disk stays full: the params saves of epoch 2 fail too
        params = os.path.join(tmpfs, 'params')
        for on_error in ('raise', 'warn'):
            if rank() == 0:
                # room for epoch 1's save again
                os.remove(os.path.join(tmpfs, 'filler-2'))
            key = f'params-full-{on_error}'
            results[key] = attempt(lambda: params_job(params, on_error, fill=tmpfs))
            results[key].update(epochs=params_job.epochs, digests=params_job.digests)
            results[key]['saved_digest'] = saved_digest(params)
    write_result(tag, results)


if __name__ == '__main__':
    main()
