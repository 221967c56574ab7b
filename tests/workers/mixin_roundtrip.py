"""Clone and pickle a FixedNet after a fit that was preempted, that ended
normally and that raised, for tests/callbacks/test_mixin.py.

usage: mixin_roundtrip.py roundtrip FOLDER
  In every process of the launch: :func:`roundtrips` (each rank pickles
  its nets into FOLDER/rank<r>), results in ``roundtrip-rank<r>.json``.

usage: mixin_roundtrip.py unpickle FOLDER
  In one fresh process: :func:`check_unpickled` of the pickles in FOLDER,
  results in ``unpickle-rank0.json``.

The test also runs :func:`roundtrips` and :func:`check_unpickled` in its own
process.
"""

import os
import pickle
import signal
import sys

import numpy as np
from sklearn.base import clone
from skorch.callbacks import Callback

from common import make_accelerator, make_data, make_net, write_result
from skorch_accel_callbacks import AccelerateCheckpoint, TrainingPreempted
from skorch_accel_callbacks._core import sync
from skorch_accel_callbacks._core.wrapping import is_wrapped

ENDINGS = ('preempted', 'normal', 'error')
MAX_EPOCHS = 2


class Interrupt(Callback):
    """After the first training batch of a fit, rank 0 gets SIGTERM
    (``ending='preempted'``) or every rank raises ``ValueError``
    (``ending='error'``)."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, ending='normal'):
        self.ending = ending

    def initialize(self):
        self.fired_ = False
        return self

    def on_batch_end(self, net, training=False, **kwargs):
        if not training or self.fired_:
            return
        self.fired_ = True
        if self.ending == 'preempted' and sync.is_main_process(net):
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.ending == 'error':
            raise ValueError("boom")


def make_interrupted_net(accelerator, ending, dirname):
    callbacks = [
        ('checkpoint', AccelerateCheckpoint(dirname=dirname, save_on_signal=('SIGTERM',))),
        ('interrupt', Interrupt(ending)),
    ]
    return make_net(accelerator, max_epochs=MAX_EPOCHS, callbacks=callbacks)


def fit_ending(net, X, y):
    """Fit ``net``; return the name of the exception that ended it, or None."""
    try:
        net.fit(X, y)
    except (TrainingPreempted, ValueError) as exc:
        return type(exc).__name__
    return None


def check_fits(net, X, y):
    """Whether ``net`` fits (``fit``, then ``partial_fit``) and predicts,
    without interruption nor checkpoints (which the test does not need)."""
    net.set_params(callbacks__interrupt__ending='normal', callbacks__checkpoint=None)
    net.fit(X, y)
    fitted = len(net.history) == MAX_EPOCHS
    net.partial_fit(X, y)
    return {'device': net.device, 'fit': fitted,
            'partial_fit': len(net.history) == 2 * MAX_EPOCHS,
            'predict': len(net.predict(X)) == len(X)}


def roundtrip(accelerator, ending, X, y, dirname, pickle_path):
    """Fit a net ended by ``ending`` (checkpoints in ``dirname``); clone it
    and pickle it, and fit both.

    The net's pickle goes to ``pickle_path``, its predictions of X next to
    it (``.npy``)."""
    net = make_interrupted_net(accelerator, ending, dirname)
    out = {'raised': fit_ending(net, X, y), 'wrapped': is_wrapped(net)}
    proba = net.predict_proba(X)
    np.save(pickle_path + '.npy', proba)

    cloned = clone(net)
    fresh = make_interrupted_net(accelerator, ending, dirname)
    out['clone'] = {
        'params_as_new': sorted(cloned.get_params(deep=False)) == sorted(
            fresh.get_params(deep=False)),
        'fitted': cloned.initialized_,
        **check_fits(cloned, X, y),
    }

    data = pickle.dumps(net)
    with open(pickle_path, 'wb') as f:
        f.write(data)
    unpickled = pickle.loads(data)
    out['unpickled'] = {
        'same_proba': bool(np.allclose(unpickled.predict_proba(X), proba, atol=1e-6)),
        **check_fits(unpickled, X, y),
    }
    # the net itself trains on as well
    out['net'] = check_fits(net, X, y)
    return out


def roundtrips(accelerator, folder):
    """:func:`roundtrip` of every ending, the same ``folder`` on every rank:
    checkpoints in ``folder/checkpoints``, each rank's pickles in
    ``folder/rank<r>``."""
    X, y = make_data()
    pickles = os.path.join(folder, f'rank{accelerator.process_index}')
    os.makedirs(pickles, exist_ok=True)
    return {ending: roundtrip(accelerator, ending, X, y,
                              os.path.join(folder, 'checkpoints', ending),
                              os.path.join(pickles, f'{ending}.pkl'))
            for ending in ENDINGS}


def check_unpickled(folder):
    """Unpickle each pickle of :func:`roundtrips` in this process; whether it
    predicts as the pickled net did, fits and partially fits."""
    X, y = make_data()
    out = {}
    for ending in ENDINGS:
        path = os.path.join(folder, f'{ending}.pkl')
        with open(path, 'rb') as f:
            net = pickle.load(f)
        out[ending] = {
            'num_processes': net.accelerator.num_processes,
            'same_proba': bool(np.allclose(
                net.predict_proba(X), np.load(path + '.npy'), atol=1e-6)),
            **check_fits(net, X, y),
        }
    return out


def main():
    mode, folder = sys.argv[1:3]
    if mode == 'roundtrip':
        accelerator = make_accelerator()
        out = roundtrips(accelerator, folder)
        out['num_processes'] = accelerator.num_processes
        write_result('roundtrip', out)
    else:
        write_result('unpickle', check_unpickled(folder))


if __name__ == '__main__':
    main()
