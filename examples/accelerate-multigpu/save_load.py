"""Save a net's parameters wrapped or unwrapped; load them into a wrapped, an
unwrapped and a plain net; check that every one predicts exactly the same.

usage::

    accelerate launch --config_file accelerate_config.yaml save_load.py
    torchrun --standalone --nproc_per_node 2 save_load.py --cpu   # no GPU

One net is trained; while it trains, ``ParamsCheckpoint`` saves at the end of
every epoch from the *wrapped* module (``DistributedDataParallel`` with more
than one process), and ``TrainEndParamsCheckpoint`` saves at the end from the
*unwrapped* one (skorch unwraps after training). Each of the two checkpoints
is then loaded

- into a *wrapped* net: ``LoadInitParams`` when training begins
  (``max_epochs=0``: nothing is trained after loading),
- into an *unwrapped* net: ``net.load_params(checkpoint=...)`` on a net that
  trained one epoch from other initial weights and was unwrapped after it,
- into a *plain* ``NeuralNetClassifier`` without accelerate (on the main
  process),

and the predicted probabilities of the test images are compared with those
of the trained net. The main process prints one line per combination and a
verdict; the exit code is 1 if any prediction differs.
"""

import os
import sys

import numpy as np
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback
from skorch.utils import noop

from common import (
    NET_KWARGS,
    AcceleratedNet,
    argument_parser,
    load_data,
    make_accelerator,
    seed_everything,
)
from skorch_accel_callbacks import LoadInitParams, ParamsCheckpoint, TrainEndParamsCheckpoint

# skorch's AccelerateMixin prints the epoch log with accelerator.print (main
# process only) whatever `verbose` says; the nets that only load stay quiet
QUIET = {'callbacks__print_log__sink': noop}


class ModuleTypes(Callback):
    """What ``net.module_`` is when the checkpoints save."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def on_epoch_end(self, net, **kwargs):
        self.at_epoch_end_ = type(net.module_).__name__

    def on_train_end(self, net, **kwargs):
        # skorch's AccelerateMixin unwraps in net.on_train_end, which runs
        # before the callbacks' on_train_end
        self.at_train_end_ = type(net.module_).__name__


def files_of(checkpoint):
    """The ParamsCheckpoint that names the files of ``checkpoint``."""
    if isinstance(checkpoint, TrainEndParamsCheckpoint):
        return checkpoint.checkpoint_
    return checkpoint


def has_module_prefix(checkpoint, net):
    path = files_of(checkpoint).get_formatted_files(net)['f_params']
    return any(key.startswith('module.')
               for key in torch.load(path, map_location='cpu', weights_only=True))


def train_and_save(args, X, y):
    seed_everything()
    types = ModuleTypes()
    sources = {
        'wrapped': ParamsCheckpoint(
            monitor=None, dirname=os.path.join(args.out, 'saved-while-wrapped')),
        'unwrapped': TrainEndParamsCheckpoint(
            dirname=os.path.join(args.out, 'saved-after-unwrap')),
    }
    net = AcceleratedNet(
        accelerator=make_accelerator(args.cpu), max_epochs=args.epochs,
        callbacks=[types, *sources.values()], **NET_KWARGS)
    net.fit(X, y)
    saved_from = {'wrapped': types.at_epoch_end_, 'unwrapped': types.at_train_end_}
    return net, sources, saved_from


def load_into_wrapped(args, checkpoint, X, y):
    net = AcceleratedNet(
        accelerator=make_accelerator(args.cpu), max_epochs=0, unwrap_after_train=False,
        callbacks=[LoadInitParams(checkpoint)], **QUIET, **NET_KWARGS)
    net.fit(X, y)
    return net


def load_into_unwrapped(args, checkpoint, X, y):
    seed_everything()
    torch.manual_seed(1)  # initial weights other than the trained net's
    net = AcceleratedNet(
        accelerator=make_accelerator(args.cpu), max_epochs=1, **QUIET, **NET_KWARGS)
    net.fit(X, y)
    net.load_params(checkpoint=files_of(checkpoint))
    return net


def load_into_plain(checkpoint, device):
    # skorch's map_location does not know accelerate's 'cpu:0'
    device = 'cpu' if device.type == 'cpu' else str(device)
    net = NeuralNetClassifier(device=device, verbose=0, **NET_KWARGS)
    net.initialize()
    net.load_params(checkpoint=files_of(checkpoint))
    return net


def main(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument('--out', default=os.path.join('runs', 'save-load'),
                        help="folder for the checkpoints (default runs/save-load)")
    parser.add_argument('--epochs', type=int, default=3, help="epochs to train (default 3)")
    args = parser.parse_args(argv)
    X, y, X_test = load_data()

    trained, sources, saved_from = train_and_save(args, X, y)
    accelerator = trained.accelerator
    reference = trained.predict_proba(X_test)
    accelerator.print(f"trained {args.epochs} epochs in {accelerator.num_processes} "
                      f"process(es) on {accelerator.device}")
    targets = (('LoadInitParams, wrapped net', load_into_wrapped),
               ('load_params, unwrapped net', load_into_unwrapped))
    rows = []
    for source, checkpoint in sources.items():
        saved = (type(checkpoint).__name__, saved_from[source],
                 has_module_prefix(checkpoint, trained))
        for target, load in targets:
            net = load(args, checkpoint, X, y)
            # every rank takes part in predict: it gathers across processes
            rows.append(saved + (target, type(net.module_).__name__,
                                 len(net.accelerator._models), net.predict_proba(X_test)))
        if accelerator.is_main_process:
            plain = load_into_plain(checkpoint, accelerator.device)
            rows.append(saved + ('load_params, NeuralNetClassifier',
                                 type(plain.module_).__name__, '-',
                                 plain.predict_proba(X_test)))

    # ends the trackers and the process group, as accelerate asks a script to
    accelerator.end_training()
    if not accelerator.is_main_process:
        return 0
    columns = ('saved by', 'module when saved', "'module.' keys", 'loaded by',
               'module when loaded', 'models registered', 'predictions')
    widths = (24, 23, 14, 33, 23, 17)
    # the last column (the verdict on the predictions) has no width
    header = ' '.join(f"{name:<{width}}"
                      for name, width in zip(columns[:-1], widths, strict=True))
    print('\n' + header + ' ' + columns[-1])
    all_identical = True
    for *cells, proba in rows:
        identical = np.array_equal(proba, reference)
        all_identical &= identical
        cells[2] = 'yes' if cells[2] else 'no'
        verdict = 'identical' if identical else (
            f"DIFFER (max |difference| {np.abs(proba - reference).max():.3g})")
        print(' '.join(f"{str(cell):<{width}}" for cell, width in zip(cells, widths, strict=True))
              + ' ' + verdict)
    print("\nVERDICT: " + ("IDENTICAL: every combination predicts exactly what the "
                           "trained net predicts." if all_identical else
                           "DIFFERS: see the lines marked DIFFER."))
    return 0 if all_identical else 1


if __name__ == '__main__':
    sys.exit(main())
