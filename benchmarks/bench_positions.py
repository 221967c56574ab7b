"""What a durable save pays for the I/O that ran before it: each save timed
right after each other kind of save, beside the peers timed in the same
position.

usage: python benchmarks/bench_positions.py [--size 50e6] [--repeats 5]
       [--before idle,disk,torch_save,dcp_save,dcp_async,ours_async,ours_durable]
       [--timed ours_durable,dcp_save,disk,ours_async_blocked,dcp_kept_blocked]
       [--where turn,same,fresh] [--nproc 1,2] [--unsynced]
       [--dir runs/bench-positions]

On the net of ``bench_checkpoint.py`` (stacks of 1024x1024 linear layers
after one Adam step), every pair (a save *before*, a save *timed*): first
``os.sync()``, then the *before* save, waited for to its end (our async
save and DCP's ``async_save`` committed, our retirement done), then
``os.sync()`` again and the timed save. Before any pair, every variant has
saved once in the process (imports, first-call costs, our two checkpoints
that each timed save retires). ``--where``:

- ``turn`` (the default, ``make bench``): every pair in one process, round
  after round, in an order shuffled anew each round (seeded): what a long
  training process that saved in every way before sees, each variant
  after every other;
- ``same``: each pair and round in a process of its own (the pairs in an
  order rotated from round to round): the *before* save and the timed one
  in one fresh process;
- ``fresh``: the *before* save in a process of its own that exits, then the
  timed save in a new process: what the machine keeps (the page cache, the
  disk) without what a process keeps, so that beside ``same`` it tells the
  process's part from the machine's.

``--nproc``: the process counts (default ``1,2``). In 2 processes
(``tests/support/launcher.py``, ``Accelerator(cpu=True)``: DDP on gloo)
``turn`` alone runs, in one launch: every rank takes the pairs in the same
shuffled order, each save starts together on every rank, and a figure is
the slower rank's. The disk's file and ``torch.save`` are written by rank 0
alone (what a job that writes one file does), DCP's saves and ours by every
rank; DCP's ``async_save`` gets a gloo group of its own (its thread's
collectives must not meet the main thread's), as in ``bench_peers``.

``--unsynced``: no ``os.sync()`` between the *before* save and the timed
one, whose files stay until then: the timed save meets the page cache that
the other I/O left dirty (a ``torch.save`` without fsync, a log), as in a
training process that does not sync its other files.

Besides the time, each timed save records what it made the machine do
(``/proc/diskstats`` of the folder's device, ``/proc/meminfo``,
``getrusage``): the bytes the device wrote during it against the
checkpoint's own, the time the device spent writing, the pages faulted in,
the context switches, the time our save took to write its files (its
stage, before the commit's fsyncs and checksums), and ``Dirty`` and
``Writeback`` of ``/proc/meminfo`` before it. Printed: per variant and
position, min, median and max (ms), the medians of those counters, and in
each position the ratios of ours to the peers timed there (of medians and
of mins): the durable save to DCP's save and to the disk, the async save's
blocked time to that of DCP's ``async_save`` with a kept stager, its
fastest here (bench_peers).
"""

import argparse
import itertools
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from bench_checkpoint import (
    REPO,
    disk_of,
    disk_write,
    folder_bytes,
    machine,
    ms,
    new_epoch,
    table,
    trained_net,
)
from bench_peers import barrier, on_rank_0, rank, state_dicts
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from skorch_accel_callbacks import AccelerateCheckpoint
from skorch_accel_callbacks.engine import SyncWriter

BEFORE = {
    'idle': 'nothing (os.sync)',
    'disk': 'disk: one file written + fsync',
    'torch_save': 'torch.save, no fsync',
    'dcp_save': 'DCP save',
    'dcp_async': 'DCP async_save',
    'ours_async': 'ours async_save=True',
    'ours_durable': 'ours durable',
}
TIMED = {
    'ours_durable': 'ours durable, keep_last=1',
    'dcp_save': 'DCP save',
    'disk': 'disk: one file written + fsync',
    'ours_async_blocked': 'ours async_save=True, blocked',
    'dcp_kept_blocked': 'DCP async_save, DefaultStager kept, blocked',
}
# each of ours -> the peers it is compared with, in the same position
TARGETS = {'ours_durable': ('dcp_save', 'disk'), 'ours_async_blocked': ('dcp_kept_blocked',)}
WHERE = {'same': 'same process', 'fresh': 'a process apart', 'turn': 'one long process'}
# the launch of one 2-process run: every pair, every round (6 minutes at 50M
# parameters and 5 rounds on 2 idle cores)
LAUNCH_TIMEOUT = 3 * 3600


# ---------------------------------------------------------------- the machine

def device_of(path):
    """The block device (``/proc/diskstats`` name) that holds ``path``."""
    dev = os.stat(path).st_dev
    sys_dev = Path(f'/sys/dev/block/{os.major(dev)}:{os.minor(dev)}')
    # a partition's counters are its own; so are a whole disk's
    return sys_dev.resolve().name if sys_dev.exists() else None


def disk_counters(device):
    """Sectors written and milliseconds spent writing, of ``device``."""
    for line in Path('/proc/diskstats').read_text().splitlines():
        fields = line.split()
        if fields[2] == device:
            return {'written': int(fields[9]) * 512, 'write_ms': int(fields[10])}
    return {'written': 0, 'write_ms': 0}


def dirty_pages():
    """Bytes of the page cache not yet written back, and being written back."""
    values = {}
    for line in Path('/proc/meminfo').read_text().splitlines():
        key, value = line.split(':', 1)
        if key in ('Dirty', 'Writeback'):
            values[key] = int(value.split()[0]) * 1024
    return values


STAGED = []


def timing_stages():
    """Record how long each of our saves takes to write its files (its
    stage; the rest is the commit: fsyncs, checksums, manifest, rename)."""
    stage = SyncWriter.stage

    def timed_stage(*args, **kwargs):
        start = time.perf_counter()
        try:
            return stage(*args, **kwargs)
        finally:
            STAGED.append(time.perf_counter() - start)
    SyncWriter.stage = timed_stage


def observed(fn, device):
    """``fn``'s seconds and what it made the machine do."""
    dirty = dirty_pages()
    disk = disk_counters(device)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    STAGED.clear()
    barrier()  # every rank starts the save together
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    after_usage = resource.getrusage(resource.RUSAGE_SELF)
    after_disk = disk_counters(device)
    return {
        'seconds': seconds,
        'stage_seconds': sum(STAGED),
        'device_bytes': after_disk['written'] - disk['written'],
        'device_write_ms': after_disk['write_ms'] - disk['write_ms'],
        'minor_faults': after_usage.ru_minflt - usage.ru_minflt,
        'involuntary_switches': after_usage.ru_nivcsw - usage.ru_nivcsw,
        'dirty_before': dirty['Dirty'],
        'writeback_before': dirty['Writeback'],
    }


# ---------------------------------------------------------------- the saves

class Saves:
    """Every variant, ready on one net in ``root``: each call saves once,
    into a new folder, and returns when the save has ended (the time that
    training would block, for the timed ones)."""

    def __init__(self, net, root):
        self.net, self.root = net, Path(root)
        # the size of our checkpoint, which the disk variant writes: known
        # once ours has saved (ready_saves)
        self.nbytes = 0
        self.count = itertools.count()
        self.written = []
        self.pending = []
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=False))
        # DCP's async thread runs collectives: on a group of its own, not the main thread's
        self.group = dist.new_group(backend='gloo') if dist.is_initialized() else None
        self.durable = AccelerateCheckpoint(dirname=str(self.root / 'ours'), keep_last=1)
        self.asynchronous = AccelerateCheckpoint(dirname=str(self.root / 'ours-async'),
                                                 keep_last=1, async_save=True)
        for cp in (self.durable, self.asynchronous):
            cp.initialize().on_train_begin(net)

    def folder(self, kind):
        """A new path for a peer's save, removed when the saves settle."""
        path = self.root / f'{kind}-{next(self.count)}'
        self.written.append(path)
        return path

    def disk(self):
        path = self.folder('disk')
        on_rank_0(lambda: disk_write(path, self.nbytes))()

    def torch_save(self):
        path = self.folder('torch-save')
        on_rank_0(lambda: torch.save(state_dicts(self.net), path))()

    def dcp_save(self):
        dcp.save(state_dicts(self.net), checkpoint_id=str(self.folder('dcp')))

    def dcp_async(self):
        future = dcp.async_save(state_dicts(self.net), checkpoint_id=str(self.folder('dcp')),
                                process_group=self.group)
        getattr(future, 'upload_completion', future).result()

    def dcp_kept_blocked(self):
        """DCP's fastest ``async_save`` on this machine (bench_peers): a
        stager kept from one save to the next; until its staging is done
        (training must wait for it), its write awaited when the saves
        settle."""
        response = dcp.async_save(state_dicts(self.net), checkpoint_id=str(self.folder('dcp')),
                                  async_stager=self.stager, process_group=self.group)
        staging = getattr(response, 'staging_completion', None)
        if staging is not None:
            staging.result()
        self.pending.append(getattr(response, 'upload_completion', response))

    def ours_durable(self):
        new_epoch(self.net)
        self.durable.save_model(self.net)

    def ours_async(self):
        self.ours_async_blocked()
        self.asynchronous.wait_for_saves(self.net)

    def ours_async_blocked(self):
        """Until training may go on; the commit is awaited when the saves settle."""
        new_epoch(self.net)
        self.asynchronous.save_model(self.net)

    def settle(self, flush=True):
        """What the saves left running ended (our retirement in its thread)
        and, with ``flush``, the peers' saves removed and the page cache
        written back."""
        self.durable.wait_for_saves(self.net)
        self.asynchronous.wait_for_saves(self.net)
        for future in self.pending:
            future.result()
        self.pending.clear()
        if not flush:
            barrier()
            return
        barrier()  # every rank's files of the peers' saves are written
        if rank() == 0:
            for path in self.written:
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
            os.sync()
        self.written.clear()
        barrier()

    def close(self):
        self.durable.close()
        self.asynchronous.close()
        self.stager.close()


def ready_saves(net, root):
    """Every variant on ``net`` in ``root``, each called once (imports,
    first-call costs; our two checkpoints that each timed save retires)."""
    saves = Saves(net, root)
    saves.ours_durable()
    saves.ours_durable()
    saves.settle()
    saves.nbytes = folder_bytes(root / 'ours' / saves.durable.last_saved_)
    # in one order on every rank (a set's order is the process's own)
    for variant in sorted(set(BEFORE) | set(TIMED)):
        if variant != 'idle':
            getattr(saves, variant)()
    saves.settle()
    return saves


def pair(saves, before, timed, device, unsynced=False):
    """``before``, then what ``timed`` did; everything settled in between
    (but the page cache left as ``before`` left it, ``unsynced``)."""
    saves.settle()
    if before != 'idle':
        getattr(saves, before)()
    saves.settle(flush=not unsynced)
    result = observed(getattr(saves, timed), device)
    result['checkpoint_bytes'] = saves.nbytes
    return result


def one_process(args):
    """The child: the pair (``--before``, ``--timed``) in this process, one
    JSON line of what the timed save did (none without ``--timed``); with
    ``--turn N``, every pair of ``--before`` and ``--timed`` N times, a JSON
    line each. Launched in several processes (``--root``, which every rank
    shares), each line has the world the rank saw."""
    root = Path(args.root) if args.root else Path(args.dir) / f'process-{os.getpid()}'
    # the net's accelerator makes the process group of a launched run: the
    # ranks are known from here on
    net = trained_net(args.size)
    if rank() == 0:
        root.mkdir(parents=True)
    barrier()
    try:
        saves = ready_saves(net, root)
        timing_stages()
        if args.turn:
            pairs = [(before, timed) for before in args.before.split(',')
                     for timed in args.timed.split(',')]
            order = random.Random(0)
            for _ in range(args.turn):
                order.shuffle(pairs)
                for before, timed in pairs:
                    result = pair(saves, before, timed, device_of(root), args.unsynced)
                    print(json.dumps(dict(result, before=before, timed=timed, world=world())),
                          flush=True)
        elif args.timed:
            print(json.dumps(pair(saves, args.before, args.timed, device_of(root),
                                  args.unsynced)), flush=True)
        elif args.before != 'idle':
            getattr(saves, args.before)()
        saves.settle()
        saves.close()
    finally:
        if rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    if dist.is_initialized():
        # leaving gloo's threads to the interpreter's exit sometimes aborts the process
        barrier()
        dist.destroy_process_group()


def world():
    """The number of processes and the back-end this rank saw."""
    if dist.is_initialized():
        return [dist.get_world_size(), dist.get_backend()]
    return [1, None]


# ---------------------------------------------------------------- the rounds

def child(args, before, timed, turn=0):
    """The JSON lines of a child process (:func:`one_process`)."""
    command = [sys.executable, __file__, '--child', '--size', str(args.size), '--dir', args.dir,
               '--before', before] + (['--timed', timed] if timed else []) + (
               ['--turn', str(turn)] if turn else []) + (['--unsynced'] if args.unsynced else [])
    out = subprocess.run(command, capture_output=True, text=True, timeout=3000)
    if out.returncode:
        raise RuntimeError(f"{command} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{')]


def launched_turn(args, nproc):
    """Every pair ``args.repeats`` times in one launch of ``nproc``
    processes: the results of the slower rank, in the order run."""
    from launcher import launch
    root = Path(args.dir) / f'launch-{os.getpid()}-{nproc}'
    command = ['--child', '--size', args.size, '--dir', args.dir, '--root', root,
               '--before', ','.join(args.before), '--timed', ','.join(args.timed),
               '--turn', args.repeats] + (['--unsynced'] if args.unsynced else [])
    try:
        outputs = launch(Path(__file__).resolve(), *command, nproc=nproc,
                         timeout=LAUNCH_TIMEOUT).check().outputs
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ranks = [[json.loads(line) for line in out.splitlines() if line.startswith('{')]
             for out in outputs]
    worlds = {tuple(result['world']) for results in ranks for result in results}
    if worlds != {(nproc, 'gloo')}:
        raise RuntimeError(f"the launched run saw {worlds}, not {nproc} gloo processes")
    merged = []
    for results in zip(*ranks, strict=True):
        if len({(result['before'], result['timed']) for result in results}) != 1:
            raise RuntimeError(f"the ranks timed different pairs: {results}")
        slower = max(results, key=lambda result: result['seconds'])
        # the machine's counters are rank 0's, the time and the stage the slower rank's
        merged.append(dict(results[0], seconds=slower['seconds'],
                           stage_seconds=max(result['stage_seconds'] for result in results)))
    return merged


def run(args):
    """``(processes, where, before, timed) -> results``."""
    samples = {}
    for nproc in args.nproc:
        wheres = args.where if nproc == 1 else [where for where in args.where if where == 'turn']
        samples.update({(nproc, where, before, timed): [] for where in wheres
                        for before in args.before for timed in args.timed})
        if 'turn' not in wheres:
            continue
        results = (child(args, ','.join(args.before), ','.join(args.timed), args.repeats)
                   if nproc == 1 else launched_turn(args, nproc))
        for result in results:
            samples[(nproc, 'turn', result['before'], result['timed'])].append(result)
    if 1 not in args.nproc:
        return samples
    pairs = [(where, before, timed) for where in args.where for before in args.before
             for timed in args.timed]
    apart = [pair for pair in pairs if pair[0] != 'turn']
    for round_ in range(args.repeats if apart else 0):
        # round r starts r pairs further: each pair in another place every round
        shift = round_ * max(1, len(apart) // args.repeats)
        for where, before, timed in apart[shift:] + apart[:shift]:
            if where == 'same':
                [result] = child(args, before, timed)
            else:
                child(args, before, None)
                [result] = child(args, 'idle', timed)
            samples[(1, where, before, timed)].append(result)
        print(f"round {round_ + 1} of {args.repeats} done", file=sys.stderr, flush=True)
    return samples


def report(samples, args):
    print(f"Machine: {machine()}; disk: {disk_of(args.dir)}; torch {torch.__version__}; "
          f"{args.size / 1e6:g}M parameters, {args.repeats} rounds; ms, MiB")
    MiB = 2 ** 20
    rows = []
    for (nproc, where, before, timed), results in samples.items():
        seconds = [r['seconds'] for r in results]

        def median(key):
            return statistics.median(r[key] for r in results)
        rows.append((nproc, WHERE[where], BEFORE[before], TIMED[timed], ms(min(seconds)),
                     ms(statistics.median(seconds)), ms(max(seconds)),
                     ms(median('stage_seconds')) if timed == 'ours_durable' else '-',
                     f"{median('checkpoint_bytes') / MiB:.0f}",
                     f"{median('device_bytes') / MiB:.0f}", f"{median('device_write_ms'):.0f}",
                     f"{median('dirty_before') / MiB:.0f}",
                     f"{median('writeback_before') / MiB:.0f}",
                     f"{median('minor_faults'):.0f}", f"{median('involuntary_switches'):.0f}"))
    print()
    print("Each save timed after another (ms; MiB; counters: medians; in several "
          "processes the slower rank's time and stage, rank 0's counters)")
    print()
    print(table(rows, ('processes', 'where', 'before', 'timed', 'min', 'median', 'max',
                       'stage median', 'own MiB', 'device MiB', 'device write ms',
                       'dirty before', 'writeback before', 'minor faults', 'preempted')))
    ratios = []
    for (nproc, where, before, timed), results in samples.items():
        for peer in TARGETS.get(timed, ()):
            if (nproc, where, before, peer) not in samples:
                continue
            ours = [r['seconds'] for r in results]
            theirs = [r['seconds'] for r in samples[(nproc, where, before, peer)]]
            ratios.append((nproc, WHERE[where], BEFORE[before],
                           f"{TIMED[timed]} / {TIMED[peer]}",
                           f"{statistics.median(ours) / statistics.median(theirs):.2f}",
                           f"{min(ours) / min(theirs):.2f}"))
    print()
    print("Ratios, ours to the peers timed in the same position")
    print()
    print(table(ratios, ('processes', 'where', 'before', 'ratio', 'of medians', 'of mins')))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--size', type=float, default=50e6)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--before')
    parser.add_argument('--timed')
    parser.add_argument('--where', default='turn')
    parser.add_argument('--nproc', default='1,2', help='process counts, e.g. 1,2')
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'bench-positions'))
    parser.add_argument('--unsynced', action='store_true')
    parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--turn', type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument('--root', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        one_process(args)
        return
    for name, known in (('before', BEFORE), ('timed', TIMED), ('where', WHERE)):
        values = (getattr(args, name) or ','.join(known)).split(',')
        unknown = [value for value in values if value not in known]
        if unknown:
            parser.error(f"--{name}: unknown {unknown}; one or more of {', '.join(known)}")
        setattr(args, name, values)
    try:
        args.nproc = [int(n) for n in args.nproc.split(',')]
    except ValueError:
        parser.error(f"--nproc: process counts such as 1,2, got {args.nproc!r}")
    if not args.nproc or min(args.nproc) < 1:
        parser.error(f"--nproc: counts of at least 1, got {args.nproc}")
    if max(args.nproc) > 1 and 'turn' not in args.where:
        parser.error("--nproc: several processes run --where turn only; add turn to --where")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    report(run(args), args)


if __name__ == '__main__':
    main()
