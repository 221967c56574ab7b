"""What saving inside epochs costs when nothing is saved, and what skipping
the trained batches of an epoch costs at a resume.

usage: python benchmarks/bench_mid_epoch.py [--repeats 5] [--rows 1000000]
       [--resume-rows 16384]

1. The checkpoint callback's batch hook (``on_batch_end``), timed call by
   call inside real training of small batches, in 1 and 2 processes (2 are
   launched with ``torchrun --standalone``, gloo): counting steps only
   (``every_n_steps``), with the signal vote (``save_on_signal``, the
   default), and with the vote carrying the time too (``every_n_seconds``).
   Nothing is due, so nothing is saved. Reported per call: min, median and
   mean over all calls of all repeats (the mean carries the votes, posted
   about every 0.5 s), and the mean against the median batch.
2. A resume 90% into an epoch of ``--rows`` rows (batches of 32): the time
   from restoring the epoch's start and setting the skip to the first
   batch of the rest, against iterating the trained batches (what a resume
   that consumes batches costs before computing anything).
3. What a relaunch costs: the time from ``fit`` to the first trained batch
   of a run resumed 10%, 50% and 90% into an epoch, beside that epoch's
   training time in the uninterrupted run, for three data pipelines: loader
   workers whose data set draws random numbers (the resume reads the
   trained batches again through the workers), the same without random
   draws (skipped by index), and the random data set read in the training
   process (skipped by index, the read-ahead states given back).

Each configuration runs in turn within each repeat, so that the load of a
shared machine falls on all of them alike.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / 'tests' / 'workers')]

CONFIGS = {
    'steps only': dict(every_n_steps=10 ** 9, save_on_signal=()),
    'signals (default)': dict(every_n_steps=10 ** 9),
    'signals + time': dict(every_n_steps=10 ** 9, every_n_seconds=10 ** 9),
}


def hook_worker(out, repeats):
    """Run in every process: time the batch hook under each configuration."""
    from skorch.callbacks import Callback

    from common import NotTrainingState, make_accelerator, make_data, make_net
    from skorch_accel_callbacks import AccelerateCheckpoint

    class BatchClock(NotTrainingState, Callback):
        """Times each training batch, begin to end."""

        def initialize(self):
            self.times = []
            return self

        def on_batch_begin(self, net, training=False, **kwargs):
            self.started = time.perf_counter()

        def on_batch_end(self, net, training=False, **kwargs):
            if training:
                self.times.append(time.perf_counter() - self.started)

    accelerator = make_accelerator()
    X, y = make_data(n=16384, n_features=64)
    calls = {name: [] for name in CONFIGS}
    batches = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for name, options in CONFIGS.items():
                cp = AccelerateCheckpoint(dirname=f'{tmp}/{repeat}-{name}', **options)
                hook = cp.on_batch_end

                def timed(net, _hook=hook, _calls=calls[name], **kwargs):
                    start = time.perf_counter()
                    _hook(net, **kwargs)
                    _calls.append(time.perf_counter() - start)

                cp.on_batch_end = timed
                clock = BatchClock()
                net = make_net(accelerator, callbacks=[cp, clock], max_epochs=1,
                               batch_size=64, module__n_in=64, module__hidden=256,
                               train_split=None)
                torch.manual_seed(repeat)
                net.fit(X, y)
                batches += clock.times
    result = {name: values for name, values in calls.items()}
    result['batch'] = batches
    result['num_processes'] = accelerator.num_processes
    with open(f"{out}-rank{accelerator.process_index}.json", 'w') as f:
        json.dump(result, f)


def bench_hook(repeats):
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(
            [str(REPO), str(REPO / 'tests' / 'workers')]))
        for nproc in (1, 2):
            out = f'{tmp}/hook{nproc}'
            command = [sys.executable, __file__, '--worker', out, str(repeats)]
            if nproc == 2:
                command = [sys.executable, '-m', 'torch.distributed.run', '--standalone',
                           '--nproc_per_node', '2', *command[1:]]
            subprocess.run(command, env=env, check=True, capture_output=True)
            result = json.loads(Path(f'{out}-rank0.json').read_text())
            assert result['num_processes'] == nproc
            batch = statistics.median(result['batch'])
            for name in CONFIGS:
                values = result[name]
                median, mean = statistics.median(values), statistics.fmean(values)
                rows[(nproc, name)] = (min(values) * 1e6, median * 1e6, mean * 1e6,
                                       batch * 1e3, 100 * mean / batch, len(values))
    return rows


def bench_skip(rows, repeats):
    """Seconds to the first batch after skipping 90% of an epoch, by index and
    by iterating the batches."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from skorch_accel_callbacks.state import EpochStart, ResumePlan, install

    dataset = TensorDataset(torch.from_numpy(np.random.rand(rows, 16).astype(np.float32)))
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(dataset, batch_size=32, shuffle=True))
    skip = int(0.9 * len(loader))
    start_state = EpochStart.capture(loader)
    control = install(loader)
    times = {'by index': [], 'iterating': []}
    for _ in range(repeats):
        start_state.restore(loader)
        began = time.perf_counter()
        control.plan_resume(ResumePlan(skip=skip))
        iterator = iter(loader)
        next(iterator)
        times['by index'].append(time.perf_counter() - began)
        del iterator
        start_state.restore(loader)
        began = time.perf_counter()
        iterator = iter(loader)
        for _ in range(skip + 1):
            next(iterator)
        times['iterating'].append(time.perf_counter() - began)
        del iterator
    return skip, len(loader), {kind: (min(v), statistics.median(v)) for kind, v in times.items()}


RESUME_PIPELINES = {
    'workers, random rows (read again)': dict(num_workers=2, augment=True),
    'workers, fixed rows (by index)': dict(num_workers=2, augment=False),
    'in process, random rows (by index)': dict(num_workers=0, augment=True),
}
RESUME_FRACTIONS = (0.1, 0.5, 0.9)


def bench_resume(rows, repeats):
    """Per pipeline and fraction of an epoch: the uninterrupted run's epoch
    time and, over ``repeats`` relaunches, the seconds from ``fit`` to the
    first trained batch."""
    import shutil

    from skorch.callbacks import Callback
    from skorch.dataset import Dataset

    from common import NotTrainingState, make_accelerator, make_data, make_net
    from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState

    class Augmented(Dataset):
        def __init__(self, X, y=None, length=None, augment=True):
            super().__init__(X, y, length=length)
            self.augment = augment

        def __getitem__(self, i):
            Xi, yi = super().__getitem__(i)
            if self.augment:
                Xi = Xi + 0.01 * torch.rand(Xi.shape).numpy()
            return Xi, yi

    class FirstBatch(NotTrainingState, Callback):
        """When the first training batch begins; then the relaunch stops."""

        def initialize(self):
            self.at = None
            return self

        def on_batch_begin(self, net, training=False, **kwargs):
            if training and self.at is None:
                self.at = time.perf_counter()
                raise KeyboardInterrupt

    X, y = make_data(n=rows, n_features=32)
    batches = rows // 32
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pipeline, options in RESUME_PIPELINES.items():
            for fraction in RESUME_FRACTIONS:
                folder = f'{tmp}/{len(results)}'
                # saved once, inside epoch 2 at the fraction's batch
                every = batches + round(fraction * batches)

                def net_of(dirname, callbacks=(), resume='latest', _every=every,
                           _options=options):
                    cp = AccelerateCheckpoint(dirname=dirname, every_n_steps=_every)
                    torch.manual_seed(0)
                    return make_net(
                        make_accelerator(), max_epochs=2, batch_size=32, train_split=None,
                        module__n_in=32, dataset=Augmented, dataset__augment=_options['augment'],
                        iterator_train__num_workers=_options['num_workers'],
                        callbacks=[AccelerateLoadInitState(cp, resume=resume), cp, *callbacks])

                full = net_of(f'{folder}/saved').fit(X, y)
                saved = [name for name in dict(full.callbacks_)['AccelerateCheckpoint']
                         .committed() if '-step-' in name]
                times = []
                for repeat in range(repeats):
                    copy = f'{folder}/relaunch{repeat}'
                    shutil.copytree(f'{folder}/saved', copy)
                    first = FirstBatch()
                    began = time.perf_counter()
                    net_of(copy, [first], resume=saved[0]).fit(X, y)
                    times.append(first.at - began)
                results[(pipeline, fraction)] = (full.history[1]['dur'], min(times),
                                                 statistics.median(times))
    return batches, results


def table(header, rows):
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    rule = '  '.join('=' * w for w in widths)
    lines = [rule, '  '.join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)), rule]
    lines += ['  '.join(str(c).ljust(w) for c, w in zip(row, widths, strict=True))
              for row in rows]
    return '\n'.join(lines + [rule])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--rows', type=int, default=1_000_000)
    parser.add_argument('--resume-rows', type=int, default=16384)
    parser.add_argument('--worker', nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        hook_worker(args.worker[0], int(args.worker[1]))
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {args.repeats} repeats\n")
    hook = bench_hook(args.repeats)
    print("Batch hook of AccelerateCheckpoint with nothing to save (rank 0), us per call\n")
    print(table(['processes', 'configuration', 'min us', 'median us', 'mean us',
                 'median batch ms', 'mean/batch %', 'calls'],
                [[nproc, name, f'{a:.1f}', f'{b:.1f}', f'{c:.1f}', f'{d:.2f}', f'{e:.2f}', n]
                 for (nproc, name), (a, b, c, d, e, n) in hook.items()]))
    skip, length, times = bench_skip(args.rows, args.repeats)
    print(f"\nResume {skip} batches into an epoch of {length} ({args.rows} rows, batches of "
          "32): seconds to the first batch of the rest\n")
    print(table(['skipping', 'min s', 'median s'],
                [[kind, f'{a:.3f}', f'{b:.3f}'] for kind, (a, b) in times.items()]))
    batches, resumes = bench_resume(args.resume_rows, args.repeats)
    print(f"\nRelaunch inside an epoch of {batches} batches ({args.resume_rows} rows, 1 "
          "process): seconds from fit to the first trained batch, beside the epoch's "
          "training time in the uninterrupted run\n")
    print(table(['data pipeline', 'into the epoch', 'epoch s', 'min s', 'median s',
                 'median / epoch'],
                [[pipeline, f'{fraction:.0%}', f'{epoch:.2f}', f'{low:.2f}', f'{median:.2f}',
                  f'{median / epoch:.2f}']
                 for (pipeline, fraction), (epoch, low, median) in resumes.items()]))


if __name__ == '__main__':
    main()
