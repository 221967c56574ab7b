"""Jobs for tests/test_params_parity.py.

usage: params_parity.py hold FN_PREFIX MARKERS
  One process, a plain skorch net whose ParamsCheckpoint keeps the default
  ``dirname=''`` (the working directory) and uses FN_PREFIX. After its first
  epoch's save it writes ``MARKERS/held`` and waits (holding the lock of its
  files) until ``MARKERS/go`` exists, then trains its second epoch and ends.
"""

import os
import sys
import time

from skorch import NeuralNetClassifier
from skorch.callbacks import Callback

from common import MLP, make_data
from skorch_accel_callbacks import ParamsCheckpoint

HOLD_TIMEOUT_S = 300


class Hold(Callback):
    """After epoch 1 (and its save): say so, then wait for the go."""

    def __init__(self, markers):
        self.markers = markers

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) != 1:
            return
        with open(os.path.join(self.markers, 'held'), 'w') as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not os.path.exists(os.path.join(self.markers, 'go')):
            if time.monotonic() > deadline:
                sys.exit("the test never said go")
            time.sleep(0.05)


def hold(prefix, markers):
    X, y = make_data(n=64)
    cp = ParamsCheckpoint(monitor=None, fn_prefix=prefix)
    NeuralNetClassifier(MLP, max_epochs=2, train_split=None, verbose=0,
                        callbacks=[cp, Hold(markers)]).fit(X, y)


if __name__ == '__main__':
    if sys.argv[1] == 'hold':
        hold(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown job {sys.argv[1]!r}")
