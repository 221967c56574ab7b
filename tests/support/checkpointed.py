"""In-process fits that checkpoint into a ``dirname`` (a folder, or a
store's URL) and resume from it, for the tests of the stores."""

import torch

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState


def fit(dirname, max_epochs, callbacks=(), **cp_kwargs):
    """A net fitted for ``max_epochs`` with an ``AccelerateCheckpoint`` of
    ``dirname`` (``cp_kwargs``) and its ``AccelerateLoadInitState``; the
    net, the checkpoint callback and the load callback."""
    cp = AccelerateCheckpoint(dirname=dirname, **cp_kwargs)
    load = AccelerateLoadInitState(cp)
    torch.manual_seed(0)
    net = make_net(make_accelerator(), callbacks=[cp, load, *callbacks], max_epochs=max_epochs)
    net.fit(*make_data(n=160))
    return net, cp, load


def state(net):
    """What assert_identical compares: parameters, optimizer state, losses."""
    return {'params': {'module': net.module_.state_dict()},
            'optimizers': {'optimizer': net.optimizer_.state_dict()},
            'history': [{key: row.get(key) for key in ('train_loss', 'valid_loss', 'event_lr')}
                        for row in net.history]}
