"""The page cache filled with a checkpoint's files while the net initializes
(engine/_prefetch.py): a fill reads what the cache lacks and nothing else,
stops when told, and the resume callback begins one for the checkpoint it
will check when it is initialized, stops it when training begins, on one
process a node, and stays picklable meanwhile.

The page cache is the real one: each test evicts its files
(``posix_fadvise(POSIX_FADV_DONTNEED)`` after an fsync) and proves the
eviction took with ``mincore``.
"""

import copy
import ctypes
import mmap
import os
import pickle
import threading
import time

import pytest
from sklearn.base import clone

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
from skorch_accel_callbacks.engine import PageCacheFill, _prefetch

PAGE = os.sysconf('SC_PAGE_SIZE')
LIBC = ctypes.CDLL(None, use_errno=True)


def cached_pages(path):
    """How many of the file's pages are in the page cache (``mincore`` of a
    mapping of it, which reads nothing: a probe by ``preadv(RWF_NOWAIT)``
    starts the kernel's read ahead), and how many it has."""
    size = os.path.getsize(path)
    pages = -(-size // PAGE)
    if not size:
        return 0, 0
    with open(path, 'rb') as f:
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        start = ctypes.c_char.from_buffer(mapping)
        residency = (ctypes.c_ubyte * pages)()
        if LIBC.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size),
                        residency):
            raise OSError(ctypes.get_errno(), f"mincore of {path}")
        del start
        return sum(page & 1 for page in residency), pages
    finally:
        mapping.close()


def files_under(folder):
    return [path for parent, _, names in os.walk(folder)
            for path in (os.path.join(parent, name) for name in names) if os.path.isfile(path)]


def evicted(folder):
    """``folder``'s files, none of their pages left in the page cache."""
    files = files_under(folder)
    for path in files:
        # pages just written may sit in the kernel's per-CPU batches, which
        # an advice skips: a few tries
        for _ in range(20):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            if cached_pages(path)[0] == 0:
                break
            time.sleep(0.01)
        assert cached_pages(path)[0] == 0, f"{path} is still cached: the eviction failed"
    return files


def write_files(folder, sizes):
    os.makedirs(folder, exist_ok=True)
    for index, size in enumerate(sizes):
        with open(os.path.join(folder, f'file-{index}'), 'wb') as f:
            f.write(os.urandom(size))


def a_checkpoint(folder):
    """``folder`` with a manifest, as a fill reads only a checkpoint's
    folder; its bytes."""
    (folder / 'manifest.json').write_text('{}')
    return 2


def fill_threads():
    return [t for t in threading.enumerate() if t.name == 'checkpoint-page-cache-fill']


def settled():
    """No fill left over from a test before (an initialize without a fit
    leaves its fill to end by itself)."""
    for thread in fill_threads():
        thread.join(30)
    assert not fill_threads()


def test_a_fill_reads_what_the_page_cache_lacks_and_nothing_else(tmp_path):
    sizes = [3 * _prefetch.FILL_CHUNK + 12345, 5 * PAGE + 7, 1]
    write_files(tmp_path / 'sub', sizes[1:])
    write_files(tmp_path, sizes[:1])
    manifest = a_checkpoint(tmp_path)
    # neither read nor waited for: a reader of a FIFO blocks until a writer comes
    os.mkfifo(tmp_path / 'sub' / 'fifo')
    files = evicted(tmp_path)

    fill = PageCacheFill(tmp_path)
    assert fill.wait(60)
    # no more than the files hold; less where the kernel's read ahead of
    # one chunk brought the next in
    assert 0 < fill.bytes_read <= sum(sizes) + manifest
    for path in files:
        cached, pages = cached_pages(path)
        assert cached == pages, path

    again = PageCacheFill(tmp_path)
    assert again.wait(60)
    assert again.bytes_read == 0


def test_a_fill_stops_when_told(tmp_path, monkeypatch):
    # a page a read: a stop lands among thousands of reads
    monkeypatch.setattr(_prefetch, 'FILL_CHUNK', PAGE)
    write_files(tmp_path, [32 * 2 ** 20])
    a_checkpoint(tmp_path)
    evicted(tmp_path)
    path = tmp_path / 'file-0'

    settled()
    fill = PageCacheFill(tmp_path)
    fill.stop()
    assert not fill_threads()
    read = fill.bytes_read
    assert read < 32 * 2 ** 20
    assert cached_pages(path)[0] < cached_pages(path)[1]
    time.sleep(0.2)
    assert fill.bytes_read == read


def test_a_folder_without_a_manifest_is_not_read(tmp_path):
    write_files(tmp_path / 'any' / 'folder', [3 * PAGE])
    (path,) = evicted(tmp_path)
    fill = PageCacheFill(tmp_path)
    assert fill.wait(10)
    assert fill.bytes_read == 0
    assert cached_pages(path)[0] == 0


def test_a_missing_folder_ends_the_fill_quietly(tmp_path):
    fill = PageCacheFill(tmp_path / 'none')
    assert fill.wait(10)
    assert fill.bytes_read == 0


def trained(tmp_path):
    checkpoint = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), keep_last=2)
    net = make_net(make_accelerator(), max_epochs=2, callbacks=[checkpoint])
    net.fit(*make_data(n=96))
    return checkpoint.dirname


def resuming(dirname, resume='latest'):
    checkpoint = AccelerateCheckpoint(dirname=dirname, keep_last=2)
    load = AccelerateLoadInitState(checkpoint, resume=resume)
    return make_net(make_accelerator(), max_epochs=3, callbacks=[load, checkpoint])


def wait_until_cached(files, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(cached == pages for cached, pages in map(cached_pages, files)):
            return True
        time.sleep(0.01)
    return False


def test_the_resume_fills_the_page_cache_with_the_checkpoint_it_checks_first(tmp_path):
    dirname = trained(tmp_path)
    latest = os.path.join(dirname, 'epoch-0002')
    older = evicted(os.path.join(dirname, 'epoch-0001'))
    files = evicted(latest)

    net = resuming(dirname)
    net.initialize()
    assert wait_until_cached(files)
    assert all(cached_pages(path)[0] == 0 for path in older)
    # a thread in the callback does not travel with the net
    pickle.loads(pickle.dumps(net))
    clone(net)
    copy.deepcopy(net)

    net.fit(*make_data(n=96))
    assert net.history[-1, 'epoch'] == 3
    assert not fill_threads()


def test_a_named_checkpoint_and_a_folder_are_filled_too(tmp_path):
    dirname = trained(tmp_path)
    for resume in ('epoch-0001', os.path.join(dirname, 'epoch-0001')):
        files = evicted(os.path.join(dirname, 'epoch-0001'))
        resuming(dirname, resume).initialize()
        assert wait_until_cached(files), resume


def test_one_process_a_node_fills(tmp_path, monkeypatch):
    dirname = trained(tmp_path)
    files = evicted(os.path.join(dirname, 'epoch-0002'))
    settled()
    net = resuming(dirname)
    # after the accelerator began: as a launcher sets it for the second process
    monkeypatch.setenv('LOCAL_RANK', '1')
    net.initialize()
    assert not fill_threads()
    assert all(cached_pages(path)[0] == 0 for path in files)

    monkeypatch.setenv('LOCAL_RANK', '0')
    net.initialize()
    assert wait_until_cached(files)


def test_no_fill_where_the_folder_is_known_once_a_fit_begins(tmp_path):
    checkpoint = AccelerateCheckpoint(dirname=str(tmp_path / 'runs-{fit}'))
    net = make_net(make_accelerator(), max_epochs=1, callbacks=[
        AccelerateLoadInitState(checkpoint), checkpoint])
    settled()
    net.initialize()
    assert not fill_threads()


def test_no_fill_of_a_stores_checkpoint_and_no_request_to_it(tmp_path):
    # no server listens there: a listing of the store would fail the initialize
    checkpoint = AccelerateCheckpoint(
        dirname='s3://bucket/run', local_dir=str(tmp_path / 'staged'),
        storage_options={'endpoint_url': 'http://127.0.0.1:9', 'key': 'k', 'secret': 's'},
        outage_seconds=1)
    net = make_net(make_accelerator(), max_epochs=1, callbacks=[
        AccelerateLoadInitState(checkpoint), checkpoint])
    settled()
    net.initialize()
    assert not fill_threads()


@pytest.mark.parametrize('dirname', [None, 3, ''])
def test_a_bad_dirname_is_named_by_the_checkpoint_even_with_the_resume_listed_first(dirname):
    checkpoint = AccelerateCheckpoint(dirname=dirname)
    net = make_net(make_accelerator(), max_epochs=1, callbacks=[
        AccelerateLoadInitState(checkpoint), checkpoint])
    with pytest.raises(ValueError, match='AccelerateCheckpoint: dirname must be a folder path'):
        net.initialize()
