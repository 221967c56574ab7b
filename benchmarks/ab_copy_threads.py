"""The host copy of ``async_save`` on one thread against two, in pairs.

usage: python benchmarks/ab_copy_threads.py [--size 25e6] [--pairs 10]

``AccelerateCheckpoint(async_save=True).save_model`` on the net of
``bench_checkpoint.py`` (two saves before, untimed), the time training is
blocked, with ``engine._stager.COPY_THREADS`` 1 and 2 in turn (the order
alternating from pair to pair), ``os.sync()`` before each, the save
waited for after each, outside the time. Printed: min and median (ms) of
each, every sample, and the median of the pairs' ratios (two threads over
one), which the load of a shared machine moves less than single figures.
"""

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import REPO, new_epoch, timed, trained_net

from skorch_accel_callbacks import AccelerateCheckpoint
from skorch_accel_callbacks.engine import _stager  # internals: the copy's threads


def blocked(cp, net, threads):
    _stager.COPY_THREADS = threads
    new_epoch(net)
    seconds = timed(lambda: cp.save_model(net))
    cp.wait_for_saves(net)
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=float, default=25e6)
    parser.add_argument('--pairs', type=int, default=10)
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'ab-copy-threads'))
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    net = trained_net(args.size)
    cp = AccelerateCheckpoint(dirname=str(root / 'ours'), keep_last=1,
                              async_save=True).initialize()
    cp.on_train_begin(net)
    for _ in range(2):
        new_epoch(net)
        cp.save_model(net)
        cp.wait_for_saves(net)
    times = {1: [], 2: []}
    for i in range(args.pairs):
        for threads in ((1, 2) if i % 2 == 0 else (2, 1)):
            times[threads].append(blocked(cp, net, threads))
    cp.close()
    shutil.rmtree(root)
    for threads, values in times.items():
        print(f"{threads} thread(s): min {min(values) * 1e3:.0f} ms, median "
              f"{statistics.median(values) * 1e3:.0f} ms: "
              + ', '.join(f'{v * 1e3:.0f}' for v in values))
    ratios = [two / one for two, one in zip(times[2], times[1], strict=True)]
    print(f"2 threads / 1, median of the pairs: {statistics.median(ratios):.2f}")


if __name__ == '__main__':
    main()
