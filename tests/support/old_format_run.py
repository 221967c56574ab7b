"""The fits of tests/format/test_old_checkpoints.py, importable by the package as it
was before the restructure (commit f5cb08a) and as it is now: only the names
of the package root, which both have.

``python tests/support/old_format_run.py OUT`` with ``PYTHONPATH=<old tree>:tests``
wrote tests/data/f5cb08a-1proc/ (see tests/data/README.rst).
"""

import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback
from skorch.hf import AccelerateMixin

from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateFixesMixin,
    AccelerateLoadInitState,
)

# 64 training samples in batches of 16: 4 optimizer steps an epoch
EVERY_N_STEPS = 3
# the in-epoch checkpoint: 1 epoch and 2 batches of the second trained (step 6)
STOP_AT = (2, 3)


class Net(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    pass


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.lin(X))), dim=-1)


class Stopped(Exception):
    """Ends a fit inside an epoch, as a killed job would."""


class StopAt(Callback):
    """Raises ``Stopped`` after batch ``where[1]`` of epoch ``where[0]``; it has
    no parameters (``where`` is a class attribute), so that a resume finds the
    same callbacks' settings as the interrupted fit had."""

    where = None

    def on_train_begin(self, net, **kwargs):
        self.batches_ = 0

    def on_batch_end(self, net, training=False, **kwargs):
        if training and self.where is not None:
            self.batches_ += 1
            epoch, batch = self.where
            if len(net.history) == epoch and self.batches_ == (epoch - 1) * 4 + batch:
                raise Stopped


def data():
    rng = np.random.RandomState(0)
    X = rng.randn(80, 4).astype(np.float32)
    y = (X @ rng.randn(4) > 0).astype(np.int64)
    return X, y


def fit(dirname, max_epochs, **cp_kwargs):
    """A fit checkpointing into ``dirname``, resuming from it if it holds a
    checkpoint; the net."""
    AcceleratorState._reset_state(True)
    cp = AccelerateCheckpoint(dirname=dirname, keep_last=1, **cp_kwargs)
    torch.manual_seed(0)
    net = Net(
        Tiny, max_epochs=max_epochs, lr=0.1, batch_size=16, optimizer=torch.optim.SGD,
        optimizer__momentum=0.9, iterator_train__shuffle=True, verbose=0,
        accelerator=Accelerator(cpu=True),
        callbacks=[cp, AccelerateLoadInitState(cp), StopAt()],
    )
    net.fit(*data())
    return net


def main(out):
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    # 2 epochs, the newest checkpoint at the end of the second
    fit(str(out / 'epoch-end'), max_epochs=2)
    StopAt.where = STOP_AT
    try:
        fit(str(out / 'in-epoch'), max_epochs=2, every_n_steps=EVERY_N_STEPS)
    except Stopped:
        pass
    else:
        raise RuntimeError("the fit was not stopped inside its epoch")
    for lock in out.rglob('.lock'):
        lock.unlink()


if __name__ == '__main__':
    # through the module's name: the checkpoint records the module class as
    # old_format_run.Tiny, as the test imports it, not as __main__.Tiny
    import old_format_run  # pylint: disable=import-self
    old_format_run.main(sys.argv[1])
