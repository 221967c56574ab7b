"""What a preempted user waits for: the relaunch, from ``fit`` to the first
trained step, ours beside the peers' resumes of the same state.

usage: python benchmarks/bench_resume.py [--sizes 25e6,50e6,100e6]
       [--repeats 5] [--nproc 1,2] [--caches cold,warm] [--remote] [--quick]
       [--dir runs/bench-resume]

On the nets of ``bench_checkpoint.py`` (stacks of 1024x1024 linear layers,
Adam, so the optimizer holds two tensors per parameter), trained one epoch
of two batches per rank with a checkpoint after every step; the peers save
the state of the epoch's end, and a second run stopped after its first
step leaves a checkpoint inside the epoch. Then every variant is a
relaunch in processes of its own (``nproc`` of them, launched as
``torchrun`` would: ``tests/support/launcher.py``): the same script's ``net.fit``,
timed to the first training batch, in a rotated order (round ``r`` starts
with the ``r``-th variant, so each variant comes in every position across
the rounds):

- nothing to resume: what skorch and accelerate cost before any step
  (``initialize``, the accelerator's ``prepare``, the loader);
- ours: ``AccelerateLoadInitState``, from the checkpoint at the epoch's end
  and from the one inside it (the checksums of every file verified on the
  way, as always); its load is the time in its hooks (the page cache is
  filled with the checkpoint's files before them, while the net
  initializes: the relaunch's time holds that); and from the one at
  the epoch's end with the optimizers' files read after the check, not
  while it runs (``engine/_read_ahead.py`` turned off: the load before it);
  and from it without the page cache filled with its files while the net
  initializes (``engine/_prefetch.py`` turned off: the relaunch before it);
  in several processes, from it with the ranks that wait for rank 0's
  choice reading the optimizers' files only once it reached them, not
  while rank 0 checks the checkpoint (the load before that);
- the peers, each loading in a callback when training begins, as skorch's
  ``LoadInitState`` does: torch DCP (``get_state_dict``, ``load``,
  ``set_state_dict``, its documented resume), ``torch.load(weights_only=True)``
  + ``load_state_dict``, and ``accelerator.load_state``;
- the disk: every file of our checkpoint read into a buffer, the floor of
  any load of those bytes; and read into memory allocated for it in the
  timing (one tensor a file), the floor of a load that creates what it
  loads, as the optimizer's state is created (its pages are faulted in
  and zeroed by the kernel as they are written).

``cold``: the page cache dropped right before ``fit`` (``echo 3 >
/proc/sys/vm/drop_caches``, which needs root; without it only ``warm``
runs, and the report says so). ``warm``: every file of the variant read
once before. In 2 processes (DDP on gloo) a figure is the slower rank's.
Printed: min, median and max (ms) of the relaunch and of the load within
it, and the ratios of medians and of mins, taken within the same run.

``--remote``: the relaunch on a new machine whose checkpoints are in a
bucket, instead of the above (``bucket`` in the report). The script starts
a local S3 server (moto's, in a process of its own, its objects in
``/dev/shm``, as ``bench_remote.py``); the runs that prepare save into it
(ours through ``dirname='s3://...'``; accelerate's ``save_state`` folder
put there with s3fs; DCP through its ``FsspecWriter``). Each relaunch
starts with an empty local staging folder, and the variants are:

- nothing to resume, with ``dirname`` an empty prefix of the bucket;
- ours, at an epoch's end and inside an epoch: the resume downloads the
  checkpoint (one process a node), checks it and loads it;
- the download alone: s3fs's ``get`` of our checkpoint's folder (one
  process a node), the floor of any resume of those bytes;
- s3fs's ``get`` of accelerate's folder, then ``accelerator.load_state``;
- DCP's documented resume from the bucket, its ``FsspecReader`` reading
  through s3fs. moto reads a whole object for each ranged GET (its reads
  go through s3fs's read-ahead blocks), which a real store does not.
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from bench_checkpoint import (
    REPO,
    WIDTH,
    disk_of,
    folder_bytes,
    machine,
    make_net,
    ms,
    quiet_fit,
    table,
)
from bench_peers import barrier, rank
from bench_remote import BUCKET, CREDENTIALS, S3_OPTIONS, start_server_process
from skorch.callbacks import Callback
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState

LABELS = {
    'fresh': 'nothing to resume',
    'ours_end': 'ours, resumed at an epoch end',
    'ours_mid': 'ours, resumed inside an epoch',
    'ours_serial': 'ours at an epoch end, optimizers not read ahead',
    'ours_unfilled': 'ours at an epoch end, page cache not filled',
    'ours_late': 'ours at an epoch end, waiting ranks read after the choice',
    'dcp': 'DCP get_state_dict + load + set_state_dict',
    'torch': 'torch.load(weights_only=True) + load_state_dict',
    'load_state': 'accelerator.load_state',
    'disk': 'disk: every file of our checkpoint read',
    'disk_fresh': 'disk: every file read into new memory',
}
# (label, ours, peer, measure): the relaunch or the load alone
RATIOS = (
    ('load: ours at an epoch end / DCP', 'ours_end', 'dcp', 'load'),
    ('load: ours inside an epoch / DCP', 'ours_mid', 'dcp', 'load'),
    ('load: ours at an epoch end / disk read', 'ours_end', 'disk', 'load'),
    ('load: ours inside an epoch / disk read', 'ours_mid', 'disk', 'load'),
    ('load: ours at an epoch end / read into new memory', 'ours_end', 'disk_fresh', 'load'),
    ('load: ours at an epoch end / accelerator.load_state', 'ours_end', 'load_state', 'load'),
    ('load: ours at an epoch end / optimizers not read ahead', 'ours_end', 'ours_serial',
     'load'),
    ('load: ours at an epoch end / waiting ranks read after the choice', 'ours_end',
     'ours_late', 'load'),
    ('relaunch: ours at an epoch end / page cache not filled', 'ours_end', 'ours_unfilled',
     'fit'),
    ('relaunch: ours at an epoch end / DCP', 'ours_end', 'dcp', 'fit'),
    ('relaunch: ours at an epoch end / nothing to resume', 'ours_end', 'fresh', 'fit'),
    ('relaunch: ours at an epoch end / disk read', 'ours_end', 'disk', 'fit'),
    ('relaunch: ours at an epoch end / read into new memory', 'ours_end', 'disk_fresh', 'fit'),
)
REMOTE_LABELS = {
    'fresh': 'nothing to resume',
    'ours_end': 'ours from the bucket, resumed at an epoch end',
    'ours_mid': 'ours from the bucket, resumed inside an epoch',
    'download': "s3fs get of our checkpoint's folder",
    'load_state': "s3fs get of accelerate's folder + accelerator.load_state",
    'dcp': 'DCP get_state_dict + load (FsspecReader) + set_state_dict',
}
REMOTE_RATIOS = (
    ('load: ours at an epoch end / s3fs get', 'ours_end', 'download', 'load'),
    ('load: ours inside an epoch / s3fs get', 'ours_mid', 'download', 'load'),
    ('load: ours at an epoch end / s3fs get + load_state', 'ours_end', 'load_state', 'load'),
    ('load: ours at an epoch end / DCP', 'ours_end', 'dcp', 'load'),
    ('relaunch: ours at an epoch end / s3fs get + load_state', 'ours_end', 'load_state',
     'fit'),
    ('relaunch: ours at an epoch end / DCP', 'ours_end', 'dcp', 'fit'),
    ('relaunch: ours at an epoch end / nothing to resume', 'ours_end', 'fresh', 'fit'),
)
MEASURES = ('fit', 'load')
# variants that differ from ours_end only where a rank waits for another's choice
SEVERAL_PROCESSES_ONLY = ('ours_late',)
# one epoch of two batches of 8 rows on every rank
BATCHES_PER_RANK = 2
BATCH_ROWS = 8


# ---------------------------------------------------------------- processes

def launched_world_size():
    """The world size the launch gave (the process group starts later, with
    the net's Accelerator)."""
    return int(os.environ.get('WORLD_SIZE', 1))


def rows(world_size):
    gen = torch.Generator().manual_seed(0)
    n = BATCHES_PER_RANK * BATCH_ROWS * world_size
    return (torch.randn(n, WIDTH, generator=gen).numpy(),
            torch.randn(n, WIDTH, generator=gen).numpy())


def drop_page_cache():
    barrier()
    if rank() == 0:
        os.sync()
        Path('/proc/sys/vm/drop_caches').write_text('3\n')
    barrier()


def can_drop_page_cache():
    return os.access('/proc/sys/vm/drop_caches', os.W_OK)


def files_of(folder):
    return [folder] if folder.is_file() else sorted(
        f for f in folder.rglob('*') if f.is_file())


def read_files(folder, buffer):
    """Every file under ``folder`` read into ``buffer`` (reused): the bytes read."""
    view = memoryview(buffer)
    total = 0
    for file in files_of(folder):
        with open(file, 'rb', buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def read_into_new_memory(folder):
    """Every file under ``folder`` read into a tensor of its size,
    allocated here: the tensors."""
    tensors = []
    for file in files_of(folder):
        tensor = torch.empty(file.stat().st_size, dtype=torch.uint8)
        view = memoryview(tensor.numpy())
        with open(file, 'rb', buffering=0) as f:
            done = 0
            while done < len(view) and (n := f.readinto(view[done:])):
                done += n
        tensors.append(tensor)
    return tensors


def warm(folder):
    if folder.exists():
        read_files(folder, bytearray(64 << 20))


def checkpoint(dirname, staging=None):
    """Ours, as every run of the benchmark has it: a save after every step;
    ``staging``: the local folder of a ``dirname`` in the bucket."""
    return AccelerateCheckpoint(dirname=str(dirname), every_n_steps=1, keep_last=10,
                                local_dir=staging and str(staging),
                                storage_options=S3_OPTIONS if staging else None)


def bucket_url(root):
    """Where the runs of ``root`` keep their checkpoints in the bucket."""
    return f's3://{BUCKET}/{root.name}'


def s3():
    """s3fs's client of the local server (the environment names it)."""
    import s3fs
    return s3fs.S3FileSystem(skip_instance_cache=True, **S3_OPTIONS)


def last_saved(net):
    return dict(net.callbacks_)['AccelerateCheckpoint'].last_saved_


def state_dicts(net):
    return {'model': net.accelerator.unwrap_model(net.module_).state_dict(),
            'optimizer': net.optimizer_.state_dict()}


# ---------------------------------------------------------------- the workers

class StopBeforeSecondStep(Callback):
    """Ends the fit when its second training batch begins: the checkpoint of
    the first is committed by then (the checkpoint callback's hook runs after
    this one's in a batch), a checkpoint inside the epoch."""

    # ends a run, trains nothing: not part of the recorded settings
    unrecorded_params = True

    def initialize(self):
        self.batches_ = 0
        return self

    def on_batch_begin(self, net, training=False, **kwargs):
        if training:
            self.batches_ += 1
            if self.batches_ == 2:
                raise StopBeforeSecondStep.Stopped

    class Stopped(Exception):
        pass


def prepare(root, size, where):
    """Train one epoch into ``ours`` and have the peers save the state of its
    end; train again into ``ours-mid``, stopped after the first step. Rank 0
    writes the names of the two checkpoints and the size of the first to
    ``root/names.json``. ``where``: ``local`` (folders under ``root``) or
    ``bucket`` (the same in the bucket, nothing left under ``root``)."""
    world_size = launched_world_size()
    url = bucket_url(root) if where == 'bucket' else None

    def ours(name):
        return checkpoint(f'{url}/{name}', root / f'staging-{name}') if url else \
            checkpoint(root / name)

    net = make_net(size, max_epochs=1, callbacks=[ours('ours')])
    quiet_fit(net, rows(world_size))
    net.accelerator.save_state(str(root / 'load_state'))
    model_state, optimizer_state = get_state_dict(
        net.accelerator.unwrap_model(net.module_), net.optimizer_)
    state = {'model': model_state, 'optimizer': optimizer_state}
    if url:
        dcp.save(state, storage_writer=FsspecWriter(f'{url}/dcp', **S3_OPTIONS))
    else:
        dcp.save(state, checkpoint_id=str(root / 'dcp'))
    if rank() == 0 and not url:
        torch.save(state_dicts(net), root / 'torch.pt')
    stopped = make_net(size, max_epochs=1, callbacks=[ours('ours-mid'), StopBeforeSecondStep()])
    try:
        quiet_fit(stopped, rows(world_size))
    except StopBeforeSecondStep.Stopped:
        # the fit ended without its end: its upload waited for here
        cp = dict(stopped.callbacks_)['AccelerateCheckpoint']
        cp.wait_for_saves(stopped)
        cp.close()
    if rank() == 0:
        end, mid = (root / 'ours' / last_saved(net), root / 'ours-mid' / last_saved(stopped))
        names = {'ours_end': str(end), 'ours_mid': str(mid), 'nbytes': folder_bytes(end)}
        if url:
            names.update(ours_end=end.name, ours_mid=mid.name,
                         nbytes=folder_bytes(root / 'staging-ours' / end.name))
            s3().put(str(root / 'load_state'), f'{url[len("s3://"):]}/load_state',
                     recursive=True)
        (root / 'names.json').write_text(json.dumps(names))
    barrier()
    if rank() == 0 and url:
        # a relaunch on a new machine finds nothing of these here
        for name in ('load_state', 'staging-ours', 'staging-ours-mid'):
            shutil.rmtree(root / name)
    os.sync()


class FirstStep(Callback):
    """When the first training batch begins: writes the seconds since
    ``started[0]`` and those the load spent (``load.seconds_``), and ends the
    process there, so the checkpoints stay as they were for the next round."""

    # measures, trains nothing: not part of the recorded settings
    unrecorded_params = True

    def __init__(self, started, load, out):
        self.started = started
        self.load = load
        self.out = out

    def on_batch_begin(self, net, training=False, **kwargs):
        if training:
            elapsed = time.perf_counter() - self.started[0]
            Path(self.out).write_text(json.dumps({
                'fit': elapsed, 'load': sum(getattr(self.load, 'seconds_', [0.0])),
                'world_size': net.accelerator.num_processes}))
            # its lease in the bucket released for the next relaunch
            dict(net.callbacks_)['AccelerateCheckpoint'].close()
            barrier()
            os._exit(0)


class TimedLoadInitState(AccelerateLoadInitState):
    """Ours, its hooks timed: what the resume costs inside the fit."""

    def initialize(self):
        super().initialize()
        self.seconds_ = []
        return self

    def on_train_begin(self, net, X=None, y=None, **kwargs):
        with self._timed():
            super().on_train_begin(net, X=X, y=y, **kwargs)

    def on_epoch_begin(self, net, dataset_train=None, **kwargs):
        with self._timed():
            super().on_epoch_begin(net, dataset_train=dataset_train, **kwargs)

    @contextlib.contextmanager
    def _timed(self):
        start = time.perf_counter()
        yield
        self.seconds_.append(time.perf_counter() - start)


class PeerLoad(Callback):
    """A peer's resume: its load of the state when training begins, into
    the net that ``initialize`` built and the accelerator prepared, as
    skorch's ``LoadInitState`` loads."""

    unrecorded_params = True

    def __init__(self, variant, path, staging=None):
        self.variant = variant
        self.path = path
        self.staging = staging

    def initialize(self):
        self.seconds_ = []
        # the floor's buffer exists before the timing; the peers allocate their tensors
        self.buffer_ = bytearray(64 << 20) if self.variant == 'disk' else None
        # so does s3fs's client: what is timed is the download
        self.s3_ = s3() if str(self.path).startswith('s3://') else None
        return self

    def on_train_begin(self, net, **kwargs):
        start = time.perf_counter()
        if self.s3_ is not None:
            load_remote_peer(self.variant, net, self.path, Path(self.staging), self.s3_)
        else:
            load_peer(self.variant, net, Path(self.path), self.buffer_)
        self.seconds_.append(time.perf_counter() - start)


def run_variant(variant, root, size, cache, out):
    """One relaunch of ``variant``: ``fit`` to the first training batch in
    this process; each rank writes its seconds (the whole and the load's)
    and the world size it saw to ``out/rank-R.json``."""
    world_size = launched_world_size()
    names = json.loads((root / 'names.json').read_text())
    if cache == 'bucket':
        cp, load = remote_variant(variant, root, names)
        files = None
    else:
        cp, load, files = local_variant(variant, root, names)
    started = [0.0]
    clock = FirstStep(started, load, Path(out) / f"rank-{os.environ.get('RANK', 0)}.json")
    net = make_net(size, max_epochs=2, callbacks=[cp, *([load] if load else []), clock])
    before_timing(cache, files)
    started[0] = time.perf_counter()
    quiet_fit(net, rows(world_size))
    raise RuntimeError(f"{variant}: the fit reached no training batch")


def remote_variant(variant, root, names):
    """The checkpoint callback and the load of ``variant`` relaunched on a
    new machine, its checkpoints in the bucket."""
    url = bucket_url(root)
    # empty at every relaunch: the driver removes it after each
    staging = root / 'staging-run'
    if variant in ('ours_end', 'ours_mid'):
        cp = checkpoint(f"{url}/{'ours' if variant == 'ours_end' else 'ours-mid'}", staging)
        return cp, TimedLoadInitState(cp, resume=names[variant])
    cp = checkpoint(f'{url}/fresh', staging)
    if variant == 'fresh':
        return cp, None
    source = f"{url}/ours/{names['ours_end']}" if variant == 'download' else f'{url}/{variant}'
    return cp, PeerLoad(variant, source, staging / 'peer')


def local_variant(variant, root, names):
    """The checkpoint callback, the load and the files of ``variant``."""
    files = {'fresh': None, 'ours_end': names['ours_end'], 'ours_mid': names['ours_mid'],
             'ours_serial': names['ours_end'], 'ours_unfilled': names['ours_end'],
             'ours_late': names['ours_end'],
             'dcp': root / 'dcp', 'torch': root / 'torch.pt',
             'load_state': root / 'load_state', 'disk': names['ours_end'],
             'disk_fresh': names['ours_end']}[variant]
    files = files and Path(files)
    cp = checkpoint(files.parent if variant.startswith('ours') else root / 'fresh')
    if variant == 'ours_serial':
        # internals: the read ahead turned off in this process
        from skorch_accel_callbacks.engine import _read_ahead
        _read_ahead.OptimizerReadAhead.begin = lambda self, folder: None
    if variant == 'ours_unfilled':
        # internals: no page cache fill while the net initializes
        from skorch_accel_callbacks.callbacks import load_state
        load_state.fills_on_this_process = lambda: False
    if variant == 'ours_late':
        # internals: a rank that waits for the choice reads nothing meanwhile
        from skorch_accel_callbacks.engine import _restore
        _restore._read_expected_choice = lambda *args: None
    if variant.startswith('ours'):
        load = TimedLoadInitState(cp, resume=str(files))
    elif variant != 'fresh':
        load = PeerLoad(variant, files)
    else:
        load = None
    return cp, load, files


def before_timing(cache, files):
    if cache == 'cold':
        drop_page_cache()
    elif cache == 'bucket':
        os.sync()  # no relaunch pays for the writeback of the one before
    elif files is not None:
        warm(files)
    barrier()


def load_peer(variant, net, path, buffer):
    model = net.accelerator.unwrap_model(net.module_)
    if variant == 'dcp':
        # DCP's recipe: state dicts whose optimizer state exists (get_state_dict
        # creates it), loaded in place, then set into the model and optimizer
        model_state, optimizer_state = get_state_dict(model, net.optimizer_)
        state = {'model': model_state, 'optimizer': optimizer_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, net.optimizer_, model_state_dict=state['model'],
                       optim_state_dict=state['optimizer'])
    elif variant == 'torch':
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state['model'])
        net.optimizer_.load_state_dict(state['optimizer'])
    elif variant == 'load_state':
        net.accelerator.load_state(str(path))
    elif variant == 'disk_fresh':
        read_into_new_memory(path)
    else:
        read_files(path, buffer)


def load_remote_peer(variant, net, url, target, fs):
    """A peer's resume from the bucket into the empty folder ``target``:
    the download (one process a node, with the s3fs client ``fs``) and,
    after it, the load."""
    if variant == 'dcp':
        model = net.accelerator.unwrap_model(net.module_)
        model_state, optimizer_state = get_state_dict(model, net.optimizer_)
        state = {'model': model_state, 'optimizer': optimizer_state}
        dcp.load(state, storage_reader=FsspecReader(url, **S3_OPTIONS))
        set_state_dict(model, net.optimizer_, model_state_dict=state['model'],
                       optim_state_dict=state['optimizer'])
        return
    if os.environ.get('LOCAL_RANK', '0') == '0':
        fs.get(url[len('s3://'):], str(target), recursive=True)
    barrier()
    if variant == 'load_state':
        net.accelerator.load_state(str(target))


def worker(args):
    kind, root, size, *rest = args
    root, size = Path(root), float(size)
    if kind == 'prepare':
        prepare(root, size, *rest)
    else:
        run_variant(kind, root, size, *rest)
    barrier()
    if dist.is_initialized():
        # leaving gloo's threads to the interpreter's exit sometimes aborts the process
        dist.destroy_process_group()


# ---------------------------------------------------------------- the driver

def bench(size, nproc, caches, repeats, root, timeout):
    """Every variant ``repeats`` times in each page cache state (or from
    the bucket: ``caches == ['bucket']``), a process (``nproc`` ranks) each:
    ``({(cache, variant, measure): [seconds]}, checkpoint bytes)``, the
    measures ``'fit'`` (to the first step) and ``'load'``, each the slower
    rank's."""
    from launcher import launch
    remote = caches == ['bucket']
    root = Path(root) / f"{nproc}-processes-{size:g}{'-bucket' if remote else ''}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    script = Path(__file__).resolve()
    launch(script, '--worker', 'prepare', root, size, 'bucket' if remote else 'local',
           nproc=nproc, timeout=timeout).check()
    nbytes = json.loads((root / 'names.json').read_text())['nbytes']
    variants = [v for v in (REMOTE_LABELS if remote else LABELS)
                if nproc > 1 or v not in SEVERAL_PROCESSES_ONLY]
    times = {(cache, v, m): [] for cache in caches for v in variants for m in MEASURES}
    for round_ in range(repeats):
        shift = round_ % len(variants)
        for cache in caches:
            for variant in variants[shift:] + variants[:shift]:
                out = root / 'out'
                out.mkdir()
                launch(script, '--worker', variant, root, size, cache, out,
                       nproc=nproc, timeout=timeout).check()
                seen = [json.loads((out / f'rank-{r}.json').read_text()) for r in range(nproc)]
                worlds = {r['world_size'] for r in seen}
                if worlds != {nproc}:
                    raise RuntimeError(f"{variant} ran in {worlds} processes, not {nproc}")
                for measure in MEASURES:
                    times[cache, variant, measure].append(max(r[measure] for r in seen))
                shutil.rmtree(out)
                shutil.rmtree(root / 'fresh', ignore_errors=True)
                shutil.rmtree(root / 'staging-run', ignore_errors=True)
    shutil.rmtree(root)
    if remote:
        s3().rm(bucket_url(root)[len('s3://'):], recursive=True)
    return times, nbytes


# ---------------------------------------------------------------- report

def spread(values):
    return min(values), statistics.median(values), max(values)


def ratio_rows(size, cache, times):
    """Ours over each peer, of medians and of mins, taken within one run."""
    rows = []
    for label, ours_key, peer_key, measure in REMOTE_RATIOS if cache == 'bucket' else RATIOS:
        if (cache, peer_key, measure) not in times:  # a variant of several processes
            continue
        ours = spread(times[cache, ours_key, measure])
        peer = spread(times[cache, peer_key, measure])
        rows.append([f"{size / 1e6:g}M", cache, label, ms(ours[1]), ms(peer[1]),
                     f"{ours[1] / peer[1]:.2f}", f"{ours[0] / peer[0]:.2f}"])
    return rows


def report(runs, args, root, caches, cold_refused):
    out = [f"Machine: {machine()}; disk: {disk_of(root)}; torch {torch.__version__}; "
           f"{args.repeats} rounds, a process per variant and round, rotated order; "
           f"1 thread per rank; ms. "
           + ("From a bucket of a local S3 server (moto), each relaunch a new machine's"
              if caches == ['bucket'] else f"Page cache: {', '.join(caches)}")
           + (' (cold needs root: /proc/sys/vm/drop_caches)' if cold_refused else '')
           + f". CUDA: {torch.cuda.is_available()}."]
    for nproc, results in runs:
        where = ('one process' if nproc == 1 else
                 f'{nproc} processes (DDP, gloo; the world size the ranks saw), the slower rank')
        rows, ratios = [], []
        for size, times, nbytes in results:
            for cache in caches:
                for variant, label in (REMOTE_LABELS if cache == 'bucket' else LABELS).items():
                    if (cache, variant, 'fit') not in times:
                        continue
                    row = [f"{size / 1e6:g}M", f"{nbytes / 2 ** 20:.0f}", cache, label]
                    for measure in MEASURES:
                        if variant == 'fresh' and measure == 'load':
                            row += ['-'] * 3
                        else:
                            row += [ms(x) for x in spread(times[cache, variant, measure])]
                    rows.append(row)
                ratios += ratio_rows(size, cache, times)
        out += ['', f'A relaunch: fit to the first step, and the load within it; {where}', '',
                table(rows, ['params', 'MiB', 'cache', 'variant', 'fit min', 'fit median',
                             'fit max', 'load min', 'load median', 'load max']),
                '', f'Ratios, {where}', '',
                table(ratios, ['params', 'cache', 'ratio', 'ours (median)',
                               'peer (median)', 'of medians', 'of mins'])]
    return '\n'.join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--sizes', default='25e6,50e6,100e6')
    parser.add_argument('--repeats', type=int, help='rounds (default 5; 2 with --quick)')
    parser.add_argument('--nproc', default='1,2', help='process counts, e.g. 1,2')
    parser.add_argument('--caches', default='cold,warm',
                        help='page cache states: cold (needs root), warm')
    parser.add_argument('--remote', action='store_true',
                        help='relaunches from a bucket of a local S3 server, not a folder')
    parser.add_argument('--quick', action='store_true', help='size 1e6, 2 rounds by default')
    parser.add_argument('--dir', default=str(REPO / 'runs' / 'bench-resume'))
    parser.add_argument('--timeout', type=float, default=600,
                        help='seconds one launched run may take')
    parser.add_argument('--worker', nargs='+', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.quick:
        args.sizes = '1e6'
    args.repeats = args.repeats or (2 if args.quick else 5)
    caches = ['bucket'] if args.remote else args.caches.split(',')
    cold_refused = 'cold' in caches and not can_drop_page_cache()
    if cold_refused:
        caches.remove('cold')
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if args.remote:
            server, endpoint = start_server_process()
            stack.callback(server.wait, timeout=60)
            stack.callback(server.stdin.close)
            # the ranks' way to the server: the environment they inherit
            os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
            s3().mkdir(BUCKET)
        runs = []
        for nproc in (int(n) for n in args.nproc.split(',')):
            results = []
            for size in (float(s) for s in args.sizes.split(',')):
                results.append((size, *bench(size, nproc, caches, args.repeats, root,
                                             args.timeout)))
                print(f"{nproc} process(es): size {size:g} done", file=sys.stderr, flush=True)
            runs.append((nproc, results))
    print(report(runs, args, root, caches, cold_refused))


if __name__ == '__main__':
    main()
