"""What the A/B benchmarks (``ab_*.py``) share: their arguments, a fresh
folder, a checkpoint saved once to read back, an async checkpoint ready to
time, and the printed spread of each variant."""

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import REPO, new_epoch, saved_twice, trained_net

from skorch_accel_callbacks import AccelerateCheckpoint

DROP_CACHES = Path('/proc/sys/vm/drop_caches')


def arguments(doc, *, size, count, dirname, count_name='pairs'):
    """``--size`` (parameters), ``--<count_name>`` (how many times each
    variant is timed) and ``--dir`` (``runs/<dirname>`` by default)."""
    parser = argparse.ArgumentParser(description=doc.split('\n')[0])
    parser.add_argument('--size', type=float, default=size)
    parser.add_argument(f'--{count_name}', type=int, default=count)
    parser.add_argument('--dir', default=str(REPO / 'runs' / dirname))
    return parser.parse_args()


def fresh_folder(path):
    """``path``, emptied of an earlier run's files."""
    root = Path(path)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return root


def caches():
    """The page caches a run can time reads with: warm, and cold where this
    process may drop the cache (root)."""
    return ['warm'] + (['cold'] if os.access(DROP_CACHES, os.W_OK) else [])


def drop_page_cache():
    os.sync()
    DROP_CACHES.write_text('3\n')


def saved_once(root, size):
    """The folder of a checkpoint of the net of ``bench_checkpoint.py`` with
    ``size`` parameters after one Adam step, saved by
    ``AccelerateCheckpoint`` into ``root``, after a line that says what it
    holds and which caches the run times."""
    net = trained_net(size)
    checkpoint = AccelerateCheckpoint(dirname=str(root), keep_last=1).initialize()
    checkpoint.on_train_begin(net)
    new_epoch(net)
    checkpoint.save_model(net)
    checkpoint.close()
    folder = next(root.glob('epoch-*'))
    mib = sum(f.stat().st_size for f in folder.iterdir()) / 2 ** 20
    print(f"{folder.name}: {mib:.0f} MiB in {len(list(folder.iterdir()))} files; "
          f"{os.cpu_count()} cores; caches: {', '.join(caches())}")
    return folder


def async_checkpoint(root, net):
    """An ``AccelerateCheckpoint(async_save=True)`` of ``net`` in ``root``
    that has saved twice, waited for: the first saves of a process make
    its host buffers, which the timed ones reuse."""
    checkpoint = AccelerateCheckpoint(dirname=str(root / 'ours'), keep_last=1,
                                      async_save=True).initialize()
    checkpoint.on_train_begin(net)
    saved_twice(checkpoint, net)
    return checkpoint


def in_turn(variants, count, run):
    """``run(variant)`` of each of ``variants`` ``count`` times, the order
    rotated from one round to the next (with two, alternating), so that
    each comes first as often: the seconds of each, by variant."""
    variants = list(variants)
    times = {variant: [] for variant in variants}
    for i in range(count):
        first = i % len(variants)
        for variant in variants[first:] + variants[:first]:
            times[variant].append(run(variant))
    return times


def spread(label, values, extra=''):
    """A line of ``values`` (seconds): min, median, every sample, in ms."""
    return (f"{label}: min {min(values) * 1e3:.0f} ms, median "
            f"{statistics.median(values) * 1e3:.0f} ms{extra}: "
            + ', '.join(f'{v * 1e3:.0f}' for v in values))


def median_ratio(numerators, denominators):
    """The median of the ratios of samples timed in the same pair or round."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def report(times, label, ratio, numerator, denominator):
    """Print the spread of each variant of ``times`` (``label(variant)``
    names it) and the median of the pairs' ratios of ``numerator`` over
    ``denominator`` (``ratio`` names it)."""
    for variant, values in times.items():
        print(spread(label(variant), values))
    print(f"{ratio}, median of the pairs: "
          f"{median_ratio(times[numerator], times[denominator]):.2f}")
