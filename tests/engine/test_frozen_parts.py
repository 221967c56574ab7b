"""The frozen parameters of a model: saved in a file of their own, linked
instead of written while unchanged (issue 40, item 3); in a bucket (the
local S3 server) sent once into the store's shared folder and referenced
by every checkpoint's manifest.

Each test fits a net whose first layer is frozen (as a pretrained base is)
in one process and reads its checkpoint folder: which files are one inode
(``os.stat``), what the manifests say, and that every reader (a resume,
``verify``, ``export``, ``load_params``) sees whole models. The changes of
a frozen tensor that the check sees are made for real between two saves,
and the one it cannot see (a write through ``.data``) is shown to need
``reuse_frozen=False``.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, Freezer

from checkpointed import fit as fit_checkpointed, state
from common import MLP, FrozenBaseMLP
from skorch_accel_callbacks.engine._frozen import tensor_identity
from skorch_accel_callbacks.engine._read_ahead import OptimizerReadAhead
from skorch_accel_callbacks.format._manifest import FROZEN_PARTS_FORMAT, SHARED_STATES_FORMAT
from skorch_accel_callbacks.storage._remote import RemoteStorage
from skorch_accel_callbacks.tools.export import export
from skorch_accel_callbacks.tools.inspection import verify
from testutil import assert_identical, machine_lacks, read_json

PART = 'model_frozen.safetensors'


fit = partial(fit_checkpointed, net_kwargs={'module': FrozenBaseMLP})


def inode(folder, name, file=PART):
    return os.stat(os.path.join(folder, name, file)).st_ino


def manifest(folder, name):
    return read_json(os.path.join(folder, name, 'manifest.json'))


def assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def keys(path):
    with safe_open(path, 'pt') as opened:
        return set(opened.keys())


@pytest.mark.parametrize('async_save', [False, True])
def test_the_frozen_layer_is_written_once_and_linked_by_every_later_save(tmp_path, async_save):
    _, cp, _ = fit(tmp_path, max_epochs=3, keep_last=3, async_save=async_save)
    assert cp.committed() == ['epoch-0001', 'epoch-0002', 'epoch-0003']
    assert inode(tmp_path, 'epoch-0001') == inode(tmp_path, 'epoch-0002') \
        == inode(tmp_path, 'epoch-0003')
    assert os.stat(tmp_path / 'epoch-0001' / PART).st_nlink == 3
    first = manifest(tmp_path, 'epoch-0001')
    assert first['format_version'] == FROZEN_PARTS_FORMAT
    assert first['frozen_parts'] == {'model.safetensors': PART} and first['linked'] == {}
    for name in ('epoch-0002', 'epoch-0003'):
        later = manifest(tmp_path, name)
        assert later['linked'] == {PART: 'epoch-0001'}
        # the checksum its first save computed, listed like any file's
        assert later['checksums'][PART] == first['checksums'][PART]
        assert later['files'][PART] == first['files'][PART]
    # the trained rest is written at every save, without the frozen layer
    latest = tmp_path / 'epoch-0003'
    assert keys(latest / PART) == {'lin.weight', 'lin.bias'}
    assert keys(latest / 'model.safetensors') == {'out.weight', 'out.bias'}
    assert inode(tmp_path, 'epoch-0002', 'model.safetensors') \
        != inode(tmp_path, 'epoch-0003', 'model.safetensors')


@pytest.mark.parametrize('async_save', [False, True])
def test_a_resume_from_a_split_checkpoint_is_exact(tmp_path, async_save):
    full, _, _ = fit(tmp_path / 'full', max_epochs=4, async_save=async_save)
    fit(tmp_path / 'split', max_epochs=2, async_save=async_save)
    resumed, _, load = fit(tmp_path / 'split', max_epochs=4, async_save=async_save)
    assert load.loaded_from_.endswith('epoch-0002')
    assert_identical(state(full), state(resumed))
    assert not resumed.module_.lin.weight.requires_grad


def test_the_sink_says_how_much_of_a_save_was_linked(tmp_path):
    said = []
    fit(tmp_path, max_epochs=2, sink=said.append)
    saves = [line for line in said if line.startswith('Saved checkpoint')]
    assert 'linked' not in saves[0]
    assert re.search(r'\(2\.\d KiB of it unchanged, linked\)', saves[1]), saves[1]


def test_load_best_loads_a_split_model(tmp_path):
    trained, _, _ = fit(tmp_path, max_epochs=3, monitor='valid_loss_best', load_best=True)
    best = manifest(tmp_path, json.loads((tmp_path / 'best.json').read_text())['name'])
    assert best['frozen_parts'] == {'model.safetensors': PART}
    saved = load_file(tmp_path / best['name'] / 'model.safetensors')
    saved.update(load_file(tmp_path / best['name'] / PART))
    assert_same_tensors(trained.module_.state_dict(), saved)


def test_retention_removes_the_first_save_but_not_the_bytes_a_kept_one_links(tmp_path):
    trained, cp, _ = fit(tmp_path, max_epochs=3, keep_last=1)
    assert cp.committed() == ['epoch-0003']
    latest = tmp_path / 'epoch-0003'
    assert manifest(tmp_path, 'epoch-0003')['linked'] == {PART: 'epoch-0001'}
    assert os.stat(latest / PART).st_nlink == 1
    verdict = verify(tmp_path / 'epoch-0003')
    assert verdict.damaged == [] and 'the bytes that epoch-0001 wrote' in verdict.notes[0]
    plain = NeuralNetClassifier(MLP, criterion=torch.nn.NLLLoss).initialize()
    plain.load_params(checkpoint=cp)
    assert_same_tensors(plain.module_.state_dict(), trained.module_.state_dict())


def test_export_writes_the_whole_model(tmp_path):
    trained, _, _ = fit(tmp_path / 'ckpt', max_epochs=2)
    files = export(str(tmp_path / 'ckpt'), out=str(tmp_path / 'out'))
    exported = load_file(files['f_params'])
    assert_same_tensors(exported, trained.module_.state_dict())


def test_a_damaged_shared_file_is_reported_in_every_checkpoint_that_holds_it(tmp_path):
    fit(tmp_path, max_epochs=3, keep_last=3)
    path = tmp_path / 'epoch-0002' / PART
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # inside a tensor: the size stays, the checksum differs
    with open(path, 'r+b') as f:  # in place: the one inode the three share
        f.write(data)
    for name in ('epoch-0001', 'epoch-0002', 'epoch-0003'):
        damaged = verify(tmp_path / name).damaged
        assert len(damaged) == 1 and str(tmp_path / name / PART) in damaged[0], damaged


class Change(Callback):
    """Changes the frozen layer after epoch 1's save, before epoch 2."""

    def __init__(self, how):
        self.how = how

    def on_epoch_begin(self, net, **kwargs):
        if len(net.history) != 2:  # the row of epoch 2 is there
            return
        lin = net.module_.lin
        if self.how == 'in place':
            with torch.no_grad():
                lin.weight.mul_(0.5)
        elif self.how == 'load_state_dict':
            lin.load_state_dict({'weight': torch.ones_like(lin.weight), 'bias': lin.bias})
        elif self.how == 'init':
            torch.nn.init.zeros_(lin.bias)
        elif self.how == 'detached':
            lin.weight.detach().add_(1.0)
        elif self.how == 'new tensor':
            lin.weight.data = lin.weight.data * 2.0
        elif self.how == 'unfrozen':
            lin.requires_grad_(True)
            net.initialize_optimizer()
        elif self.how == 'through .data':
            lin.weight.data.add_(1.0)
        else:
            raise ValueError(self.how)


SEEN = ['in place', 'load_state_dict', 'init', 'detached', 'new tensor']


@pytest.mark.parametrize('how', SEEN)
def test_a_change_the_check_sees_writes_the_part_again(tmp_path, how):
    trained, _, _ = fit(tmp_path, Change(how), max_epochs=2, keep_last=2)
    assert inode(tmp_path, 'epoch-0001') != inode(tmp_path, 'epoch-0002')
    assert manifest(tmp_path, 'epoch-0002')['linked'] == {}
    saved = load_file(tmp_path / 'epoch-0002' / PART)
    assert_same_tensors(saved, {key: value for key, value in trained.module_.state_dict().items()
                                if key.startswith('lin.')})


def test_an_unfrozen_layer_goes_back_into_the_model_file(tmp_path):
    fit(tmp_path, Change('unfrozen'), max_epochs=2, keep_last=2)
    assert manifest(tmp_path, 'epoch-0001')['frozen_parts'] == {'model.safetensors': PART}
    second = manifest(tmp_path, 'epoch-0002')
    assert 'frozen_parts' not in second and second['format_version'] == SHARED_STATES_FORMAT
    assert PART not in os.listdir(tmp_path / 'epoch-0002')
    assert 'lin.weight' in keys(tmp_path / 'epoch-0002' / 'model.safetensors')


def test_a_write_through_data_is_unseen_and_needs_reuse_frozen_false(tmp_path):
    """torch gives ``.data`` a version counter of its own: the one change
    the check cannot see (documented), which ``reuse_frozen=False`` saves."""
    trained, _, _ = fit(tmp_path / 'linked', Change('through .data'), max_epochs=2)
    assert inode(tmp_path / 'linked', 'epoch-0001') == inode(tmp_path / 'linked', 'epoch-0002')
    stale = load_file(tmp_path / 'linked' / 'epoch-0002' / PART)['lin.weight']
    assert not torch.equal(stale, trained.module_.lin.weight)

    trained, _, _ = fit(tmp_path / 'whole', Change('through .data'), max_epochs=2,
                        reuse_frozen=False)
    saved = manifest(tmp_path / 'whole', 'epoch-0002')
    assert 'frozen_parts' not in saved and PART not in saved['files']
    whole = load_file(tmp_path / 'whole' / 'epoch-0002' / 'model.safetensors')
    assert_same_tensors(whole, trained.module_.state_dict())


def test_a_part_removed_by_hand_is_written_again(tmp_path):
    class RemoveFirst(Callback):
        def on_epoch_begin(self, net, **kwargs):
            if len(net.history) == 2:
                os.remove(tmp_path / 'epoch-0001' / PART)

    fit(tmp_path, RemoveFirst(), max_epochs=2, keep_last=2)
    assert manifest(tmp_path, 'epoch-0002')['linked'] == {}
    assert os.stat(tmp_path / 'epoch-0002' / PART).st_nlink == 1
    assert verify(tmp_path / 'epoch-0002').damaged == []
    assert 'is missing' in verify(tmp_path / 'epoch-0001').damaged[0]


def test_nothing_frozen_writes_what_save_state_writes(tmp_path):
    fit_checkpointed(tmp_path, max_epochs=2)
    saved = manifest(tmp_path, 'epoch-0002')
    assert 'frozen_parts' not in saved and saved['format_version'] == SHARED_STATES_FORMAT
    assert sorted(f for f in saved['files'] if f.startswith('model')) == ['model.safetensors']



# ---------------------------------------------------------------- in a bucket

def bucket_files(prefix):
    import fsspec
    fs = fsspec.filesystem('s3')
    fs.invalidate_cache()
    return sorted(path[len(prefix) + 1:] for path in fs.find(prefix))


def test_a_bucket_holds_a_frozen_part_once_and_every_checkpoint_references_it(
        s3_bucket, tmp_path):
    """The part is sent once, into the store's shared folder named by its
    checksum; each manifest lists it as any file; a resume on a new machine
    (nothing staged) from the bucket alone is exact."""
    import fsspec
    url = f's3://{s3_bucket}/run'
    full, _, _ = fit(tmp_path / 'local', max_epochs=4)
    _, cp, _ = fit(url, max_epochs=3, keep_last=3)
    files = bucket_files(f'{s3_bucket}/run')
    shared = [file for file in files if file.startswith('shared/')]
    checksum = manifest(cp.folder_.local_dir, 'epoch-0003')['checksums'][PART]
    assert shared == [f"shared/model_frozen-{checksum.split(':')[1]}.safetensors"]
    for name in ('epoch-0001', 'epoch-0002', 'epoch-0003'):
        assert f'{name}/manifest.json' in files and f'{name}/{PART}' not in files
        sealed = json.loads(fsspec.filesystem('s3').cat_file(
            f'{s3_bucket}/run/{name}/manifest.json'))
        assert sealed['checksums'][PART] == checksum
    shutil.rmtree(cp.folder_.local_dir)  # a new machine: only the bucket
    resumed, _, load = fit(url, max_epochs=4, keep_last=3)
    assert load.loaded_from_ == f'{url}/epoch-0003'
    assert_identical(state(full), state(resumed))


def test_retention_in_a_bucket_keeps_the_part_a_kept_checkpoint_references(s3_bucket):
    url = f's3://{s3_bucket}/run'
    _, cp, _ = fit(url, max_epochs=3, keep_last=1)
    files = bucket_files(f'{s3_bucket}/run')
    assert [file for file in files if not file.startswith('shared/')] == sorted(
        ['latest.json'] + [f'epoch-0003/{file}' for file in os.listdir(
            os.path.join(cp.folder_.local_dir, 'epoch-0003')) if file != PART])
    assert len([file for file in files if file.startswith('shared/')]) == 1
    assert cp.folder_.check('epoch-0003')[1] is None


def test_a_part_no_kept_checkpoint_references_is_removed_from_the_bucket(s3_bucket):
    """Unfrozen after epoch 1: epoch 2 has no part; once retention removed
    epoch 1, nothing references the shared part, and it goes too."""
    _, cp, _ = fit(f's3://{s3_bucket}/run', Change('unfrozen'), max_epochs=2, keep_last=1)
    files = bucket_files(f'{s3_bucket}/run')
    assert not [file for file in files if file.startswith('shared/')], files
    assert 'epoch-0002/manifest.json' in files and cp.committed() == ['epoch-0002']


def test_a_damaged_shared_part_is_reported_for_every_checkpoint_in_the_bucket(s3_bucket):
    import fsspec
    fs = fsspec.filesystem('s3')
    url = f's3://{s3_bucket}/run'
    _, cp, _ = fit(url, max_epochs=2, keep_last=2)
    fs.invalidate_cache()
    (shared,) = fs.find(f'{s3_bucket}/run/shared')
    data = bytearray(fs.cat_file(shared))
    data[-1] ^= 0xFF
    fs.pipe_file(shared, bytes(data))
    storage = RemoteStorage(url)
    for name in ('epoch-0001', 'epoch-0002'):
        _, why = storage.check(name)
        assert why is not None and 'shared/model_frozen-' in why and 'checksum' in why, why


# ---------------------------------------------------------------- an optimizer's state of them

OPTIMIZER_PART = 'optimizer_frozen.bin'
# the first layer (lin.weight, lin.bias: the optimizer's parameters 0 and 1)
# trains in epoch 1 and is frozen from epoch 2 on: the optimizer (SGD with
# momentum) keeps its momentum buffers
fit_frozen_after_training = partial(fit_checkpointed, net_kwargs={'module': MLP})


def freezer():
    return Freezer('lin.*', at=2)


def optimizer_file(folder, name, file='optimizer.bin'):
    return torch.load(os.path.join(folder, name, file), weights_only=True)


@pytest.mark.parametrize('async_save', [False, True])
def test_the_optimizers_state_of_a_base_frozen_after_training_is_written_once_then_linked(
        tmp_path, async_save):
    trained, cp, _ = fit_frozen_after_training(tmp_path, freezer(), max_epochs=3, keep_last=3,
                                               async_save=async_save)
    assert 'frozen_parts' not in manifest(tmp_path, 'epoch-0001')
    second = manifest(tmp_path, 'epoch-0002')
    assert second['frozen_parts'] == {'model.safetensors': PART,
                                      'optimizer.bin': OPTIMIZER_PART}
    assert second['linked'] == {}
    assert manifest(tmp_path, 'epoch-0003')['linked'] == {PART: 'epoch-0002',
                                                          OPTIMIZER_PART: 'epoch-0002'}
    assert inode(tmp_path, 'epoch-0002', OPTIMIZER_PART) \
        == inode(tmp_path, 'epoch-0003', OPTIMIZER_PART)
    # the frozen layer's momentum in the part, the rest in the optimizer's file
    live = trained.optimizer_.state_dict()
    part = optimizer_file(tmp_path, 'epoch-0003', OPTIMIZER_PART)
    rest = optimizer_file(tmp_path, 'epoch-0003')
    assert set(part) == {'state'} and set(part['state']) == {0, 1}
    assert set(rest['state']) == {2, 3} and rest['param_groups'] == live['param_groups']
    for index in (0, 1):
        assert_same_tensors(part['state'][index], live['state'][index])
    for name in cp.committed():
        assert verify(tmp_path / name).damaged == []


@pytest.mark.parametrize('async_save', [False, True])
@pytest.mark.parametrize('epochs', [2, 3], ids=['from the save that wrote it',
                                                  'from a save that linked it'])
def test_a_resume_with_the_optimizers_frozen_part_is_exact(tmp_path, async_save, epochs):
    full, _, _ = fit_frozen_after_training(tmp_path / 'full', freezer(), max_epochs=4,
                                           async_save=async_save)
    fit_frozen_after_training(tmp_path / 'split', freezer(), max_epochs=epochs,
                              async_save=async_save)
    resumed, _, load = fit_frozen_after_training(tmp_path / 'split', freezer(), max_epochs=4,
                                                 async_save=async_save)
    assert load.loaded_from_.endswith(f'epoch-000{epochs}')
    assert_identical(state(full), state(resumed))


def test_a_resume_whose_read_ahead_failed_reads_the_optimizers_frozen_part_itself(
        tmp_path, monkeypatch):
    full, _, _ = fit_frozen_after_training(tmp_path / 'full', freezer(), max_epochs=4)
    fit_frozen_after_training(tmp_path / 'split', freezer(), max_epochs=3)
    taken = []
    monkeypatch.setattr(OptimizerReadAhead, 'take',
                        lambda self, folder: taken.append(folder))  # hands over nothing
    resumed, _, _ = fit_frozen_after_training(tmp_path / 'split', freezer(), max_epochs=4)
    assert taken
    assert_identical(state(full), state(resumed))


class ChangeMoment(Callback):
    """Changes the frozen layer's momentum in place before epoch 3."""

    def on_epoch_begin(self, net, **kwargs):
        if len(net.history) == 3:
            net.optimizer_.state[net.module_.lin.weight]['momentum_buffer'].mul_(0.5)


def test_a_change_of_the_optimizers_frozen_state_writes_its_part_again(tmp_path):
    trained, _, _ = fit_frozen_after_training(tmp_path, freezer(), ChangeMoment(),
                                              max_epochs=3, keep_last=3)
    assert manifest(tmp_path, 'epoch-0003')['linked'] == {PART: 'epoch-0002'}
    assert inode(tmp_path, 'epoch-0002', OPTIMIZER_PART) \
        != inode(tmp_path, 'epoch-0003', OPTIMIZER_PART)
    saved = optimizer_file(tmp_path, 'epoch-0003', OPTIMIZER_PART)['state'][0]
    assert_same_tensors(saved, trained.optimizer_.state_dict()['state'][0])
    earlier = optimizer_file(tmp_path, 'epoch-0002', OPTIMIZER_PART)['state'][0]
    assert torch.equal(saved['momentum_buffer'], earlier['momentum_buffer'] * 0.5)


def test_a_bucket_holds_the_optimizers_frozen_part_once(s3_bucket, tmp_path):
    url = f's3://{s3_bucket}/run'
    full, _, _ = fit_frozen_after_training(tmp_path / 'local', freezer(), max_epochs=4)
    _, cp, _ = fit_frozen_after_training(url, freezer(), max_epochs=3, keep_last=3)
    checksum = manifest(cp.folder_.local_dir, 'epoch-0003')['checksums'][OPTIMIZER_PART]
    files = bucket_files(f'{s3_bucket}/run')
    assert f"shared/optimizer_frozen-{checksum.split(':')[1]}.bin" in files
    assert len([file for file in files if file.startswith('shared/')]) == 2
    assert not [file for file in files if file.endswith(f'/{OPTIMIZER_PART}')]
    shutil.rmtree(cp.folder_.local_dir)  # a new machine: only the bucket
    resumed, _, load = fit_frozen_after_training(url, freezer(), max_epochs=4, keep_last=3)
    assert load.loaded_from_ == f'{url}/epoch-0003'
    assert_identical(state(full), state(resumed))


def test_the_identity_of_an_optimizers_state_sees_each_change_of_its_values():
    """What the check compares of an optimizer's state of one parameter:
    its tensors' memory and version counters, numbers by value, a list
    (LBFGS keeps some) by what it holds now, and any other object as
    changed, always."""
    buffer, history = torch.zeros(3), [torch.ones(2)]
    state = {0: {'momentum_buffer': buffer, 'step': 3, 'old_dirs': history, 'note': None}}
    before = tensor_identity(state, state)
    assert tensor_identity(state, state) == before
    buffer.add_(1.0)
    assert tensor_identity(state, state) != before
    before = tensor_identity(state, state)
    history.append(torch.ones(2))
    assert tensor_identity(state, state) != before
    before = tensor_identity(state, state)
    state[0]['step'] = 4
    assert tensor_identity(state, state) != before
    state[0]['note'] = {'set'}  # a set might change in place, unseen
    assert tensor_identity(state, state) != tensor_identity(state, state)


# ---------------------------------------------------------------- bad input

def reseal(folder, name, edit_part=None, edit_manifest=None):
    """Change checkpoint ``name``'s frozen part or manifest, the manifest's
    sizes and checksums made to match: damage that the checksums cannot
    see, which the load must refuse by itself."""
    from safetensors.torch import save_file

    from skorch_accel_callbacks.format import checksum_file
    path = os.path.join(folder, name)
    if edit_part is not None:
        part = os.path.join(path, PART)
        os.remove(part)  # a new inode: the other checkpoints keep theirs
        save_file(edit_part(load_file(os.path.join(folder, 'epoch-0001', PART))), part)
    saved = manifest(folder, name)
    if edit_manifest is not None:
        edit_manifest(saved)
    saved['files'][PART] = os.path.getsize(os.path.join(path, PART))
    saved['checksums'][PART] = checksum_file(os.path.join(path, PART))
    with open(os.path.join(path, 'manifest.json'), 'w') as f:
        json.dump(saved, f)


@pytest.mark.parametrize('edit, named', [
    (lambda state: {'lin.weight': state['lin.weight']}, "lack \\['lin.bias'\\]"),
    (lambda state: dict(state, extra=torch.zeros(1)), "holds \\['extra'\\]"),
])
def test_a_part_that_does_not_hold_the_frozen_parameters_is_refused_naming_it(
        tmp_path, edit, named):
    from skorch_accel_callbacks import CheckpointError
    fit(tmp_path, max_epochs=2, keep_last=2)
    reseal(tmp_path, 'epoch-0002', edit_part=edit)
    with pytest.raises(CheckpointError, match=f"{PART}.*{named}|{named}.*{PART}"):
        fit(tmp_path, max_epochs=3, keep_last=2, resume='epoch-0002')


@pytest.mark.parametrize('edit, named', [
    (lambda part, rest: {'state': {**part['state'], 2: rest['state'][2]}},
     "holds the state of parameters \\[2\\], which .*optimizer.bin holds too"),
    (lambda part, rest: {'state': {**part['state'], 7: part['state'][0]}},
     "holds the state of parameters \\[7\\], which no group of .*optimizer.bin has"),
    (lambda part, rest: part['state'], "holds no optimizer state of frozen parameters"),
])
def test_an_optimizers_frozen_part_that_does_not_merge_is_refused_naming_it(
        tmp_path, edit, named):
    """Resealed: damage that the checksums cannot see."""
    from skorch_accel_callbacks import CheckpointError
    from skorch_accel_callbacks.format import checksum_file
    fit_frozen_after_training(tmp_path, freezer(), max_epochs=2)
    path = tmp_path / 'epoch-0002' / OPTIMIZER_PART
    torch.save(edit(optimizer_file(tmp_path, 'epoch-0002', OPTIMIZER_PART),
                    optimizer_file(tmp_path, 'epoch-0002')), path)
    saved = manifest(tmp_path, 'epoch-0002')
    saved['files'][OPTIMIZER_PART] = os.path.getsize(path)
    saved['checksums'][OPTIMIZER_PART] = checksum_file(path)
    (tmp_path / 'epoch-0002' / 'manifest.json').write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match=f"{OPTIMIZER_PART}.* {named}"):
        fit_frozen_after_training(tmp_path, freezer(), max_epochs=3, resume='epoch-0002')


def test_a_manifest_naming_another_file_as_a_part_is_refused_naming_it(tmp_path):
    from skorch_accel_callbacks import CorruptCheckpointError
    fit(tmp_path, max_epochs=2, keep_last=2)
    path = tmp_path / 'epoch-0002' / 'manifest.json'
    saved = json.loads(path.read_text())
    saved['frozen_parts'] = {'model.safetensors': 'optimizer.bin'}
    path.write_text(json.dumps(saved))
    with pytest.raises(CorruptCheckpointError, match=f"{path} has frozen_parts"):
        fit(tmp_path, max_epochs=3, keep_last=2, resume='epoch-0002')


# ---------------------------------------------------------------- no hard links

@pytest.mark.slow  # a fresh interpreter in a mount namespace of its own
def test_a_file_system_that_refuses_the_link_gets_the_part_written_and_one_warning(tmp_path):
    """Hard links cannot cross a mount point (EXDEV), even on one file
    system: after epoch 1's save the job bind-mounts epoch-0001 onto itself
    in a private mount namespace, so that epoch 2's link of its part fails
    for real. The part is written instead, with one warning, and epoch 3
    does not try again."""
    if shutil.which('unshare') is None or os.geteuid() != 0:
        machine_lacks('unshare (util-linux) and root')
    root = Path(__file__).resolve().parents[2]
    script = textwrap.dedent(f"""
        import json, subprocess, sys, warnings
        sys.path[:0] = [{str(root)!r}, {str(root / 'tests' / 'support')!r},
                        {str(root / 'tests' / 'workers')!r}]
        from skorch.callbacks import Callback, Freezer
        from checkpointed import fit
        from common import FrozenBaseMLP

        class BindMount(Callback):
            def on_epoch_begin(self, net, **kwargs):
                if len(net.history) == 2:
                    first = {str(tmp_path / 'epoch-0001')!r}
                    subprocess.run(['mount', '--bind', first, first], check=True)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            fit({str(tmp_path)!r}, BindMount(), max_epochs=3, keep_last=3,
                net_kwargs={{'module': FrozenBaseMLP}})
        print(json.dumps([str(w.message) for w in caught if 'hard-link' in str(w.message)]))
    """)
    done = subprocess.run(['unshare', '--mount', '--propagation', 'private', sys.executable,
                           '-c', script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(said) == 1 and 'Invalid cross-device link' in said[0], said
    inodes = {inode(tmp_path, name) for name in ('epoch-0001', 'epoch-0002', 'epoch-0003')}
    assert len(inodes) == 3  # each written
    assert manifest(tmp_path, 'epoch-0003')['linked'] == {}
    assert verify(tmp_path / 'epoch-0003').damaged == []
