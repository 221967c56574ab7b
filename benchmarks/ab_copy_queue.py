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

import argparse
import resource
import shutil
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from bench_checkpoint import REPO, new_epoch, timed, trained_net

from skorch_accel_callbacks import AccelerateCheckpoint
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
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=float, default=100e6)
    parser.add_argument('--rounds', type=int, default=12)
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'ab-copy-queue'))
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
    names = list(VARIANTS)
    times = {name: [] for name in names}
    preempted = {name: [] for name in names}
    try:
        for i in range(args.rounds):
            for name in (names if i % 2 == 0 else names[::-1]):
                seconds, switches = blocked(cp, net, VARIANTS[name])
                times[name].append(seconds)
                preempted[name].append(switches)
    finally:
        _stager.copy_all = QUEUE
    cp.close()
    shutil.rmtree(root)
    print(f"{args.size:g} parameters, {_stager.COPY_THREADS} copy threads, pieces of "
          f"{_stager.COPY_CHUNK >> 20} MiB")
    for name, values in times.items():
        print(f"{name}: min {min(values) * 1e3:.0f} ms, median "
              f"{statistics.median(values) * 1e3:.0f} ms, max {max(values) * 1e3:.0f} ms, "
              f"preempted (median) {statistics.median(preempted[name]):.0f}: "
              + ', '.join(f'{v * 1e3:.0f}' for v in values))
    ratios = [queue / old for queue, old in zip(times['queue'], times['futures'], strict=True)]
    print(f"queue / futures, median of the rounds: {statistics.median(ratios):.2f}")


if __name__ == '__main__':
    main()
