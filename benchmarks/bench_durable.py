"""The durable save against ``save_state`` + fsync, side by side in one process.

usage: python benchmarks/bench_durable.py [--sizes 25e6,100e6] [--repeats 5]

For each size, within every repeat, in turn, on the same net (stacks of
1024x1024 linear layers after one Adam step, as in ``bench_checkpoint.py``):

- ``save_state+fsync``: ``accelerator.save_state`` into a new folder, then an
  fsync of each file it wrote;
- ``durable (new)``: ``AccelerateCheckpoint(durable=True).save_model`` of a
  new epoch, as in training (the retired checkpoint is removed in a thread,
  joined outside the timing);
- ``durable (again)``: the same epoch saved again over its committed folder,
  as after resuming from an older checkpoint (the case where the old folder
  used to be removed inside the commit).

Before each timed call: ``os.sync()`` and, as root, the page cache dropped.
Printed: min and median of each variant and of each ratio to
``save_state+fsync`` of the same repeat.
"""

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import REPO, fsync_folder, new_epoch, trained_net

from skorch_accel_callbacks import AccelerateCheckpoint

VARIANTS = ('save_state+fsync', 'durable (new)', 'durable (again)')


def drop_caches():
    os.sync()
    try:
        with open('/proc/sys/vm/drop_caches', 'w') as f:
            f.write('3\n')
    except OSError:
        pass


def timed(fn):
    drop_caches()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(size, repeats, root):
    net = trained_net(size)
    root = Path(root) / f'size-{size:g}'
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    new = AccelerateCheckpoint(dirname=str(root / 'new'), keep_last=1).initialize()
    again = AccelerateCheckpoint(dirname=str(root / 'again'), keep_last=1).initialize()
    new.on_train_begin(net)
    again.on_train_begin(net)
    again.save_model(net)  # the folder that every timed save replaces
    again.wait_for_saves(net)
    times = {variant: [] for variant in VARIANTS}
    for i in range(repeats):
        bare = root / f'bare-{i}'
        times['save_state+fsync'].append(timed(
            lambda: (net.accelerator.save_state(str(bare)), fsync_folder(bare))))
        shutil.rmtree(bare)
        new_epoch(net)
        times['durable (new)'].append(timed(lambda: new.save_model(net)))
        new.wait_for_saves(net)
        times['durable (again)'].append(timed(lambda: again.save_model(net)))
        again.wait_for_saves(net)
    new.close()
    again.close()
    shutil.rmtree(root)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--sizes', default='25e6,100e6')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'bench-durable'))
    args = parser.parse_args()
    print(f"{'params':>7}  {'variant':<17} {'min ms':>8} {'median ms':>10} "
          f"{'ratio min':>10} {'ratio median':>13}")
    for size in (float(s) for s in args.sizes.split(',')):
        times = bench(size, args.repeats, args.dir)
        base = times['save_state+fsync']
        for variant in VARIANTS:
            values = times[variant]
            ratios = [v / b for v, b in zip(values, base, strict=True)]
            print(f"{size / 1e6:>6g}M  {variant:<17} {min(values) * 1e3:>8.0f} "
                  f"{statistics.median(values) * 1e3:>10.0f} {min(ratios):>10.2f} "
                  f"{statistics.median(ratios):>13.2f}")


if __name__ == '__main__':
    main()
