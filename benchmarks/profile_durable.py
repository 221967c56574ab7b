"""Where a durable save spends its time: timestamps around its phases.

usage: python benchmarks/profile_durable.py [--size 50e6] [--repeats 4]

``AccelerateCheckpoint(keep_last=1).save_model`` of a new epoch on the net
of ``bench_checkpoint.py`` (two saves before, so that each timed one
retires one), ``os.sync()`` before each, beside the disk's own write +
fsync of the same bytes in the same repeat. The package's functions of each
phase are wrapped to record when they start and end (on any thread):
``state_files.save_state`` (the files written into the page cache), the
parallel fsync of the files and each one, the checksums (read back while
the fsyncs wait), the manifest and pointer (atomic JSON files), the rename
of the folder, the wait for the previous retirement and the removal of the
retired folder (in a thread, after the save returns; waited for apart).
Printed per repeat: each phase's count, total time, and first start and
last end from the call of ``save_model`` (ms).
"""

import argparse
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import REPO, disk_write, folder_bytes, new_epoch, saved_twice, trained_net

from skorch_accel_callbacks import AccelerateCheckpoint
from skorch_accel_callbacks.engine import (
    SyncWriter,
    _state_files as state_files,  # internals: the phases
)
from skorch_accel_callbacks.format import _atomic as atomic, _manifest as manifest_format
from skorch_accel_callbacks.storage import _local as folder

SPANS = []
# (module or class, function, label): each function where its caller looks
# it up (a subpackage holds what it imports from another's face)
PHASES = (
    (folder.CheckpointFolder, 'wait', 'wait for the previous retirement'),
    (SyncWriter, 'stage', 'stage: every file written'),
    (state_files, 'save_state', '  accelerator.save_state'),
    (SyncWriter, 'commit', 'commit'),
    (folder, 'write_manifest', '  seal: fsyncs || checksums, manifest'),
    (atomic, 'fsync_files', '    fsync of the files, in parallel'),
    (atomic, '_fsync_file', '    fsync of one file'),
    (manifest_format, 'checksum_file', '    checksum of one file'),
    (atomic, 'write_json', '  manifest (atomic JSON)'),
    (folder, 'write_json', '  pointer (atomic JSON)'),
    (folder, 'replace_folder', '  rename + fsync of the parent'),
    (folder.CheckpointFolder, 'retire', '  retire: rename aside'),
    (atomic, 'remove_path', 'removal of the retired folder (thread)'),
)


def record(owner, name, label):
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPANS.append((label, threading.current_thread().name, start,
                          time.perf_counter()))
    setattr(owner, name, timed)


def profile(size, repeats, root):
    net = trained_net(size)
    cp = AccelerateCheckpoint(dirname=str(root / 'ours'), keep_last=1).initialize()
    cp.on_train_begin(net)
    saved_twice(cp, net)
    nbytes = folder_bytes(root / 'ours' / cp.last_saved_)
    for owner, name, label in PHASES:
        record(owner, name, label)
    for i in range(repeats):
        os.sync()
        start = time.perf_counter()
        disk_write(root / 'disk.bin', nbytes)
        disk = time.perf_counter() - start
        os.remove(root / 'disk.bin')
        new_epoch(net)
        os.sync()
        SPANS.clear()
        start = time.perf_counter()
        cp.save_model(net)
        saved = time.perf_counter() - start
        cp.wait_for_saves(net)
        print(f"repeat {i}: {nbytes / 2 ** 20:.0f} MiB; disk write + fsync {disk * 1e3:.0f} ms, "
              f"save_model {saved * 1e3:.0f} ms")
        print_spans(start, saved)
    cp.close()


def print_spans(origin, saved):
    """Each phase's spans, those begun after ``save_model`` returned apart
    (the removal, and the wait for it)."""
    by_label = {}
    for label, _, start, end in SPANS:
        after = ' (after the save)' if start - origin >= saved else ''
        by_label.setdefault(label + after, []).append((start - origin, end - origin))
    for label in sorted(by_label, key=lambda label: min(s for s, _ in by_label[label])):
        spans = by_label[label]
        if spans:
            total = sum(end - start for start, end in spans)
            print(f"  {label:58s} x{len(spans):<2d} {total * 1e3:7.0f} ms   "
                  f"{spans[0][0] * 1e3:6.0f} -> {max(end for _, end in spans) * 1e3:6.0f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=float, default=50e6)
    parser.add_argument('--repeats', type=int, default=4)
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'profile-durable'))
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    profile(args.size, args.repeats, root)
    shutil.rmtree(root)


if __name__ == '__main__':
    main()
