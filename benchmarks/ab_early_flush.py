"""A durable save with the early flush of its large files against one
without, beside the disk's own write + fsync, in turn.

usage: python benchmarks/ab_early_flush.py [--size 50e6] [--rounds 7]

``AccelerateCheckpoint(keep_last=1).save_model`` of a new epoch on the net
of ``bench_checkpoint.py`` (two saves before, untimed), with
``format._atomic.EarlyFlush`` as it is (each model and optimizer file's
``fdatasync`` begun once the file is complete) and with its ``begin`` a
no-op (every file flushed by the seal alone, as before), and one file of
the checkpoint's size written + fsynced; the order of the three rotates
from round to round, ``os.sync()`` before each, a save's retirement waited
for after it, outside the time. Printed: min, median and max (ms) of each,
every sample, and the medians of the rounds' ratios to the disk and of
with over without, which the load of a shared machine moves less than
single figures.
"""

import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_support import arguments, fresh_folder
from bench_checkpoint import disk_write, folder_bytes, new_epoch, timed, trained_net

from skorch_accel_callbacks import AccelerateCheckpoint
from skorch_accel_callbacks.format import EarlyFlush  # internals: the early flush

BEGIN = EarlyFlush.begin


def saved(cp, net, early):
    EarlyFlush.begin = BEGIN if early else (lambda self, path: None)
    try:
        new_epoch(net)
        seconds = timed(lambda: cp.save_model(net))
        cp.wait_for_saves(net)
    finally:
        EarlyFlush.begin = BEGIN
    return seconds


def written(path, nbytes):
    seconds = timed(lambda: disk_write(path, nbytes))
    os.remove(path)
    return seconds


def main():
    args = arguments(__doc__, size=50e6, count=7, dirname='ab-early-flush',
                     count_name='rounds')
    root = fresh_folder(args.dir)
    net = trained_net(args.size)
    cps = {early: AccelerateCheckpoint(dirname=str(root / f'ours-{early}'),
                                       keep_last=1).initialize()
           for early in (True, False)}
    for early, cp in cps.items():
        cp.on_train_begin(net)
        for _ in range(2):
            saved(cp, net, early)
    nbytes = folder_bytes(root / 'ours-True' / cps[True].last_saved_)
    runs = {
        'with the early flush': lambda: saved(cps[True], net, True),
        'without (the seal flushes all)': lambda: saved(cps[False], net, False),
        'disk: one file written + fsync': lambda: written(root / 'disk.bin', nbytes),
    }
    names = list(runs)
    times = {name: [] for name in names}
    for i in range(args.rounds):
        for name in names[i % 3:] + names[:i % 3]:
            times[name].append(runs[name]())
    for cp in cps.values():
        cp.close()
    shutil.rmtree(root)
    print(f"{args.size:g} parameters, {nbytes / 2 ** 20:.0f} MiB, {args.rounds} rounds (ms)")
    for name, values in times.items():
        print(f"{name:32s} min {min(values) * 1e3:5.0f}  median "
              f"{statistics.median(values) * 1e3:5.0f}  max {max(values) * 1e3:5.0f}: "
              + ', '.join(f'{v * 1e3:.0f}' for v in values))
    with_, without, disk = (times[name] for name in names)

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(a, b, strict=True))
    print(f"median of the rounds' ratios: with / disk {ratio(with_, disk):.2f}, "
          f"without / disk {ratio(without, disk):.2f}, with / without {ratio(with_, without):.2f}")


if __name__ == '__main__':
    main()
