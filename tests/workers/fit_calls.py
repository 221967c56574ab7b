"""A script of two fit calls, as a user writes it: ``fit`` to 4 epochs,
then ``partial_fit`` (or, with WARM=1, ``fit`` again with ``warm_start=True``)
4 more; optionally interrupted in the second call.

usage: fit_calls.py DIRNAME TAG

Environment:
- INTERRUPT: ``sigterm:E:B`` sends every rank SIGTERM after training batch
  B of epoch E (its last batch: the epoch's end saves and stops), and the
  script ends with exit code 3 once ``TrainingPreempted`` was raised;
  ``sigkill:E:B`` SIGKILLs every rank there, after it wrote
  ``<TAG>-killed-rank<r>.json`` (proof that it fired);
- CKPT_OPTIONS: JSON of extra AccelerateCheckpoint arguments;
- WARM=1: the second call is a ``fit`` with ``warm_start=True``.

When the script ends, every rank writes ``<TAG>-rank<r>.pt`` (parameters,
optimizer state, history, the checkpoint callback's optimizer steps) and
``<TAG>-rank<r>.json`` (number of processes, what it resumed from, the
training batches it ran).
"""

import json
import os
import signal
import sys

import torch
from skorch.callbacks import Callback

from common import (
    BatchEnds,
    NotTrainingState,
    make_accelerator,
    make_data,
    make_net,
    rank,
    write_result,
)
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState, TrainingPreempted


class Interrupt(NotTrainingState, BatchEnds):
    """SIGTERM or SIGKILL to this process after batch ``batch`` of epoch ``epoch``."""

    def __init__(self, kind, epoch, batch, tag):
        self.kind = kind
        self.epoch = epoch
        self.batch = batch
        self.tag = tag

    def at_batch(self, net, batch):
        if (len(net.history), batch) != (self.epoch, self.batch):
            return
        if self.kind == 'sigkill':
            write_result(f'{self.tag}-killed', {'epoch': self.epoch, 'batch': batch})
            os.kill(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGTERM)


class CountBatches(NotTrainingState, Callback):
    """The training batches this process ran, over every call."""

    def initialize(self):
        self.trained = 0
        return self

    def on_batch_end(self, net, training=False, **kwargs):
        self.trained += bool(training)


def state(net, cp):
    """What the uninterrupted and the relaunched script must end with alike."""
    return {
        'params': net.accelerator.unwrap_model(net.module_).state_dict(),
        'optimizer': net.optimizer_.state_dict(),
        'history': [{key: value for key, value in row.items() if key != 'dur'}
                    for row in net.history],
        'step': cp.global_step_,
    }


def main():
    dirname, tag = sys.argv[1], sys.argv[2]
    extra, counter = [], CountBatches()
    interrupt = os.environ.get('INTERRUPT')
    if interrupt:
        kind, epoch, batch = interrupt.split(':')
        extra.append(Interrupt(kind, int(epoch), int(batch), tag))
    cp = AccelerateCheckpoint(dirname=dirname,
                              **json.loads(os.environ.get('CKPT_OPTIONS', '{}')))
    load = AccelerateLoadInitState(cp)
    torch.manual_seed(0)
    net = make_net(make_accelerator(), callbacks=[cp, load, counter, *extra], max_epochs=4)
    X, y = make_data()
    result = {'num_processes': net.accelerator.num_processes}
    try:
        net.fit(X, y)
        if os.environ.get('WARM') == '1':
            net.set_params(warm_start=True)
            net.fit(X, y)
        else:
            net.partial_fit(X, y)
    except TrainingPreempted as exc:
        write_result(tag, dict(result, preempted=os.path.basename(exc.checkpoint)))
        sys.exit(3)
    torch.save(state(net, cp), os.path.join(os.environ.get('RESULT_DIR', '.'),
                                            f'{tag}-rank{rank()}.pt'))
    loaded = load.loaded_from_
    write_result(tag, dict(result, trained=counter.trained,
                           loaded_from=loaded and os.path.basename(loaded)))


if __name__ == '__main__':
    main()
