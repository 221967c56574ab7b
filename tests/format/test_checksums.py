"""Checksums in the manifest (issue 21, item 3): every listed file's
checksum is recorded at the save; a byte changed inside a tensor (the size
kept) is found by ``verify`` and by a resume, which for ``'latest'`` falls
back to the checkpoint before and trains on bit for bit; manifests without
checksums still resume."""

import importlib.util
import json
import re
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file

from common import Snapshot, make_accelerator, make_data, make_net
from launcher import REPO
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    CorruptCheckpointError,
)
from skorch_accel_callbacks.format import (
    CHECKSUM_ALGORITHM,
    MANIFEST_NAME,
    _manifest,
    check_manifest,
    checksum_file,
    read_manifest,
)
from skorch_accel_callbacks.format._manifest import SHARED_STATES_FORMAT
from skorch_accel_callbacks.tools.export import export
from testutil import cli, edit_manifest


def build(dirname, resume='latest', max_epochs=3):
    """A 1-process net that checkpoints every epoch (the last 3 kept)."""
    cp = AccelerateCheckpoint(dirname=str(dirname), keep_last=3)
    torch.manual_seed(0)
    return make_net(make_accelerator(), max_epochs=max_epochs, batch_size=16,
                    train_split=None, callbacks=[
                        AccelerateLoadInitState(cp, resume=resume), cp, Snapshot()])


def fit(net):
    return net.fit(*make_data(n=64))


def snapshots(net):
    return dict(net.callbacks_)['Snapshot'].params_


def loaded_from(net):
    return net.callbacks_[0][1].loaded_from_


def assert_same_params(a, b):
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def bench_checksum():
    """benchmarks/bench_checksum.py, whose algorithms chose the manifest's."""
    spec = importlib.util.spec_from_file_location(
        'bench_checksum', REPO / 'benchmarks' / 'bench_checksum.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    """3 epochs in one go: the parameters after each."""
    net = fit(build(tmp_path_factory.mktemp('uninterrupted') / 'ck'))
    return snapshots(net)


@pytest.fixture(scope='module')
def two_epochs(tmp_path_factory):
    """A job that ended after 2 epochs (epoch-0001, epoch-0002 saved)."""
    dirname = tmp_path_factory.mktemp('two') / 'ck'
    fit(build(dirname, max_epochs=2))
    return dirname


@pytest.fixture
def ckpt(two_epochs, tmp_path):
    """A copy of ``two_epochs`` to damage."""
    return shutil.copytree(two_epochs, tmp_path / 'ck')


def flip_tensor_byte(file):
    """Change the byte in the middle of a safetensors file's tensor data
    (after the 8-byte header length and the JSON header); the size stays."""
    data = bytearray(file.read_bytes())
    header = struct.unpack('<Q', data[:8])[0]
    middle = 8 + header + (len(data) - 8 - header) // 2
    before = data[middle]
    data[middle] ^= 0xff
    file.write_bytes(bytes(data))
    return middle, before


def test_a_save_records_the_checksum_of_every_listed_file(two_epochs):
    digest = bench_checksum().ALGORITHMS[CHECKSUM_ALGORITHM]
    for name in ('epoch-0001', 'epoch-0002'):
        folder = two_epochs / name
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        assert manifest['format_version'] == SHARED_STATES_FORMAT
        assert manifest['checksums'].keys() == manifest['files'].keys()
        assert 'model.safetensors' in manifest['checksums']
        for rel, checksum in manifest['checksums'].items():
            assert checksum == f"xxh3_64:{digest(folder / rel)}", rel
            assert checksum == checksum_file(folder / rel), rel
    # and they differ from file to file: each is of its own file
    assert len(set(manifest['checksums'].values())) == len(manifest['checksums'])


def test_a_flipped_byte_inside_a_tensor_is_found_and_latest_falls_back(
        ckpt, uninterrupted, recwarn):
    model = ckpt / 'epoch-0002' / 'model.safetensors'
    listed = json.loads((ckpt / 'epoch-0002' / MANIFEST_NAME).read_text())
    size = model.stat().st_size
    at, before = flip_tensor_byte(model)
    # the fault fired: the byte differs, the size does not, the checksum does
    assert model.read_bytes()[at] != before and model.stat().st_size == size
    actual = checksum_file(model)
    assert actual != listed['checksums']['model.safetensors']
    # ... and the file still loads: only the checksum can tell
    assert load_file(model).keys() == load_file(ckpt / 'epoch-0001' / model.name).keys()

    proc = cli('verify', ckpt)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (f"{ckpt}/epoch-0002: DAMAGED\n  {model} has checksum {actual}, "
            f"{ckpt}/epoch-0002/{MANIFEST_NAME} says "
            f"{listed['checksums']['model.safetensors']}: the file is damaged") in proc.stdout
    assert f"{ckpt}/epoch-0001: intact" in proc.stdout

    named = build(ckpt, resume=str(ckpt / 'epoch-0002'))
    with pytest.raises(CorruptCheckpointError,
                       match=re.escape(f"{model} has checksum {actual}")):
        fit(named)
    assert len(named.history) == 0  # not one epoch began

    recwarn.clear()
    net = fit(build(ckpt))
    skipped = [str(w.message) for w in recwarn if issubclass(w.category, UserWarning)
               and str(w.message).startswith(f"skipping checkpoint {ckpt / 'epoch-0002'}")]
    assert skipped and f"{model} has checksum {actual}" in skipped[0], skipped
    assert loaded_from(net) == str(ckpt / 'epoch-0001')
    assert sorted(snapshots(net)) == [2, 3]  # epochs 2 and 3 trained again
    for epoch in (2, 3):
        assert_same_params(snapshots(net)[epoch], uninterrupted[epoch])


def test_an_old_manifest_without_checksums_still_resumes(ckpt, uninterrupted):
    for name in ('epoch-0001', 'epoch-0002'):
        edit_manifest(ckpt / name, lambda manifest: manifest.pop('checksums'))
        assert 'checksums' not in json.loads((ckpt / name / MANIFEST_NAME).read_text())
    assert check_manifest(ckpt / 'epoch-0002')[1] == []
    net = fit(build(ckpt))
    assert loaded_from(net) == str(ckpt / 'epoch-0002')
    assert sorted(snapshots(net)) == [3]
    assert_same_params(snapshots(net)[3], uninterrupted[3])
    # the checkpoint it saved has them
    assert 'checksums' in json.loads((ckpt / 'epoch-0003' / MANIFEST_NAME).read_text())


@pytest.mark.parametrize('checksums', [[], {'model.safetensors': 7}, None])
def test_a_malformed_checksums_field_is_named(ckpt, checksums):
    folder = ckpt / 'epoch-0002'
    edit_manifest(folder, checksums=checksums)
    with pytest.raises(CorruptCheckpointError,
                       match=re.escape(f"{folder / MANIFEST_NAME} has checksums")):
        read_manifest(folder)


def test_a_checksum_of_an_unknown_algorithm_is_not_checked(ckpt):
    folder = ckpt / 'epoch-0002'
    edit_manifest(folder, lambda manifest: manifest['checksums'].update(
        {'model.safetensors': 'sha3_512:00'}))
    assert check_manifest(folder)[1] == []
    edit_manifest(folder, lambda manifest: manifest['checksums'].update(
        {'model.safetensors': 'xxh3_64:0000000000000000'}))
    assert [problem.file for problem in check_manifest(folder)[1]] == ['model.safetensors']


@pytest.mark.parametrize('threads', [1, 2])
def test_every_damaged_file_is_reported_in_the_manifests_order(ckpt, monkeypatch, threads):
    """The files are checked on CHECK_THREADS threads, the largest first;
    the problems come in the order of the manifest, whatever finished first."""
    monkeypatch.setattr(_manifest, 'CHECK_THREADS', threads)
    folder = ckpt / 'epoch-0002'
    listed = list(json.loads((folder / MANIFEST_NAME).read_text())['files'])
    damaged = [listed[0], listed[-1], 'model.safetensors', 'optimizer.bin']
    for rel in damaged:
        with open(folder / rel, 'ab') as file:
            file.write(b'0')
    problems = check_manifest(folder)[1]
    assert [problem.file for problem in problems] == [rel for rel in listed if rel in damaged]
    assert all(f"{folder / problem.file} has" in str(problem.error) for problem in problems)


def test_export_refuses_a_model_file_whose_checksum_differs(ckpt, tmp_path):
    """It would load: a damaged model would be exported as an intact one."""
    model = ckpt / 'epoch-0002' / 'model.safetensors'
    flip_tensor_byte(model)
    assert load_file(model)  # the fault leaves a file that loads
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{model} has checksum")):
        export(ckpt, out=tmp_path / 'out', which='epoch-0002')
    assert not (tmp_path / 'out').exists()
