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

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_support import (
    arguments,
    async_checkpoint,
    fresh_folder,
    in_turn,
    report,
)
from bench_checkpoint import new_epoch, timed, trained_net

from skorch_accel_callbacks.engine import _stager  # internals: the copy's threads


def blocked(cp, net, threads):
    _stager.COPY_THREADS = threads
    new_epoch(net)
    seconds = timed(lambda: cp.save_model(net))
    cp.wait_for_saves(net)
    return seconds


def main():
    args = arguments(__doc__, size=25e6, count=10, dirname='ab-copy-threads')
    root = fresh_folder(args.dir)
    net = trained_net(args.size)
    cp = async_checkpoint(root, net)
    times = in_turn((1, 2), args.pairs, lambda threads: blocked(cp, net, threads))
    cp.close()
    shutil.rmtree(root)
    report(times, lambda threads: f"{threads} thread(s)", "2 threads / 1", 2, 1)


if __name__ == '__main__':
    main()
