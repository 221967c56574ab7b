"""What a save of a net with a frozen base writes, and how long it takes.

usage: python benchmarks/bench_frozen.py [--size 50e6] [--frozen 0.95]
       [--repeats 7] [--dir runs/bench-frozen]

On the net of ``bench_checkpoint.py`` (a stack of 1024x1024 linear layers,
one Adam step), with the first ``--frozen`` of its layers frozen as the
module is built (``requires_grad_(False)``, before accelerate prepares it,
as a pretrained base is: Adam holds no state of them); with the same
layers frozen after the Adam step (a base fine-tuned, then frozen, as
skorch's ``Freezer(at=...)`` does: Adam keeps its two moments of each of
their weights); with the base frozen as it is built and skorch's default
optimizer (SGD without momentum, which holds no state: what changes at a
step is the trainable layers alone); and with nothing frozen. Each round times, in an order
shuffled anew each round (seeded), ``os.sync()`` before each:

- ours: ``AccelerateCheckpoint.save_model`` durable, ``keep_last=2``, by
  default (the frozen layers, and the optimizer's state of them, in files
  of their own, hard-linked while unchanged: after the first save of the
  process, every save links them)
  and with ``reuse_frozen=False`` (each model whole, written at every
  save);
- torch DCP's ``save`` of the model and optimizer state dicts (its writer
  fsyncs every file), into a new folder;
- the disk: one file of the size of our full save, written and fsynced.

Besides the time, each save's bytes: those of the files it wrote (a
linked file counts nothing: its inode was written by an earlier save) and
those the folder's device wrote during it (``/proc/diskstats``, where the
folder lies on a block device). Printed: per net and variant, min, median
and max (ms) and the median bytes, and the ratios of the default save to
the others, of medians and of mins, measured in the same run.
"""

import argparse
import random
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed.checkpoint as dcp
from bench_checkpoint import (
    Net,
    Stack,
    data,
    disk_of,
    disk_write,
    machine,
    ms,
    n_layers,
    new_epoch,
    quiet_fit,
    saved_twice,
    table,
    timed,
)
from bench_positions import device_of, disk_counters

from skorch_accel_callbacks import AccelerateCheckpoint

VARIANTS = ('ours', 'ours_whole', 'dcp_save', 'disk')
LABELS = {
    'ours': 'ours durable (frozen parts linked while unchanged)',
    'ours_whole': 'ours durable, reuse_frozen=False',
    'dcp_save': 'DCP save',
    'disk': 'disk: one file of our full size + fsync',
}


class FrozenStack(Stack):
    """The stack with its first ``frozen_layers`` layers frozen as it is built."""

    def __init__(self, n_layers=1, frozen_layers=0):
        super().__init__(n_layers)
        for layer in list(self)[:frozen_layers]:
            layer.requires_grad_(False)


def trained_net(size, frozen, after_the_step=False, optimizer=torch.optim.Adam):
    """The net of ``size`` parameters after one step of ``optimizer``, the
    first ``frozen`` of its layers frozen as it is built, or
    ``after_the_step``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)
    layers = n_layers(size)
    # one layer at least trains: the loss needs a gradient
    frozen_layers = min(layers - 1, round(layers * frozen))
    net = Net(FrozenStack, module__n_layers=layers,
              module__frozen_layers=0 if after_the_step else frozen_layers,
              optimizer=optimizer,
              lr=1e-4, batch_size=8, max_epochs=1, train_split=None,
              accelerator=Accelerator(cpu=True), verbose=0)
    net = quiet_fit(net, data())
    if after_the_step:
        for layer in list(net.module_)[:frozen_layers]:
            layer.requires_grad_(False)
    return net


def written_bytes(folder):
    """Bytes of the files of ``folder`` that no other checkpoint links."""
    return sum(f.stat().st_size for f in Path(folder).rglob('*')
               if f.is_file() and f.stat().st_nlink == 1)


def measured(fn, device):
    """``fn``'s seconds and the bytes the device wrote meanwhile (None
    where the folder is on no block device)."""
    before = disk_counters(device) if device else None
    seconds = timed(fn)
    after = disk_counters(device) if device else None
    return seconds, None if device is None else after['written'] - before['written']


def bench_net(label, net, repeats, root, rng):
    root = Path(root) / label
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    device = device_of(root)
    checkpoints = {
        'ours': AccelerateCheckpoint(dirname=str(root / 'ours'), keep_last=2),
        'ours_whole': AccelerateCheckpoint(dirname=str(root / 'whole'), keep_last=2,
                                           reuse_frozen=False),
    }
    for cp in checkpoints.values():
        cp.initialize().on_train_begin(net)
        saved_twice(cp, net)  # the first save of a process writes everything
    full_bytes = written_bytes(root / 'whole' / checkpoints['ours_whole'].last_saved_)
    samples = {key: [] for key in VARIANTS}
    for round_no in range(repeats):
        order = list(VARIANTS)
        rng.shuffle(order)
        for key in order:
            folder = root / f'{key}-{round_no}'
            if key in checkpoints:
                cp = checkpoints[key]
                new_epoch(net)
                seconds, device_bytes = measured(lambda: cp.save_model(net), device)
                cp.wait_for_saves(net)  # the retirement, outside the time
                files = written_bytes(Path(cp.dirname) / cp.last_saved_)
            elif key == 'dcp_save':
                state = {'model': net.module_.state_dict(),
                         'optimizer': net.optimizer_.state_dict()}
                seconds, device_bytes = measured(
                    lambda: dcp.save(state, checkpoint_id=str(folder)), device)
                files = written_bytes(folder)
            else:
                folder.mkdir()
                seconds, device_bytes = measured(
                    lambda: disk_write(folder / 'disk.bin', full_bytes), device)
                files = full_bytes
            samples[key].append({'seconds': seconds, 'files': files,
                                 'device': device_bytes})
            if not key.startswith('ours'):
                shutil.rmtree(folder)
    for cp in checkpoints.values():
        cp.close()
    shutil.rmtree(root)
    return samples


def mib(nbytes):
    return '-' if nbytes is None else f"{nbytes / 2 ** 20:.1f}"


def median_of(samples, field):
    values = [s[field] for s in samples if s[field] is not None]
    return statistics.median(values) if values else None


def report(results, args):
    out = [f"Machine: {machine()}; disk: {disk_of(args.dir)}; torch {torch.__version__}. "
           f"{args.size / 1e6:.0f}M parameters, {args.repeats} rounds, variants in a "
           "shuffled order each round (ms; MiB)."]
    rows, ratios = [], []
    for label, samples in results.items():
        for key in VARIANTS:
            times = sorted(s['seconds'] for s in samples[key])
            rows.append([label, LABELS[key], ms(times[0]), ms(statistics.median(times)),
                         ms(times[-1]), mib(median_of(samples[key], 'files')),
                         mib(median_of(samples[key], 'device'))])
        ours = [s['seconds'] for s in samples['ours']]
        for key in VARIANTS[1:]:
            other = [s['seconds'] for s in samples[key]]
            bytes_ratio = median_of(samples[key], 'files') / median_of(samples['ours'], 'files')
            ratios.append([label, f"{LABELS[key]} / ours",
                           f"{statistics.median(other) / statistics.median(ours):.2f}x",
                           f"{min(other) / min(ours):.2f}x", f"{bytes_ratio:.1f}x"])
    out.append(table(rows, ['net', 'variant', 'min', 'median', 'max', 'files written',
                            'device wrote']))
    out.append('')
    out.append(table(ratios, ['net', 'ratio', 'of medians', 'of mins', 'bytes written']))
    return '\n'.join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=float, default=50e6)
    parser.add_argument('--frozen', type=float, default=0.95)
    parser.add_argument('--repeats', type=int, default=7)
    parser.add_argument('--dir', default='runs/bench-frozen')
    args = parser.parse_args()
    rng = random.Random(0)
    results = {}
    nets = ((args.frozen, False, torch.optim.Adam), (args.frozen, True, torch.optim.Adam),
            (args.frozen, False, torch.optim.SGD), (0.0, False, torch.optim.Adam))
    for frozen, after_the_step, optimizer in nets:
        net = trained_net(int(args.size), frozen, after_the_step, optimizer)
        share = sum(p.numel() for p in net.module_.parameters() if not p.requires_grad) / sum(
            p.numel() for p in net.module_.parameters())
        when = ' after the step' if after_the_step else ''
        label = f'{share:.1%} frozen{when}, {optimizer.__name__}'
        results[label] = bench_net(
            f'frozen-{share:.3f}{when.replace(" ", "-")}-{optimizer.__name__}', net,
            args.repeats, args.dir, rng)
        del net
    print(report(results, args))


if __name__ == '__main__':
    main()
