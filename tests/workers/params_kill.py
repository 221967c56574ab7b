"""A process killed (SIGKILL) in the middle of writing a checkpoint file.

ParamsCheckpoint saves every epoch. After epoch 1 each rank records the
parameters it saved; in epoch 2 the main process writes half of the params
file and kills itself. The test then loads the folder (params_main.py) and
expects epoch 1's parameters.

Usage: params_kill.py FOLDER
"""

import io
import os
import signal
import sys

import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback
from skorch.hf import AccelerateMixin
from torch.nn.parallel import DistributedDataParallel

from common import make_accelerator, make_data, make_net, params_digest, write_result
from skorch_accel_callbacks import AccelerateFixesMixin, ParamsCheckpoint, unwrapped
from skorch_accel_callbacks._core import sync


class DieWhileWriting:
    """Sits below AccelerateMixin, so it only runs where the bytes are written:
    on the main process, after skorch's barrier, with the temporary path."""

    def save_params(self, **kwargs):
        # skorch's Checkpoint passes the params file as f_module
        target = kwargs.get('f_module')
        if target is not None and len(self.history) == 2:
            buffer = io.BytesIO()
            torch.save(self.module_.state_dict(), buffer)
            data = buffer.getvalue()
            with open(target, 'wb') as f:
                f.write(data[:len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return super().save_params(**kwargs)


class DyingNet(AccelerateFixesMixin, AccelerateMixin, DieWhileWriting, NeuralNetClassifier):
    pass


class RecordEpochOne(Callback):
    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) == 1:
            with unwrapped(net):
                digest = params_digest(net.module_)
            write_result('kill', {
                'num_processes': sync.num_processes(net),
                'is_ddp': isinstance(net.module_, DistributedDataParallel),
                'digest_epoch1': digest,
            })


def main():
    folder = sys.argv[1]
    # every launch trains the same path, so a failure can be replayed
    torch.manual_seed(0)
    accelerator = make_accelerator()
    X, y = make_data()
    net = make_net(
        accelerator, net_cls=DyingNet, max_epochs=3, callbacks=[
            ParamsCheckpoint(monitor=None, dirname=folder, on_error='raise'),
            RecordEpochOne(),
        ])
    net.fit(X, y)


if __name__ == '__main__':
    main()
