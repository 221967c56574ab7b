"""Loading an untrusted checkpoint executes no code.

A pickle whose ``__reduce__`` would create a marker file is planted in place
of each file of a checkpoint (with the manifest's size updated, as a
deliberate attacker would). Every plant must be refused with an error naming
the file, and the marker must never appear. Our own files are JSON and
safetensors; what is read with ``torch.load`` is read with
``weights_only=True``; nothing of ours goes through accelerate's
``register_for_checkpointing`` (those are unpickled with
``weights_only=False``).
"""

import json
import os
import pickle
import shutil

import pytest
from skorch import NeuralNetClassifier

from common import MLP, make_data
import faultjob
from skorch_accel_callbacks import (
    CheckpointError,
    CorruptCheckpointError,
    LoadInitParams,
    ParamsCheckpoint,
)
from skorch_accel_callbacks.format import checksum_file
from testutil import read_json

pytestmark = pytest.mark.faults


class Payload:
    """Unpickling this creates ``marker`` (an attacker would run anything)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, 'w'))


def plant(file, marker):
    # protocol 2: the weights-only unpickler gets as far as the GLOBAL opcode
    file.write_bytes(pickle.dumps(Payload(marker), protocol=2))


def test_the_payload_runs_code_when_unpickled(tmp_path):
    """The control: without weights_only the plant would have run."""
    marker = tmp_path / 'pwned'
    plant(tmp_path / 'evil.pkl', marker)
    with open(tmp_path / 'evil.pkl', 'rb') as f:
        pickle.load(f).close()
    assert marker.exists()


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp('saved') / 'ckpt'
    net, _ = faultjob.build(str(ckpt), max_epochs=1)
    net.fit(*faultjob.data())
    # nothing of ours is a custom object of accelerate's (unpickled unsafely)
    assert net.accelerator._custom_objects == []
    return ckpt / 'epoch-0001'


FILES = ['model.safetensors', 'optimizer.bin', 'random_states_0.pkl', 'history.json',
         'callbacks.json', 'callbacks.safetensors', 'loader_state_0.safetensors']


def test_every_file_of_the_checkpoint_is_covered(saved):
    listed = read_json(saved / 'manifest.json')['files']
    assert sorted(listed) == sorted(FILES)
    assert not [name for name in listed if name.startswith('custom_checkpoint')]


@pytest.mark.parametrize('name', FILES)
def test_planted_pickle_in_a_checkpoint_is_refused(saved, tmp_path, name):
    folder = shutil.copytree(saved, tmp_path / 'ckpt' / 'epoch-0001')
    marker = tmp_path / 'pwned'
    plant(folder / name, marker)
    manifest = read_json(folder / 'manifest.json')
    manifest['files'][name] = (folder / name).stat().st_size
    # as an attacker who rewrites the manifest would: the loaders must refuse it
    manifest['checksums'][name] = checksum_file(folder / name)
    (folder / 'manifest.json').write_text(json.dumps(manifest))
    net, _ = faultjob.build(str(folder.parent), resume=str(folder), max_epochs=2)
    with pytest.raises((CheckpointError, CorruptCheckpointError),
                       match=f"{folder / name}.* (could not|cannot) be loaded"):
        net.fit(*faultjob.data())
    assert not marker.exists()
    assert len(net.history) == 0


PARAMS_FILES = ['params.pt', 'optimizer.pt', 'criterion.pt', 'history.json']


@pytest.mark.parametrize('name', PARAMS_FILES)
def test_planted_pickle_in_params_checkpoint_is_refused(tmp_path, name):
    X, y = make_data(n=64)
    cp = ParamsCheckpoint(monitor=None, dirname=str(tmp_path / 'cp'))
    NeuralNetClassifier(MLP, max_epochs=1, callbacks=[cp], train_split=None,
                        verbose=0).fit(X, y)
    assert sorted(os.listdir(tmp_path / 'cp')) == sorted(PARAMS_FILES)
    marker = tmp_path / 'pwned'
    plant(tmp_path / 'cp' / name, marker)
    net = NeuralNetClassifier(MLP, max_epochs=1, callbacks=[LoadInitParams(cp)],
                              train_split=None, verbose=0)
    with pytest.raises(CorruptCheckpointError,
                       match=f"{tmp_path / 'cp' / name} cannot be loaded"):
        net.fit(X, y)
    assert not marker.exists()
