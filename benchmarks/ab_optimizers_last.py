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

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_support import (
    arguments,
    caches,
    drop_page_cache,
    fresh_folder,
    in_turn,
    report,
    saved_once,
)
from bench_checkpoint import make_net, timed
from bench_resume import read_files

from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
from skorch_accel_callbacks._core import accelerate_io  # internals: the load's order

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
        drop_page_cache()
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
    args = arguments(__doc__, size=50e6, count=8, dirname='ab-optimizers-last')
    root = fresh_folder(args.dir)
    saved_once(root, args.size)
    loads = {order: load_in_order(order) for order in ORDERS}
    for cache in caches():
        times = in_turn(ORDERS, args.pairs,
                        lambda order: resumed(root, args.size, cache, loads[order]))
        report(times, lambda order: f"{cache}, optimizers {order}",
               f"{cache}: last / first", 'last', 'first')
    shutil.rmtree(root)


if __name__ == '__main__':
    main()
