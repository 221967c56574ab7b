"""AccelerateCheckpoint's commit protocol, options and errors.

Single-process behaviour is checked in this process (cheap); the commit
protocol under a kill, failures on one rank and multi-node layouts with real
launches.
"""

import json

import pytest
from accelerate.utils import ProjectConfiguration
from sklearn.base import clone
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback

from checkpointed import fit
from common import MLP, make_accelerator, make_data, make_net
from resume_runs import run
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState, CheckpointError
from skorch_accel_callbacks.format._manifest import SHARED_STATES_FORMAT
from testutil import assert_identical, edit_manifest, final_state, read_results

# ---------------------------------------------------------------- in process

def test_no_checkpoint_starts_fresh(tmp_path):
    net, cp, load = fit(tmp_path / 'ck')
    assert load.loaded_from_ is None
    assert len(net.history) == 3
    assert cp.committed() == ['epoch-0002', 'epoch-0003']
    assert json.loads((tmp_path / 'ck' / 'latest.json').read_text()) == {'name': 'epoch-0003'}


def test_manifest_describes_the_checkpoint(tmp_path):
    fit(tmp_path / 'ck', max_epochs=1)
    folder = tmp_path / 'ck' / 'epoch-0001'
    manifest = json.loads((folder / 'manifest.json').read_text())
    assert manifest['format_version'] == SHARED_STATES_FORMAT and manifest['world_size'] == 1
    assert manifest['models'] == [['module', {
        'lin.weight': [32, 20], 'lin.bias': [32], 'out.weight': [2, 32], 'out.bias': [2]}]]
    assert manifest['optimizers'] == [['SGD', [4]]]
    assert manifest['data']['X']['shape'] == [160, 20]
    assert not manifest['stopped_early']
    on_disk = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != 'manifest.json'}
    assert manifest['files'] == on_disk
    assert {'model.safetensors', 'optimizer.bin', 'random_states_0.pkl', 'history.json',
            'callbacks.json', 'callbacks.safetensors',
            'loader_state_0.safetensors'} <= set(on_disk)
    assert set(manifest['versions']) == {'torch', 'accelerate', 'skorch', 'skorch-accel-callbacks'}
    assert manifest['bytes'] == sum(on_disk.values())
    assert manifest['save_seconds'] > 0 and isinstance(manifest['saved_at'], str)


def test_resume_continues_to_max_epochs(tmp_path):
    fit(tmp_path / 'ck', max_epochs=2)
    net, _, load = fit(tmp_path / 'ck', max_epochs=5)
    assert load.loaded_from_.endswith('epoch-0002')
    assert len(net.history) == 5 and net.max_epochs == 5
    assert [row['epoch'] for row in net.history] == [1, 2, 3, 4, 5]


class SeeMaxEpochs(Callback):
    """Records net.max_epochs in each epoch; raises in epoch ``fail_at``."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def initialize(self):
        self.seen_ = []
        return self

    def on_epoch_begin(self, net, **kwargs):
        self.seen_.append(net.max_epochs)
        if len(net.history) == self.fail_at:
            raise RuntimeError('stop here')


def test_epochs_see_the_users_max_epochs_also_when_fit_raises(tmp_path):
    fit(tmp_path / 'ck', max_epochs=2)
    see = SeeMaxEpochs()
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    net = make_net(make_accelerator(), callbacks=[cp, AccelerateLoadInitState(cp), see],
                   max_epochs=5)
    net.fit(*make_data(n=160))
    assert len(net.history) == 5 and see.seen_ == [5, 5, 5]

    raising = SeeMaxEpochs(fail_at=6)
    net = make_net(make_accelerator(), callbacks=[cp, AccelerateLoadInitState(cp), raising],
                   max_epochs=8)
    with pytest.raises(RuntimeError, match='stop here'):
        net.fit(*make_data(n=160))
    # seen_ is callback state: the first three came back from the checkpoint
    assert raising.seen_ == [5, 5, 5, 8] and net.max_epochs == 8


@pytest.mark.parametrize('change, message', [
    ({'world_size': 2}, 'written by 2 processes, this run has 1'),
    ({'format_version': 99}, 'format 99'),
])
def test_incompatible_checkpoint_fails_before_training(tmp_path, change, message):
    fit(tmp_path / 'ck', max_epochs=1)
    edit_manifest(tmp_path / 'ck' / 'epoch-0001', **change)
    with pytest.raises(CheckpointError, match=message):
        fit(tmp_path / 'ck', max_epochs=3)


def test_checkpoint_of_another_model_names_the_difference(tmp_path):
    fit(tmp_path / 'ck', max_epochs=1)
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    net = make_net(make_accelerator(), callbacks=[cp, AccelerateLoadInitState(cp)],
                   module__hidden=16)
    with pytest.raises(CheckpointError, match=r"'lin.weight' has shape \(32, 20\) in the "
                                              r"checkpoint, \(16, 20\) in the net"):
        net.fit(*make_data(n=160))
    assert len(net.history) == 0  # not a single epoch began


def test_damaged_latest_is_skipped_with_a_warning(tmp_path):
    fit(tmp_path / 'ck', max_epochs=2)
    model = tmp_path / 'ck' / 'epoch-0002' / 'model.safetensors'
    model.write_bytes(model.read_bytes()[:100])
    with pytest.warns(UserWarning, match=f"skipping checkpoint .*{model}"):
        net, _, load = fit(tmp_path / 'ck', max_epochs=3)
    assert load.loaded_from_.endswith('epoch-0001')
    assert len(net.history) == 3


def test_partial_folder_is_ignored_and_cleaned(tmp_path):
    fit(tmp_path / 'ck', max_epochs=1)
    partial = tmp_path / 'ck' / 'epoch-0005.partial'
    partial.mkdir()
    (partial / 'model.safetensors').write_bytes(b'garbage')
    net, _, load = fit(tmp_path / 'ck', max_epochs=2)
    assert load.loaded_from_.endswith('epoch-0001')
    assert not partial.exists()


def test_monitor_best_and_retention(tmp_path):
    calls = []

    def every_other(net):
        calls.append(len(net.history))
        return len(net.history) in (1, 3)

    net, cp, _ = fit(tmp_path / 'ck', max_epochs=5, monitor=every_other, keep_last=1)
    assert calls == [1, 2, 3, 4, 5]
    # epoch 5, the last, is saved at its end, marked finished; epoch 3 is best
    assert list(net.history[:, 'event_acp']) == [True, False, True, False, True]
    assert cp.committed() == ['epoch-0003', 'epoch-0005']
    assert json.loads((tmp_path / 'ck' / 'best.json').read_text()) == {'name': 'epoch-0003'}
    manifest = json.loads((tmp_path / 'ck' / 'epoch-0005' / 'manifest.json').read_text())
    assert manifest['finished'] and not manifest['best']

    net, _, load = fit(tmp_path / 'ck', max_epochs=5, resume='best', monitor=every_other,
                       keep_last=1)
    assert load.loaded_from_.endswith('epoch-0003')
    assert len(net.history) == 5


def test_every_n_epochs(tmp_path):
    net, cp, _ = fit(tmp_path / 'ck', max_epochs=5, every_n_epochs=2, keep_last=5)
    # the last epoch is saved too, marked finished
    assert list(net.history[:, 'event_acp']) == [False, True, False, True, True]
    assert cp.committed() == ['epoch-0002', 'epoch-0004', 'epoch-0005']


def test_best_without_monitor_is_an_error(tmp_path):
    fit(tmp_path / 'ck', max_epochs=1)
    with pytest.raises(CheckpointError, match='no best checkpoint'):
        fit(tmp_path / 'ck', max_epochs=2, resume='best')


def test_automatic_checkpoint_naming_is_refused(tmp_path):
    accelerator = make_accelerator(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    with pytest.raises(ValueError, match='automatic_checkpoint_naming'):
        fit(tmp_path / 'ck', accelerator=accelerator)


def test_plain_net_gets_a_clear_error(tmp_path):
    cp = AccelerateCheckpoint(dirname=str(tmp_path))
    net = NeuralNetClassifier(MLP, callbacks=[cp], max_epochs=1)
    with pytest.raises(TypeError, match='needs a net with skorch.s AccelerateMixin'):
        net.fit(*make_data(n=64))


@pytest.mark.parametrize('kwargs', [
    {'every_n_epochs': 0}, {'keep_last': 0}, {'dirname': ''}, {'monitor': 3}])
def test_bad_arguments_raise_at_initialize(kwargs):
    with pytest.raises(ValueError):
        AccelerateCheckpoint(**kwargs).initialize()


def test_clone_and_set_params():
    """What a grid search does with the callbacks: clone, then set params."""
    cp = AccelerateCheckpoint(dirname='x', monitor='valid_loss_best', keep_last=3)
    load = AccelerateLoadInitState(cp, resume='best')
    cloned = clone(load)
    assert type(cloned) is AccelerateLoadInitState and cloned is not load
    assert cloned.resume == 'best'
    # the checkpoint is cloned too: an independent object with the same arguments
    assert type(cloned.checkpoint) is AccelerateCheckpoint and cloned.checkpoint is not cp
    assert cloned.checkpoint.get_params() == cp.get_params()
    assert (cloned.checkpoint.dirname, cloned.checkpoint.monitor,
            cloned.checkpoint.keep_last) == ('x', 'valid_loss_best', 3)
    # set_params, nested too, changes the attributes of the clone only
    cloned.set_params(resume='latest', checkpoint__keep_last=5, checkpoint__dirname='y')
    assert (cloned.resume, cloned.checkpoint.keep_last, cloned.checkpoint.dirname) == (
        'latest', 5, 'y')
    assert (load.resume, cp.keep_last, cp.dirname) == ('best', 3, 'x')
    assert cloned.get_params()['checkpoint__keep_last'] == 5


def test_clone_after_fit(tmp_path):
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), keep_last=3)
    load = AccelerateLoadInitState(cp)
    net = make_net(make_accelerator(), callbacks=[cp, load], max_epochs=1)
    net.fit(*make_data(n=64))
    cloned = clone(load)
    assert cloned.checkpoint.keep_last == 3 and cloned.checkpoint is not cp


def test_callback_order_does_not_matter(tmp_path):
    """Listed in the 'wrong' order, the callbacks move themselves."""
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    net = make_net(make_accelerator(), callbacks=[cp, AccelerateLoadInitState(cp)],
                   max_epochs=1)
    net.fit(*make_data(n=64))
    names = [type(cb).__name__ for _, cb in net.callbacks_]
    assert names[0] == 'AccelerateLoadInitState'
    assert names[-2:] == ['AccelerateCheckpoint', 'PrintLog']


def test_saving_warns_about_unsaveable_callback_state(tmp_path):

    class Holder(Callback):
        # observes or injects a fault, trains nothing: not recorded, may come and go
        unrecorded_params = True

        def initialize(self):
            self.thing_ = object()
            return self

    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    net = make_net(make_accelerator(), callbacks=[cp, Holder()], max_epochs=1)
    with pytest.warns(UserWarning, match="callback 'Holder': attribute 'thing_'"):
        net.fit(*make_data(n=64))


# ---------------------------------------------------------------- launches

# make test-extended: make test kills saves in 2 processes in the crash-point
# suite (tests/faults/test_crash_points.py), which checks the same after each
@pytest.mark.slow
@pytest.mark.extended
def test_kill_inside_the_save_leaves_a_partial_folder_that_is_ignored(tmp_path):
    full = run(tmp_path, 'full', dirname='full')
    killed = run(tmp_path, 'killed', expect_ok=False, KILL='save:4')
    assert killed.returncodes[0] == -9
    ckpt = tmp_path / 'ckpt'
    assert (ckpt / 'epoch-0004.partial').is_dir()
    assert json.loads((ckpt / 'latest.json').read_text()) == {'name': 'epoch-0003'}
    resumed = run(tmp_path, 'resumed')
    assert [r['num_processes'] for r in full + resumed] == [2] * 4
    assert resumed[0]['module_type'] == 'DistributedDataParallel'
    assert resumed[0]['loaded_from'].endswith('epoch-0003')
    assert not (ckpt / 'epoch-0004.partial').exists()
    assert_identical(final_state(tmp_path, 'full'), final_state(tmp_path, 'resumed'))


@pytest.mark.slow  # a launch of its own
def test_failed_save_on_one_rank_raises_on_every_rank(tmp_path):
    result = run(tmp_path, 'fail', expect_ok=False, FAIL='1:2')
    assert not result.timed_out
    assert [r['num_processes'] for r in read_results(tmp_path, 'fail-started', 2)] == [2, 2]
    assert all(rc not in (0, None) for rc in result.returncodes), result.report()
    assert 'No space left on device' in result.outputs[1]
    assert 'RankError' in result.outputs[0] and 'failed on rank 1' in result.outputs[0]
    ckpt = tmp_path / 'ckpt'
    # the save of epoch 2 never committed; epoch 1 is intact
    assert json.loads((ckpt / 'latest.json').read_text()) == {'name': 'epoch-0001'}
    assert not (ckpt / 'epoch-0002').exists()


@pytest.mark.slow
@pytest.mark.parametrize('per_node', [False, True], ids=['shared-folder', 'folder-per-node'])
def test_two_nodes(tmp_path, per_node):
    """Two node ranks on loopback (nnodes=2, one process each), as torchrun
    --nnodes 2 --nproc_per_node 1 would start them."""
    env = {'PER_NODE': '1'} if per_node else {}
    full = run(tmp_path, 'full', nproc=1, nnodes=2, dirname='full', **env)
    run(tmp_path, 'killed', nproc=1, nnodes=2, expect_ok=False, KILL='batch:4:2', **env)
    resumed = run(tmp_path, 'resumed', nproc=1, nnodes=2, **env)
    assert [r['num_processes'] for r in full + resumed] == [2] * 4
    assert all(r['loaded_from'].endswith('epoch-0003') for r in resumed)
    assert_identical(final_state(tmp_path, 'full'), final_state(tmp_path, 'resumed'))
    if per_node:
        for node in (0, 1):
            latest = tmp_path / 'ckpt' / f'node{node}' / 'epoch-0006'
            rng_files = sorted(p.name for p in latest.glob('random_states_*'))
            assert rng_files == [f'random_states_{node}.pkl']
            assert (latest / 'model.safetensors').exists()
            # each rank logs its own losses: its own history, in its node's folder
            assert sorted(p.name for p in latest.glob('history*')) == [f'history_{node}.json']
    else:
        latest = tmp_path / 'ckpt' / 'epoch-0006'
        assert sorted(p.name for p in latest.glob('random_states_*')) == [
            'random_states_0.pkl', 'random_states_1.pkl']


@pytest.mark.slow
def test_folder_per_node_is_required_with_save_on_each_node(tmp_path):
    """save_on_each_node with one shared folder: two committers would race."""
    result = run(tmp_path, 'clash', nproc=1, nnodes=2, expect_ok=False,
                 SHARED_PER_NODE='1')
    assert all(rc not in (0, None) for rc in result.returncodes), result.report()
    assert [r['num_processes'] for r in read_results(tmp_path, 'clash-started', 2)] == [2, 2]
    for out in result.outputs:
        assert 'commit into the same folder' in out
    assert not (tmp_path / 'ckpt' / 'epoch-0001').exists()
