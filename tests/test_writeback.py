"""Early write-back of a durable save (issue 31, item 2): while a save's
files are written, their bytes are handed to the disk chunk by chunk
(``sync_file_range``), so that the commit's fsyncs wait less. These tests
record the real calls (the real ``sync_file_range`` runs) and show that
they happen during the block, cover every byte of every file once, and
that the save's files and their durability are what they were."""

import os
import threading
import time

import pytest

from skorch_accel_callbacks.format import _atomic as atomic

CHUNK = atomic.WRITEBACK_CHUNK

pytestmark = pytest.mark.skipif(atomic._START_WRITEBACK is None,
                                reason="no sync_file_range on this system")


@pytest.fixture
def handed(monkeypatch):
    """Every range handed to the disk: ``[(path, offset, nbytes)]``, from
    the real ``sync_file_range``'s calls that succeeded."""
    calls = []
    real = atomic._START_WRITEBACK

    def recorded(fd, offset, nbytes, flags):
        result = real(fd, offset, nbytes, flags)
        if result == 0:
            calls.append((os.readlink(f'/proc/self/fd/{fd}'), offset, nbytes))
        return result

    monkeypatch.setattr(atomic, '_START_WRITEBACK', recorded)
    return calls


def covered(calls, path):
    """The ranges handed for ``path``, checked to follow each other from 0;
    the bytes they cover."""
    end = 0
    for _, offset, nbytes in [call for call in calls if call[0] == os.path.realpath(path)]:
        assert offset == end, f"{path}: range at {offset} after {end}"
        end = offset + nbytes
    return end


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the write-back thread did not run"
        time.sleep(0.01)


def test_chunks_are_handed_while_the_file_is_written_and_the_rest_at_the_end(
        tmp_path, handed):
    path = tmp_path / 'sub' / 'model.bin'
    path.parent.mkdir()
    with atomic.write_back_while_writing(tmp_path), open(path, 'wb') as f:
        f.write(b'\1' * (2 * CHUNK))
        f.flush()
        # during the block: both whole chunks, not the file's end yet
        wait_for(lambda: covered(handed, path) == 2 * CHUNK)
        f.write(b'\2' * 100)
        f.flush()
        time.sleep(5 * atomic.WRITEBACK_INTERVAL)
        assert covered(handed, path) == 2 * CHUNK  # less than a chunk waits for the end
    assert covered(handed, path) == 2 * CHUNK + 100
    assert path.read_bytes() == b'\1' * (2 * CHUNK) + b'\2' * 100


def test_every_file_is_handed_once_also_those_written_last(tmp_path, handed):
    sizes = {'a.bin': CHUNK + 1, 'b.bin': 10, 'c.bin': 0}
    with atomic.write_back_while_writing(tmp_path):
        for name, size in sizes.items():
            (tmp_path / name).write_bytes(b'x' * size)
    for name, size in sizes.items():
        assert covered(handed, tmp_path / name) == size
    assert not [call for call in handed if call[2] == 0]  # an empty file needs nothing


def test_a_file_removed_meanwhile_is_left_out_and_no_descriptor_is_left_open(
        tmp_path, handed):
    fds_before = set(os.listdir('/proc/self/fd'))
    with atomic.write_back_while_writing(tmp_path):
        (tmp_path / 'gone.bin').write_bytes(b'x' * CHUNK)
        wait_for(lambda: covered(handed, tmp_path / 'gone.bin') == CHUNK)
        os.remove(tmp_path / 'gone.bin')
        (tmp_path / 'kept.bin').write_bytes(b'y' * 3)
    assert covered(handed, tmp_path / 'kept.bin') == 3
    assert set(os.listdir('/proc/self/fd')) <= fds_before
    assert not [t for t in threading.enumerate() if t.name.startswith('writeback-')]


def test_an_exception_in_the_block_is_raised_and_the_thread_ends(tmp_path, handed):
    with pytest.raises(KeyError, match='writer failed'), \
            atomic.write_back_while_writing(tmp_path):
        (tmp_path / 'a.bin').write_bytes(b'x' * 5)
        raise KeyError('writer failed')
    assert covered(handed, tmp_path / 'a.bin') == 5
    assert not [t for t in threading.enumerate() if t.name.startswith('writeback-')]


def test_a_failing_hint_stops_the_thread_and_fails_nothing(tmp_path, monkeypatch):
    calls = []

    def refused(fd, offset, nbytes, flags):
        calls.append(offset)
        return -1  # as sync_file_range on a filesystem that refuses it

    monkeypatch.setattr(atomic, '_START_WRITEBACK', refused)
    with atomic.write_back_while_writing(tmp_path):
        (tmp_path / 'a.bin').write_bytes(b'x' * (3 * CHUNK))
        wait_for(lambda: calls)
        (tmp_path / 'b.bin').write_bytes(b'x' * (3 * CHUNK))
        time.sleep(5 * atomic.WRITEBACK_INTERVAL)
    assert calls == [0]  # tried once, then given up for this save
