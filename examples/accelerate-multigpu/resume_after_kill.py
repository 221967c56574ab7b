r"""Train with whole-state checkpoints, die by SIGKILL, resume, compare.

usage (each command on every node, or once on a single machine)::

    # 1. the reference: 8 epochs uninterrupted
    accelerate launch --config_file accelerate_config.yaml resume_after_kill.py --dirname runs/full
    # 2. the same training, every process SIGKILLed in the middle of epoch 5
    accelerate launch --config_file accelerate_config.yaml resume_after_kill.py \
        --dirname runs/killed --die-in-epoch 5
    # 3. the same command without the kill: resumes after epoch 4
    accelerate launch --config_file accelerate_config.yaml resume_after_kill.py \
        --dirname runs/killed

Without GPUs: ``torchrun --standalone --nproc_per_node 2 resume_after_kill.py --cpu ...``.

``AccelerateCheckpoint`` commits a checkpoint of the whole training state
(model, optimizer, LR scheduler, history, random states and data order of
every process) at the end of every epoch; ``AccelerateLoadInitState`` finds
the newest complete one when training begins and continues from there. The
main process prints the epoch log, what it resumed from, and at the end
``final parameters sha256: ...``: runs 1 and 3 print the same hash when the
resumed training is bit-identical to the uninterrupted one.
"""

import os
import signal
import sys

from skorch.callbacks import Callback, LRScheduler
from skorch.dataset import ValidSplit
from torch.optim.lr_scheduler import StepLR

from common import (
    NET_KWARGS,
    AcceleratedNet,
    argument_parser,
    load_data,
    make_accelerator,
    params_sha256,
    seed_everything,
)
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState

DIE_AFTER_BATCH = 2


class DieInEpoch(Callback):
    """SIGKILL this process after a training batch of an epoch, as a power cut
    would: no exception, no cleanup, nothing flushed."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_begin(self, net, **kwargs):
        self.batches_ = 0

    def on_batch_end(self, net, training=False, **kwargs):
        if not training:
            return
        self.batches_ += 1
        if len(net.history) == self.epoch and self.batches_ == DIE_AFTER_BATCH:
            net.accelerator.print(
                f"killing every process (SIGKILL) after batch {DIE_AFTER_BATCH} "
                f"of epoch {self.epoch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument('--dirname', default=os.path.join('runs', 'resume'),
                        help="checkpoint folder (default runs/resume)")
    parser.add_argument('--epochs', type=int, default=8, help="epochs in all (default 8)")
    parser.add_argument('--die-in-epoch', type=int, default=None, metavar='E',
                        help=f"SIGKILL every process after batch {DIE_AFTER_BATCH} of epoch E")
    parser.add_argument('--resume', default='latest',
                        help="'latest', 'best' or a checkpoint folder (default latest)")
    args = parser.parse_args(argv)

    seed_everything()
    accelerator = make_accelerator(args.cpu)
    checkpoint = AccelerateCheckpoint(dirname=args.dirname, sink=print)
    callbacks = [
        checkpoint,
        AccelerateLoadInitState(checkpoint, resume=args.resume, sink=print),
        LRScheduler(policy=StepLR, step_size=3, gamma=0.5),
    ]
    if args.die_in_epoch is not None:
        callbacks.append(DieInEpoch(args.die_in_epoch))
    net = AcceleratedNet(
        accelerator=accelerator, max_epochs=args.epochs, callbacks=callbacks,
        train_split=ValidSplit(5, stratified=True), **NET_KWARGS)
    X, y, _ = load_data()
    net.fit(X, y)
    accelerator.print(f"trained {len(net.history)} epochs in {accelerator.num_processes} "
                      f"process(es) on {accelerator.device}")
    accelerator.print(f"final parameters sha256: {params_sha256(net.module_)}")
    # ends the trackers and the process group, as accelerate asks a script to
    accelerator.end_training()
    return 0


if __name__ == '__main__':
    sys.exit(main())
