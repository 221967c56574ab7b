"""Damaged and foreign checkpoints: a clear error (or, when resuming from
``'latest'``, a skip with a warning) that names the file, never a traceback
from deep inside torch and never a half-loaded net that trains on.

Single-process cases run in this process; a checkpoint of 2 processes comes
from the reference run, and one launch checks a rank's missing file.
"""

import shutil

import pytest
import torch

import faultjob
from faultsuite import run_job
from skorch_accel_callbacks import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.format._manifest import FORMAT_VERSION
from testutil import edit_manifest

pytestmark = pytest.mark.faults


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    """A finished single-process run of 2 epochs; retention (keep_last=1) left
    epoch-0002 only."""
    ckpt = tmp_path_factory.mktemp('saved') / 'ckpt'
    net, _ = faultjob.build(str(ckpt), max_epochs=2)
    net.fit(*faultjob.data())
    return ckpt


@pytest.fixture
def ckpt(saved, tmp_path):
    """A copy of ``saved`` to damage."""
    return shutil.copytree(saved, tmp_path / 'ckpt')


def job(ckpt, resume='latest', **net_kwargs):
    """The job on ``ckpt``, to fit."""
    net, _ = faultjob.build(str(ckpt), resume=resume, max_epochs=3, **net_kwargs)
    return net


def fit(net):
    return net.fit(*faultjob.data())


def loaded_from(net):
    return net.callbacks_[0][1].loaded_from_


def test_truncated_model_file_is_named(ckpt):
    model = ckpt / 'epoch-0002' / 'model.safetensors'
    model.write_bytes(model.read_bytes()[:100])
    net = job(ckpt, resume=str(ckpt / 'epoch-0002'))
    with pytest.raises(CorruptCheckpointError, match=f"{model} has 100 bytes"):
        fit(net)
    assert len(net.history) == 0  # not one epoch began


def test_model_file_damaged_in_place_is_named(ckpt):
    """Same size, so the manifest cannot tell: the load fails and names it."""
    model = ckpt / 'epoch-0002' / 'model.safetensors'
    data = bytearray(model.read_bytes())
    data[:8] = b'\xff' * 8  # the header length
    model.write_bytes(bytes(data))
    net = job(ckpt, resume=str(ckpt / 'epoch-0002'))
    with pytest.raises(CheckpointError, match=f"{model}"):
        fit(net)
    assert len(net.history) == 0  # not one epoch began


def test_missing_rng_file_is_named(ckpt):
    folder = ckpt / 'epoch-0002'
    (folder / 'random_states_0.pkl').unlink()
    edit_manifest(folder, lambda m: m['files'].pop('random_states_0.pkl'))
    net = job(ckpt)
    with pytest.raises(CorruptCheckpointError,
                       match=f"{folder / 'random_states_0.pkl'} is missing"):
        fit(net)
    assert len(net.history) == 0  # not one epoch began


@pytest.mark.slow
def test_missing_rng_file_of_rank_1_fails_every_rank(reference, tmp_path):
    ckpt = shutil.copytree(reference / 'ckpt', tmp_path / 'ckpt')
    folder = ckpt / 'epoch-0003'
    (folder / 'random_states_1.pkl').unlink()
    edit_manifest(folder, lambda m: m['files'].pop('random_states_1.pkl'))
    result = run_job('killable.py', tmp_path, ckpt, 'norng', timeout=120)
    assert not result.timed_out and 0 not in result.returncodes, result.report()
    assert f"{folder / 'random_states_1.pkl'} is missing" in result.outputs[1]
    assert 'RankError' in result.outputs[0] and 'rank 1' in result.outputs[0]


@pytest.mark.parametrize('edit, error, message', [
    (lambda m: m['files'].update({'optimizer.bin': 3}), CorruptCheckpointError,
     r"optimizer.bin has \d+ bytes, .*manifest.json says 3"),
    (lambda m: m['files'].update({'extra.bin': 3}), CorruptCheckpointError,
     r"extra.bin is missing \(listed in .*manifest.json\)"),
    (lambda m: m.pop('files'), CorruptCheckpointError, r"manifest.json lists no files"),
    (lambda m: m['models'][0][1].pop('lin.bias'), CheckpointError,
     r"parameter 'lin.bias' is in the net, not in the checkpoint"),
    (lambda m: m.update(format_version=FORMAT_VERSION + 1), CheckpointError,
     rf"format {FORMAT_VERSION + 1}; .*reads format {FORMAT_VERSION} and older: upgrade"),
], ids=['size', 'unknown-file', 'no-files', 'models', 'newer-format'])
def test_edited_manifest(ckpt, edit, error, message):
    folder = ckpt / 'epoch-0002'
    edit_manifest(folder, edit)
    net = job(ckpt, resume=str(folder))
    with pytest.raises(error, match=f"{folder}.*{message}"):
        fit(net)
    assert len(net.history) == 0  # not one epoch began


def test_manifest_that_is_not_json_is_named(ckpt):
    manifest = ckpt / 'epoch-0002' / 'manifest.json'
    manifest.write_text('{"format_version": 1, "fil')
    net = job(ckpt, resume=str(manifest.parent))
    with pytest.raises(CorruptCheckpointError, match=f"{manifest} is not valid JSON"):
        fit(net)
    # resuming from 'latest' skips it with a warning naming it; it was the
    # only checkpoint (keep_last=1), so that is an error naming it too
    net = job(ckpt)
    with pytest.warns(UserWarning, match=f"skipping checkpoint .*{manifest}"), \
            pytest.raises(CheckpointError, match=f"{ckpt} holds checkpoints but none is "
                                                 f"complete: {manifest} is not valid JSON"):
        fit(net)


@pytest.mark.slow
def test_checkpoint_of_another_world_size(reference, tmp_path):
    ckpt = shutil.copytree(reference / 'ckpt', tmp_path / 'ckpt')
    net = job(ckpt)
    with pytest.raises(CheckpointError, match=f"{ckpt / 'epoch-0003'} was written by 2 "
                                              "processes, this run has 1"):
        fit(net)
    assert len(net.history) == 0  # not one epoch began


class Renamed(torch.nn.Module):
    """The job's MLP with other layer names."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(20, 32)
        self.head = torch.nn.Linear(32, 2)

    def forward(self, X):
        return torch.softmax(self.head(torch.relu(self.hidden(X))), dim=-1)


def test_checkpoint_of_a_model_with_other_names(ckpt):
    net = job(ckpt, module=Renamed)
    with pytest.raises(CheckpointError, match=r"saved from another model: module: parameter "
                                              r"'head.bias' is in the net, not in the checkpoint"):
        fit(net)
    assert len(net.history) == 0  # not one epoch began


def test_empty_folder(ckpt, tmp_path):
    empty = tmp_path / 'empty'
    empty.mkdir()
    net = job(ckpt, resume=str(empty))
    with pytest.raises(CorruptCheckpointError,
                       match=f"{empty / 'manifest.json'} is missing: {empty} is not a "
                             "complete checkpoint"):
        fit(net)
    # latest.json names a folder that was emptied: skipped, naming it
    shutil.rmtree(ckpt / 'epoch-0002')
    (ckpt / 'epoch-0002').mkdir()
    net = job(ckpt)
    with pytest.warns(UserWarning, match=f"skipping checkpoint {ckpt / 'epoch-0002'}"), \
            pytest.raises(CheckpointError, match="none is complete"):
        fit(net)


def test_file_where_a_folder_is_expected(ckpt, tmp_path):
    a_file = tmp_path / 'a_file'
    a_file.write_text('not a folder')
    net = job(ckpt, resume=str(a_file))
    with pytest.raises(CorruptCheckpointError, match=f"{a_file} is not a folder"):
        fit(net)
    net = job(a_file)
    with pytest.raises(NotADirectoryError, match=f"checkpoint folder {a_file} is a file"):
        fit(net)
    assert len(net.history) == 0  # not one epoch began
    shutil.rmtree(ckpt / 'epoch-0002')
    (ckpt / 'epoch-0002').write_text('not a folder')
    net = job(ckpt)
    with pytest.warns(UserWarning, match=f"skipping checkpoint {ckpt / 'epoch-0002'}: "
                                         f"{ckpt / 'epoch-0002'} is not a folder"), \
            pytest.raises(CheckpointError, match="none is complete"):
        fit(net)
