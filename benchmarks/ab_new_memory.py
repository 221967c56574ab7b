"""What a load that creates its tensors pays for their memory: the optimizer
file of a checkpoint read in fresh processes, into memory made in
different ways.

usage: python benchmarks/ab_new_memory.py [--size 50e6] [--rounds 6]

A relaunch makes the optimizer's state anew (a fresh Adam has none): every
byte of the optimizer file goes into memory the process never touched, and
a fresh process is where a resume runs. ``bench_resume.py`` shows the warm
load taking about 3x the read of the checkpoint's bytes into one reused
buffer, and no more than their read into new memory; this benchmark times,
for ``optimizer.bin`` of a checkpoint of the net of ``bench_checkpoint.py``
(Adam, one step) saved by ``AccelerateCheckpoint``, each read in a process
of its own (the variants in a rotated order, round after round; the
page cache warm, the file read once before), what the memory costs:

- ``reused``: into a buffer allocated and written before the timing (the
  disk-read floor of ``bench_resume.py``);
- ``new``: into ``torch.empty`` of the file's size (the kernel faults its
  pages in, 4 KiB at a time, and zeroes them as the read writes them);
- ``torch.load``: ``torch.load(weights_only=True)``, how accelerate's
  ``load_state`` and our read ahead read it;
- ``populated``: into an anonymous mapping made with ``MAP_POPULATE`` (the
  pages made and zeroed in one call, without a fault for each);
- ``huge pages``: into an anonymous mapping advised ``MADV_HUGEPAGE``
  (2 MiB pages: where ``transparent_hugepage`` is ``madvise`` or
  ``always``);
- ``mapped, copied on N threads``: ``torch.load(mmap=True)`` and every
  storage copied out of the file's mapping (``copy.deepcopy``) by torch's
  intra-op threads, one and two.

Printed: min, median and every sample (ms) of each, and the medians'
ratios to ``reused``, which is what a read that needs no new memory pays.
"""

import copy
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from ab_support import arguments, fresh_folder, saved_once

VARIANTS = ('reused', 'new', 'torch.load', 'populated', 'huge pages',
            'mapped, copied on 1 thread', 'mapped, copied on 2 threads')
_CHUNK = 64 << 20


def read_into(path, buffer):
    view = memoryview(buffer).cast('B')
    with open(path, 'rb', buffering=0) as stream:
        done = 0
        while done < len(view):
            done += stream.readinto(view[done:done + _CHUNK])


def anonymous(size, flags=0):
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)


def timed_read(variant, path):
    """The seconds of ``variant``'s read of ``path``, in this process; the
    result is kept until the time is taken."""
    size = os.path.getsize(path)
    if variant == 'reused':
        buffer = bytearray(size)
        read_into(path, buffer)  # its pages made and written before the timing
    elif variant.startswith('mapped'):
        torch.set_num_threads(int(variant.split()[3]))
    start = time.perf_counter()
    if variant == 'reused':
        read_into(path, buffer)
    elif variant == 'new':
        buffer = torch.empty(size, dtype=torch.uint8)
        read_into(path, buffer.numpy())
    elif variant == 'torch.load':
        buffer = torch.load(path, map_location='cpu', weights_only=True)
    elif variant == 'populated':
        buffer = anonymous(size, mmap.MAP_POPULATE)
        read_into(path, buffer)
    elif variant == 'huge pages':
        buffer = anonymous(size)
        buffer.madvise(mmap.MADV_HUGEPAGE)
        read_into(path, buffer)
    else:
        buffer = copy.deepcopy(torch.load(path, map_location='cpu', weights_only=True,
                                          mmap=True))
    seconds = time.perf_counter() - start
    del buffer
    return seconds


def in_fresh_process(variant, path):
    out = subprocess.run([sys.executable, __file__, '--worker', variant, str(path)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main():
    if sys.argv[1:2] == ['--worker']:
        print(json.dumps(timed_read(sys.argv[2], sys.argv[3])))
        return
    args = arguments(__doc__, size=50e6, count=6, dirname='ab-new-memory',
                     count_name='rounds')
    root = fresh_folder(args.dir)
    path = saved_once(root, args.size) / 'optimizer.bin'
    hugepage = Path('/sys/kernel/mm/transparent_hugepage/enabled')
    print(f"{path.stat().st_size / 2 ** 20:.0f} MiB; transparent_hugepage: "
          f"{hugepage.read_text().strip() if hugepage.exists() else 'absent'}")
    times = {variant: [] for variant in VARIANTS}
    for round_ in range(args.rounds):
        first = round_ % len(VARIANTS)
        for variant in VARIANTS[first:] + VARIANTS[:first]:
            path.read_bytes()  # warm
            times[variant].append(in_fresh_process(variant, path))
    floor = statistics.median(times['reused'])
    for variant, values in times.items():
        median = statistics.median(values)
        print(f"{variant}: min {min(values) * 1e3:.0f} ms, median {median * 1e3:.0f} ms "
              f"({median / floor:.2f}x reused): " + ', '.join(f'{v * 1e3:.0f}' for v in values))


if __name__ == '__main__':
    main()
