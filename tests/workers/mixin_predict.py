"""The gather of a FixedNet's predictions, for tests/callbacks/test_mixin.py.

usage: mixin_predict.py
  In every process of the launch: :func:`predictions`, results in
  ``predict-rank<r>.json``. The launch then ends with a FixedNet's
  ``predict_proba`` as its last collective, without ``settle_gloo``.

The test also runs :func:`predictions` in its own process.
"""

from contextlib import contextmanager

import numpy as np
import torch

from common import (
    FixedNet,
    StockNet,
    make_accelerator,
    make_data,
    make_net,
    plain_criterion,
    rank,
    write_result,
)
from skorch_accel_callbacks._core import sync

# accelerate fills up the last batch of 101 rows in 2 processes of 16 rows each
ROWS = 101
BATCH_SIZE = 16
# the gathers counted: X (256 rows) this many times, in steps of 2 * 16 rows
HELD_REPEATS = 4

# every tensor passed to torch.distributed.all_gather while spied on
PASSED = []
# how many of PASSED were still held by gloo right after each evaluation step
HELD_AFTER_STEP = []


def held_by_gloo():
    """How many tensors passed to a gather another owner than Python holds
    (gloo's work, until its worker thread lets go)."""
    return sum(tensor._use_count() > 1 for tensor in PASSED)


@contextmanager
def spied_all_gather():
    PASSED.clear()
    HELD_AFTER_STEP.clear()
    saved = torch.distributed.all_gather

    def all_gather(tensor_list, tensor, *args, **kwargs):
        PASSED.extend([*tensor_list, tensor])
        return saved(tensor_list, tensor, *args, **kwargs)

    torch.distributed.all_gather = all_gather
    try:
        yield
    finally:
        torch.distributed.all_gather = saved


class CountingNet(FixedNet):
    """A FixedNet that counts, after each evaluation step, the gathered
    tensors still held by gloo (at that moment skorch drops its own)."""

    def evaluation_step(self, batch, training=False):
        output = super().evaluation_step(batch, training=training)
        HELD_AFTER_STEP.append(held_by_gloo())
        return output


def same_gathers(net, data):
    """Whether ``sync.gather_for_metrics`` gathers ``data`` as the
    accelerator's ``gather_for_metrics`` does (outside a loader)."""
    ours = sync.gather_for_metrics(net, data)
    theirs = net.accelerator.gather_for_metrics(data)
    if isinstance(data, list):
        return ours == theirs
    return sorted(ours) == sorted(theirs) and all(
        torch.equal(ours[key], theirs[key]) for key in theirs)


def predictions(accelerator):
    X, y = make_data()
    net = make_net(accelerator, net_cls=CountingNet, max_epochs=1, train_split=None,
                   batch_size=BATCH_SIZE)
    net.fit(X, y)
    out = {'num_processes': accelerator.num_processes}

    # the same module, predicting through skorch's own mixin
    stock = make_net(accelerator, net_cls=StockNet, module=net.module_,
                     criterion=plain_criterion, batch_size=BATCH_SIZE).initialize()
    proba = net.predict_proba(X[:ROWS])
    out['rows'] = len(proba)
    out['same_as_stock'] = bool(np.array_equal(proba, stock.predict_proba(X[:ROWS])))
    with torch.no_grad():
        reference = net.module_.eval()(torch.as_tensor(X[:ROWS])).numpy()
    out['same_as_module'] = bool(np.allclose(proba, reference, atol=1e-6))

    mine = torch.arange(3.0) + 10 * rank()
    out['same_gathers'] = {
        'tensors': same_gathers(net, {'rows': mine[:, None], 'scalar': mine.sum()}),
        'objects': same_gathers(net, [f'rank {rank()}', rank()]),
    }

    # a step held by gloo is a matter of thread scheduling: of 8 steps in a
    # process, accelerate's gather left 1 to 3 held; counted over 32
    with spied_all_gather():
        net.predict_proba(np.tile(X, (HELD_REPEATS, 1)))
        out['held_by_gloo'] = {
            'gathered': len(PASSED),
            'after_steps': HELD_AFTER_STEP[:],
            'after_predict': held_by_gloo(),
        }
    return net, X, out


def main():
    net, X, out = predictions(make_accelerator())
    write_result('predict', out)
    # the last collective of the launch
    net.predict_proba(X)


if __name__ == '__main__':
    main()
