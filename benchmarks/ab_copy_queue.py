"""The host copy of ``async_save``: its pieces taken from one queue by the
calling thread and a copy thread, against a future a piece, in turn.

usage: python benchmarks/ab_copy_queue.py [--size 100e6] [--rounds 12]

``AccelerateCheckpoint(async_save=True).save_model`` on the net of
``bench_checkpoint.py`` (two saves before, untimed), the time training is
blocked, with ``engine._stager.copy_all`` as it is (*queue*: the calling
thread and ``COPY_THREADS - 1`` copy threads each take the next piece from
one queue until it is empty) and as it was (*futures*: every piece
submitted to a pool of ``COPY_THREADS`` threads as a future of its own,
waited for by the calling thread), in turn (the order alternating from
round to round), ``os.sync()`` before each, the save waited for after
each, outside the time. Printed: min, median and max (ms) of each, the
median of its involuntary context switches in the process during the save
(``getrusage``: a thread preempted), every sample, and the median of the
rounds' ratios (queue over futures).
"""

import resource
import shutil
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from ab_support import (
    arguments,
    async_checkpoint,
    fresh_folder,
    in_turn,
    median_ratio,
    spread,
)
from bench_checkpoint import new_epoch, timed, trained_net

from skorch_accel_callbacks.engine import _stager  # internals: the host copy

QUEUE = _stager.copy_all


def futures(copies):
    """``copy_all`` as it was: a future a piece."""
    pieces = []
    for buffer, tensor in copies:
        if not (tensor.device.type == 'cpu' and tensor.dim() and tensor.is_contiguous()):
            buffer.copy_(tensor)
            continue
        source = tensor.view(-1).view(torch.uint8).numpy()
        target = buffer.view(-1).view(torch.uint8).numpy()
        pieces += [(target[at:at + _stager.COPY_CHUNK], source[at:at + _stager.COPY_CHUNK])
                   for at in range(0, source.size, _stager.COPY_CHUNK)]
    with ThreadPoolExecutor(max_workers=_stager.COPY_THREADS,
                            thread_name_prefix='checkpoint-copy') as pool:
        list(pool.map(lambda piece: np.copyto(*piece), pieces))


VARIANTS = {'futures': futures, 'queue': QUEUE}


def blocked(cp, net, copy_all):
    _stager.copy_all = copy_all
    new_epoch(net)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
    seconds = timed(lambda: cp.save_model(net))
    preempted = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - before
    cp.wait_for_saves(net)
    return seconds, preempted


def main():
    args = arguments(__doc__, size=100e6, count=12, dirname='ab-copy-queue',
                     count_name='rounds')
    root = fresh_folder(args.dir)
    net = trained_net(args.size)
    cp = async_checkpoint(root, net)
    preempted = {name: [] for name in VARIANTS}

    def run(name):
        seconds, switches = blocked(cp, net, VARIANTS[name])
        preempted[name].append(switches)
        return seconds

    try:
        times = in_turn(VARIANTS, args.rounds, run)
    finally:
        _stager.copy_all = QUEUE
    cp.close()
    shutil.rmtree(root)
    print(f"{args.size:g} parameters, {_stager.COPY_THREADS} copy threads, pieces of "
          f"{_stager.COPY_CHUNK >> 20} MiB")
    for name, values in times.items():
        print(spread(name, values, f", max {max(values) * 1e3:.0f} ms, preempted (median) "
                                   f"{statistics.median(preempted[name]):.0f}"))
    print(f"queue / futures, median of the rounds: "
          f"{median_ratio(times['queue'], times['futures']):.2f}")


if __name__ == '__main__':
    main()
