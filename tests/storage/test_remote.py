"""Checkpoints in an object store: a real S3 API (moto's server, s3fs).

Each test gets a fresh bucket of one local S3 server (tests/conftest.py
``s3_bucket``) and stages under its own temporary folder; deleting that
folder is a new machine that has only the bucket.
"""

import base64
import json
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import zlib

import fsspec
import pytest
import torch
from sklearn.base import clone
from skorch.callbacks import Callback

from checkpointed import fit, state
from common import UploadsEnded, make_accelerator, make_data, make_net
from launcher import launch
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    CheckpointError,
    CorruptCheckpointError,
    StoreUnavailableError,
    TrainingPreempted,
)
from skorch_accel_callbacks.errors import FolderInUseError
from skorch_accel_callbacks.format import _manifest, check_manifest, merged_manifest
from skorch_accel_callbacks.storage import CheckpointStorage, _transfer as transfer, open_storage
from skorch_accel_callbacks.storage._local import CheckpointFolder
from skorch_accel_callbacks.storage._remote import RemoteStorage, default_staging
from testutil import assert_identical, cli, final_state, read_results

FILES = {'callbacks.json', 'callbacks.safetensors', 'history.json', 'loader_state_0.safetensors',
         'manifest.json', 'model.safetensors', 'optimizer.bin', 'random_states_0.pkl'}


def s3():
    return fsspec.filesystem('s3')


def listing(prefix):
    fs = s3()
    fs.invalidate_cache()
    return sorted(path[len(prefix) + 1:] for path in fs.find(prefix))


# ---------------------------------------------------------------- opening

def test_open_storage_takes_a_url_as_a_store(tmp_path):
    storage = open_storage('s3://bucket/run1')
    assert isinstance(storage, RemoteStorage) and isinstance(storage, CheckpointStorage)
    assert storage.local_dir == default_staging('s3://bucket/run1')
    assert storage.url('epoch-0001') == 's3://bucket/run1/epoch-0001'
    assert storage.path('epoch-0001') == os.path.join(storage.local_dir, 'epoch-0001')
    staged = open_storage('s3://bucket/run1/', local_dir=tmp_path, storage_options={'anon': True})
    assert (staged.local_dir, staged.storage_options) == (str(tmp_path), {'anon': True})
    for local in (tmp_path, str(tmp_path), f'file://{tmp_path}'):
        folder = open_storage(local)
        assert isinstance(folder, CheckpointFolder) and folder.dirname == str(tmp_path)


# ---------------------------------------------------------------- saving

def test_fit_commits_into_the_bucket(s3_bucket):
    url = f's3://{s3_bucket}/run'
    _, cp, _ = fit(url, max_epochs=3)
    files = listing(f'{s3_bucket}/run')
    assert files == sorted(['latest.json'] + [f'{name}/{file}' for name in (
        'epoch-0002', 'epoch-0003') for file in FILES])
    assert json.loads(s3().cat_file(f'{s3_bucket}/run/latest.json')) == {'name': 'epoch-0003'}
    manifest = json.loads(s3().cat_file(f'{s3_bucket}/run/epoch-0003/manifest.json'))
    for rel, size in manifest['files'].items():
        assert s3().info(f'{s3_bucket}/run/epoch-0003/{rel}')['size'] == size
    assert cp.committed() == ['epoch-0002', 'epoch-0003']
    # the staging folder keeps only the newest checkpoint
    staged = CheckpointFolder(cp.folder_.local_dir).committed()
    assert staged == ['epoch-0003']


def test_local_dir_and_storage_options_reach_the_store(s3_bucket, s3_endpoint, tmp_path,
                                                       monkeypatch):
    """Without the AWS_ENDPOINT_URL of the environment, the callback's
    storage_options alone reach the server, and saves stage in local_dir."""
    monkeypatch.delenv('AWS_ENDPOINT_URL')
    options = {'client_kwargs': {'endpoint_url': s3_endpoint},
               'key': 'testing', 'secret': 'testing'}
    url = f's3://{s3_bucket}/run'
    _, cp, _ = fit(url, max_epochs=2, local_dir=str(tmp_path / 'staging'),
                   storage_options=options)
    assert cp.folder_.local_dir == str(tmp_path / 'staging')
    assert CheckpointFolder(str(tmp_path / 'staging')).committed() == ['epoch-0002']
    assert 'epoch-0002/manifest.json' in listing(f'{s3_bucket}/run')
    resumed, _, load = fit(url, max_epochs=3, local_dir=str(tmp_path / 'other-staging'),
                           storage_options=options)
    assert load.loaded_from_ == f'{url}/epoch-0002'
    assert CheckpointFolder(str(tmp_path / 'other-staging')).committed() == ['epoch-0003']
    assert len(resumed.history) == 3


@pytest.mark.parametrize('argument, value', [('local_dir', 3), ('storage_options', 'anon')])
def test_bad_store_arguments_are_refused_at_initialize(argument, value):
    with pytest.raises(ValueError, match=f'{argument} must be'):
        AccelerateCheckpoint(dirname='s3://bucket/run', **{argument: value}).initialize()


def test_resume_from_the_bucket_alone_is_bit_identical(s3_bucket, tmp_path):
    full, _, _ = fit(str(tmp_path / 'local'), max_epochs=4)
    url = f's3://{s3_bucket}/run'
    _, cp, _ = fit(url, max_epochs=2)
    # a new machine: nothing staged
    shutil.rmtree(cp.folder_.local_dir)
    resumed, cp, load = fit(url, max_epochs=4)
    assert load.loaded_from_ == f'{url}/epoch-0002'
    assert load.resumed_.path == os.path.join(cp.folder_.local_dir, 'epoch-0002')
    assert_identical(state(full), state(resumed))
    assert cp.committed() == ['epoch-0002', 'epoch-0003', 'epoch-0004']


def test_retention_removes_from_the_bucket(s3_bucket):
    _, cp, _ = fit(f's3://{s3_bucket}/run', max_epochs=3, keep_last=1)
    assert listing(f'{s3_bucket}/run') == sorted(
        ['latest.json'] + [f'epoch-0003/{file}' for file in FILES])


def test_async_save_uploads(s3_bucket):
    _, cp, _ = fit(f's3://{s3_bucket}/run', max_epochs=2, async_save=True)
    assert cp.committed() == ['epoch-0001', 'epoch-0002']
    assert json.loads(s3().cat_file(f'{s3_bucket}/run/latest.json')) == {'name': 'epoch-0002'}


class AnotherWriter(Callback):
    """Commits epoch-0001 into the bucket before this job's save does."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, manifest):
        self.manifest = manifest

    def on_epoch_end(self, net, **kwargs):
        s3().pipe_file(self.manifest, b'{"written by": "another job"}')


def test_a_manifest_committed_by_another_job_is_not_overwritten(s3_bucket):
    manifest = f'{s3_bucket}/run/epoch-0001/manifest.json'
    with pytest.raises(CheckpointError, match=f's3://{s3_bucket}/run/epoch-0001') as info:
        fit(f's3://{s3_bucket}/run', AnotherWriter(manifest), max_epochs=1)
    # the create-only write was refused by the server
    assert isinstance(info.value.__cause__, FileExistsError)
    assert s3().cat_file(manifest) == b'{"written by": "another job"}'
    assert not s3().exists(f'{s3_bucket}/run/latest.json')


def test_a_manifest_that_this_very_write_stored_is_not_another_job_s(s3_bucket):
    """The store kept the manifest, but its answer was lost and the client's
    retry was refused: the same bytes are this write's own, and it goes on
    to the pointer; other bytes are another job's."""
    store = transfer.Store(s3(), f'{s3_bucket}/run', f's3://{s3_bucket}/run')
    sealed = json.dumps({'files': {}, 'epoch': 1}).encode()
    s3().pipe_file(f'{s3_bucket}/run/epoch-0001/manifest.json', sealed)
    transfer.seal(store, 'epoch-0001', sealed, best=False, before_manifest=lambda: None)
    assert json.loads(s3().cat_file(f'{s3_bucket}/run/latest.json')) == {'name': 'epoch-0001'}
    with pytest.raises(CheckpointError, match=f's3://{s3_bucket}/run/epoch-0001/manifest.json '
                       'exists already: another job committed'):
        transfer.seal(store, 'epoch-0001', sealed + b' ', best=False,
                      before_manifest=lambda: None)


def test_an_epoch_trained_again_replaces_its_checkpoint(s3_bucket):
    url = f's3://{s3_bucket}/run'
    _, cp, _ = fit(url, max_epochs=3)
    # resuming from epoch-0002 trains epoch 3 again
    cp = AccelerateCheckpoint(dirname=url)
    torch.manual_seed(0)
    net = make_net(make_accelerator(), max_epochs=3,
                   callbacks=[cp, AccelerateLoadInitState(cp, resume='epoch-0002')])
    net.fit(*make_data(n=160))
    assert cp.committed() == ['epoch-0002', 'epoch-0003']
    assert cp.folder_.find_checkpoint('epoch-0003').manifest['epoch'] == 3


def test_the_next_job_of_the_machine_finishes_a_cut_upload(s3_bucket):
    url = f's3://{s3_bucket}/run'
    fit(url, max_epochs=2)
    # killed while uploading epoch-0002: its files are there, not its manifest
    manifest = f'{s3_bucket}/run/epoch-0002/manifest.json'
    sealed = s3().cat_file(manifest)
    s3().rm_file(manifest)
    s3().pipe_file(f'{s3_bucket}/run/latest.json', b'{"name": "epoch-0001"}')
    _, cp, load = fit(url, max_epochs=3)
    assert load.loaded_from_.endswith('epoch-0002')
    assert s3().cat_file(manifest) == sealed
    assert cp.committed() == ['epoch-0002', 'epoch-0003']


def test_a_net_saving_into_a_store_pickles_and_clones(s3_bucket):
    net, cp, _ = fit(f's3://{s3_bucket}/run', max_epochs=1, async_save=True)
    assert cp.folder_._fs is not None  # it has talked to the store
    copy = pickle.loads(pickle.dumps(net))
    storage = dict(copy.callbacks_)['AccelerateCheckpoint'].folder_
    assert isinstance(storage, RemoteStorage) and storage._fs is None
    assert storage.committed() == ['epoch-0001']
    clone(net)


# ---------------------------------------------------------------- errors

def test_a_missing_bucket_is_refused_before_training(s3_bucket):
    url = f's3://{s3_bucket}-missing/run'
    with pytest.raises(CheckpointError, match=f'{url}.*bucket {s3_bucket}-missing does not'):
        fit(url, max_epochs=1)


def test_a_second_job_on_the_url_is_refused_by_the_lease(s3_bucket, tmp_path):
    """Another machine (its own staging folder) cannot take a store in use:
    the lease, not the staging lock, refuses it, naming the holder."""
    url = f's3://{s3_bucket}/run'
    fit(url, max_epochs=1)
    holder = make_net(make_accelerator(), max_epochs=1).initialize()
    first = open_storage(url, local_dir=tmp_path / 'machine-a')
    first.claim(holder)
    try:
        assert 'run/.lease.json' in listing(s3_bucket)
        with pytest.raises(FolderInUseError, match=f'{url} is in use by another running job '
                                                   rf'\(pid {os.getpid()} on host'):
            fit(url, max_epochs=2, local_dir=str(tmp_path / 'machine-b'))
        # refused before any step: the store holds what the first fit left
        assert AccelerateCheckpoint(dirname=url).committed() == ['epoch-0001']
    finally:
        first.release()
    assert 'run/.lease.json' not in listing(s3_bucket)
    resumed, _, _ = fit(url, max_epochs=2, local_dir=str(tmp_path / 'machine-b'))
    assert len(resumed.history) == 2


def test_a_missing_protocol_package_is_refused_before_training(s3_bucket, monkeypatch):
    # gcsfs made unimportable, as where the [gcs] extra is not installed;
    # and unknown to fsspec, which keeps the class of a protocol it opened
    # once in this process (test_gcs opens gs://)
    monkeypatch.setitem(sys.modules, 'gcsfs', None)
    for protocol in ('gs', 'gcs'):
        monkeypatch.delitem(sys.modules['fsspec.registry']._registry, protocol, raising=False)
    url = 'gs://bucket/run'
    hint = r"\(pip install gcsfs: the package's \[gcs\] extra\)"
    with pytest.raises(CheckpointError, match=f"cannot open {url}: .*gcsfs.* {hint}"):
        fit(url, max_epochs=1)


@pytest.mark.parametrize('url', ['az://bucket/run', 'ftp://host/run', 'http://host/run'])
def test_an_untested_store_is_refused_when_training_begins_naming_the_tested(url):
    with pytest.raises(ValueError, match=(
            f"dirname='{url}' is in a {url.split(':')[0]}:// store, which this package is not "
            "tested with; the tested stores are s3://, gs://, gcs://, memory:// and local")):
        fit(url, max_epochs=1)


def test_a_damaged_checkpoint_in_the_bucket_is_skipped_for_latest(s3_bucket):
    url = f's3://{s3_bucket}/run'
    _, cp, _ = fit(url, max_epochs=3)
    shutil.rmtree(cp.folder_.local_dir)
    model = f'{s3_bucket}/run/epoch-0003/model.safetensors'
    s3().pipe_file(model, s3().cat_file(model)[:-10])
    with pytest.warns(UserWarning, match=f'skipping checkpoint {url}/epoch-0003: '
                                         f'{url}/epoch-0003/model.safetensors has'):
        _, cp, load = fit(url, max_epochs=3)
    assert load.loaded_from_.endswith('epoch-0002')
    # epoch 3, trained again, replaced the damaged one
    assert cp.folder_.find_checkpoint('latest').path.endswith('epoch-0003')


# ---------------------------------------------------------------- the command

@pytest.mark.slow
def test_list_and_verify_a_url(s3_bucket):
    url = f's3://{s3_bucket}/run'
    fit(url, max_epochs=2)
    listed = cli('list', url)
    assert listed.returncode == 0, listed.stderr
    assert f'{url}: 2 checkpoint(s)' in listed.stdout
    assert 'latest.json -> epoch-0002' in listed.stdout
    verified = cli('verify', url)
    assert verified.returncode == 0, verified.stderr
    assert f'{url}/epoch-0001: intact' in verified.stdout
    assert f'{url}/epoch-0002: intact' in verified.stdout
    model = f'{s3_bucket}/run/epoch-0001/model.safetensors'
    s3().pipe_file(model, b'0' * len(s3().cat_file(model)))
    damaged = cli('verify', url, 'epoch-0001')
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    assert f'{url}/epoch-0001: DAMAGED' in damaged.stdout
    # same-size garbage: its checksum, as a local folder's list says (issue 30
    # item 6), and exits 1
    listed = cli('list', url)
    assert listed.returncode == 1, listed.stdout + listed.stderr
    rows = {line.split()[0]: line.split()[-1] for line in listed.stdout.splitlines()
            if line.split()[:1] in (['epoch-0001'], ['epoch-0002']) and ' is ' not in line}
    assert rows == {'epoch-0001': 'DAMAGED', 'epoch-0002': 'ok'}, listed.stdout
    assert (f'{url}/epoch-0001/model.safetensors has checksum xxh3_64:' in listed.stdout
            and 'the file is damaged' in listed.stdout), listed.stdout


# ---------------------------------------------------------------- 2 processes

@pytest.mark.slow
def test_two_processes_resume_after_a_kill_and_on_a_new_machine(s3_bucket, tmp_path):
    url = f's3://{s3_bucket}/run'

    def run(tag, expect_ok=True, dirname=url, nproc=2, **env):
        result = launch('resume.py', dirname, tag, nproc=nproc,
                        env=dict(env, RESULT_DIR=str(tmp_path)))
        if expect_ok:
            result.check()
            return read_results(tmp_path, tag, nproc)
        return result

    full = run('full', dirname=str(tmp_path / 'local'))
    killed = run('killed', expect_ok=False, KILL='batch:4:2')
    assert killed.returncodes == [-9, -9]
    # epoch-0003 was committed into the staging folder; its upload may have
    # been cut short by the kill: the next job on this machine finishes it
    resumed = run('resumed')
    assert all(res['loaded_from'] == f'{url}/epoch-0003' for res in resumed)
    assert_identical(final_state(tmp_path, 'full'), final_state(tmp_path, 'resumed'))
    assert json.loads(s3().cat_file(f'{s3_bucket}/run/latest.json')) == {'name': 'epoch-0006'}
    # a new machine: both ranks read what rank 0 downloaded
    shutil.rmtree(default_staging(url))
    again = run('again')
    assert all(res['loaded_from'].endswith('epoch-0006') for res in again)
    assert [res['num_processes'] for res in full + resumed + again] == [2] * 6
    assert len({res['digest'] for res in full + again}) == 1
    # one process on another new machine: the random states derived anew
    shutil.rmtree(default_staging(url))
    (alone,) = run('alone', nproc=1, MAX_EPOCHS='7',
                   LOAD_OPTIONS=json.dumps({'on_world_size_change': 'reseed'}))
    assert alone['num_processes'] == 1
    assert alone['loaded_from'] == f'{url}/epoch-0006'
    assert alone['history'][:6] == again[0]['history'] and len(alone['history']) == 7


@pytest.mark.slow
def test_a_refused_upload_fails_training_on_every_rank(s3_bucket, run_workers):
    url = f's3://{s3_bucket}/run'
    results = run_workers('remote_conflict.py', 'conflict', args=(url,))
    assert [res['num_processes'] for res in results] == [2, 2]
    assert results[0]['error'] == 'CheckpointError', results[0]
    assert f'{url}/epoch-0001/manifest.json exists already' in results[0]['message']
    assert results[1]['error'] == 'RankError', results[1]
    assert 'rank 0' in results[1]['message']
    # refused at the wait before the save of epoch 2: no rank trained on after it
    assert [res['epochs'] for res in results] == [2, 2]
    assert json.loads(s3().cat_file(f'{s3_bucket}/run/epoch-0001/manifest.json')) == {
        'written by': 'another job'}


# ---------------------------------------------------------------- robustness
# (in the full suite only: the quick one is at its limit)

@pytest.mark.slow
def test_leftovers_of_a_cut_upload_are_ignored_then_removed_at_the_next_claim(s3_bucket):
    url = f's3://{s3_bucket}/run'
    fit(url, max_epochs=2)
    fs = s3()
    # what a job killed while uploading epoch-0009 leaves: some of its
    # files, and a multipart upload of another that was never completed
    fs.pipe_file(f'{s3_bucket}/run/epoch-0009/model.safetensors', b'half of it')
    key = 'run/epoch-0009/optimizer.bin'
    unfinished = fs.call_s3('create_multipart_upload', Bucket=s3_bucket, Key=key)
    fs.call_s3('upload_part', Bucket=s3_bucket, Key=key, PartNumber=1,
               UploadId=unfinished['UploadId'], Body=b'a part')
    # not under the folder, or under a run nested in it: not this job's to abort
    fs.call_s3('create_multipart_upload', Bucket=s3_bucket, Key='run-other/file')
    nested = 'run/sub/epoch-0001/model.safetensors'
    fs.call_s3('create_multipart_upload', Bucket=s3_bucket, Key=nested)
    storage = open_storage(url)
    assert storage.committed() == ['epoch-0001', 'epoch-0002']
    assert storage.find_checkpoint('latest').manifest['epoch'] == 2
    _, cp, load = fit(url, max_epochs=3)
    assert load.loaded_from_.endswith('epoch-0002')
    uploads = fs.call_s3('list_multipart_uploads', Bucket=s3_bucket).get('Uploads', [])
    assert sorted(upload['Key'] for upload in uploads) == ['run-other/file', nested]
    assert not [path for path in listing(f'{s3_bucket}/run') if 'epoch-0009' in path]
    assert cp.committed() == ['epoch-0002', 'epoch-0003']


@pytest.mark.slow
def test_the_next_job_of_the_machine_finishes_the_pointers_of_a_cut_upload(s3_bucket):
    url = f's3://{s3_bucket}/run'
    fit(url, max_epochs=2)
    # killed after the manifest of epoch-0002, before its latest.json
    s3().pipe_file(f'{s3_bucket}/run/latest.json', b'{"name": "epoch-0001"}')
    _, cp, load = fit(url, max_epochs=3)
    assert load.loaded_from_ == f'{url}/epoch-0002'
    assert cp.committed() == ['epoch-0002', 'epoch-0003']


@pytest.mark.slow
def test_a_download_whose_bytes_differ_is_refused_naming_the_url(s3_bucket):
    url = f's3://{s3_bucket}/run'
    _, cp, _ = fit(url, max_epochs=2)
    shutil.rmtree(cp.folder_.local_dir)
    # one byte changed, the size kept: only the manifest's checksum sees it
    model = f'{s3_bucket}/run/epoch-0002/model.safetensors'
    data = bytearray(s3().cat_file(model))
    data[-1] ^= 1
    s3().pipe_file(model, bytes(data))
    storage = open_storage(url)
    refused = f'the download of {url}/epoch-0002/model.safetensors is refused: '
    with pytest.raises(CorruptCheckpointError, match=refused + '.* has checksum xxh3_64:'):
        storage.find_checkpoint('epoch-0002')
    with pytest.warns(UserWarning, match=f'skipping checkpoint {url}/epoch-0002: {refused}'):
        assert storage.find_checkpoint('latest').manifest['epoch'] == 1


@pytest.mark.slow
def test_a_staged_copy_damaged_here_is_mended_from_the_bucket(s3_bucket):
    """A staged checkpoint with a damaged file: only that file is downloaded
    again, the intact ones are kept (the same inode)."""
    url = f's3://{s3_bucket}/run'
    _, cp, _ = fit(url, max_epochs=2)
    staged = os.path.join(cp.folder_.local_dir, 'epoch-0002')
    model = os.path.join(staged, 'model.safetensors')
    with open(model, 'r+b') as file:
        file.seek(-1, os.SEEK_END)
        last = file.read(1)
        file.seek(-1, os.SEEK_END)
        file.write(bytes([last[0] ^ 1]))
    inode = os.stat(os.path.join(staged, 'optimizer.bin')).st_ino
    found = open_storage(url).find_checkpoint('latest')
    assert found.path == staged and found.manifest['epoch'] == 2
    with open(model, 'rb') as file:
        assert file.read() == s3().cat_file(f'{s3_bucket}/run/epoch-0002/model.safetensors')
    assert os.stat(os.path.join(staged, 'optimizer.bin')).st_ino == inode


def test_the_manifest_of_the_nodes_parts_lists_every_node_s_files():
    node0 = {'epoch': 2, 'files': {'model.safetensors': 10, 'random_states_0.pkl': 3},
             'checksums': {'model.safetensors': 'xxh3_64:a', 'random_states_0.pkl': 'xxh3_64:b'},
             'bytes': 13}
    node1 = {'epoch': 2, 'files': {'model.safetensors': 10, 'random_states_1.pkl': 4},
             'checksums': {'model.safetensors': 'xxh3_64:c', 'random_states_1.pkl': 'xxh3_64:d'},
             'bytes': 14}
    assert merged_manifest([node0, node1]) == {
        'epoch': 2,
        'files': {'model.safetensors': 10, 'random_states_0.pkl': 3, 'random_states_1.pkl': 4},
        'checksums': {'model.safetensors': 'xxh3_64:a', 'random_states_0.pkl': 'xxh3_64:b',
                      'random_states_1.pkl': 'xxh3_64:d'},
        'bytes': 17}


@pytest.mark.slow
def test_every_object_is_sent_with_a_crc32_that_the_store_keeps(s3_bucket):
    """Also where botocore adds a checksum only when an operation requires
    one (``when_required``, as older botocore did)."""
    url = f's3://{s3_bucket}/run'
    fit(url, max_epochs=1, storage_options={
        'config_kwargs': {'request_checksum_calculation': 'when_required'}})
    fs = s3()
    stored = listing(f'{s3_bucket}/run')
    assert stored == sorted(['latest.json'] + [f'epoch-0001/{file}' for file in FILES])
    for rel in stored:
        head = fs.call_s3('head_object', Bucket=s3_bucket, Key=f'run/{rel}',
                          ChecksumMode='ENABLED')
        crc = zlib.crc32(fs.cat_file(f'{s3_bucket}/run/{rel}')).to_bytes(4, 'big')
        assert head.get('ChecksumCRC32') == base64.b64encode(crc).decode(), rel


@pytest.mark.slow
def test_missing_credentials_are_refused_before_training(s3_bucket, monkeypatch, tmp_path):
    for name in ('AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY'):
        monkeypatch.delenv(name)
    for name in ('AWS_SHARED_CREDENTIALS_FILE', 'AWS_CONFIG_FILE'):
        monkeypatch.setenv(name, str(tmp_path / 'none'))
    monkeypatch.setenv('AWS_EC2_METADATA_DISABLED', 'true')
    url = f's3://{s3_bucket}/run'
    with pytest.raises(CheckpointError, match=f'cannot save into {url}: NoCredentialsError'):
        fit(url, max_epochs=1, storage_options={'skip_instance_cache': True})


class SignalAt(Callback):
    """SIGTERM to this process after the first batch this fit trains in ``epoch``."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_begin(self, net, **kwargs):
        self.sent = False

    def on_batch_end(self, net, training=False, **kwargs):
        if training and len(net.history) == self.epoch and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


# s3fs's own retries only: a failed upload fails in a second or two
NO_RETRIES = {'skip_instance_cache': True,
              'config_kwargs': {'retries': {'total_max_attempts': 1}}}


def cut_fit(network, url, drop_on, cut_on, max_epochs, *callbacks):
    """A fit into ``url`` whose network drops the requests matching
    ``drop_on``, or goes down at the one matching ``cut_on``; the checkpoint
    callback, what it said, the error the fit raised."""
    network.fired.clear()
    network.drop_on, network.cut_on = drop_on, cut_on
    said = []
    # a network that stays down: its requests are sent again for 2 s only
    cp = AccelerateCheckpoint(dirname=url, storage_options=NO_RETRIES, sink=said.append,
                              outage_seconds=2)
    load = AccelerateLoadInitState(cp)
    torch.manual_seed(0)
    net = make_net(make_accelerator(), callbacks=[cp, load, *callbacks], max_epochs=max_epochs)
    with pytest.raises((StoreUnavailableError, TrainingPreempted)) as info:
        net.fit(*make_data(n=160))
    assert network.fired.is_set() == bool(drop_on or cut_on), info.value
    return cp, load, said, info.value


@pytest.mark.slow
# SignalAt has no state to checkpoint
@pytest.mark.filterwarnings('ignore:.*SignalAt.* act on every batch:UserWarning')
def test_an_upload_the_network_cuts_fails_naming_the_staged_checkpoint(s3_bucket, network):
    """The error says the upload failed, names its URL and the staged
    checkpoint, which the next job of the machine uploads: at the next
    save's wait, before TrainingPreempted, at the end of training."""
    url = f's3://{s3_bucket}/run'
    staged = default_staging(url)

    def failed(error, name):
        return (f'the upload of {url}/{name} failed' in str(error)
                and f'stays staged in {os.path.join(staged, name)}' in str(error))

    # each save tells an upload that ended, or raises its failure: the
    # uploads end before the saves of epochs 2 and 3
    cp, _, said, error = cut_fit(network, url, rb'PUT /[^ ]*/run/epoch-0002/manifest\.json',
                                 None, 3, UploadsEnded(epochs=(2, 3)))
    assert failed(error, 'epoch-0002'), error
    assert [line for line in said if line.startswith(f'Uploaded {url}/epoch-0001 in ')]
    assert open_storage(url).committed() == ['epoch-0001']
    network.drop_on = None
    cp.close()  # the process ended
    # the next job finishes the upload and resumes from it; the upload of the
    # checkpoint at its SIGTERM is cut: the error comes before TrainingPreempted
    cp, load, said, error = cut_fit(network, url, rb'PUT /[^ ]*/run/epoch-0002-step-\d+/manif',
                                    None, 3, SignalAt(3))
    assert load.loaded_from_ == f'{url}/epoch-0002'
    step = cp.last_saved_
    assert step.startswith('epoch-0002-step-') and failed(error, step), error
    # on SIGTERM the upload is finished before TrainingPreempted, and timed
    _, load, said, error = cut_fit(network, url, None, None, 3, SignalAt(3))
    assert load.loaded_from_ == f'{url}/{step}'
    assert isinstance(error, TrainingPreempted), error
    uploaded = [index for index, line in enumerate(said) if line.startswith(
        f'Uploaded {url}/{error.checkpoint[len(url) + 1:]} in ')]
    stopping = [index for index, line in enumerate(said) if line.startswith('Stopping on')]
    assert uploaded and stopping and uploaded[0] < stopping[0], said
    # the network stays down: the upload of the end of training fails
    with pytest.warns(UserWarning, match=f'could not remove the lease of {url}'):
        _, _, said, error = cut_fit(network, url, None, rb'PUT /[^ ]*/run/epoch-0003/manif', 3)
    assert failed(error, 'epoch-0003'), error
    assert check_manifest(os.path.join(staged, 'epoch-0003'))[1] == []


@pytest.mark.slow
def test_a_multipart_upload_cut_by_the_network_is_aborted_at_the_next_claim(
        s3_bucket, network, tmp_path):
    """s3fs sends a file of 100 MiB or more in parts; when the network goes
    down after the upload began, s3fs cannot abort it either: the next job
    finishes the upload, with a CRC32 for the whole object, and aborts the
    unfinished one."""
    url = f's3://{s3_bucket}/run'
    net = make_net(make_accelerator()).initialize()
    # a network that stays down: its requests are sent again for 2 s only
    storage = open_storage(url, local_dir=tmp_path / 'staging', storage_options=NO_RETRIES,
                           outage_seconds=2)
    storage.claim(net)
    content = {'format_version': _manifest.FORMAT_VERSION}
    for name, size in (('epoch-0001', 10), ('epoch-0002', 100 * 2**20 + 1)):
        with open(os.path.join(storage.start(name), 'model.safetensors'), 'wb') as file:
            file.write(os.urandom(size))
        network.cut_on = rb'PUT /[^ ]*/run/epoch-0002/model\.safetensors\?partNumber=1&'
        storage.commit(name, content, durable=False, best=False)
        if name == 'epoch-0002':
            with pytest.raises(StoreUnavailableError,
                               match=f'the upload of {url}/epoch-0002 failed'):
                storage.wait()
        else:
            storage.wait()
    assert network.fired.is_set()
    network.restore()
    storage.release()
    fs = s3()
    key = 'run/epoch-0002/model.safetensors'
    unfinished = fs.call_s3('list_multipart_uploads', Bucket=s3_bucket).get('Uploads', [])
    assert [upload['Key'] for upload in unfinished] == [key]
    again = open_storage(url, local_dir=tmp_path / 'staging')
    again.claim(net)
    again.release()
    assert fs.call_s3('list_multipart_uploads', Bucket=s3_bucket).get('Uploads', []) == []
    assert again.committed() == ['epoch-0001', 'epoch-0002']
    head = fs.call_s3('head_object', Bucket=s3_bucket, Key=key, ChecksumMode='ENABLED')
    assert head.get('ChecksumCRC32'), head


def test_files_that_failed_past_the_client_s_retries_are_sent_again(
        s3_bucket, network, tmp_path):
    """A file cannot be sent for longer than the client retries (s3fs's
    retries, botocore's are off here), and can again before the upload's
    next attempt: the upload sends the files again, with a warning, and
    commits."""
    url = f's3://{s3_bucket}/run'
    net = make_net(make_accelerator()).initialize()
    storage = open_storage(url, local_dir=tmp_path / 'staging', storage_options=NO_RETRIES)
    storage.claim(net)
    with open(os.path.join(storage.start('epoch-0001'), 'model.safetensors'), 'wb') as file:
        file.write(os.urandom(1000))
    # every attempt at the file fails until the upload warned that its first did
    network.drop_on = rb'PUT /[^ ]*/run/epoch-0001/model\.safetensors '

    def back_once_warned(warned):
        deadline = time.monotonic() + 30
        while not warned and time.monotonic() < deadline:
            time.sleep(0.01)
        network.drop_on = None

    # the upload's thread warns: from the commit that starts it to the wait
    with pytest.warns(UserWarning, match=f'sending the files of {url}/epoch-0001 failed '
                      r'\(.*\); sending it again for up to 60 s') as warned:
        back = threading.Thread(target=back_once_warned, args=(warned,))
        back.start()
        storage.commit('epoch-0001', {'format_version': _manifest.FORMAT_VERSION},
                       durable=False, best=False)
        storage.wait()
    back.join()
    storage.release()
    assert network.fired.is_set()
    assert open_storage(url).committed() == ['epoch-0001']
    assert open_storage(url).check('epoch-0001')[1] is None


@pytest.mark.slow
def test_two_nodes_each_stage_on_their_own_disk_and_resume_from_one_bucket(s3_bucket, tmp_path):
    """Two node ranks on loopback (nnodes=2, one process each), as torchrun
    --nnodes 2 would start them, each staging on its own disk: refused
    before any step, naming the rank, unless save_on_each_node. With it each
    node uploads its part; when node 1's fails, the save fails on every
    rank, naming the node, and the store keeps the checkpoint before; the
    relaunch on the same machines finishes that upload from both nodes and
    resumes from it (each node's own files kept, the other's downloaded),
    and on new machines (all downloaded) ends bit-identical."""
    url = f's3://{s3_bucket}/run'
    staging = tmp_path / 'staging'

    def run(tag, dirname=url, fails=False, **env):
        result = launch('resume.py', dirname, tag, nproc=1, nnodes=2,
                        env=dict(env, RESULT_DIR=str(tmp_path), STAGING_PER_NODE=str(staging)))
        if fails:
            assert all(rc not in (0, None) for rc in result.returncodes), result.report()
        else:
            result.check()
            results = read_results(tmp_path, tag, 2)
            assert [res['num_processes'] for res in results] == [2, 2]
            return results
        return result

    apart = run('apart', fails=True)
    for rank, out in enumerate(apart.outputs):
        # each rank names the folder of its own node
        assert (f"rank 1 (the main process of its node) does not see the folder "
                f"{staging / f'node{rank}'} as rank 0 does") in out, out[-3000:]
        assert 'set save_on_each_node=True to stage on' in out
    assert not [path for path in listing(f'{s3_bucket}/run') if 'epoch-' in path]

    # node 1's part of epoch 2 cannot be sent (the network down, past the
    # 2 s that its requests are sent again): the save fails on every rank,
    # and the store keeps epoch 1
    failing = run('first', fails=True, MAX_EPOCHS='2', SHARED_PER_NODE='1',
                  FAIL_UPLOAD='1:2', OUTAGE_SECONDS='2')
    assert (tmp_path / 'failed-upload-rank1.json').exists()
    assert (f"node 1 (rank 1) could not upload its part of {url}/epoch-0002: "
            f"StoreUnavailableError: sending the files of {url}/epoch-0002 failed for "
            ) in failing.outputs[0], failing.outputs[0][-3000:]
    assert (f"the upload of {url}/epoch-0002 failed: sending the files of {url}/epoch-0002 "
            "failed for" in failing.outputs[1]), failing.outputs[1][-3000:]
    assert 'Network is unreachable' in failing.outputs[1]
    rng_files = ['random_states_0.pkl', 'random_states_1.pkl']
    s3().invalidate_cache()
    assert json.loads(s3().cat_file(f'{s3_bucket}/run/latest.json')) == {'name': 'epoch-0001'}
    assert not s3().exists(f'{s3_bucket}/run/epoch-0002/manifest.json')
    for node in (0, 1):
        # each node staged its own ranks' part only
        assert sorted(path.name for path in (staging / f'node{node}' / 'epoch-0002').glob(
            'random_states_*')) == [f'random_states_{node}.pkl']
    model = staging / 'node1' / 'epoch-0002' / 'model.safetensors'
    inode = model.stat().st_ino

    # the same machines: the claim finishes the failed upload from both nodes
    again = run('again', MAX_EPOCHS='2', SHARED_PER_NODE='1')
    assert [res['loaded_from'] for res in again] == [f'{url}/epoch-0002'] * 2
    assert [len(res['history']) for res in again] == [2, 2]
    s3().invalidate_cache()
    manifest = json.loads(s3().cat_file(f'{s3_bucket}/run/epoch-0002/manifest.json'))
    assert [rel for rel in manifest['files'] if rel.startswith('random_states')] == rng_files
    for node in (0, 1):
        kept = staging / f'node{node}' / 'epoch-0002'
        # the other node's files were downloaded beside its own...
        assert sorted(path.name for path in kept.glob('random_states_*')) == rng_files
    # ... which were kept, not downloaded again
    assert model.stat().st_ino == inode
    shutil.rmtree(staging)
    resumed = run('resumed', MAX_EPOCHS='4', SHARED_PER_NODE='1')
    assert [res['loaded_from'] for res in resumed] == [f'{url}/epoch-0002'] * 2
    run('full', f's3://{s3_bucket}/full', MAX_EPOCHS='4', SHARED_PER_NODE='1')
    assert_identical(final_state(tmp_path, 'full'), final_state(tmp_path, 'resumed'))
    assert s3().glob(f'{s3_bucket}/run/epoch-*/manifest.json') and not s3().glob(
        f'{s3_bucket}/run/epoch-0001/*')


@pytest.mark.slow
def test_another_fsspec_store_commits_and_resumes(tmp_path):
    """memory:// (fsspec's in-process store) through the same code as S3,
    without a lease: its lock is the staging folder's."""
    url = f'memory://test-{os.getpid()}-{id(tmp_path)}/run'
    _, cp, _ = fit(url, max_epochs=2, local_dir=str(tmp_path / 'staging'))
    assert cp.committed() == ['epoch-0001', 'epoch-0002']
    resumed, cp, load = fit(url, max_epochs=3, local_dir=str(tmp_path / 'other-staging'))
    assert load.loaded_from_ == f'{url}/epoch-0002'
    assert len(resumed.history) == 3
    assert json.loads(fsspec.filesystem('memory').cat_file(
        url[len('memory://'):] + '/latest.json')) == {'name': 'epoch-0003'}


@pytest.mark.slow
def test_the_next_job_uploads_only_the_newest_complete_of_several_staged(s3_bucket, tmp_path):
    """A job killed with several checkpoints queued for upload leaves them
    staged: the next job of the machine uploads the newest complete one,
    not the older ones (superseded), and resumes from it; a staged
    checkpoint older than the bucket's newest is never uploaded."""
    local = tmp_path / 'local'
    fit(str(local), max_epochs=4, keep_last=4)
    url = f's3://{s3_bucket}/run'
    _, cp, _ = fit(url, max_epochs=1)
    staging = cp.folder_.local_dir
    for name in ('epoch-0002', 'epoch-0003', 'epoch-0004'):
        shutil.copytree(local / name, os.path.join(staging, name))
    # the newest staged is damaged: the one before it is the newest complete
    with open(os.path.join(staging, 'epoch-0004', 'model.safetensors'), 'r+b') as file:
        file.truncate(10)
    _, cp, load = fit(url, max_epochs=3)
    assert load.loaded_from_ == f'{url}/epoch-0003'
    assert cp.committed() == ['epoch-0001', 'epoch-0003']
    assert not [path for path in listing(f'{s3_bucket}/run') if path.startswith('epoch-0002/')]
    assert cp.folder_.pointed('latest') == 'epoch-0003'
    # still staged, and now older than the bucket's newest: not uploaded
    assert CheckpointFolder(staging).committed() == [
        'epoch-0001', 'epoch-0002', 'epoch-0003', 'epoch-0004']
    for name in ('epoch-0003', 'epoch-0004'):
        shutil.rmtree(os.path.join(staging, name))
    _, cp, load = fit(url, max_epochs=3)
    assert load.loaded_from_ == f'{url}/epoch-0003'
    assert cp.committed() == ['epoch-0001', 'epoch-0003']
