"""The check of a checkpoint's files at a resume on one thread against two, in pairs.

usage: python benchmarks/ab_check_threads.py [--size 50e6] [--pairs 7]

A checkpoint of the net of ``bench_checkpoint.py`` (Adam, one step),
saved by ``AccelerateCheckpoint``; timed: ``check_manifest`` of it, the
check a resume makes before it loads anything (every listed file's size
and xxh3 checksum), with ``format._manifest.CHECK_THREADS`` 1 and 2 in
turn (the order alternating from pair to pair), the page cache warm (the
files read once before) and, where this process may drop it (root), cold.
Printed: min and median (ms) of each, every sample, and the median of the
pairs' ratios (two threads over one), which the load of a shared machine
moves less than single figures.
"""

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import REPO, new_epoch, timed, trained_net

from skorch_accel_callbacks import AccelerateCheckpoint
from skorch_accel_callbacks.format import _manifest  # internals: the check's threads

DROP_CACHES = Path('/proc/sys/vm/drop_caches')


def checked(folder, threads, cache):
    _manifest.CHECK_THREADS = threads
    if cache == 'cold':
        os.sync()
        DROP_CACHES.write_text('3\n')
    else:
        _manifest.check_manifest(folder)
    manifest, problems = None, None

    def check():
        nonlocal manifest, problems
        manifest, problems = _manifest.check_manifest(folder)

    seconds = timed(check)
    assert manifest is not None and not problems, problems
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=float, default=50e6)
    parser.add_argument('--pairs', type=int, default=7)
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'ab-check-threads'))
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
    folder = next(root.glob('epoch-*'))
    mib = sum(f.stat().st_size for f in folder.iterdir()) / 2 ** 20
    caches = ['warm'] + (['cold'] if os.access(DROP_CACHES, os.W_OK) else [])
    print(f"{folder.name}: {mib:.0f} MiB in {len(list(folder.iterdir()))} files; "
          f"{os.cpu_count()} cores; caches: {', '.join(caches)}")
    for cache in caches:
        times = {1: [], 2: []}
        for i in range(args.pairs):
            for threads in ((1, 2) if i % 2 == 0 else (2, 1)):
                times[threads].append(checked(folder, threads, cache))
        for threads, values in times.items():
            print(f"{cache}, {threads} thread(s): min {min(values) * 1e3:.0f} ms, median "
                  f"{statistics.median(values) * 1e3:.0f} ms: "
                  + ', '.join(f'{v * 1e3:.0f}' for v in values))
        ratios = [two / one for two, one in zip(times[2], times[1], strict=True)]
        print(f"{cache}: 2 threads / 1, median of the pairs: {statistics.median(ratios):.2f}")
    shutil.rmtree(root)


if __name__ == '__main__':
    main()
