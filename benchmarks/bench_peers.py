"""Our checkpoint beside the peers a user would pick instead, in one process and in 2.

usage: python benchmarks/bench_peers.py [--sizes 25e6,50e6,100e6] [--repeats 5]
       [--nproc 1,2] [--quick] [--dir runs/bench-peers]

On the nets of ``bench_checkpoint.py`` (stacks of 1024x1024 linear layers
after one Adam step), one save of each variant in turn within every repeat
(so that the load of a shared machine falls on all of them alike), each
into a new folder, ``os.sync()`` before each timed call:

- the floors: the disk (one file of the checkpoint's size written and
  fsynced) and memory (the tensors copied into buffers allocated before);
- the peers: ``torch.save`` of the two state dicts + fsync,
  ``accelerator.save_state`` + an fsync of its files, torch DCP's ``save``
  (its writer fsyncs every file) and ``async_save``: as it comes (a stager
  made for each call), with a ``DefaultStager`` kept from one save to the
  next (its buffers reused; pinned where CUDA is), with that stager's
  staging in a thread (blocked: until the staging is done, which training
  must wait for before the next step changes the tensors) and, where CUDA
  is, ``BlockingAsyncStager(cache_staged_state_dict=True)``;
- ours: ``AccelerateCheckpoint.save_model`` durable with ``keep_last=1``
  and ``keep_last=2``, ``durable=False``, and ``async_save=True`` (blocked,
  and until committed). Every timed save of ours retires one checkpoint, as
  in training (two were saved before); the removal of the retired folder
  runs in the background while training goes on, and is timed apart
  (``retirement``: waited for after the save, outside its time).

In 2 processes (``tests/support/launcher.py``, ``Accelerator(cpu=True)``: DDP on
gloo) a figure is the slower rank's; DCP's ``async_save`` gets a gloo
group of its own (its thread's collectives must not meet the main
thread's). In one process there is no process group (DCP saves without
one). Printed: min, median and max (ms) of each variant, and the ratios,
of medians and of mins, taken within the same run. Memory: about 8 GB per
process at 100M parameters (the net, the copies of ours and of DCP's kept
stagers, the buffers of the memory copy).
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
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
    saved_twice,
    table,
    trained_net,
)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from skorch_accel_callbacks import AccelerateCheckpoint

# what each variant is called in the tables, in the order they are run
LABELS = {
    'disk': 'disk: one file written + fsync',
    'copy': 'memory copy into buffers allocated before',
    'torch_save': 'torch.save of the state dicts + fsync',
    'save_state': 'accelerator.save_state + fsync of its files',
    'dcp_save': 'DCP save',
    'dcp_async': 'DCP async_save, blocked',
    'dcp_async_total': 'DCP async_save, until committed',
    'dcp_reused': 'DCP async_save, DefaultStager kept, blocked',
    'dcp_reused_total': 'DCP async_save, DefaultStager kept, until committed',
    'dcp_staging': 'DCP async_save, DefaultStager async staging, blocked',
    'dcp_staging_total': 'DCP async_save, DefaultStager async staging, until committed',
    'dcp_blocking': 'DCP async_save, BlockingAsyncStager cached, blocked',
    'dcp_blocking_total': 'DCP async_save, BlockingAsyncStager cached, until committed',
    'durable_1': 'ours durable, keep_last=1',
    'retire_1': 'ours durable, keep_last=1: retirement (background)',
    'durable_2': 'ours durable, keep_last=2',
    'retire_2': 'ours durable, keep_last=2: retirement (background)',
    'fast': 'ours durable=False, keep_last=1',
    'async': 'ours async_save=True, blocked',
    'async_total': 'ours async_save=True, until committed',
}
DCP_ASYNC = ('dcp_async', 'dcp_reused', 'dcp_staging', 'dcp_blocking')


# ---------------------------------------------------------------- processes

def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def barrier():
    if dist.is_initialized():
        dist.barrier()


def flushed():
    """Every rank here once rank 0 flushed the page cache: no save pays for
    the writeback of an earlier one."""
    barrier()
    if rank() == 0:
        os.sync()
    barrier()


def timed(fn):
    """``fn``'s duration on this rank, started together on every rank."""
    flushed()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def on_rank_0(fn):
    """``fn`` run by rank 0 alone: what a job that writes one file does."""
    return lambda: fn() if rank() == 0 else None


def fsync_one(file):
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path):
    """Flush the file ``path`` or every file under the folder ``path``, in
    parallel, as our save and ``bench_checkpoint.py``'s ``save_state+fsync`` do."""
    path = Path(path)
    files = [path] if path.is_file() else [f for f in path.rglob('*') if f.is_file()]
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
        list(pool.map(fsync_one, files))


# ---------------------------------------------------------------- the variants

def state_dicts(net):
    return {'model': net.module_.state_dict(), 'optimizer': net.optimizer_.state_dict()}


def host_tensors(net):
    return [t for t in net.module_.state_dict().values()] + [
        t for state in net.optimizer_.state_dict()['state'].values()
        for t in state.values() if isinstance(t, torch.Tensor)]


def memory_copy(tensors, buffers):
    # one memcpy per tensor on this thread, as our stager copies host tensors
    for buffer, tensor in zip(buffers, tensors, strict=True):
        if tensor.dim():
            np.copyto(buffer.view(torch.uint8).numpy(), tensor.view(torch.uint8).numpy())
        else:  # Adam's step count
            buffer.copy_(tensor)


def dcp_stagers():
    """The DCP stagers kept from one save to the next that this torch has."""
    cuda = torch.cuda.is_available()
    stagers = {
        'dcp_reused': DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=False)),
        'dcp_staging': DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
            use_non_blocking_copy=cuda)),
    }
    if cuda:
        # it pins its cache, which a CPU-only torch cannot
        from torch.distributed.checkpoint.staging import BlockingAsyncStager
        stagers['dcp_blocking'] = BlockingAsyncStager(cache_staged_state_dict=True)
    return stagers


def dcp_async(net, folder, stager, group):
    """DCP's async_save: the time it blocks and the time until committed."""
    start = time.perf_counter()
    response = dcp.async_save(state_dicts(net), checkpoint_id=str(folder),
                              async_stager=stager, process_group=group)
    upload = getattr(response, 'upload_completion', response)
    staging = getattr(response, 'staging_completion', None)
    if staging is not None:
        staging.result()  # the next step would change the tensors being copied
    blocked = time.perf_counter() - start
    upload.result()
    return blocked, time.perf_counter() - start


def ours(net, root):
    checkpoints = {
        'durable_1': AccelerateCheckpoint(dirname=str(root / 'ours-1'), keep_last=1),
        'durable_2': AccelerateCheckpoint(dirname=str(root / 'ours-2'), keep_last=2),
        'fast': AccelerateCheckpoint(dirname=str(root / 'ours-fast'), keep_last=1,
                                     durable=False),
        'async': AccelerateCheckpoint(dirname=str(root / 'ours-async'), keep_last=1,
                                      async_save=True),
    }
    for cp in checkpoints.values():
        cp.initialize().on_train_begin(net)
        saved_twice(cp, net)
    return checkpoints


# ---------------------------------------------------------------- one size

def bench_size(size, repeats, root):
    """Every variant ``repeats`` times at ``size`` parameters: this rank's
    seconds of each, and the checkpoint's size in bytes."""
    net = trained_net(size)
    root = Path(root) / f'size-{size:g}'
    if rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    barrier()
    checkpoints = ours(net, root)
    nbytes = folder_bytes(root / 'ours-1' / checkpoints['durable_1'].last_saved_)
    # on the committing rank only, which alone copies them in our async_save
    tensors = host_tensors(net) if rank() == 0 else []
    buffers = [torch.empty_like(t) for t in tensors]
    memory_copy(tensors, buffers)  # the buffers' pages exist before the timing
    stagers = dcp_stagers()
    # DCP's async thread runs collectives: on a group of its own, not the main thread's
    group = dist.new_group(backend='gloo') if dist.is_initialized() else None
    times = {key: [] for key in LABELS
             if not key.startswith('dcp_blocking') or 'dcp_blocking' in stagers}
    for i in range(repeats):
        run_peers(net, root / f'peers-{i}', nbytes, tensors, buffers, stagers, group, times)
        run_ours(net, checkpoints, times)
    for cp in checkpoints.values():
        cp.close()
    for stager in stagers.values():
        stager.close()
    barrier()
    if rank() == 0:
        shutil.rmtree(root)
    return times, nbytes


def run_peers(net, folder, nbytes, tensors, buffers, stagers, group, times):
    if rank() == 0:
        folder.mkdir()
    barrier()
    times['disk'].append(timed(on_rank_0(lambda: disk_write(folder / 'disk.bin', nbytes))))
    times['copy'].append(timed(lambda: memory_copy(tensors, buffers)))
    times['torch_save'].append(timed(on_rank_0(lambda: (
        torch.save(state_dicts(net), folder / 'plain.pt'), fsync_tree(folder / 'plain.pt')))))

    def save_state():
        net.accelerator.save_state(str(folder / 'save_state'))
        barrier()  # every rank's files are written
        if rank() == 0:
            fsync_tree(folder / 'save_state')
    times['save_state'].append(timed(save_state))
    times['dcp_save'].append(timed(
        lambda: dcp.save(state_dicts(net), checkpoint_id=str(folder / 'dcp'))))
    for key in DCP_ASYNC:
        if key in times:
            flushed()
            blocked, total = dcp_async(net, folder / key, stagers.get(key), group)
            times[key].append(blocked)
            times[key + '_total'].append(total)
    barrier()
    if rank() == 0:
        shutil.rmtree(folder)


def run_ours(net, checkpoints, times):
    for key in ('durable_1', 'durable_2', 'fast'):
        new_epoch(net)
        times[key].append(timed(lambda: checkpoints[key].save_model(net)))
        # the retired folder is removed in the background while training
        # goes on; it must not slow down the next measurement
        retirement = timed(lambda: checkpoints[key].wait_for_saves(net))
        if key != 'fast':
            times['retire' + key[len('durable'):]].append(retirement)
    new_epoch(net)
    cp = checkpoints['async']
    blocked = timed(lambda: cp.save_model(net))
    start = time.perf_counter()
    cp.wait_for_saves(net)
    times['async'].append(blocked)
    times['async_total'].append(blocked + time.perf_counter() - start)


# ---------------------------------------------------------------- processes

def run_sizes(sizes, repeats, root):
    """This rank's samples of every size: ``[{size, nbytes, times}]``."""
    results = []
    for size in sizes:
        times, nbytes = bench_size(size, repeats, root)
        gc.collect()  # the net and its copies, held in cycles, before the next size
        results.append({'size': size, 'nbytes': nbytes, 'times': times})
        if rank() == 0:
            print(f"{dist.get_world_size() if dist.is_initialized() else 1} "
                  f"process(es): size {size:g} done", file=sys.stderr, flush=True)
    return results


def worker(out, sizes, repeats, root):
    """One rank of the 2-process run: its samples, and the world it saw."""
    results = run_sizes(sizes, repeats, root)
    Path(out, f'rank-{rank()}.json').write_text(json.dumps(
        {'world_size': dist.get_world_size(), 'backend': dist.get_backend(),
         'results': results}))
    # leaving gloo's threads to the interpreter's exit sometimes aborts the process
    barrier()
    dist.destroy_process_group()


def launched(sizes, repeats, root, nproc, timeout):
    """The run in ``nproc`` processes: the world size the ranks saw, and
    every size's samples, each the slowest rank's."""
    from launcher import launch
    out = Path(root) / f'peers-{nproc}'
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    launch(Path(__file__).resolve(), '--worker', out, ','.join(map(repr, sizes)), repeats,
           root, nproc=nproc, timeout=timeout).check()
    ranks = [json.loads((out / f'rank-{r}.json').read_text()) for r in range(nproc)]
    shutil.rmtree(out)
    worlds = {(r['world_size'], r['backend']) for r in ranks}
    if worlds != {(nproc, 'gloo')}:
        raise RuntimeError(f"the launched run saw {worlds}, not {nproc} gloo processes")
    merged = ranks[0]['results']
    for i, result in enumerate(merged):
        for key in list(result['times']):
            result['times'][key] = [max(values) for values in zip(
                *(r['results'][i]['times'][key] for r in ranks), strict=True)]
    return ranks[0]['world_size'], merged


# ---------------------------------------------------------------- report

def spread(times):
    return {key: (min(v), statistics.median(v), max(v)) for key, v in times.items()}


RATIOS = (
    ('ours durable / DCP save', 'durable_1', ('dcp_save',)),
    ('ours durable / disk', 'durable_1', ('disk',)),
    ('ours durable keep_last=2 / DCP save', 'durable_2', ('dcp_save',)),
    ('ours async blocked / DCP async blocked (fastest)', 'async', DCP_ASYNC),
    ('ours async blocked / memory copy', 'async', ('copy',)),
)


def ratio_rows(result):
    stats = spread(result['times'])
    rows = []
    for label, ours_key, peers in RATIOS:
        peers = [p for p in peers if p in stats]
        peer = min(peers, key=lambda p: stats[p][1])
        rows.append([f"{result['size'] / 1e6:g}M", label + (f" ({peer})" if len(peers) > 1 else ''),
                     f"{stats[ours_key][1] / stats[peer][1]:.2f}",
                     f"{stats[ours_key][0] / stats[peer][0]:.2f}"])
    return rows


def report(runs, repeats, root):
    out = [f"Machine: {machine()}; disk: {disk_of(root)}; torch {torch.__version__}, "
           f"{torch.get_num_threads()} threads in the one-process run (1 per rank in 2); "
           f"{repeats} repeats; ms. CUDA: {torch.cuda.is_available()}."]
    for world_size, results in runs:
        where = ('one process, no process group' if world_size == 1 else
                 f'{world_size} processes (DDP, gloo; the world size the ranks saw), '
                 'the slower rank')
        rows, ratios = [], []
        for result in results:
            size = f"{result['size'] / 1e6:g}M"
            for key, (low, mid, high) in spread(result['times']).items():
                rows.append([size, f"{result['nbytes'] / 2 ** 20:.0f}", LABELS[key],
                             ms(low), ms(mid), ms(high)])
            ratios += ratio_rows(result)
        out += ['', f'One save, {where}', '',
                table(rows, ['params', 'MiB', 'variant', 'min', 'median', 'max']),
                '', f'Ratios, {where}', '',
                table(ratios, ['params', 'ratio', 'of medians', 'of mins'])]
    return '\n'.join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--sizes', default='25e6,50e6,100e6')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--nproc', default='1,2', help='process counts, e.g. 1,2')
    parser.add_argument('--quick', action='store_true', help='sizes 1e6,2e6, 2 repeats')
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'bench-peers'))
    parser.add_argument('--timeout', type=float, default=3600,
                        help='seconds the launched run may take')
    parser.add_argument('--worker', nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        out, sizes, repeats, root = args.worker
        worker(out, [float(s) for s in sizes.split(',')], int(repeats), root)
        return
    if args.quick:
        args.sizes, args.repeats = '1e6,2e6', 2
    sizes = [float(s) for s in args.sizes.split(',')]
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    runs = []
    for nproc in (int(n) for n in args.nproc.split(',')):
        runs.append((1, run_sizes(sizes, args.repeats, root)) if nproc == 1 else
                    launched(sizes, args.repeats, root, nproc, args.timeout))
    print(report(runs, args.repeats, root))


if __name__ == '__main__':
    main()
