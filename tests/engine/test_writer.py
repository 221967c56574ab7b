"""The writers, the storage interface and the restore, each on its own.

One process, a real accelerator and a real folder: the callbacks are not
involved, only what they hand down (a SaveRequest) and read back (a
Restored record).
"""

import threading

import pytest
import torch

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks.engine import (
    BackgroundWriter,
    ResumeChecks,
    Retention,
    SaveRequest,
    SyncWriter,
    _restore as restore,
    _state_files as state_files,
    read_checkpoint,
)
from skorch_accel_callbacks.engine._writer import SaveReport
from skorch_accel_callbacks.format import read_manifest
from skorch_accel_callbacks.state import find_train_loader
from skorch_accel_callbacks.storage import CheckpointStorage, open_storage
from skorch_accel_callbacks.storage._local import CheckpointFolder
from testutil import read_json, replace_everywhere


@pytest.fixture
def trained():
    torch.manual_seed(0)
    net = make_net(make_accelerator(), max_epochs=1)
    net.fit(*make_data(n=64))
    return net


def request_for(net, name='epoch-0001', **kwargs):
    return SaveRequest(name=name, step=2, batches=0,
                       train_loader=find_train_loader(net, None), **kwargs)


def claimed(tmp_path, net):
    storage = open_storage(tmp_path / 'ck')
    storage.claim(net)
    return storage


def test_the_local_folder_is_a_checkpoint_storage(tmp_path):
    assert isinstance(open_storage(tmp_path), CheckpointStorage)
    assert isinstance(open_storage(tmp_path), CheckpointFolder)


def test_sync_writer_commits_before_it_returns_and_reports(tmp_path, trained):
    storage = claimed(tmp_path, trained)
    writer = SyncWriter(storage, Retention(keep_last=2))
    report = writer.save(trained, request_for(trained, best=True))
    try:
        saved = read_json(tmp_path / 'ck' / 'epoch-0001' / 'manifest.json')
        assert isinstance(report, SaveReport)
        assert report.path == storage.path('epoch-0001')
        assert report.bytes == saved['bytes'] > 0
        assert report.seconds == saved['save_seconds'] >= 0
        assert report.blocked_seconds is None and 'blocked_seconds' not in saved
        assert saved['position'] == {'step': 2, 'batches': 0}
        assert storage.committed() == ['epoch-0001'] and storage.pointed('best') == 'epoch-0001'
        assert not writer.busy()
        assert report.message().startswith(f"Saved checkpoint {report.path}: ")
    finally:
        writer.close()
        storage.release()


def test_sync_writer_retires_by_its_retention_and_keeps_what_is_asked(tmp_path, trained):
    storage = claimed(tmp_path, trained)
    writer = SyncWriter(storage, Retention(keep_last=1))
    try:
        for epoch in range(1, 5):
            writer.save(trained, request_for(trained, name=f'epoch-{epoch:04d}',
                                             keep=('epoch-0001',)))
            writer.wait(trained)
        assert storage.committed() == ['epoch-0001', 'epoch-0004']
    finally:
        writer.close()
        storage.release()


def test_background_writer_reports_when_waited_for(tmp_path, trained, monkeypatch):
    release = threading.Event()
    original = state_files.write_large_state

    def held(*args):
        assert release.wait(10)
        original(*args)

    monkeypatch.setattr(state_files, 'write_large_state', held)
    storage = claimed(tmp_path, trained)
    writer = BackgroundWriter(SyncWriter(storage, Retention(keep_last=2)))
    try:
        assert writer.save(trained, request_for(trained)) is None
        assert writer.busy()
        # not committed while the large states are still being written
        assert storage.committed() == []
        with pytest.raises(RuntimeError, match='not waited for'):
            writer.save(trained, request_for(trained, name='epoch-0002'))
        release.set()
        report = writer.wait(trained)
        assert not writer.busy()
        saved = read_json(tmp_path / 'ck' / 'epoch-0001' / 'manifest.json')
        assert report.bytes == saved['bytes']
        assert report.blocked_seconds == saved['blocked_seconds'] >= 0
        assert 'training blocked' in report.message()
        assert writer.wait(trained) is None  # nothing in flight any more
    finally:
        release.set()
        writer.close()
        storage.release()


def test_a_failed_background_write_raises_at_the_wait_then_never_again(
        tmp_path, trained, monkeypatch):
    def full_disk(*args):
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(state_files, 'write_large_state', full_disk)
    storage = claimed(tmp_path, trained)
    writer = BackgroundWriter(SyncWriter(storage, Retention(keep_last=2)))
    try:
        writer.save(trained, request_for(trained))
        with pytest.raises(OSError, match='No space left'):
            writer.wait(trained)
        assert storage.committed() == []
        # the failure was reported: closing raises nothing more
        writer.close()
    finally:
        storage.release()


def test_close_raises_what_a_save_nobody_waited_for_raised(tmp_path, trained, monkeypatch):
    def full_disk(*args):
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(state_files, 'write_large_state', full_disk)
    storage = claimed(tmp_path, trained)
    writer = BackgroundWriter(SyncWriter(storage, Retention(keep_last=2)))
    writer.save(trained, request_for(trained))
    try:
        with pytest.raises(OSError, match='No space left'):
            writer.close()
        assert not any(t.name.startswith('checkpoint-writer') for t in threading.enumerate())
    finally:
        storage.release()


class RecordingStorage(CheckpointFolder):
    """A storage of its own kind: a folder that records what it is asked."""

    def __init__(self, dirname):
        super().__init__(dirname)
        self.calls = []

    def start(self, name):
        self.calls.append(('start', name))
        return super().start(name)

    def commit(self, name, content, durable, best, started=None, early=None):
        self.calls.append(('commit', name))
        return super().commit(name, content, durable, best, started, early)


def test_a_writer_uses_its_storage_through_the_interface_only(tmp_path, trained):
    storage = RecordingStorage(tmp_path / 'ck')
    storage.claim(trained)
    writer = BackgroundWriter(SyncWriter(storage, Retention(keep_last=2)))
    try:
        writer.save(trained, request_for(trained))
        writer.wait(trained)
    finally:
        writer.close()
        storage.release()
    assert storage.calls == [('start', 'epoch-0001'), ('commit', 'epoch-0001')]


def test_read_checkpoint_gives_a_record_of_what_was_saved(tmp_path, trained, monkeypatch):
    storage = claimed(tmp_path, trained)
    writer = SyncWriter(storage, Retention(keep_last=2))
    writer.save(trained, request_for(trained))
    writer.close()
    storage.release()
    torch.manual_seed(1)
    other = make_net(make_accelerator(), max_epochs=1).initialize()
    reads = []
    original = read_manifest
    replace_everywhere(monkeypatch, original,
                       lambda folder: reads.append(folder) or original(folder))
    restored = read_checkpoint(
        other, restore.Chosen(storage.path('epoch-0001')), ResumeChecks())
    assert reads == [storage.path('epoch-0001')]
    assert restored.path == storage.path('epoch-0001') and restored.step == 2
    assert restored.inside is None and restored.reseeded_from is None
    assert restored.epochs_done == 1 and not restored.stopped_early
    assert restored.history[-1]['train_loss'] == trained.history[-1]['train_loss']
    assert restored.rank_state is not None
    # the accelerator state is loaded; the rest waits for the hooks to apply it
    for key, value in trained.module_.state_dict().items():
        assert torch.equal(other.module_.state_dict()[key], value), key
    assert len(other.history) == 0
