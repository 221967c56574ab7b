"""FSDP2 and a net's parameters: a sharded model read in one process
(:mod:`skorch_accel_callbacks.engine._consolidate`), and, in a 2-process FSDP2
job, ``ParamsCheckpoint``/``save_params`` writing the full parameters,
``load_params(checkpoint=...)`` and ``export`` of its sharded checkpoint
into plain nets, and the clear errors where a plain module is needed.

The sharded folders of the quick tests are written in this process by
``torch.distributed.checkpoint.save(no_dist=True)``, as accelerate's
``save_state`` writes each model under FSDP2 (``{'model': state_dict}``);
``single_file_per_rank=False`` gives each tensor a piece file of its own.
"""

import io
import os
import pickle
import re
import shutil
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from common import MLP, make_data, plain_net
from skorch_accel_callbacks import AccelerateCheckpoint, CorruptCheckpointError
from skorch_accel_callbacks.engine import loadable, model_files
from skorch_accel_callbacks.engine._consolidate import check_sharded_model, read_model
from skorch_accel_callbacks.tools.export import export
from skorch_accel_callbacks.tools.inspection import verify
from testutil import cli

# plain_net(batch_size=32): a net that loads a checkpoint predicts in batches of
# the trained net's size, the same batches, the same floats


def plain_state(seed=0):
    torch.manual_seed(seed)
    return MLP().state_dict()


def save_sharded(folder, state):
    with warnings.catch_warnings():
        # that it saves in this one process, as asked
        warnings.simplefilter('ignore', UserWarning)
        dcp.save({'model': state}, no_dist=True,
                 storage_writer=dcp.FileSystemWriter(folder, single_file_per_rank=False))
    return str(folder)


@pytest.fixture
def sharded(tmp_path):
    """A sharded model of MLP's parameters, one piece file per tensor: (folder, state)."""
    state = plain_state()
    return save_sharded(tmp_path / 'pytorch_model_fsdp_0', state), state


def pieces(folder):
    return sorted(name for name in os.listdir(folder) if name.endswith('.distcp'))


def test_a_sharded_model_reads_as_its_plain_state_dict(sharded):
    folder, state = sharded
    assert len(pieces(folder)) == len(state) > 1
    read = read_model(folder)
    assert read.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(read[key], value), key
    # what load_params takes: an in-memory file of torch's format
    net_file = loadable([folder])
    assert isinstance(net_file, io.BytesIO)
    loaded = torch.load(net_file, weights_only=True)
    module = MLP()
    module.load_state_dict(loaded)
    for key, value in state.items():
        assert torch.equal(module.state_dict()[key], value), key


def test_a_model_file_is_read_as_it_is(tmp_path):
    # FULL_STATE_DICT: accelerate writes one torch file
    state = plain_state()
    path = str(tmp_path / 'pytorch_model_fsdp.bin')
    torch.save(state, path)
    assert loadable([path]) == path
    read = read_model(path)
    assert all(torch.equal(read[key], value) for key, value in state.items())


def test_a_missing_piece_is_named(sharded):
    folder, _ = sharded
    missing = os.path.join(folder, pieces(folder)[1])
    os.remove(missing)
    with pytest.raises(CorruptCheckpointError, match=rf"^{missing} is missing: "
                       rf"{folder}/\.metadata lists it$"):
        read_model(folder)


def test_a_piece_cut_short_is_named(sharded):
    folder, _ = sharded
    cut = os.path.join(folder, pieces(folder)[0])
    size = os.path.getsize(cut)
    with open(cut, 'r+b') as f:
        f.truncate(size - 1)
    with pytest.raises(CorruptCheckpointError, match=rf"^{cut} is cut short: {size - 1} bytes"):
        read_model(folder)


def test_damaged_or_missing_metadata_is_named(sharded):
    folder, _ = sharded
    metadata = os.path.join(folder, '.metadata')
    with open(metadata, 'r+b') as f:
        f.truncate(os.path.getsize(metadata) // 2)
    with pytest.raises(CorruptCheckpointError, match=rf"^{metadata} cannot be loaded: "):
        read_model(folder)
    os.remove(metadata)
    with pytest.raises(CorruptCheckpointError, match=rf"^{metadata} is missing: "
                       r".* is not a sharded model"):
        read_model(folder)


class _Payload:
    """Unpickled, creates the folder ``path``: proof that code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


def test_metadata_that_would_run_code_is_refused(sharded, tmp_path):
    folder, _ = sharded
    metadata = os.path.join(folder, '.metadata')
    ran = tmp_path / 'code-ran'
    with open(metadata, 'wb') as f:
        pickle.dump(_Payload(str(ran)), f)
    # the payload works: a plain unpickling (what the library does) runs it
    with open(metadata, 'rb') as f:
        pickle.load(f)
    assert ran.is_dir()
    ran.rmdir()
    with pytest.raises(CorruptCheckpointError, match=rf"^{metadata} cannot be loaded: "
                       r"UnpicklingError: os\.makedirs is not part of"):
        read_model(folder)
    assert not ran.exists()


def test_an_entry_other_than_a_tensor_is_refused(tmp_path):
    # the library reads it with torch.load(weights_only=False)
    folder = save_sharded(tmp_path / 'model', dict(plain_state(), note=[1, 2]))
    with pytest.raises(CorruptCheckpointError,
                       match=r"\.metadata: 'model\.note' is not a tensor"):
        check_sharded_model(folder)


# ---------------------------------------------------------------- 2 processes


def assert_predicts(net, expected):
    np.testing.assert_array_equal(net.predict_proba(make_data(n=160)[0]), expected)


SHARDED = r"net\.module_ is sharded by FSDP2 \(each rank holds a shard of its parameters\): "
REFUSED = {
    'f_optimizer': r"^ParamsCheckpoint: f_optimizer='optimizer\.pt' needs the optimizer state "
                   rf"of a plain module, and {SHARDED}set f_optimizer=None; AccelerateCheckpoint",
    'f_pickle': r"^ParamsCheckpoint: f_pickle='net\.pkl' needs a plain module to pickle, "
                rf"and {SHARDED}set f_pickle=None",
    'load_best': r"^ParamsCheckpoint: load_best=True needs a plain module to load into, "
                 rf"and {SHARDED}set load_best=False",
    'load_init': rf"^LoadInitParams needs a plain module to load into, and {SHARDED}resume "
                 "with AccelerateCheckpoint and AccelerateLoadInitState$",
    'load_params': rf"^load_params needs a plain module to load into, and {SHARDED}load the "
                   "parameters into a net without FSDP2, or resume the sharded training "
                   "with AccelerateLoadInitState$",
}


@pytest.mark.slow
def test_what_a_fsdp2_job_saves_loads_into_plain_nets(tmp_path, run_workers):
    """One FSDP2 launch; then, in this one process without a process group,
    each file it saved loads into a plain net that predicts as the trained
    net did on every rank."""
    results = run_workers('fsdp_params.py', 'params', nproc=2, timeout=240,
                          env={'COLLECTIVE_TIMEOUT': '30'}, args=[str(tmp_path)])
    assert [result['num_processes'] for result in results] == [2, 2]
    expected = np.array(results[0]['proba'], dtype=np.float32)
    for result in results:
        np.testing.assert_array_equal(np.array(result['proba'], dtype=np.float32), expected)
        # unwrapped leaves the module sharded
        assert result['unwrapped'] == {'type': 'FSDPMLP', 'dtensors': True}
        assert result['refused'].keys() == REFUSED.keys()
        for key, pattern in REFUSED.items():
            assert re.search(pattern, result['refused'][key]), (key, result['refused'][key])
    assert not dist.is_initialized()

    # the full parameters, written on the main process
    params = tmp_path / 'params'
    for f_params, kwargs in [(params / 'params.pt', {}),
                             (params / 'train_end_params.pt', {'use_safetensors': True}),
                             (tmp_path / 'direct.pt', {})]:
        net = plain_net(batch_size=32).initialize()
        net.load_params(f_params=f_params, **kwargs)
        assert_predicts(net, expected)

    # the sharded checkpoint, merged in this process
    ck = tmp_path / 'ck'
    sharded = ck / 'epoch-0002' / 'pytorch_model_fsdp_0'
    assert pieces(sharded) == ['__0_0.distcp', '__1_0.distcp']
    net = plain_net(batch_size=32).initialize()
    net.load_params(checkpoint=AccelerateCheckpoint(dirname=str(ck)))
    assert_predicts(net, expected)
    assert len(net.history) == 2
    files = export(ck, out=tmp_path / 'exported')
    net = plain_net(batch_size=32).initialize()
    net.load_params(**files, use_safetensors=True)
    assert_predicts(net, expected)
    proc = cli('export', ck, tmp_path / 'by-command')
    assert proc.returncode == 0, proc.stderr
    by_command = load_file(tmp_path / 'by-command' / 'params.safetensors')
    for key, value in load_file(files['f_params']).items():
        assert torch.equal(by_command[key], value), key
    assert verify(ck / 'epoch-0002').intact

    # a piece missing: named by the export, by verify, and when merging
    damaged = shutil.copytree(ck / 'epoch-0002', tmp_path / 'damaged' / 'epoch-0002')
    missing = damaged / 'pytorch_model_fsdp_0' / '__1_0.distcp'
    os.remove(missing)
    with pytest.raises(CorruptCheckpointError, match=rf"^{missing} is missing"):
        export(damaged, out=tmp_path / 'not-exported')
    assert not (tmp_path / 'not-exported').exists()
    assert any(str(missing) in damage for damage in verify(damaged).damaged)
    with pytest.raises(CorruptCheckpointError, match=rf"^{missing} is missing: "):
        read_model(damaged / 'pytorch_model_fsdp_0')


def test_the_model_files_of_a_fsdp_checkpoint(tmp_path):
    layout = {'lin.weight': [32, 20]}
    sharded = {'files': {'history.json': 1, 'pytorch_model_fsdp_0/.metadata': 1,
                         'pytorch_model_fsdp_0/__0_0.distcp': 1},
               'models': [['module', layout]]}
    assert model_files(sharded, str(tmp_path)) == [('module', 'pytorch_model_fsdp_0')]
    # FULL_STATE_DICT
    full = {'files': {'pytorch_model_fsdp.bin': 1}, 'models': [['module', layout]]}
    assert model_files(full, str(tmp_path)) == [('module', 'pytorch_model_fsdp.bin')]
    # as before for every other checkpoint
    plain = {'files': {'model.safetensors': 1}, 'models': [['module', layout]]}
    assert model_files(plain, str(tmp_path)) == [('module', 'model.safetensors')]
    del sharded['files']['pytorch_model_fsdp_0/.metadata']
    missing = tmp_path / 'pytorch_model_fsdp_0' / '.metadata'
    with pytest.raises(CorruptCheckpointError, match=rf"^{missing} is missing: the manifest "
                       "lists model 'module' but not its file$"):
        model_files(sharded, str(tmp_path))
