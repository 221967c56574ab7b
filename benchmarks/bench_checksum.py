"""Which checksum the manifest records: the algorithms' speed on a
checkpoint's files, and what the checksums add to a durable save.

usage: python benchmarks/bench_checksum.py [--size 25e6] [--repeats 9]

The net is a stack of 1024x1024 linear layers after one Adam step, as in
``bench_checkpoint.py`` (at 25M parameters: ~100 MB of model, ~200 MB of
optimizer state). Within every repeat, in turn:

- ``fsync``: ``accelerator.save_state`` into a new folder, then
  ``atomic.fsync_files`` of its files (the flush of a durable save);
- ``fsync+checksums``: the same into another folder, then
  ``_manifest.write_manifest(durable=True)``, which reads the files back for their
  checksums while the fsyncs run;
- ``durable save``: ``AccelerateCheckpoint(durable=True).save_model``
  (checksums included);
- each algorithm (a different one first in each repeat) over the files
  of the checkpoint just saved, from the page cache (each file read once,
  in 4 MiB chunks; CRC32C through ``google-crc32c``, which takes only
  ``bytes``; xxh3 also over an ``mmap``, which copies nothing).

``os.sync()`` runs before every save, so that none pays for the writeback
of another. Printed: the best and the median MB/s of each algorithm (from
the min and the median time) and the min and median of its time as
a fraction of the durable save of the same repeat (the cost if it ran
after the fsyncs, or without them), then the three timings and
``(fsync+checksums - fsync) / durable save``, the cost as ``_manifest.write_manifest``
pays it.
"""

import argparse
import mmap
import os
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import google_crc32c
import xxhash
from bench_checkpoint import REPO, new_epoch, trained_net

from skorch_accel_callbacks import AccelerateCheckpoint
from skorch_accel_callbacks.format import _atomic as atomic, write_manifest

CHUNK = 1 << 22


def _chunks(path):
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, 'rb', buffering=0) as f:
        while size := f.readinto(buffer):
            yield view[:size]


def zlib_crc32(path):
    crc = 0
    for chunk in _chunks(path):
        crc = zlib.crc32(chunk, crc)
    return f'{crc:08x}'


def crc32c(path):
    checksum = google_crc32c.Checksum()
    with open(path, 'rb', buffering=0) as f:
        while chunk := f.read(CHUNK):
            checksum.update(chunk)
    return checksum.digest().hex()


def _xxh(new):
    def digest(path):
        hasher = new()
        for chunk in _chunks(path):
            hasher.update(chunk)
        return hasher.hexdigest()
    return digest


def _xxh_mmap(new):
    def digest(path):
        hasher = new()
        with open(path, 'rb') as f:
            if os.fstat(f.fileno()).st_size:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    hasher.update(mapped)
        return hasher.hexdigest()
    return digest


#: name -> checksum of a file, as hex digits
ALGORITHMS = {
    'zlib.crc32': zlib_crc32,
    'crc32c': crc32c,
    'xxh3_64': _xxh(xxhash.xxh3_64),
    'xxh3_128': _xxh(xxhash.xxh3_128),
    'xxh3_64 mmap': _xxh_mmap(xxhash.xxh3_64),
    'xxh3_128 mmap': _xxh_mmap(xxhash.xxh3_128),
}
SAVES = ('fsync', 'fsync+checksums', 'durable save')


def files_of(folder):
    return [str(f) for f in sorted(Path(folder).rglob('*')) if f.is_file()]


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_repeat(net, checkpoint, root, i):
    """The timings of one repeat: seconds per save and per algorithm."""
    times = {}
    for save in SAVES[:2]:
        bare = root / f'bare-{i}-{save}'
        os.sync()
        net.accelerator.save_state(str(bare))
        flush = ((lambda: atomic.fsync_files(files_of(bare))) if save == 'fsync' else
                 (lambda: write_manifest(str(bare), {}, durable=True)))
        times[save] = timed(flush)
        shutil.rmtree(bare)
    new_epoch(net)
    os.sync()
    times['durable save'] = timed(lambda: checkpoint.save_model(net))
    checkpoint.wait_for_saves(net)
    files = files_of(checkpoint.folder_.find('latest'))
    names = list(ALGORITHMS)
    # each repeat starts with another: none pays for coming first
    for name in names[i % len(names):] + names[:i % len(names)]:
        times[name] = timed(lambda: [ALGORITHMS[name](file) for file in files])
    return times, sum(os.path.getsize(file) for file in files)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--size', type=float, default=25e6)
    parser.add_argument('--repeats', type=int, default=9)
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'bench-checksum'))
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    net = trained_net(args.size)
    checkpoint = AccelerateCheckpoint(dirname=str(root / 'checkpoints'), keep_last=1,
                                      durable=True).initialize()
    checkpoint.on_train_begin(net)
    runs = []
    for i in range(args.repeats):
        times, size = one_repeat(net, checkpoint, root, i)
        runs.append(times)
    checkpoint.close()
    shutil.rmtree(root)

    def column(name):
        return [run[name] for run in runs]

    def of_save(values):
        return [value / run['durable save'] for value, run in zip(values, runs, strict=True)]

    print(f"{args.size / 1e6:g}M parameters, {size / 1e6:.0f} MB of checkpoint files, "
          f"{args.repeats} repeats")
    print(f"{'algorithm':<14} {'MB/s best':>10} {'MB/s median':>12} "
          f"{'of save min':>12} {'of save median':>15}")
    for name in ALGORITHMS:
        speeds = [size / 1e6 / t for t in column(name)]
        fractions = of_save(column(name))
        print(f"{name:<14} {max(speeds):>10.0f} {statistics.median(speeds):>12.0f} "
              f"{min(fractions):>12.3f} {statistics.median(fractions):>15.3f}")
    print(f"{'save':<16} {'min ms':>7} {'median ms':>10}")
    for name in SAVES:
        print(f"{name:<16} {min(column(name)) * 1e3:>7.0f} "
              f"{statistics.median(column(name)) * 1e3:>10.0f}")
    added = of_save([run['fsync+checksums'] - run['fsync'] for run in runs])
    print(f"(fsync+checksums - fsync) / durable save: min {min(added):.3f}, "
          f"median {statistics.median(added):.3f}")


if __name__ == '__main__':
    main()
