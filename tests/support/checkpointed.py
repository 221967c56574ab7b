"""In-process fits that checkpoint into a ``dirname`` (a folder, or a
store's URL) and resume from it: the one fit the tests of one process share
(a test module that fits otherwise by default binds its defaults with
``functools.partial``)."""

import torch

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState, CheckpointError


def fit(dirname, *callbacks, max_epochs=3, resume='latest', accelerator=None, data=None,
        net_kwargs=None, load_kwargs=None, checkpoint_class=AccelerateCheckpoint, **cp_kwargs):
    """A net seeded and fitted for ``max_epochs`` with an
    ``AccelerateCheckpoint`` (or ``checkpoint_class``, a subclass) of
    ``dirname`` (``cp_kwargs``), its
    ``AccelerateLoadInitState`` (``resume``, ``load_kwargs``) and
    ``callbacks``, on ``data`` (``make_data(n=160)`` by default); the net,
    the checkpoint callback and the load callback.

    ``accelerator`` (a new one by default) and ``net_kwargs`` go to
    ``make_net``. A fit refused with a ``CheckpointError`` closes the
    checkpoint callback before it raises, as the refused job's end would:
    its claim of the folder or store goes with it.
    """
    cp = checkpoint_class(dirname=str(dirname), **cp_kwargs)
    load = AccelerateLoadInitState(cp, resume=resume, **(load_kwargs or {}))
    torch.manual_seed(0)
    net = make_net(accelerator or make_accelerator(), callbacks=[cp, load, *callbacks],
                   max_epochs=max_epochs, **(net_kwargs or {}))
    try:
        net.fit(*(make_data(n=160) if data is None else data))
    except CheckpointError:
        cp.close()
        raise
    return net, cp, load


def state(net):
    """What assert_identical compares: parameters, optimizer state, losses."""
    return {'params': {'module': net.module_.state_dict()},
            'optimizers': {'optimizer': net.optimizer_.state_dict()},
            'history': [{key: row.get(key) for key in ('train_loss', 'valid_loss', 'event_lr')}
                        for row in net.history]}
