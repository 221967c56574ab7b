"""FSDP2 through skorch: training, checkpoints and resumes, in 2 real
processes on CPU (the FSDP back-end forced by tests/workers/fsdp_backend.py,
``fully_shard`` with gloo)."""

import json
import os
import shutil

import numpy as np
import pytest
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from common import make_accelerator, make_data, make_net
from contract_fuzz import check_batch, run_launched
from launcher import free_port, launch
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    CheckpointError,
    CorruptCheckpointError,
)
from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.format import PARTIAL_SUFFIX, read_manifest
from skorch_accel_callbacks.state import _fsdp_layout as fsdp_layout, shard_layout
from testutil import assert_identical, edit_manifest, final_state, read_json, read_results

# a hang in a collective fails the launch in seconds
SHORT_COLLECTIVES = {'COLLECTIVE_TIMEOUT': '30'}
# 4 optimizer steps an epoch in 2 processes: the checkpoint after step 10
# is inside epoch 3, after its batch 2; the kill comes as batch 3 begins
MID_EPOCH = {'EVERY_N_STEPS': '2', 'KILL': '3:3'}
MID_EPOCH_CHECKPOINT = 'epoch-0002-step-00000010'
# a torchrun of one process: one member of a process group of its own
ONE_PROCESS = {'WORLD_SIZE': '1', 'RANK': '0', 'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '1',
               'MASTER_ADDR': '127.0.0.1'}


@pytest.mark.slow
def test_fsdp2_trains_predicts_and_fits_again_as_ddp(runs):
    """The module and optimizer are prepared together and sharded; fit,
    predict on every rank, a warm partial_fit and a second fit give the
    losses and predictions of the same net under DDP; a criterion with
    parameters (a second model for FSDP2) is refused at initialize."""
    results = read_results(runs[1], 'train', 2)
    for result in results:
        assert result['fsdp2']['num_processes'] == result['ddp']['num_processes'] == 2
        assert result['fsdp2']['sharded'] and not result['ddp']['sharded']
        for step in ('fit', 'partial_fit', 'second_fit'):
            fsdp2, ddp = result['fsdp2'][step], result['ddp'][step]
            np.testing.assert_allclose(fsdp2['losses'], ddp['losses'], rtol=1e-5)
            np.testing.assert_allclose(fsdp2['proba'], ddp['proba'], atol=1e-6)
        assert len(result['fsdp2']['partial_fit']['losses']) == 4
        assert len(result['fsdp2']['second_fit']['losses']) == 2
        assert result['refused']['trained_criterion'].startswith(
            'under FSDP2 the net must have exactly one module with trainable parameters '
            'and one optimizer')
        assert "criteria with trainable parameters ['criterion']" in \
            result['refused']['trained_criterion']
    # each rank's losses are those of its share of the data; the
    # predictions are gathered from every rank
    for step in ('fit', 'partial_fit', 'second_fit'):
        assert results[0]['fsdp2'][step]['proba'] == results[1]['fsdp2'][step]['proba']


# ---------------------------------------------------------------- refused back-ends

@pytest.fixture
def accelerator():
    """A real accelerator of this process, whose state a test may set to
    another back-end (restored afterwards)."""
    accelerator = make_accelerator()
    state = accelerator.state
    saved = state.distributed_type, getattr(state, 'fsdp_plugin', None)
    yield accelerator
    state.distributed_type, state.fsdp_plugin = saved


def refusal(accelerator, tmp_path, kind, plugin=None, net_kwargs=None, **cp_kwargs):
    """What AccelerateCheckpoint refuses when training begins on a net
    (with ``net_kwargs``) prepared as usual whose accelerator then reports
    ``kind``."""
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), **cp_kwargs)
    net = make_net(accelerator, callbacks=[cp], max_epochs=1,
                   **(net_kwargs or {})).initialize()
    accelerator.state.distributed_type = kind
    accelerator.state.fsdp_plugin = plugin
    with pytest.raises(ValueError) as info:
        net.partial_fit(*make_data(n=64))
    assert len(net.history) == 0 and list(tmp_path.iterdir()) == []
    return str(info.value)


def test_fsdp1_is_refused_naming_fsdp2_and_why(accelerator, tmp_path):
    message = refusal(accelerator, tmp_path, DistributedType.FSDP,
                      FullyShardedDataParallelPlugin(fsdp_version=1))
    assert message.startswith(
        "AccelerateCheckpoint does not support accelerate's FSDP back-end "
        "(FullyShardedDataParallelPlugin) other than FSDP2 (fsdp_version=1, or no plugin): "
        "its full state dict (gathered with offload_to_cpu=True) crashed rank 0")
    assert message.endswith(
        "for a model that does not fit one device, FSDP2: "
        "FullyShardedDataParallelPlugin(fsdp_version=2)")


def test_deepspeed_is_refused_naming_fsdp2(accelerator, tmp_path):
    message = refusal(accelerator, tmp_path, DistributedType.DEEPSPEED)
    assert message.startswith(
        "AccelerateCheckpoint does not support accelerate's DEEPSPEED back-end "
        "(DeepSpeedPlugin): its engine partitions the model and optimizer")
    assert message.endswith("FSDP2: FullyShardedDataParallelPlugin(fsdp_version=2)")


def test_async_save_under_fsdp2_is_refused_when_training_begins(accelerator, tmp_path):
    """The sharded save is collectives of every rank: it cannot run on the
    background writer's thread; the synchronous save is what FSDP2 gets."""
    message = refusal(accelerator, tmp_path, DistributedType.FSDP,
                      FullyShardedDataParallelPlugin(fsdp_version=2), async_save=True)
    assert message.startswith(
        "AccelerateCheckpoint(async_save=True) cannot save in the background under FSDP2")
    assert message.endswith("use async_save=False")
    accelerate_io.check_plain_state(accelerator, 'AccelerateCheckpoint')


def test_compiled_modules_under_fsdp2_are_refused_when_training_begins(accelerator, tmp_path):
    message = refusal(accelerator, tmp_path, DistributedType.FSDP,
                      FullyShardedDataParallelPlugin(fsdp_version=2),
                      net_kwargs={'compile': True})
    assert message.startswith(
        "AccelerateCheckpoint does not checkpoint FSDP2 with compiled modules (compile=True)")


def test_resume_under_fsdp1_is_refused_naming_fsdp2(accelerator, tmp_path):
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    net = make_net(accelerator, callbacks=[AccelerateLoadInitState(cp), cp],
                   max_epochs=1).initialize()
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=1)
    with pytest.raises(ValueError, match=(
            r"^AccelerateLoadInitState does not support accelerate's FSDP back-end "
            r"\(FullyShardedDataParallelPlugin\) other than FSDP2")):
        net.partial_fit(*make_data(n=64))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- checkpoints

def launch_runs(script, results, runs, nproc=2, expect_ok=True):
    """Launch ``script`` (fsdp_train.py or fsdp_resume.py) to run the
    trainings ``runs`` of fsdp_resume.py one after the other; with
    ``expect_ok=False`` every rank must die of SIGKILL, with None fail."""
    env = dict(SHORT_COLLECTIVES, RESULT_DIR=str(results), RUNS=json.dumps(runs))
    if nproc == 1:
        env.update(ONE_PROCESS, MASTER_PORT=str(free_port()))
    result = launch(script, nproc=nproc, timeout=300, env=env)
    if expect_ok:
        result.check()
    elif expect_ok is None:
        # one rank killed, the other failed or killed in turn
        assert not result.timed_out and all(rc != 0 for rc in result.returncodes), \
            result.report()
    else:
        assert result.returncodes == [-9] * nproc, result.report()


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """One launch checks the training and trains uninterrupted (full state
    dicts, a checkpoint at each epoch's end); one is killed inside epoch 3,
    after a sharded checkpoint there; one resumes it, then resumes the
    uninterrupted run's checkpoint of epoch 2; one resumes the killed run's
    checkpoint in 1 process. The root folder and the results' folder."""
    root = tmp_path_factory.mktemp('fsdp')
    results = root / 'results'
    results.mkdir()
    launch_runs('fsdp_train.py', results, [
        {'dirname': str(root / 'full'), 'tag': 'straight', 'state_dict': 'FULL_STATE_DICT'}])
    launch_runs('fsdp_resume.py', results, [
        {'dirname': str(root / 'ck'), 'tag': 'killed', 'every_n_steps': 2, 'kill': [3, 3]}],
        expect_ok=False)
    launch_runs('fsdp_resume.py', results, [
        {'dirname': str(root / 'cut'), 'tag': 'cut', 'every_n_steps': 2,
         'kill_in_save': [MID_EPOCH_CHECKPOINT, 1]}], expect_ok=None)
    shutil.copytree(root / 'ck', root / 'ck-for-one')
    launch_runs('fsdp_resume.py', results, [
        {'dirname': str(root / 'ck'), 'tag': 'resumed', 'every_n_steps': 2},
        {'dirname': str(root / 'cut'), 'tag': 'cut-resumed', 'every_n_steps': 2},
        {'dirname': str(root / 'full-again'), 'tag': 'full-resumed',
         'state_dict': 'FULL_STATE_DICT', 'resume': str(root / 'full' / 'epoch-0002')}])
    launch_runs('fsdp_resume.py', results, [
        {'dirname': str(root / 'ck-for-one'), 'tag': 'one', 'every_n_steps': 2,
         'reseed': True}], nproc=1)
    return root, results


def assert_same_model_and_optimizer(a, b):
    assert_identical(dict(a, history=[]), dict(b, history=[]))


@pytest.mark.slow
def test_sharded_checkpoint_killed_inside_an_epoch_resumes_bit_identically(runs):
    _, results = runs
    for tag in ('straight', 'resumed'):
        assert [r['num_processes'] for r in read_results(results, tag, 2)] == [2, 2]
    # the kill fired where the test wants it, on every rank
    assert [read_json(results / f'killed-killed-rank{r}.json') for r in (0, 1)] == \
        [{'epoch': 3, 'batch': 3}] * 2
    resumed = read_results(results, 'resumed', 2)
    assert [r['loaded_from'] for r in resumed] == [MID_EPOCH_CHECKPOINT] * 2
    assert_identical(final_state(results, 'straight'), final_state(results, 'resumed'))
    assert resumed[0]['history'] == read_results(results, 'straight', 2)[0]['history']


@pytest.mark.slow
def test_a_kill_once_one_ranks_shards_are_written_resumes_from_the_checkpoint_before(runs):
    """Rank 1 dies after writing its shards of the checkpoint inside epoch
    3, before the commit: that partial checkpoint is not resumed from, the
    one of epoch 2 is, and the run ends bit-identical."""
    root, results = runs
    cut = read_json(results / 'cut-killed-in-save-rank1.json')
    assert cut['folder'] == MID_EPOCH_CHECKPOINT + PARTIAL_SUFFIX
    # the kill came after this rank's shards were written
    assert {'pytorch_model_fsdp_0/__1_0.distcp', 'optimizer_0/__1_0.distcp'} <= \
        set(cut['written'])
    assert not (root / 'cut' / cut['folder']).exists()
    resumed = read_results(results, 'cut-resumed', 2)
    assert [r['num_processes'] for r in resumed] == [2, 2]
    assert [r['loaded_from'] for r in resumed] == ['epoch-0002'] * 2
    assert_identical(final_state(results, 'straight'), final_state(results, 'cut-resumed'))


@pytest.mark.slow
def test_sharded_checkpoint_lists_every_ranks_shards_and_their_layout(runs):
    folder = runs[0] / 'ck-for-one' / MID_EPOCH_CHECKPOINT
    manifest = read_manifest(folder)
    assert manifest['world_size'] == 2
    names = ['.metadata', '__0_0.distcp', '__1_0.distcp']
    settings = ['dampening', 'differentiable', 'foreach', 'fused', 'initial_lr', 'lr',
                'maximize', 'momentum', 'nesterov', 'weight_decay']
    assert manifest['fsdp'] == {
        'fsdp_version': 2, 'state_dict_type': 'SHARDED_STATE_DICT',
        'shard_files': {'pytorch_model_fsdp_0': names, 'optimizer_0': names},
        'param_group_keys': [[settings]]}
    for shards in ('pytorch_model_fsdp_0', 'optimizer_0'):
        # the layout is what the ranks wrote, each file listed with its checksum
        assert sorted(os.listdir(folder / shards)) == names
        listed = {f'{shards}/{name}' for name in names}
        assert listed <= set(manifest['files']) and listed <= set(manifest['checksums'])
    for name in ('random_states_0.pkl', 'random_states_1.pkl'):
        assert name in manifest['files']


@pytest.mark.slow
def test_sharded_checkpoint_resumes_resharded_on_one_process(runs):
    """The model and optimizer loaded on 1 process from the shards of 2 are
    those that the resume in 2 processes loaded (which then trained on bit
    for bit as the uninterrupted run); the random states and the data order
    are derived anew, as the warning says."""
    _, results = runs
    [one] = read_results(results, 'one', 1)
    assert one['num_processes'] == 1
    assert one['loaded_from'] == MID_EPOCH_CHECKPOINT
    assert_same_model_and_optimizer(final_state(results, 'one-resumed')[0],
                                    final_state(results, 'resumed-resumed')[0])
    [warning] = [w for w in one['warnings'] if 'was written by 2 processes' in w]
    assert 'the model, optimizer, schedulers, history and callbacks are resumed exactly' \
        in warning
    assert one['history'][-1]['epoch'] == 3


@pytest.mark.slow
def test_full_state_dict_checkpoint_resumes_at_an_epoch_end_bit_identically(runs):
    root, results = runs
    resumed = read_results(results, 'full-resumed', 2)
    assert [r['num_processes'] for r in resumed] == [2, 2]
    assert [r['loaded_from'] for r in resumed] == ['epoch-0002'] * 2
    assert_identical(final_state(results, 'straight'), final_state(results, 'full-resumed'))
    manifest = read_manifest(root / 'full' / 'epoch-0002')
    assert manifest['fsdp']['state_dict_type'] == 'FULL_STATE_DICT'
    assert manifest['fsdp']['shard_files'] == {}
    assert {'pytorch_model_fsdp.bin', 'optimizer.bin'} <= set(manifest['files'])


def fsdp2_net(accelerator, state_dict_type):
    """A net whose accelerator now reports FSDP2 with ``state_dict_type``."""
    net = make_net(accelerator)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type=state_dict_type)
    return net


@pytest.mark.slow
def test_shards_missing_from_the_manifest_or_damaged_are_named(runs, accelerator, tmp_path):
    folder = shutil.copytree(runs[0] / 'ck-for-one' / MID_EPOCH_CHECKPOINT,
                             tmp_path / MID_EPOCH_CHECKPOINT)
    fsdp2_net(accelerator, 'SHARDED_STATE_DICT')
    fsdp_layout.check_shards(read_manifest(folder), shard_layout(accelerator), str(folder))
    shard = 'optimizer_0/__1_0.distcp'
    with open(folder / shard, 'r+b') as f:
        f.truncate(100)
    with pytest.raises(CorruptCheckpointError, match=f"{folder / shard} has 100 bytes"):
        read_manifest(folder)
    edit_manifest(folder, lambda manifest: manifest['files'].pop(shard))
    with pytest.raises(CorruptCheckpointError, match=(
            f"^{folder / shard} is missing: the manifest of {folder} does not list it "
            "among the shards of optimizer_0$")):
        fsdp_layout.check_shards(read_json(folder / 'manifest.json'), shard_layout(accelerator),
                                 str(folder))


@pytest.mark.slow
def test_another_layout_than_the_checkpoints_is_refused(runs, accelerator):
    sharded_folder = str(runs[0] / 'ck-for-one' / MID_EPOCH_CHECKPOINT)
    full_folder = str(runs[0] / 'full' / 'epoch-0002')
    for folder, saved, make in (
            (sharded_folder, 'with FSDP2 and state_dict_type=SHARDED_STATE_DICT',
             make_net),
            (full_folder, 'with FSDP2 and state_dict_type=FULL_STATE_DICT',
             lambda accelerator: fsdp2_net(accelerator, 'SHARDED_STATE_DICT'))):
        make(accelerator)
        loads = shard_layout(accelerator)
        now = ('without FSDP2' if loads is None
               else f"with FSDP2 and state_dict_type={loads['state_dict_type']}")
        with pytest.raises(CheckpointError, match=(
                f"^{folder} was saved {saved}, this run loads {now}: resume it with the "
                "accelerator")):
            fsdp_layout.check_shards(read_manifest(folder), loads, folder)


# a sharded checkpoint of a net whose lin.bias skorch's Freezer froze from
# epoch 1 (SGD with momentum: it never gets a momentum buffer), preempted
# by a SIGTERM after training batch 10 (inside epoch 2 of 3, 6 an epoch;
# without every_n_steps its save comes at that epoch's end)
FROZEN = {
    'nproc': 2, 'backend': 'fsdp2', 'rows': 96, 'hidden': 8, 'batchnorm': False,
    'dropout': 0.0, 'lr': 0.05, 'momentum': 0.9, 'batch_size': 8, 'max_epochs': 3,
    'valid': False, 'script': 'fit',
    'callbacks': [{'kind': 'freezer', 'name': None, 'params': {'patterns': 'lin.bias'}}],
    'saves': {'every_n_epochs': 1, 'every_n_steps': None, 'async_save': False,
              'keep_last': 2},
    'interrupt': {'kind': 'sigterm', 'batch': 10, 'who': 'all'},
    'change': {'kind': 'none'},
}


@pytest.mark.slow
def test_a_net_with_frozen_parameters_resumes_exactly(tmp_path):
    """torch.distributed.checkpoint's load of the optimizer's shards is
    planned after the fresh optimizer's state: a frozen parameter, which
    has none in the checkpoint, was asked for its momentum buffer
    (``Missing key in checkpoint state_dict``); it resumes without one,
    bit-identical to the uninterrupted run on both ranks."""
    results, launches = run_launched([FROZEN], tmp_path)
    result = results[0]
    assert [o['num_processes'] for o in result['reference']] == [2, 2]
    # the SIGTERM fired on both ranks; training stopped at the end of epoch
    # 2, whose checkpoint is resumed
    assert [o['status'] for o in result['first']['outcomes']] == ['preempted'] * 2
    assert result['facts']['committed'][-1] == 'epoch-0002'
    check_batch([FROZEN], results, launches)
    # the bias was frozen, the weight trained: the gathered optimizer
    # states (rank 0) compared above differ in what they hold
    state = result['relaunch'][0]['state']['optimizer']['state']
    assert 'lin.weight' in state and 'lin.bias' not in state
