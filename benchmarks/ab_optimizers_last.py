"""A resume's load taking the optimizers' states read ahead last, against
first, in pairs.

usage: python benchmarks/ab_optimizers_last.py [--size 50e6] [--pairs 8]

A checkpoint of the net of ``bench_checkpoint.py`` (Adam, one step), saved
by ``AccelerateCheckpoint``; timed: ``AccelerateLoadInitState``'s
``on_train_begin`` on a fresh net (the choice of the checkpoint, the check
of its files while a thread reads the optimizers' files, the load), the
load taking the states read ahead once the models and the other states
are loaded (*last*, as it does: a read not done when the check ends
finishes while the models load) and before anything is loaded (*first*,
as it did: the load waits for the read), in turn (the order alternating
from pair to pair), the page cache warm (the files read once before) and,
where this process may drop it (root), cold. Printed: min and median (ms)
of each, every sample, and the median of the pairs' ratios (last over
first), which the load of a shared machine moves less than single
figures.
"""

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import REPO, make_net, new_epoch, timed, trained_net
from bench_resume import read_files

from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
from skorch_accel_callbacks._core import accelerate_io  # internals: the load's order

DROP_CACHES = Path('/proc/sys/vm/drop_caches')
ORDERS = ('first', 'last')


def load_in_order(order):
    """``accelerate_io.load_state`` with the states read ahead taken in
    ``order``."""
    load_state = accelerate_io.load_state

    def load(accelerator, folder, frozen_parts=None, optimizer_states=None):
        if order == 'first' and optimizer_states is not None:
            states = optimizer_states()
            return load_state(accelerator, folder, frozen_parts, lambda: states)
        return load_state(accelerator, folder, frozen_parts, optimizer_states)

    return load


def resumed(root, size, cache, loads):
    """The time of a fresh net's resume from the checkpoint in ``root``."""
    checkpoint = AccelerateCheckpoint(dirname=str(root), keep_last=1)
    load_init_state = AccelerateLoadInitState(checkpoint)
    net = make_net(size, callbacks=[checkpoint, load_init_state]).initialize()
    if cache == 'cold':
        os.sync()
        DROP_CACHES.write_text('3\n')
    else:
        read_files(root, bytearray(64 << 20))
    original = accelerate_io.load_state
    accelerate_io.load_state = loads
    try:
        seconds = timed(lambda: load_init_state.on_train_begin(net))
    finally:
        accelerate_io.load_state = original
    assert load_init_state.loaded_from_ is not None
    assert net.optimizer_.state_dict()['state'], "the optimizer's state was not loaded"
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=float, default=50e6)
    parser.add_argument('--pairs', type=int, default=8)
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'ab-optimizers-last'))
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    net = trained_net(args.size)
    cp = AccelerateCheckpoint(dirname=str(root), keep_last=1).initialize()
    cp.on_train_begin(net)
    new_epoch(net)
    cp.save_model(net)
    cp.close()
    del net, cp
    folder = next(root.glob('epoch-*'))
    mib = sum(f.stat().st_size for f in folder.iterdir()) / 2 ** 20
    caches = ['warm'] + (['cold'] if os.access(DROP_CACHES, os.W_OK) else [])
    print(f"{folder.name}: {mib:.0f} MiB in {len(list(folder.iterdir()))} files; "
          f"{os.cpu_count()} cores; caches: {', '.join(caches)}")
    loads = {order: load_in_order(order) for order in ORDERS}
    for cache in caches:
        times = {order: [] for order in ORDERS}
        for i in range(args.pairs):
            for order in (ORDERS if i % 2 == 0 else ORDERS[::-1]):
                times[order].append(resumed(root, args.size, cache, loads[order]))
        for order, values in times.items():
            print(f"{cache}, optimizers {order}: min {min(values) * 1e3:.0f} ms, median "
                  f"{statistics.median(values) * 1e3:.0f} ms: "
                  + ', '.join(f'{v * 1e3:.0f}' for v in values))
        ratios = [last / first for last, first in zip(times['last'], times['first'], strict=True)]
        print(f"{cache}: last / first, median of the pairs: {statistics.median(ratios):.2f}")
    shutil.rmtree(root)


if __name__ == '__main__':
    main()
