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
from bench_checkpoint import timed

from skorch_accel_callbacks.format import _manifest  # internals: the check's threads


def checked(folder, threads, cache):
    _manifest.CHECK_THREADS = threads
    if cache == 'cold':
        drop_page_cache()
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
    args = arguments(__doc__, size=50e6, count=7, dirname='ab-check-threads')
    root = fresh_folder(args.dir)
    folder = saved_once(root, args.size)
    for cache in caches():
        times = in_turn((1, 2), args.pairs, lambda threads: checked(folder, threads, cache))
        report(times, lambda threads: f"{cache}, {threads} thread(s)",
               f"{cache}: 2 threads / 1", 2, 1)
    shutil.rmtree(root)


if __name__ == '__main__':
    main()
