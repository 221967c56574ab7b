"""How much checkpointing costs, next to what it cannot beat.

usage: python benchmarks/bench_checkpoint.py [--sizes 1e6,25e6,100e6]
       [--repeats 5] [--quick] [--dir runs/bench] [--resume-size 25e6]

Each figure is the median of ``--repeats`` runs; the variants of one size
are run in turn within each repeat (so that the load of a shared machine
falls on all of them alike), and every ratio is taken between figures of
the same run. The page cache is flushed (``os.sync``) before every timed
save, so that no save pays for the writeback of the one before.

The nets are stacks of 1024x1024 linear layers trained one step with Adam
(so the optimizer holds two tensors per parameter), in one process, unless
said otherwise:

- ``AccelerateCheckpoint.save_model`` (durable: every file fsynced before
  the commit; and ``durable=False``), against a bare
  ``accelerator.save_state`` (alone, and followed by an fsync of its files,
  the same durability), a ``torch.save`` of the two state dicts, and the
  disk: one file of the checkpoint's size written and fsynced;
- ``async_save=True``: how long ``save_model`` blocks training, and how
  long until the checkpoint is committed in the background; against a copy
  of the same tensors into buffers allocated beforehand (what a snapshot
  cannot beat);
- ``ParamsCheckpoint`` against skorch's ``Checkpoint``;
- in 2 processes: the cost of the checkpoint hooks in an epoch that saves
  nothing, per process;
- the time from process start to the first training step, resumed from a
  checkpoint and fresh.
"""

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / 'tests' / 'support')]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from skorch import NeuralNetRegressor  # noqa: E402
from skorch.callbacks import Checkpoint  # noqa: E402
from skorch.hf import AccelerateMixin  # noqa: E402

from skorch_accel_callbacks import (  # noqa: E402
    AccelerateCheckpoint,
    AccelerateFixesMixin,
    AccelerateLoadInitState,
    ParamsCheckpoint,
)
from skorch_accel_callbacks.format import _atomic as atomic  # noqa: E402

WIDTH = 1024


def copy_into(buffer, tensor):
    """The memory floor: a single memcpy of a host tensor into a buffer of
    its size (not torch's ``copy_``, whose intra-op threads stall on a busy
    machine: RESULTS.rst)."""
    np.copyto(buffer.view(torch.uint8).numpy(), tensor.view(torch.uint8).numpy())


class Net(AccelerateFixesMixin, AccelerateMixin, NeuralNetRegressor):
    pass


class Stack(torch.nn.Sequential):
    def __init__(self, n_layers=1):
        super().__init__(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(n_layers)])


def n_layers(size):
    return max(1, round(size / (WIDTH * WIDTH + WIDTH)))


def make_net(size, callbacks=(), max_epochs=1):
    AcceleratorState._reset_state(True)
    return Net(Stack, module__n_layers=n_layers(size), optimizer=torch.optim.Adam,
               lr=1e-4, batch_size=8, max_epochs=max_epochs, train_split=None,
               accelerator=Accelerator(cpu=True), callbacks=list(callbacks),
               verbose=0)


def data():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(8, WIDTH, generator=gen).numpy(),
            torch.randn(8, WIDTH, generator=gen).numpy())


def quiet_fit(net, X_y=None):
    """``net`` fitted on ``X_y`` (default: :func:`data`), printing nothing."""
    # skorch's AccelerateMixin prints the epoch table whatever net.verbose says
    with contextlib.redirect_stdout(io.StringIO()):
        return net.fit(*(X_y or data()))


def trained_net(size):
    return quiet_fit(make_net(size))  # one Adam step: the optimizer has its state


def folder_bytes(path):
    return sum(f.stat().st_size for f in Path(path).rglob('*') if f.is_file())


def timed(fn):
    os.sync()  # no save pays for the writeback of an earlier one
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fsync_folder(path):
    atomic.fsync_files([str(f) for f in Path(path).rglob('*') if f.is_file()])


BLOCK = os.urandom(1 << 20) * 64


def disk_write(path, nbytes, block=BLOCK):
    """One file of ``nbytes`` written in 64 MiB blocks and fsynced."""
    with open(path, 'wb') as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[:min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())


def new_epoch(net):
    """A history row, so that each save is a new checkpoint folder."""
    net.history.new_epoch()
    net.history.record('train_loss', 0.0)
    net.history.new_batch()


def saved_twice(cp, net):
    """Two saves of ``net`` by ``AccelerateCheckpoint`` ``cp`` (begun), each
    waited for, before any timed one: the first saves of a process make what
    the later ones reuse (an async save's host buffers, a frozen part to
    link), and each timed save then retires one of the two."""
    for _ in range(2):
        new_epoch(net)
        cp.save_model(net)
        cp.wait_for_saves(net)


# ---------------------------------------------------------------- one process

def bench_size(size, repeats, root):
    net = trained_net(size)
    accelerator = net.accelerator
    root = Path(root) / f'size-{size:g}'
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    checkpoints = {
        'durable': AccelerateCheckpoint(dirname=str(root / 'ours')),
        'fast': AccelerateCheckpoint(dirname=str(root / 'ours-fast'), durable=False),
        'async': AccelerateCheckpoint(dirname=str(root / 'ours-async'), async_save=True),
    }
    for cp in checkpoints.values():
        cp.initialize().on_train_begin(net)
    params_cp = ParamsCheckpoint(monitor=None, dirname=str(root / 'params'), f_history=None)
    skorch_cp = Checkpoint(monitor=None, dirname=str(root / 'skorch'), f_history=None)
    params_cp.initialize()
    skorch_cp.initialize()

    times = {key: [] for key in (
        'bare', 'bare_fsync', 'torch_save', 'disk', 'copy', 'durable', 'fast',
        'async_blocked', 'async_total', 'params', 'skorch', 'skorch_fsync')}
    # what async_save cannot beat: copying the tensors into buffers allocated
    # before, as it copies them
    tensors = [t for t in net.module_.state_dict().values()] + [
        t for state in net.optimizer_.state_dict()['state'].values()
        for t in state.values() if isinstance(t, torch.Tensor)]
    buffers = [torch.empty_like(t) for t in tensors]
    for buffer, tensor in zip(buffers, tensors, strict=True):
        buffer.copy_(tensor)
    nbytes = None
    for i in range(repeats):
        bare = root / f'bare-{i}'
        times['bare'].append(timed(lambda: accelerator.save_state(str(bare))))
        nbytes = folder_bytes(bare)
        shutil.rmtree(bare)
        times['bare_fsync'].append(timed(
            lambda: (accelerator.save_state(str(bare)), fsync_folder(bare))))
        shutil.rmtree(bare)
        plain = root / 'plain.pt'
        times['torch_save'].append(timed(lambda: torch.save(
            {'model': net.module_.state_dict(), 'optimizer': net.optimizer_.state_dict()},
            plain)))
        plain.unlink()
        times['disk'].append(timed(lambda: disk_write(root / 'disk.bin', nbytes)))
        (root / 'disk.bin').unlink()
        times['copy'].append(timed(
            lambda: [copy_into(buffer, tensor)
                     for buffer, tensor in zip(buffers, tensors, strict=True)]))
        for key in ('durable', 'fast'):
            new_epoch(net)
            times[key].append(timed(lambda: checkpoints[key].save_model(net)))
            # the retired checkpoint is removed in the background, while
            # training goes on; it must not slow down the next measurement
            checkpoints[key].wait_for_saves(net)
        new_epoch(net)
        cp = checkpoints['async']
        blocked = timed(lambda: cp.save_model(net))
        start = time.perf_counter()
        cp.wait_for_saves(net)
        times['async_blocked'].append(blocked)
        times['async_total'].append(blocked + time.perf_counter() - start)
        times['params'].append(timed(lambda: params_cp.save_model(net)))
        times['skorch'].append(timed(lambda: skorch_cp.save_model(net)))
        times['skorch_fsync'].append(timed(
            lambda: (skorch_cp.save_model(net), fsync_folder(root / 'skorch'))))
    checkpoints['async'].writer_.close()
    shutil.rmtree(root)
    if os.environ.get("BENCH_RAW"):
        print(json.dumps({k: [round(x * 1000) for x in v] for k, v in times.items()}),
              file=sys.stderr)
    medians = {key: statistics.median(values) for key, values in times.items()}
    return dict(size=sum(p.numel() for p in net.module_.parameters()), nbytes=nbytes,
                **medians)


# ---------------------------------------------------------------- two processes

def worker_epoch_cost(out, calls):
    """Every rank times the checkpoint hooks of epochs that save nothing."""
    from skorch_accel_callbacks._core import sync
    net = make_net(1e6, max_epochs=1)
    variants = {
        'AccelerateCheckpoint(every_n_epochs=large)':
            AccelerateCheckpoint(dirname=f'{out}/a', every_n_epochs=10 ** 6),
        'AccelerateCheckpoint(monitor=no)':
            AccelerateCheckpoint(dirname=f'{out}/b', monitor=lambda net: False),
        'AccelerateCheckpoint(monitor=no, async_save=True)':
            AccelerateCheckpoint(dirname=f'{out}/c', monitor=lambda net: False,
                                 async_save=True),
        'ParamsCheckpoint(monitor=no)':
            ParamsCheckpoint(dirname=f'{out}/d', monitor=lambda net: False),
    }
    net.set_params(callbacks=list(variants.values()))
    X, y = data()
    net.fit(X, y)
    dataset = net.get_dataset(X, y)
    new_epoch(net)
    result = {}
    for name, cb in variants.items():
        samples = []
        for _ in range(calls):
            sync.barrier(net)
            start = time.perf_counter()
            cb.on_epoch_begin(net, dataset_train=dataset)
            cb.on_epoch_end(net)
            samples.append(time.perf_counter() - start)
        result[name] = statistics.median(samples)
    rank = sync.process_index(net)
    Path(out, f'epoch-cost-{rank}.json').write_text(json.dumps(result))
    # leaving gloo's threads to the interpreter's exit sometimes aborts the process
    sync.barrier(net)
    torch.distributed.destroy_process_group()


def bench_epoch_cost(root, calls):
    from launcher import launch
    out = Path(root) / 'epoch-cost'
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    launch(Path(__file__).resolve(), '--worker', 'epoch-cost', out, calls,
           nproc=2, timeout=300).check()
    ranks = [json.loads((out / f'epoch-cost-{r}.json').read_text()) for r in range(2)]
    shutil.rmtree(out)
    return ranks


def worker_resume(dirname, size, stamp_file):
    """Train until the first training step, write the wall times of the
    call of ``fit`` and of that step, and die."""
    from skorch.callbacks import Callback

    class FirstStep(Callback):
        def on_batch_begin(self, net, training=False, **kwargs):
            if training:
                Path(stamp_file).write_text(json.dumps([fit_start, time.time()]))
                os._exit(0)  # leaves the checkpoint as it is for the next run

    cp = AccelerateCheckpoint(dirname=dirname)
    net = make_net(size, callbacks=[cp, AccelerateLoadInitState(cp), FirstStep()],
                   max_epochs=2)
    fit_start = time.time()
    net.fit(*data())


def bench_resume(root, size, repeats):
    """Process start to first training step: fresh and resumed, one process."""
    root = Path(root) / 'resume'
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ckpt = root / 'ckpt'
    # a checkpoint after epoch 1 of 2: resuming trains epoch 2
    cp = AccelerateCheckpoint(dirname=str(ckpt))
    quiet_fit(make_net(size, callbacks=[cp], max_epochs=1))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / 'tests' / 'support')]))
    times = {'fresh': [], 'resumed': [], 'fresh_fit': [], 'resumed_fit': []}
    for i in range(repeats):
        for kind in ('fresh', 'resumed'):
            dirname = ckpt if kind == 'resumed' else root / f'fresh-{i}'
            stamp = root / f'stamp-{kind}-{i}'
            os.sync()
            start = time.time()
            subprocess.run([sys.executable, __file__, '--worker', 'resume', dirname,
                            repr(size), stamp], env=env, check=True)
            fit_start, first_step = json.loads(stamp.read_text())
            times[kind].append(first_step - start)
            times[kind + '_fit'].append(first_step - fit_start)
    shutil.rmtree(root)
    return {kind: statistics.median(values) for kind, values in times.items()}


# ---------------------------------------------------------------- report

def machine():
    cpu = next((line.split(':', 1)[1].strip() for line in
                Path('/proc/cpuinfo').read_text().splitlines()
                if line.startswith('model name')), platform.processor())
    return f"{os.cpu_count()} cores, {cpu}"


def disk_of(path):
    try:
        out = subprocess.run(['df', '--output=source,fstype', str(path)],
                             capture_output=True, text=True, check=True).stdout
        return ' '.join(out.splitlines()[-1].split())
    except (OSError, subprocess.CalledProcessError):
        return 'unknown'


def ms(seconds):
    return f"{seconds * 1000:.0f}" if seconds >= 0.01 else f"{seconds * 1000:.2f}"


def table(rows, header):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = '  '.join('=' * w for w in widths)
    fmt = lambda row: '  '.join(str(x).ljust(w) for x, w in zip(row, widths, strict=True))  # noqa: E731
    return '\n'.join([line, fmt(header), line] + [fmt(r) for r in rows] + [line])


def report(sizes, epoch_cost, resume, args, root):
    out = [f"Machine: {machine()}; disk: {disk_of(root)}; torch {torch.__version__}, "
           f"{torch.get_num_threads()} threads. Medians of {args.repeats} runs (ms)."]
    rows = []
    for r in sizes:
        rows.append([
            f"{r['size'] / 1e6:.0f}M", f"{r['nbytes'] / 2 ** 20:.0f}",
            ms(r['disk']), ms(r['bare']), ms(r['bare_fsync']), ms(r['torch_save']),
            ms(r['fast']), ms(r['durable']),
            f"{r['fast'] / r['bare']:.2f}", f"{r['durable'] / r['bare_fsync']:.2f}",
            f"{r['durable'] / r['disk']:.2f}",
            ms(r['copy']), ms(r['async_blocked']), ms(r['async_total']),
            f"{r['async_blocked'] / r['durable']:.2f}"])
    out += ['', 'Whole-state checkpoint (AccelerateCheckpoint), one process', '', table(rows, [
        'params', 'MiB', 'disk', 'save_state', 'save_state+fsync', 'torch.save',
        'ours durable=False', 'ours', 'fast/save_state', 'ours/save_state+fsync',
        'ours/disk', 'memory copy', 'async blocked', 'async committed',
        'blocked/ours'])]
    rows = [[f"{r['size'] / 1e6:.0f}M", ms(r['skorch']), ms(r['skorch_fsync']), ms(r['params']),
             f"{r['params'] / r['skorch']:.2f}", f"{r['params'] / r['skorch_fsync']:.2f}"]
            for r in sizes]
    out += ['', 'ParamsCheckpoint vs skorch Checkpoint (params + optimizer), one process', '',
            table(rows, ['params', 'skorch Checkpoint', 'skorch Checkpoint+fsync',
                         'ParamsCheckpoint', 'ratio', 'ratio to +fsync'])]
    if epoch_cost:
        rows = [[name] + [ms(rank[name]) for rank in epoch_cost] for name in epoch_cost[0]]
        out += ['', 'Epoch that saves nothing, 2 processes (gloo): hooks per epoch', '',
                table(rows, ['callback', 'rank 0', 'rank 1'])]
    if resume:
        rows = [[label, ms(resume[key]), ms(resume['resumed' + suffix]),
                 ms(resume['resumed' + suffix] - resume[key])]
                for label, key, suffix in (('process start', 'fresh', ''),
                                           ('net.fit() called', 'fresh_fit', '_fit'))]
        out += ['', f"Time to the first training step, {args.resume_size / 1e6:.0f}M params, "
                    "one process", '',
                table(rows, ['from', 'fresh', 'resumed', 'difference'])]
    return '\n'.join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--sizes', default='1e6,25e6,100e6')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--quick', action='store_true',
                        help='sizes 1e6,25e6, 3 repeats, no resume timing')
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'bench'))
    parser.add_argument('--resume-size', type=float, default=25e6)
    parser.add_argument('--calls', type=int, default=200,
                        help='hook calls timed per variant in 2 processes')
    parser.add_argument('--worker', nargs='+', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == 'epoch-cost':
            worker_epoch_cost(rest[0], int(rest[1]))
        else:
            worker_resume(rest[0], float(rest[1]), rest[2])
        return
    if args.quick:
        args.sizes, args.repeats = '1e6,25e6', 3
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    sizes = []
    for size in (float(s) for s in args.sizes.split(',')):
        sizes.append(bench_size(size, args.repeats, root))
        print(f"size {size:g} done", file=sys.stderr, flush=True)
    epoch_cost = bench_epoch_cost(root, args.calls)
    resume = None if args.quick else bench_resume(root, args.resume_size, args.repeats)
    print(report(sizes, epoch_cost, resume, args, root))


if __name__ == '__main__':
    main()
