"""Bit-exact resume after a SIGKILL, in 1 and in 2 real processes.

Each case trains 6 epochs uninterrupted, then the same command is killed
(SIGKILL on every rank) after batch 2 of epoch 4 and launched again
unchanged; both must end with identical parameters, optimizer state and
per-epoch losses.
"""

import os

import pytest
import torch
from safetensors import safe_open

from resume_runs import run
from skorch_accel_callbacks.format._manifest import FROZEN_PARTS_FORMAT
from testutil import assert_identical, final_state, read_json

CASES = [
    ('basic', 1), ('basic', 2),
    ('earlystop', 1), ('earlystop', 2),
    ('accumulate', 2), ('twomodules', 2), ('novalid', 2), ('stock', 2),
    ('frozen', 1), ('frozen', 2), ('frozenlater', 2),
]
# the basic cases stay in the quick subset (make test-quick)
QUICK = [('basic', 1), ('basic', 2)]
# make test-extended: make test accumulates gradients across a resume in 1
# and 2 processes in tests/callbacks/test_mid_epoch.py (its midepoch scenario)
EXTENDED = [('accumulate', 2)]


def case_param(case):
    scenario, nproc = case
    marks = [] if case in QUICK else [pytest.mark.slow]
    if case in EXTENDED:
        marks.append(pytest.mark.extended)
    return pytest.param(case, id=f'{scenario}-{nproc}proc', marks=marks)


@pytest.fixture(scope='module', params=[case_param(case) for case in CASES])
def case(request, tmp_path_factory):
    scenario, nproc = request.param
    folder = tmp_path_factory.mktemp(f'{scenario}{nproc}')
    full = run(folder, 'full', nproc, dirname='full', SCENARIO=scenario)
    killed = run(folder, 'killed', nproc, expect_ok=False, SCENARIO=scenario,
                 KILL='batch:4:2')
    resumed = run(folder, 'resumed', nproc, SCENARIO=scenario)
    return dict(scenario=scenario, nproc=nproc, folder=folder, full=full,
                killed=killed, resumed=resumed)


def test_runs_are_really_distributed(case):
    for res in case['full'] + case['resumed']:
        assert res['num_processes'] == case['nproc']
        module = 'FrozenBaseMLP' if case['scenario'] == 'frozen' else 'MLP'
        expected = 'DistributedDataParallel' if case['nproc'] == 2 else module
        assert res['module_type'] == expected


def test_kill_was_a_sigkill_of_every_rank(case):
    assert case['killed'].returncodes == [-9] * case['nproc']


def test_resumed_from_the_last_complete_epoch(case):
    for res in case['resumed']:
        assert res['loaded_from'].endswith('epoch-0003')


def test_every_rank_loads_the_optimizers_it_read_while_checking(case):
    """Rank 0 reads them ahead as it checks the checkpoint to choose it;
    rank 1, which waits for rank 0's choice, those of the folder rank 0
    checks first, meanwhile: each on a thread of its own, one read each,
    begun before the choice, handed to the load (a fallback to the load's
    own read would pass every other test)."""
    n_optimizers = 2 if case['scenario'] == 'twomodules' else 1
    for res in case['resumed']:
        assert res['num_processes'] == case['nproc']
        loaded_from = os.path.realpath(res['loaded_from'])
        assert [(os.path.realpath(read['folder']), read['thread'], read['while_choosing'])
                for read in res['read_ahead']] == [
                    (loaded_from, 'checkpoint-read-ahead', True)]
        assert res['loaded_read_ahead'] == [n_optimizers]
    for res in case['full']:  # nothing to resume from: nothing read
        assert res['read_ahead'] == res['loaded_read_ahead'] == []


def test_one_process_a_node_fills_the_page_cache_with_the_checkpoint_it_resumes(case):
    """While the net initializes, the first process of the node (the
    launcher's LOCAL_RANK 0) reads the checkpoint it will resume from into
    the page cache; the other reads nothing: the cache is the node's."""
    for rank, res in enumerate(case['resumed']):
        assert res['num_processes'] == case['nproc']
        loaded_from = os.path.realpath(res['loaded_from'])
        fills = [os.path.realpath(folder) for folder in res['page_cache_fills']]
        assert fills == ([loaded_from] if rank == 0 else []), rank
    for res in case['full']:  # nothing to resume from: no folder to read
        assert res['page_cache_fills'] == []


def test_resumed_run_is_bit_identical(case):
    assert_identical(final_state(case['folder'], 'full'),
                     final_state(case['folder'], 'resumed'))


def test_ranks_agree(case):
    assert len({res['digest'] for res in case['resumed']}) == 1


@pytest.mark.parametrize('case', [case_param(('earlystop', 1)), case_param(('earlystop', 2))],
                         indirect=True)
def test_early_stopping_stops_at_the_same_epoch(case):
    full = case['full'][0]['history']
    resumed = case['resumed'][0]['history']
    assert len(full) == len(resumed) < 30  # stopped early, at the same epoch


def test_registries_and_files_do_not_grow(case):
    n_models = 2 if case['scenario'] == 'twomodules' else 1
    for res in case['full'] + case['resumed']:
        assert res['registry'] == [n_models, n_models]
    ckpt = os.path.join(case['folder'], 'ckpt')
    latest = os.path.join(ckpt, case['resumed'][0]['committed'][-1])
    model_files = sorted(f for f in os.listdir(latest) if f.startswith('model'))
    expected = ['model.safetensors', 'model_1.safetensors'][:n_models]
    if case['scenario'] in ('frozen', 'frozenlater'):
        expected.append('model_frozen.safetensors')
    assert model_files == expected


@pytest.mark.parametrize('case', [case_param(('frozen', 1)), case_param(('frozen', 2))],
                         indirect=True)
def test_a_frozen_layer_is_written_once_a_process_and_linked_after(case):
    """The killed run wrote epoch 3's frozen part; the resumed one writes
    its first save's (epoch 4) again, a new process knows no earlier one,
    and links epochs 5 and 6 to it."""
    ckpt = os.path.join(case['folder'], 'ckpt')

    def part(name):
        return os.stat(os.path.join(ckpt, name, 'model_frozen.safetensors'))

    def manifest(name):
        return read_json(os.path.join(ckpt, name, 'manifest.json'))

    first = part('epoch-0003')
    assert part('epoch-0005').st_ino == part('epoch-0006').st_ino != first.st_ino
    for name in ('epoch-0005', 'epoch-0006'):
        assert manifest(name)['linked'] == {'model_frozen.safetensors': 'epoch-0004'}
    assert manifest('epoch-0003')['linked'] == {'model_frozen.safetensors': 'epoch-0001'}
    assert manifest('epoch-0006')['format_version'] == FROZEN_PARTS_FORMAT
    latest = os.path.join(ckpt, 'epoch-0006')
    with safe_open(os.path.join(latest, 'model.safetensors'), 'pt') as opened:
        rest = set(opened.keys())
    with safe_open(os.path.join(latest, 'model_frozen.safetensors'), 'pt') as opened:
        frozen = set(opened.keys())
    assert frozen and all('lin.' in key for key in frozen) and not rest & frozen


@pytest.mark.parametrize('case', [case_param(('frozenlater', 2))], indirect=True)
def test_the_optimizers_state_of_a_layer_frozen_later_is_linked_in_2_processes(case):
    """Frozen from epoch 2 on, after it trained: each process writes the
    optimizer's state of the layer (its momentum) into a file of its own at
    its first save and links it after, as the layer's weights; the resumed
    run (already compared with the full one) read them back on both ranks."""
    ckpt = os.path.join(case['folder'], 'ckpt')
    parts = {'model.safetensors': 'model_frozen.safetensors',
             'optimizer.bin': 'optimizer_frozen.bin'}

    def manifest(name):
        return read_json(os.path.join(ckpt, name, 'manifest.json'))

    assert manifest('epoch-0003')['frozen_parts'] == parts
    assert manifest('epoch-0003')['linked'] == {part: 'epoch-0002' for part in parts.values()}
    for name in ('epoch-0005', 'epoch-0006'):
        assert manifest(name)['linked'] == {part: 'epoch-0004' for part in parts.values()}
    saved = torch.load(os.path.join(ckpt, 'epoch-0006', 'optimizer_frozen.bin'),
                       weights_only=True)
    rest = torch.load(os.path.join(ckpt, 'epoch-0006', 'optimizer.bin'), weights_only=True)
    assert set(saved) == {'state'} and sorted(saved['state']) == [0, 1]
    assert sorted(rest['state']) == [2, 3]
    assert all(torch.count_nonzero(buffer['momentum_buffer']) for buffer in saved['state'].values())


def test_retention_keeps_the_last_two_and_the_one_resumed_from(case):
    committed = case['resumed'][0]['committed']
    n_epochs = len(case['full'][0]['history'])
    assert committed == ['epoch-0003', f'epoch-{n_epochs - 1:04d}', f'epoch-{n_epochs:04d}']
    visible = [name for name in os.listdir(os.path.join(case['folder'], 'full'))
               if not name.startswith('.')]  # the folder lock stays
    assert sorted(visible) == [
        f'epoch-{n_epochs - 1:04d}', f'epoch-{n_epochs:04d}', 'latest.json']


@pytest.mark.slow  # one more launch
@pytest.mark.parametrize('case', [case_param(('basic', 1)), case_param(('basic', 2))],
                         indirect=True)
def test_finished_run_trains_nothing_more(case):
    again = run(case['folder'], 'again', case['nproc'], SCENARIO='basic')
    assert again[0]['loaded_from'].endswith('epoch-0006')
    assert again[0]['max_epochs_after'] == 6
    assert_identical(final_state(case['folder'], 'full'),
                     final_state(case['folder'], 'again'))
