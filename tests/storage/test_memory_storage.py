"""A third kind of storage needs only the backend operations of
:class:`~skorch_accel_callbacks.storage._interface.CheckpointStorage`.

``MemoryStorage`` keeps the checkpoints of ``memory://run`` in fsspec's
MemoryFileSystem (a store of the process, real, not a mock): written into a
local staging folder, committed there, copied into the store with the
manifest last and create-only, guarded by a lease object written
create-only. Which checkpoint is the newest complete one, which the best,
what retention keeps: none of it is written here; the interface's policy
decides it, as it does for the local folder and the fsspec store.
"""

import json
import os
import shutil

import fsspec
import pytest

import checkpointed
from checkpointed import state
from common import make_accelerator, make_net
from skorch_accel_callbacks import AccelerateCheckpoint
from skorch_accel_callbacks.errors import FolderInUseError
from skorch_accel_callbacks.format import (
    HISTORY_NAME,
    LEASE_NAME,
    MANIFEST_NAME,
    pointer_name,
    read_manifest,
)
from skorch_accel_callbacks.storage import CheckpointStorage, Found
from skorch_accel_callbacks.storage._local import CheckpointFolder
from testutil import assert_identical


class MemoryStorage(CheckpointStorage):
    """The checkpoints of ``dirname`` (``memory://run``) in fsspec's memory
    store, staged in the local folder ``local_dir``; one job at a time holds
    the lease object ``.lease.json``."""

    def __init__(self, dirname, local_dir):
        self.dirname = dirname.rstrip('/')
        self.fs, self.root = fsspec.core.url_to_fs(self.dirname)
        self.staging = CheckpointFolder(local_dir)
        self.leased = False

    def _at(self, *parts):
        return '/'.join((self.root, *parts))

    # the backend operations
    def claim(self, net):
        if not self.leased:
            try:
                self.fs.pipe_file(self._at(LEASE_NAME), b'{"holder": "this test"}',
                                  mode='create')
            except FileExistsError as exc:
                raise FolderInUseError(f"{self.dirname} is leased by another job") from exc
            self.leased = True
        self.staging.claim(net)

    def release(self):
        if self.leased:
            self.fs.rm_file(self._at(LEASE_NAME))
            self.leased = False
        self.staging.release()

    def path(self, name):
        return self.staging.path(name)

    def url(self, name):
        return f"{self.dirname}/{name}"

    def partial_path(self, name):
        return self.staging.partial_path(name)

    def start(self, name):
        return self.staging.start(name)

    def commit(self, name, sealed, durable, best, started=None, early=None):
        written = self.staging.commit(name, sealed, durable=durable, best=best,
                                      started=started, early=early)
        local = self.staging.path(name)
        for rel in written['files']:
            self.fs.put_file(os.path.join(local, rel), self._at(name, rel))
        manifest = self._at(name, MANIFEST_NAME)
        if self.fs.exists(manifest):
            self.fs.rm_file(manifest)  # an epoch trained again replaces its checkpoint
        with open(os.path.join(local, MANIFEST_NAME), 'rb') as f:
            self.fs.pipe_file(manifest, f.read(), mode='create')
        for which in ('latest', 'best') if best else ('latest',):
            self.fs.pipe_file(self._at(pointer_name(which)),
                              json.dumps({'name': name}).encode())
        return written

    def wait(self):
        self.staging.wait()

    def exists(self):
        return self.fs.exists(self.root)

    def list_names(self):
        return {path[len(self.root) + 1:].partition('/')[0]
                for path in self.fs.find(self.root)
                if path.endswith('/' + MANIFEST_NAME)}

    def read_json(self, *parts):
        return json.loads(self.fs.cat_file(self._at(*parts)))

    def check(self, name):
        try:
            saved = self.read_json(name, MANIFEST_NAME)
        except (OSError, ValueError) as exc:
            return {}, f"{self.url(name)}/{MANIFEST_NAME}: {exc}"
        for rel, size in saved['files'].items():
            if self.fs.size(self._at(name, rel)) != size:
                return saved, f"{self.url(name)}/{rel} has another size than listed"
        return saved, None

    def fetch(self, name):
        local = self.staging.path(name)
        shutil.rmtree(local, ignore_errors=True)
        self.fs.get(self._at(name) + '/', local + '/', recursive=True)
        return Found(local, read_manifest(local))

    def remove(self, name):
        self.fs.rm_file(self._at(name, MANIFEST_NAME))
        self.fs.rm(self._at(name), recursive=True)


class MemoryCheckpoint(AccelerateCheckpoint):
    """An ``AccelerateCheckpoint`` whose storage is a :class:`MemoryStorage`."""

    def open_storage(self):
        return MemoryStorage(self.dirname, self.local_dir)


@pytest.fixture
def memory_url():
    """A folder of its own in fsspec's memory store: its URL."""
    url = f'memory://run-{os.getpid()}-{id(object())}'
    yield url
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def fit(url, staging, max_epochs, **cp_kwargs):
    """The net and its :class:`MemoryCheckpoint` of ``url``, staged in ``staging``."""
    net, cp, _ = checkpointed.fit(url, max_epochs=max_epochs, checkpoint_class=MemoryCheckpoint,
                                  local_dir=str(staging), **cp_kwargs)
    return net, cp


@pytest.mark.slow
def test_a_net_checkpoints_into_memory_and_resumes_from_it(memory_url, tmp_path):
    full, _ = fit(memory_url + '-full', tmp_path / 'full', max_epochs=4)
    _, cp = fit(memory_url, tmp_path / 'staging', max_epochs=2)
    fs, root = fsspec.core.url_to_fs(memory_url)
    assert cp.committed() == ['epoch-0001', 'epoch-0002']
    assert json.loads(fs.cat_file(f'{root}/latest.json')) == {'name': 'epoch-0002'}
    assert not fs.exists(f'{root}/{LEASE_NAME}')  # released at the end of fit
    # a new machine: nothing staged, the store alone
    shutil.rmtree(tmp_path / 'staging')
    resumed, cp = fit(memory_url, tmp_path / 'staging', max_epochs=4)
    assert [row['epoch'] for row in resumed.history] == [1, 2, 3, 4]
    assert cp.committed()[-1] == 'epoch-0004'
    assert_identical(state(full), state(resumed))


@pytest.mark.slow
def test_retention_and_best_in_memory(memory_url, tmp_path):
    _, cp = fit(memory_url, tmp_path / 'staging', max_epochs=4, keep_last=2,
                monitor='valid_loss_best')
    storage = cp.open_storage()
    best = storage.pointed('best')
    assert best is not None and storage.marked_best(best)
    # the two newest and the best are kept, the rest retired from the store
    assert storage.committed() == sorted({best, 'epoch-0003', 'epoch-0004'})
    assert storage.find_checkpoint('best').manifest['epoch'] == int(best[len('epoch-'):])
    # a damaged newest is skipped for the one before, the warning naming its URL
    fs, root = fsspec.core.url_to_fs(memory_url)
    fs.pipe_file(f'{root}/epoch-0004/{HISTORY_NAME}', b'[]')
    with pytest.warns(UserWarning, match=f"skipping checkpoint {memory_url}/epoch-0004"):
        assert storage.find_checkpoint('latest').path == storage.path('epoch-0003')


def test_the_lease_keeps_a_second_job_out(memory_url, tmp_path):
    net = make_net(make_accelerator(), max_epochs=1)
    first = MemoryStorage(memory_url, tmp_path / 'a')
    first.fs.mkdir(first.root)
    first.claim(net)
    second = MemoryStorage(memory_url, tmp_path / 'b')
    with pytest.raises(FolderInUseError, match=f"{memory_url} is leased"):
        second.claim(net)
    first.release()
    second.claim(net)
    second.release()
