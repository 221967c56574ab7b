"""The benchmarks run, so that they cannot rot: ``bench_peers.py --quick``
(its small sizes, 2 repeats) in one process and in 2, as ``make bench`` runs
it; ``bench_resume.py`` (from a folder and from a bucket),
``bench_positions.py`` and ``bench_frozen.py`` on small nets."""

import os
import re
import subprocess
import sys

import pytest

from launcher import REPO

BENCHMARKS = REPO / 'benchmarks'
# the quick run took 2 min 10 s on 2 loaded cores
TIMEOUT = 600
# the variants every size reports in both runs (DCP's BlockingAsyncStager needs CUDA)
VARIANTS = ('disk: one file written + fsync', 'memory copy into buffers allocated before',
            'torch.save of the state dicts + fsync',
            'accelerator.save_state + fsync of its files', 'DCP save',
            'DCP async_save, blocked', 'DCP async_save, DefaultStager kept, blocked',
            'DCP async_save, DefaultStager async staging, blocked',
            'ours durable, keep_last=1', 'ours durable, keep_last=2',
            'ours durable=False, keep_last=1', 'ours async_save=True, blocked',
            'ours async_save=True, until committed')
RATIOS = ('ours durable / DCP save', 'ours durable / disk',
          'ours async blocked / DCP async blocked', 'ours async blocked / memory copy')


def sections(text, titles=('One save,', 'Ratios,')):
    """Title -> the rows of the table below it (lists of cells), of the
    tables whose titles begin with one of ``titles``."""
    found, title = {}, None
    for line in text.splitlines():
        if line.startswith(titles):
            title = line
            found[title] = []
        elif title and line and not line.startswith(('=', 'params')):
            found[title].append(re.split(r'\s{2,}', line.strip()))
    return found


def run_benchmark(script, *args, timeout=TIMEOUT):
    """The output of ``benchmarks/<script>`` run with ``args`` against this
    checkout's package, which must exit 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.fixture(scope='module')
def quick_peers(tmp_path_factory):
    return sections(run_benchmark('bench_peers.py', '--quick', '--dir',
                                  tmp_path_factory.mktemp('bench'), '--timeout', TIMEOUT))


@pytest.mark.slow
@pytest.mark.parametrize('where', ['one process, no process group',
                                   '2 processes (DDP, gloo; the world size the ranks saw), '
                                   'the slower rank'])
def test_bench_peers_quick_reports_every_variant_and_ratio(quick_peers, where):
    rows = quick_peers[f'One save, {where}']
    for size in ('1M', '2M'):
        seen = {row[2]: row[3:] for row in rows if row[0] == size}
        assert set(VARIANTS) <= set(seen), (size, sorted(seen))
        for variant, cells in seen.items():
            low, mid, high = map(float, cells)
            assert 0 < low <= mid <= high, (size, variant, cells)
        ratios = [row[1] for row in quick_peers[f'Ratios, {where}'] if row[0] == size]
        assert all(any(r.startswith(name) for r in ratios) for name in RATIOS), ratios


@pytest.mark.slow
def test_bench_peers_2_process_run_had_2_processes(quick_peers):
    # the title's count is the world size the launched ranks reported (the
    # script also refuses a run whose ranks disagree or are not on gloo)
    launched = [title for title in quick_peers if 'processes' in title]
    assert launched and all(title.split(', ', 1)[1].startswith('2 processes ')
                            for title in launched), launched


# the relaunch benchmark's variants and ratios, in both runs
RESUME_VARIANTS = ('nothing to resume', 'ours, resumed at an epoch end',
                   'ours, resumed inside an epoch',
                   'ours at an epoch end, optimizers not read ahead',
                   'ours at an epoch end, page cache not filled',
                   'DCP get_state_dict + load + set_state_dict',
                   'torch.load(weights_only=True) + load_state_dict', 'accelerator.load_state',
                   'disk: every file of our checkpoint read',
                   'disk: every file read into new memory')
RESUME_RATIOS = ('load: ours at an epoch end / DCP', 'load: ours inside an epoch / DCP',
                 'load: ours at an epoch end / disk read',
                 'load: ours at an epoch end / read into new memory',
                 'relaunch: ours at an epoch end / DCP',
                 'load: ours at an epoch end / optimizers not read ahead',
                 'relaunch: ours at an epoch end / page cache not filled',
                 'relaunch: ours at an epoch end / disk read',
                 'relaunch: ours at an epoch end / read into new memory')
# where ranks wait for rank 0's choice of the checkpoint
SEVERAL_PROCESSES_VARIANTS = ('ours at an epoch end, waiting ranks read after the choice',)
SEVERAL_PROCESSES_RATIOS = ('load: ours at an epoch end / waiting ranks read after the choice',)


def check_relaunch_row(row):
    """A row of the relaunch benchmark's table: min <= median <= max of the
    relaunch and of the load, the load within the relaunch."""
    fit = list(map(float, row[4:7]))
    assert 0 < fit[0] <= fit[1] <= fit[2], row
    if row[3] != 'nothing to resume':
        load = list(map(float, row[7:10]))
        # the load is part of the relaunch it was timed in
        assert 0 < load[0] <= load[1] <= load[2] and load[0] < fit[0], row


# a relaunch per variant, page cache state and process count: 3 min 40 s
# of one round on 2 loaded cores, which make test cannot spare
@pytest.mark.slow
@pytest.mark.extended
def test_bench_resume_quick_reports_every_variant_in_1_and_2_processes(tmp_path):
    output = run_benchmark('bench_resume.py', '--quick', '--repeats', 1, '--dir', tmp_path,
                           '--timeout', TIMEOUT, timeout=2 * TIMEOUT)
    found = sections(output, ('A relaunch:', 'Ratios,'))
    caches = {'warm', 'cold'} if os.access('/proc/sys/vm/drop_caches', os.W_OK) else {'warm'}
    # the titles' count is the world size the launched ranks reported (the
    # script refuses a run whose ranks saw another)
    wheres = ('one process', '2 processes (DDP, gloo; the world size the ranks saw), '
              'the slower rank')
    for nproc, where in enumerate(wheres, start=1):
        variants = RESUME_VARIANTS + (SEVERAL_PROCESSES_VARIANTS if nproc > 1 else ())
        expected_ratios = RESUME_RATIOS + (SEVERAL_PROCESSES_RATIOS if nproc > 1 else ())
        rows = found[f'A relaunch: fit to the first step, and the load within it; {where}']
        assert {(row[2], row[3]) for row in rows} == {
            (cache, variant) for cache in caches for variant in variants}, rows
        for row in rows:
            check_relaunch_row(row)
        ratios = {(row[1], row[2]) for row in found[f'Ratios, {where}']}
        assert {(cache, ratio) for cache in caches for ratio in expected_ratios} <= ratios


REMOTE_RESUME_VARIANTS = ('nothing to resume', 'ours from the bucket, resumed at an epoch end',
                          'ours from the bucket, resumed inside an epoch',
                          "s3fs get of our checkpoint's folder",
                          "s3fs get of accelerate's folder + accelerator.load_state",
                          'DCP get_state_dict + load (FsspecReader) + set_state_dict')
REMOTE_RESUME_RATIOS = ('load: ours at an epoch end / s3fs get',
                        'load: ours inside an epoch / s3fs get',
                        'load: ours at an epoch end / s3fs get + load_state',
                        'load: ours at an epoch end / DCP',
                        'relaunch: ours at an epoch end / s3fs get + load_state',
                        'relaunch: ours at an epoch end / DCP',
                        'relaunch: ours at an epoch end / nothing to resume')


# the same from a bucket of the local S3 server the script starts: about
# 1.5 min of one round on 2 cores
@pytest.mark.slow
@pytest.mark.extended
def test_bench_resume_remote_quick_reports_every_variant_in_1_and_2_processes(tmp_path):
    output = run_benchmark('bench_resume.py', '--remote', '--quick', '--repeats', 1,
                           '--dir', tmp_path, '--timeout', TIMEOUT, timeout=2 * TIMEOUT)
    found = sections(output, ('A relaunch:', 'Ratios,'))
    wheres = ('one process', '2 processes (DDP, gloo; the world size the ranks saw), '
              'the slower rank')
    for where in wheres:
        rows = found[f'A relaunch: fit to the first step, and the load within it; {where}']
        assert sorted((row[2], row[3]) for row in rows) == sorted(
            ('bucket', variant) for variant in REMOTE_RESUME_VARIANTS), rows
        for row in rows:
            check_relaunch_row(row)
        assert sorted((row[1], row[2]) for row in found[f'Ratios, {where}']) == sorted(
            ('bucket', ratio) for ratio in REMOTE_RESUME_RATIOS)
    # nothing of the runs is left behind: each relaunch's staging folder
    # (a new machine's) and the prepared folders are removed
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob('*'))[:20]


# the positional benchmark: every position of each timed save in the three
# protocols in one process and in one launch of 2, on a small net (one round
# of 2 before-saves x 5 timed saves: about 2.5 min on 2 loaded cores, which
# make test cannot spare)
POSITION_BEFORE = ('idle', 'dcp_async')
POSITION_RATIOS = ('ours durable, keep_last=1 / DCP save',
                   'ours durable, keep_last=1 / disk: one file written + fsync',
                   'ours async_save=True, blocked / DCP async_save, DefaultStager kept, blocked')


@pytest.mark.slow
@pytest.mark.extended
def test_bench_positions_reports_every_position_in_every_protocol(tmp_path):
    output = run_benchmark('bench_positions.py', '--size', '2e6', '--repeats', 1,
                           '--where', 'turn,same,fresh', '--before', ','.join(POSITION_BEFORE),
                           '--nproc', '1,2', '--dir', tmp_path, timeout=2 * TIMEOUT)
    # the tables' rows without their header rows
    found = {title: [row for row in rows if row[0] != 'processes']
             for title, rows in sections(output, ('Each save', 'Ratios,')).items()}
    [rows] = [rows for title, rows in found.items() if title.startswith('Each save')]
    # in 2 processes the launch's ranks take every pair in turn
    wheres = {('1', 'one long process'), ('1', 'same process'), ('1', 'a process apart'),
              ('2', 'one long process')}
    befores = {'nothing (os.sync)', 'DCP async_save'}
    assert len(rows) == len(wheres) * len(befores) * 5, rows
    assert {(row[0], row[1]) for row in rows} == wheres
    assert {row[2] for row in rows} == befores
    for row in rows:
        low, mid, high = map(float, row[4:7])
        assert 0 < low <= mid <= high, row
        own, device = float(row[8]), float(row[9])
        if 'blocked' not in row[3]:
            # a durable save's bytes reach the device while it is timed (a
            # peer's checkpoint is about the size of ours)
            assert device >= 0.9 * own > 0, row
    [ratios] = [rows for title, rows in found.items() if title.startswith('Ratios,')]
    assert {(row[0], row[1], row[2], row[3]) for row in ratios} == {
        (*where, before, ratio) for where in wheres for before in befores
        for ratio in POSITION_RATIOS}, ratios


# the frozen-base benchmark on a small net: 4 layers, 3 of them frozen
FROZEN_NETS = ('75.0% frozen, Adam', '75.0% frozen after the step, Adam', '75.0% frozen, SGD',
               '0.0% frozen, Adam')
FROZEN_VARIANTS = ('ours durable (frozen parts linked while unchanged)',
                   'ours durable, reuse_frozen=False', 'DCP save',
                   'disk: one file of our full size + fsync')


@pytest.mark.slow
@pytest.mark.extended
def test_bench_frozen_reports_every_net_and_what_each_save_wrote(tmp_path):
    output = run_benchmark('bench_frozen.py', '--size', '4e6', '--frozen', '0.75',
                           '--repeats', 2, '--dir', tmp_path)
    rows = [row for row in output.splitlines() if row.startswith(FROZEN_NETS)]
    saves = {(cells[0], cells[1]): cells[2:]
             for cells in (re.split(r'\s{2,}', row.strip()) for row in rows)
             if cells[1] in FROZEN_VARIANTS}
    assert set(saves) == {(net, variant) for net in FROZEN_NETS
                          for variant in FROZEN_VARIANTS}, output
    for cells in saves.values():
        low, mid, high = map(float, cells[:3])
        assert 0 < low <= mid <= high, cells
    ours, whole = FROZEN_VARIANTS[:2]
    written = {key: float(cells[3]) for key, cells in saves.items()}
    # the trained layer and its two Adam moments, whether the other layers
    # were frozen before the step or after it (the optimizer's state of
    # them linked, not written); a quarter of the full save after the step
    assert written[FROZEN_NETS[0], ours] == written[FROZEN_NETS[1], ours] > 0
    assert written[FROZEN_NETS[1], whole] == pytest.approx(
        4 * written[FROZEN_NETS[1], ours], rel=0.02)
    # SGD holds no state: the trained layer alone, a quarter of the weights
    assert written[FROZEN_NETS[2], whole] == pytest.approx(
        4 * written[FROZEN_NETS[2], ours], rel=0.02)
    assert written[FROZEN_NETS[3], ours] == written[FROZEN_NETS[3], whole]
