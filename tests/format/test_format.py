"""The on-disk format (issue 20, item 3): format/_manifest.py sits at the
bottom of the package, its manifest writer takes JSON values only (the duration of a
save is a ``started`` stamp, not a callable in the manifest), and manifests
written by earlier versions still read."""

import ast
import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

import skorch_accel_callbacks
from skorch_accel_callbacks.format import (
    HISTORY_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    POINTERS,
    CheckpointRecord,
    _manifest,
    batches_into_epoch,
    checkpoint_name,
    epoch_caches_names,
    is_checkpoint_name,
    manifest_content,
    pointer_name,
    position_name,
    probe_name,
    rank_state_name,
    read_manifest,
    stopped_early,
    write_manifest,
)
from testutil import parse_source

PACKAGE = Path(skorch_accel_callbacks.__file__).parent


def own_imports(module):
    """The modules of the package (dotted, below it) that ``module``'s source imports."""
    tree = parse_source(PACKAGE / f"{module.replace('.', '/')}.py")
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            named |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
    found = set()
    for name in named:
        if not name.startswith('skorch_accel_callbacks.'):
            continue
        # ``from skorch_accel_callbacks.format import _atomic``: the module _atomic;
        # ``from skorch_accel_callbacks.errors import CheckpointError``: errors
        name = name.removeprefix('skorch_accel_callbacks.')
        for candidate in (name, name.rpartition('.')[0]):
            if (PACKAGE / f"{candidate.replace('.', '/')}.py").is_file():
                found.add(candidate)
                break
    return found


def test_format_imports_nothing_above_atomic_and_errors():
    assert own_imports('format._manifest') == {'format._atomic', 'errors'}
    # and they import nothing of the package: the format is at the bottom
    seen, todo = set(), ['format._manifest']
    while todo:
        module = todo.pop()
        seen.add(module)
        todo += sorted(own_imports(module) - seen)
    assert seen == {'format._manifest', 'format._atomic', 'errors'}


def folder_with_a_file(tmp_path):
    folder = tmp_path / 'epoch-0001.partial'
    folder.mkdir()
    (folder / HISTORY_NAME).write_text('[]')
    return folder


@pytest.mark.parametrize('durable', [False, True])
def test_write_measures_the_save_from_started(tmp_path, durable):
    folder = folder_with_a_file(tmp_path)
    started = time.monotonic()
    written = write_manifest(str(folder), {'format_version': _manifest.FORMAT_VERSION},
                           durable=durable, started=started)
    on_disk = json.loads((folder / MANIFEST_NAME).read_text())
    assert on_disk == written
    assert isinstance(on_disk['save_seconds'], float) and on_disk['save_seconds'] >= 0
    assert on_disk['files'] == {HISTORY_NAME: 2} and on_disk['bytes'] == 2
    assert isinstance(on_disk['saved_at'], str)


def test_write_without_started_records_no_duration(tmp_path):
    folder = folder_with_a_file(tmp_path)
    written = write_manifest(str(folder), {'format_version': _manifest.FORMAT_VERSION},
                           durable=False)
    assert 'save_seconds' not in written
    assert 'save_seconds' not in json.loads((folder / MANIFEST_NAME).read_text())


def test_write_refuses_a_callable_and_writes_no_manifest(tmp_path):
    """Before, a callable value was called and its result written: the
    writer now takes JSON values only."""
    folder = folder_with_a_file(tmp_path)
    content = {'format_version': _manifest.FORMAT_VERSION, 'save_seconds': lambda: 1.0}
    with pytest.raises(TypeError, match='not JSON serializable'):
        write_manifest(str(folder), content, durable=False)
    assert sorted(os.listdir(folder)) == [HISTORY_NAME]  # no manifest, no temp file


# manifests as 0.2 (format 2) and 0.3 (format 3) wrote them, less the
# model layout, package versions and settings no reader of the format needs
FORMAT_2 = {
    'format_version': 2, 'name': 'epoch-0002', 'epoch': 2, 'best': True,
    'finished': True, 'stopped_early': True, 'data': None, 'world_size': 1,
    'save_on_each_node': False, 'models': [['module', {'w': [2, 3]}]],
    'optimizers': [['SGD', [1]]], 'bytes': 2, 'save_seconds': 0.012,
    'saved_at': '2024-05-01T10:00:00.000+00:00',
}
FORMAT_3 = {
    **FORMAT_2, 'format_version': 3, 'name': 'epoch-0002-step-00000012', 'best': False,
    'finished': False, 'stopped_early': False, 'position': {'step': 12, 'batches': 2},
    'params': {'lr': 0.1}, 'epoch_settings': {'batch_size': 32, 'train_rows': 128},
    'blocked_seconds': 0.003,
}


@pytest.mark.parametrize('saved, stopped, batches', [
    (FORMAT_2, True, 0),
    (FORMAT_3, False, 2),
    # format 1: finished stood for stopped early too, and there was no position
    ({key: value for key, value in FORMAT_2.items() if key != 'stopped_early'}
     | {'format_version': 1, 'optimizers': 1}, True, 0),
], ids=['format2', 'format3', 'format1'])
def test_read_manifests_of_earlier_versions(tmp_path, saved, stopped, batches):
    folder = tmp_path / saved['name']
    folder.mkdir()
    (folder / HISTORY_NAME).write_text('[]')
    manifest = dict(saved, files={HISTORY_NAME: 2})
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert read_manifest(folder) == manifest
    assert stopped_early(manifest) is stopped
    assert batches_into_epoch(manifest) == batches
    assert is_checkpoint_name(saved['name'])


RECORD = CheckpointRecord(
    name='epoch-0002-step-00000012', epoch=2, position={'step': 12, 'batches': 2},
    best=False, finished=False, stopped_early=False, data={'X': 'fingerprint'},
    params={'lr': 0.1}, epoch_settings={'batch_size': 32}, world_size=2,
    save_on_each_node=False, models=[['module', [['0.weight', [4, 3]]]]],
    frozen={'module': []}, optimizers=[['SGD', [2]]], versions={'torch': '2.0'})


@pytest.mark.parametrize('changes, version, extra', [
    ({}, _manifest.SHARED_STATES_FORMAT, {}),
    ({'per_rank': ('history',)}, _manifest.PER_RANK_FORMAT, {'per_rank': ['history']}),
    ({'fsdp': {'module': 'layout'}}, _manifest.SHARED_STATES_FORMAT,
     {'fsdp': {'module': 'layout'}}),
], ids=['ranks-agree', 'per-rank', 'fsdp'])
def test_a_record_makes_the_manifest_fields_of_its_format(tmp_path, changes, version, extra):
    """The format a checkpoint is written in follows from what it holds:
    one whose ranks agree stays readable by the versions that read format 3."""
    content = manifest_content(dataclasses.replace(RECORD, **changes))
    fields = [field.name for field in dataclasses.fields(RECORD)
              if field.name not in ('fsdp', 'per_rank')]
    assert list(content) == ['format_version', *fields, *extra]
    assert content['format_version'] == version
    assert {key: content[key] for key in extra} == extra
    folder = tmp_path / RECORD.name
    folder.mkdir()
    write_manifest(str(folder), content, durable=False)
    assert read_manifest(folder)['format_version'] == version


def test_names_are_the_ones_on_disk():
    """The names a checkpoint folder of 0.3 holds, from their one place."""
    assert checkpoint_name(3) == 'epoch-0003'
    assert checkpoint_name(2, 12) == 'epoch-0002-step-00000012'
    assert all(is_checkpoint_name(checkpoint_name(2, step))
               for step in (None, 0, 12))
    assert not is_checkpoint_name('epoch-0003' + PARTIAL_SUFFIX)
    assert [pointer_name(which) for which in POINTERS] == [
        'latest.json', 'best.json']
    assert rank_state_name(1) == 'loader_state_1.safetensors'
    assert position_name(1) == 'position_1.safetensors'
    assert epoch_caches_names(1) == ('epoch_caches_1.json',
                                            'epoch_caches_1.safetensors')
    assert probe_name(1) == '.node-probe-1'
    assert (MANIFEST_NAME, HISTORY_NAME, _manifest.CALLBACKS_NAME,
            _manifest.CALLBACK_TENSORS_NAME, LOCK_NAME) == (
        'manifest.json', 'history.json', 'callbacks.json', 'callbacks.safetensors', '.lock')
