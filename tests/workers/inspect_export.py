"""Train with AccelerateCheckpoint in every process, then load the newest
checkpoint's parameters with ``net.load_params(checkpoint=cp)`` into a
wrapped (DDP) and an unwrapped net of this job.

usage: inspect_export.py DIRNAME

Every rank writes ``load-rank<r>.json`` to RESULT_DIR: the predictions of
the trained net and of the two loaded nets on ``make_data(n=160)``, and the
type of each loaded net's module when it was loaded.
"""

import sys

import torch

from common import make_accelerator, make_data, make_net, rank, write_result
from skorch_accel_callbacks import AccelerateCheckpoint, unwrapped


def predictions(net, X):
    # a collective under DDP: every rank predicts on all of X
    return net.predict_proba(X).tolist()


def main(dirname):
    accelerator = make_accelerator()
    X, y = make_data(n=160)
    torch.manual_seed(0)
    cp = AccelerateCheckpoint(dirname=dirname)
    trained = make_net(accelerator, callbacks=[cp], max_epochs=3)
    trained.fit(X, y)

    # a fresh net, prepared by accelerate: its module is DDP-wrapped
    torch.manual_seed(1)
    wrapped = make_net(accelerator).initialize()
    wrapped_type = type(wrapped.module_).__name__
    wrapped.load_params(checkpoint=AccelerateCheckpoint(dirname=dirname))

    # a net after training: skorch unwraps its module (unwrap_after_train)
    torch.manual_seed(2)
    bare = make_net(accelerator, max_epochs=1)
    bare.fit(X, y)
    bare_type = type(bare.module_).__name__
    bare.load_params(checkpoint=AccelerateCheckpoint(dirname=dirname))
    with unwrapped(wrapped):
        wrapped_keys = sorted(wrapped.module_.state_dict())

    write_result('load', {
        'num_processes': accelerator.num_processes,
        'trained': predictions(trained, X),
        'wrapped': predictions(wrapped, X),
        'wrapped_type': wrapped_type,
        'wrapped_type_after': type(wrapped.module_).__name__,
        'wrapped_keys': wrapped_keys,
        'bare': predictions(bare, X),
        'bare_type': bare_type,
        'history_len': len(wrapped.history),
        'rank': rank(),
    })
    accelerator.end_training()


if __name__ == '__main__':
    main(sys.argv[1])
