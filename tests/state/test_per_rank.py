"""Every rank's own history, callbacks' states and (under FSDP2) buffers:
saved per rank when they differ, once when they agree, and resumed on the
same rank (issue 28, items 1 and 2).

Under skorch's AccelerateMixin each rank logs its own losses, so ranks'
histories and the states of callbacks that read them (EarlyStopping) differ;
FSDP2 keeps BatchNorm's running statistics per rank. One launch of 2 real
processes (gloo) trains uninterrupted and resumes its checkpoints of an
epoch's end and of inside an epoch, under DDP and forced FSDP2, and trains a
run whose ranks agree, and resumes 2-process checkpoints written before the
package's restructure; one launch of 1 process resumes the 2-process
checkpoint with on_world_size_change='reseed'.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import old_version
from common import MLP, make_accelerator, make_data, make_net
from launcher import REPO, free_port, launch
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    CheckpointError,
    CorruptCheckpointError,
)
from skorch_accel_callbacks.format import HISTORY_NAME, MANIFEST_NAME, _manifest
from skorch_accel_callbacks.tools import inspection
from skorch_accel_callbacks.tools.export import export
from testutil import assert_nested_equal, cli, edit_manifest, read_json, read_results

# 256 training rows, 128 a rank in batches of 32: 4 optimizer steps an
# epoch; with every_n_steps=3 the checkpoint after step 9 is inside epoch 3
EPOCH_END = 'epoch-0002'
MID_EPOCH = 'epoch-0002-step-00000009'
RESUMED = {'epoch': EPOCH_END, 'mid': MID_EPOCH}
# kept as the 'ddp-full' training at commit f5cb08a wrote them
# (tests/data/README.rst); the test writes them anew on this machine
OLD_CHECKPOINTS = REPO / 'tests' / 'data' / 'f5cb08a-2proc'
ONE_PROCESS = {'WORLD_SIZE': '1', 'RANK': '0', 'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '1',
               'MASTER_ADDR': '127.0.0.1'}


def launch_runs(results, runs, nproc=2):
    env = {'COLLECTIVE_TIMEOUT': '30', 'RESULT_DIR': str(results), 'RUNS': json.dumps(runs)}
    if nproc == 1:
        env.update(ONE_PROCESS, MASTER_PORT=str(free_port()))
    launch('per_rank.py', nproc=nproc, timeout=420, env=env).check()


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp('per-rank')
    results = root / 'results'
    results.mkdir()
    trainings = []
    for backend in ('ddp', 'fsdp2'):
        full = str(root / backend / 'full')
        trainings.append({'dirname': full, 'tag': f'{backend}-full', 'backend': backend,
                          'every_n_steps': 3})
        for kind, name in RESUMED.items():
            trainings.append({'dirname': str(root / backend / kind), 'backend': backend,
                              'tag': f'{backend}-{kind}', 'every_n_steps': 3,
                              'resume': os.path.join(full, name)})
    # the states are encoded on the training thread, the rest written in the background
    trainings.append({'dirname': str(root / 'async'), 'tag': 'async-epoch', 'async_save': True,
                      'every_n_steps': 3, 'resume': os.path.join(root / 'ddp' / 'full', EPOCH_END)})
    trainings.append({'dirname': str(root / 'agree'), 'tag': 'agree', 'agree': True,
                      'max_epochs': 2})
    # checkpoints of these trainings that the package wrote before its
    # restructure, written here: the uninterrupted training they are
    # compared with is computed here (old_version says why)
    old = write_old_checkpoints(root / 'old-checkpoints', results)
    for kind, name in RESUMED.items():
        trainings.append({'dirname': str(root / 'old' / kind), 'tag': f'old-{kind}',
                          'every_n_steps': 3, 'resume': str(old / name)})
    launch_runs(results, trainings)
    launch_runs(results, [{'dirname': str(root / 'reseed'), 'tag': 'reseed', 'reseed': True,
                           'resume': str(root / 'ddp' / 'full' / EPOCH_END)}], nproc=1)
    return root, results


def write_old_checkpoints(out, results):
    """The 'ddp-full' training of this module as the package at
    ``old_version.COMMIT`` ran it (its own worker script), writing the
    checkpoints of :data:`OLD_CHECKPOINTS` into ``out``."""
    tree = old_version.old_tree(out.parent / 'old-tree')
    env = old_version.old_environment(tree, tree / 'tests', tree / 'tests' / 'workers')
    env.update(COLLECTIVE_TIMEOUT='30', RESULT_DIR=str(results), RUNS=json.dumps(
        [{'dirname': str(out), 'tag': 'old-version', 'backend': 'ddp', 'every_n_steps': 3}]))
    launch(tree / 'tests' / 'workers' / 'per_rank.py', nproc=2, timeout=420, env=env).check()
    # the same checkpoints as those kept, which users of that version have
    for name in RESUMED.values():
        kept = read_json(OLD_CHECKPOINTS / name / MANIFEST_NAME)
        fresh = read_json(out / name / MANIFEST_NAME)
        assert (kept['format_version'], sorted(kept['files']), kept['per_rank']) == \
            (fresh['format_version'], sorted(fresh['files']), fresh['per_rank']), name
    return out


def rank_state(results, tag, rank):
    return torch.load(results / f'{tag}-rank{rank}.pt', weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize('backend', ['ddp', 'fsdp2'])
def test_each_rank_resumes_its_own_history_and_callbacks(runs, backend):
    """Resumed at an epoch's end and inside an epoch, each rank ends with
    the history, EarlyStopping state, user callback state, parameters,
    optimizer state and buffers of the same rank of the uninterrupted run."""
    root, results = runs
    full = read_results(results, f'{backend}-full', 2)
    assert [r['num_processes'] for r in full] == [2, 2]
    # the premise: the ranks' states differ
    assert full[0]['history'] != full[1]['history']
    assert full[0]['rank_losses'] != full[1]['rank_losses']
    for kind, name in RESUMED.items():
        resumed = read_results(results, f'{backend}-{kind}', 2)
        assert [r['loaded_from'] for r in resumed] == [name, name]
        for rank in (0, 1):
            for key in ('history', 'early', 'rank_losses'):
                assert resumed[rank][key] == full[rank][key], (kind, rank, key)
            assert_nested_equal(rank_state(results, f'{backend}-{kind}', rank),
                                 rank_state(results, f'{backend}-full', rank),
                                 f"{kind} rank {rank}")
    if backend == 'ddp':
        resumed = read_results(results, 'async-epoch', 2)
        for rank in (0, 1):
            for key in ('history', 'early', 'rank_losses'):
                assert resumed[rank][key] == full[rank][key], ('async', rank, key)
            assert_nested_equal(rank_state(results, 'async-epoch', rank),
                                 rank_state(results, 'ddp-full', rank), f"async rank {rank}")
        saved = read_json(root / 'async' / 'epoch-0004' / MANIFEST_NAME)
        assert saved['per_rank'] == ['history', 'callbacks']
    for name in RESUMED.values():
        saved = read_json(root / backend / 'full' / name / MANIFEST_NAME)
        assert saved['per_rank'] == (['history', 'callbacks', 'buffers']
                                     if backend == 'fsdp2' else ['history', 'callbacks'])
        # a version that reads one history.json refuses it as newer
        assert saved['format_version'] == _manifest.PER_RANK_FORMAT > _manifest.SHARED_STATES_FORMAT
        assert {'history_0.json', 'history_1.json', 'callbacks_1.json'} <= set(saved['files'])
        assert HISTORY_NAME not in saved['files']


@pytest.mark.slow
def test_each_rank_resumes_its_own_state_from_checkpoints_of_before_the_restructure(runs):
    """2-process checkpoints of format 4, written by the package before it
    was split into subpackages, resume on each rank bit for bit as the
    uninterrupted training of now ends."""
    _, results = runs
    full = read_results(results, 'ddp-full', 2)
    for kind, name in RESUMED.items():
        resumed = read_results(results, f'old-{kind}', 2)
        assert [r['num_processes'] for r in resumed] == [2, 2]
        assert [r['loaded_from'] for r in resumed] == [name, name]
        for rank in (0, 1):
            for key in ('history', 'early', 'rank_losses'):
                assert resumed[rank][key] == full[rank][key], (kind, rank, key)
            assert_nested_equal(rank_state(results, f'old-{kind}', rank),
                                 rank_state(results, 'ddp-full', rank), f"old {kind} rank {rank}")


@pytest.mark.slow
def test_fsdp2_buffers_are_per_rank_warned_of_and_exported_from_rank_0(runs, tmp_path):
    root, results = runs
    buffers = [rank_state(results, 'fsdp2-full', rank)['buffers'] for rank in (0, 1)]
    assert not torch.equal(buffers[0]['bn.running_mean'], buffers[1]['bn.running_mean'])
    full = read_results(results, 'fsdp2-full', 2)
    warned = [w for w in full[0]['warnings'] if 'SyncBatchNorm' in w]
    assert len(warned) == 1 and "'module.bn' (BatchNorm1d)" in warned[0]
    assert not [w for w in full[1]['warnings'] if 'SyncBatchNorm' in w]
    assert not [w for w in read_results(results, 'ddp-full', 2)[0]['warnings']
                if 'SyncBatchNorm' in w]
    with pytest.warns(UserWarning, match=r"exported with rank 0's .*buffers_0\.safetensors"):
        files = export(root / 'fsdp2' / 'full', out=tmp_path / 'out', which='epoch-0004')
    exported = load_file(files['f_params'])
    for key, tensor in buffers[0].items():
        assert torch.equal(exported[key], tensor), key
    history = read_json(files['f_history'])
    final_rows = read_results(results, 'fsdp2-full', 2)[0]['history']
    assert [row['valid_loss'] for row in history] == [row['valid_loss'] for row in final_rows]


@pytest.mark.slow
def test_states_that_agree_are_stored_once_as_before(runs):
    root, results = runs
    agree = read_results(results, 'agree', 2)
    assert [r['num_processes'] for r in agree] == [2, 2]
    assert agree[0]['history'] == agree[1]['history']
    for name in ('epoch-0001', 'epoch-0002'):
        saved = read_json(root / 'agree' / name / MANIFEST_NAME)
        assert 'per_rank' not in saved and saved['format_version'] == _manifest.SHARED_STATES_FORMAT
        assert {HISTORY_NAME, _manifest.CALLBACKS_NAME,
                _manifest.CALLBACK_TENSORS_NAME} <= set(saved['files'])
        assert not [file for file in saved['files']
                    if file.startswith(('history_', 'callbacks_', 'buffers_'))]


@pytest.mark.slow
def test_reseed_to_one_process_takes_rank_0s_states_and_says_so(runs):
    root, results = runs
    reseed, = read_results(results, 'reseed', 1)
    assert reseed['num_processes'] == 1
    full = read_results(results, 'ddp-full', 2)
    # the two epochs resumed are saved rank 0's, not rank 1's
    assert reseed['history'][:2] == full[0]['history'][:2]
    said = [w for w in reseed['warnings'] if 'on_world_size_change' in w]
    assert len(said) == 1
    assert ("Its ranks' history, callbacks' states differed (each rank logs its own "
            "losses): every rank resumes saved rank 0's") in said[0]
    assert reseed['said'][0].startswith(
        f"Resumed from {root / 'ddp' / 'full' / EPOCH_END} (written by 2 processes, random "
        "states derived anew, saved rank 0's history and callbacks) after epoch 2")


@pytest.mark.slow
def test_list_and_verify_read_per_rank_checkpoints(runs):
    root, _ = runs
    folder = root / 'ddp' / 'full'
    rows = {row['name']: row for row in inspection.describe(folder)}
    assert rows[EPOCH_END]['problem'] is None
    # the score of rank 0's history
    history = read_json(folder / EPOCH_END / 'history_0.json')
    assert rows[EPOCH_END]['score'] == ('valid_loss', history[-1]['valid_loss'])
    for args in (['list', folder], ['verify', folder / EPOCH_END], ['verify', folder / MID_EPOCH]):
        out = cli(*args)
        assert out.returncode == 0, out.stdout + out.stderr


def test_one_process_keeps_the_files_of_before(tmp_path):
    """One process has one copy of everything: the files and manifest of
    before, which resume."""
    def net(max_epochs):
        cp = AccelerateCheckpoint(dirname=str(tmp_path))
        return make_net(make_accelerator(), module=MLP, max_epochs=max_epochs,
                        callbacks=[AccelerateLoadInitState(cp), cp])

    X, y = make_data(n=64)
    net(1).fit(X, y)
    saved = read_json(tmp_path / 'epoch-0001' / MANIFEST_NAME)
    assert 'per_rank' not in saved
    assert {HISTORY_NAME, _manifest.CALLBACKS_NAME} <= set(saved['files'])
    assert not [file for file in saved['files'] if file.startswith(('history_', 'callbacks_'))]
    assert len(net(2).fit(X, y).history) == 2


def test_a_missing_per_rank_file_is_refused_naming_it_and_the_rank(tmp_path):
    def net(max_epochs=2):
        cp = AccelerateCheckpoint(dirname=str(tmp_path))
        return make_net(make_accelerator(), max_epochs=max_epochs,
                        callbacks=[AccelerateLoadInitState(cp), cp])

    X, y = make_data(n=64)
    net(1).fit(X, y)
    folder = tmp_path / 'epoch-0001'
    # as a checkpoint whose ranks' histories differed, but without rank 0's copy
    edit_manifest(folder, per_rank=['history'])
    with pytest.raises(CorruptCheckpointError) as info:
        net().fit(X, y)
    assert str(info.value).startswith(
        f"{folder / 'history_0.json'} is missing: {folder} has no state for rank 0")
    assert "history per rank" in str(info.value)
    # a malformed field is a damaged manifest: the folder has no checkpoint to resume
    edit_manifest(folder, per_rank=['nonsense'])
    with pytest.warns(UserWarning, match=r"skipping checkpoint"), \
            pytest.raises(CheckpointError, match=r"has per_rank \['nonsense'\], not a list"):
        net().fit(X, y)
