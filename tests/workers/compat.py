"""A hyper-parameter loop on one checkpoint folder, in every process.

usage: compat.py DIRNAME

The first fit (lr 0.05) trains one epoch and finishes; the second (lr 0.5)
must be refused on every rank before it trains. Every rank writes
``compat-rank<r>.json``: its number of processes, the refusal's message and
whether its parameters are still those the second fit was initialized with.
"""

import sys

import torch

from common import (
    make_accelerator,
    make_data,
    make_net,
    params_digest,
    settle_gloo,
    write_result,
)
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState, CheckpointError


def net_with_lr(dirname, lr, accelerator):
    cp = AccelerateCheckpoint(dirname=dirname)
    torch.manual_seed(0)
    return make_net(accelerator, lr=lr, max_epochs=1,
                    callbacks=[cp, AccelerateLoadInitState(cp)])


def main():
    dirname = sys.argv[1]
    accelerator = make_accelerator()
    X, y = make_data(n=128)
    net_with_lr(dirname, 0.05, accelerator).fit(X, y)
    net = net_with_lr(dirname, 0.5, accelerator).initialize()
    before = params_digest(net.module_)
    # fit initializes the net again, from the same seed
    torch.manual_seed(0)
    try:
        net.fit(X, y)
        message = None
    except CheckpointError as exc:
        message = str(exc)
    write_result('compat', {
        'num_processes': accelerator.num_processes,
        'message': message,
        'params_unchanged': params_digest(net.module_) == before,
        'history_length': len(net.history),
    })
    settle_gloo()


if __name__ == '__main__':
    main()
