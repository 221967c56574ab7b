"""The files and locks of a checkpoint: a job fitted in another thread of
the same process is refused like one in another process, and every file and
folder a checkpoint writes has the mode that a plain ``open`` / ``mkdir``
gives under the process's umask.
"""

import os
import socket
import stat
import threading
import warnings

import pytest
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback

from common import MLP, make_accelerator, make_data, make_net
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    FolderInUseError,
    ParamsCheckpoint,
)
from skorch_accel_callbacks.format import LOCK_NAME, _atomic as atomic, is_leftover, remove_path
from skorch_accel_callbacks.storage import PrefixLock, _lock as lock
from skorch_accel_callbacks.storage._local import CheckpointFolder

# a deadlock guard, not a timed assert: the threads meet far sooner
MEET_S = 120


class WaitInFirstEpoch(Callback):
    """Holds its net in the first epoch, inside training (its checkpoint
    folder claimed), until ``release`` is set; ``inside`` says it got there."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, inside, release):
        self.inside = inside
        self.release = release

    def on_epoch_begin(self, net, **kwargs):
        if len(net.history) == 1:
            self.inside.set()
            assert self.release.wait(MEET_S), "the second fit never ended"


def fit_in_threads(first, second, data):
    """Fit ``first`` in a thread until it is inside its first epoch, then
    ``second`` in another thread while ``first`` waits there; each thread's
    exception (or None)."""
    errors = {}

    def fit(name, net):
        try:
            with warnings.catch_warnings():
                # no signal handler can be set outside the main thread
                warnings.simplefilter('ignore', UserWarning)
                net.fit(*data)
        except BaseException as exc:  # pylint: disable=broad-except
            errors[name] = exc
        else:
            errors[name] = None

    inside, release = first.inside, first.release
    one = threading.Thread(target=fit, args=('first', first.net), name='fit-first')
    one.start()
    try:
        assert inside.wait(MEET_S), "the first fit never reached its first epoch"
        two = threading.Thread(target=fit, args=('second', second), name='fit-second')
        two.start()
        two.join(MEET_S)
        assert not two.is_alive(), "the second fit hangs"
    finally:
        release.set()
        one.join(MEET_S)
    assert not one.is_alive(), "the first fit hangs"
    return errors['first'], errors['second']


class First:
    """The first net of :func:`fit_in_threads` and its meeting point."""

    def __init__(self, build):
        self.inside, self.release = threading.Event(), threading.Event()
        self.net = build([WaitInFirstEpoch(self.inside, self.release)])


def refused_by_thread(dirname, error):
    assert isinstance(error, FolderInUseError), repr(error)
    message = str(error)
    assert f"checkpoint folder {dirname} is in use by another running job" in message
    assert (f"pid {os.getpid()} on host {socket.gethostname()}, thread 'fit-first' "
            "of this process") in message


def test_accelerate_checkpoint_in_a_second_thread_is_refused(tmp_path):
    dirname = str(tmp_path / 'ck')
    data = make_data(n=96)

    def build(extra):
        cp = AccelerateCheckpoint(dirname=dirname, keep_last=5)
        return make_net(make_accelerator(), max_epochs=2,
                        callbacks=[cp, AccelerateLoadInitState(cp), *extra])

    first = First(build)
    second = build([])
    first_error, second_error = fit_in_threads(first, second, data)
    refused_by_thread(dirname, second_error)
    assert len(second.history) == 0
    assert first_error is None
    assert len(first.net.history) == 2
    # the first job's checkpoints are whole, none of the second's is there
    folder = CheckpointFolder(dirname)
    assert folder.committed() == ['epoch-0001', 'epoch-0002']
    assert folder.find('latest') == os.path.join(dirname, 'epoch-0002')
    for name in folder.committed():
        folder.find(os.path.join(dirname, name))
    assert not [name for name in os.listdir(dirname) if is_leftover(name)
                or name.endswith('.partial')]
    # both released it when training ended
    lock.FolderLock(dirname).acquire().release()


def test_params_checkpoint_in_a_second_thread_is_refused(tmp_path):
    dirname = str(tmp_path / 'ck')
    data = make_data(n=64)

    def build(extra):
        return NeuralNetClassifier(
            MLP, max_epochs=2, lr=0.1, train_split=None, verbose=0,
            callbacks=[ParamsCheckpoint(monitor=None, dirname=dirname), *extra])

    first = First(build)
    second = build([])
    first_error, second_error = fit_in_threads(first, second, data)
    refused_by_thread(dirname, second_error)
    assert "for the files of fn_prefix=''" in str(second_error)
    assert len(second.history) == 0
    assert first_error is None
    assert sorted(os.listdir(dirname)) == [
        'criterion.pt', 'history.json', 'optimizer.pt', 'params.pt']
    assert len(first.net.history) == 2


def test_lock_of_an_ended_thread_is_not_taken_over(tmp_path):
    """A fit that raised keeps its lock: the thread that took it ended, but
    its callbacks may train again; another thread is told so."""
    held = PrefixLock(tmp_path, 'x_')
    taker = threading.Thread(target=held.acquire, name='ended')
    taker.start()
    taker.join()
    try:
        with pytest.raises(FolderInUseError,
                           match="thread 'ended' of this process, a thread that has "
                                 "ended without releasing it"):
            PrefixLock(tmp_path, 'x_').acquire()
    finally:
        held.release()
    assert not (tmp_path / '.x_lock').exists()


def in_thread(function):
    """What ``function()`` raised in another thread, or None."""
    raised = []

    def run():
        try:
            function()
        except BaseException as exc:  # pylint: disable=broad-except
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return raised[0] if raised else None


def test_locks_of_one_thread_are_shared(tmp_path):
    one = lock.FolderLock(tmp_path).acquire()
    # another path to the same lock file, as a callback of the same job may have
    two = lock.FolderLock(str(tmp_path) + '/.').acquire()
    one.release()
    assert two.held
    assert isinstance(in_thread(lambda: lock.FolderLock(tmp_path).acquire()),
                      FolderInUseError)
    two.release()
    assert in_thread(lambda: lock.FolderLock(tmp_path).acquire().release()) is None


# ---------------------------------------------------------------- file modes


@pytest.fixture(params=[0o022, 0o027], ids=['umask022', 'umask027'])
def umask(request):
    """The process's umask while the test runs; the test is single-threaded."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def modes_unlike_plain(root, umask):
    """The files and folders under ``root`` (and ``root``) whose mode is not
    what a plain open / mkdir gives under ``umask``, with their modes."""
    wanted = {True: 0o777 & ~umask, False: 0o666 & ~umask}
    found = {}
    for path in [root, *(os.path.join(folder, name) for folder, folders, files
                         in os.walk(root) for name in folders + files)]:
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        if mode != wanted[os.path.isdir(path)]:
            found[os.path.relpath(path, root)] = oct(mode)
    return found


@pytest.mark.parametrize('async_save', [False, True], ids=['sync', 'async'])
def test_accelerate_checkpoint_files_have_plain_modes(tmp_path, umask, async_save):
    dirname = str(tmp_path / 'ck')
    cp = AccelerateCheckpoint(dirname=dirname, async_save=async_save, every_n_steps=2,
                              keep_last=10)
    net = make_net(make_accelerator(), max_epochs=2,
                   callbacks=[cp, AccelerateLoadInitState(cp)])
    net.fit(*make_data(n=96))
    committed = cp.committed()
    # mid-epoch ones too; safetensors writes its files 0600
    assert any('-step-' in name for name in committed), committed
    assert 'model.safetensors' in os.listdir(os.path.join(dirname, committed[-1]))
    assert modes_unlike_plain(dirname, umask) == {}


@pytest.mark.parametrize('use_safetensors', [False, True], ids=['torch', 'safetensors'])
def test_params_checkpoint_files_have_plain_modes(tmp_path, umask, use_safetensors):
    dirname = str(tmp_path / 'ck')
    cp = ParamsCheckpoint(
        monitor=None, dirname=dirname, f_pickle='net.pkl',
        use_safetensors=use_safetensors,
        **({'f_optimizer': None} if use_safetensors else {}))
    net = NeuralNetClassifier(MLP, max_epochs=2, lr=0.1, train_split=None, verbose=0,
                              callbacks=[cp])
    net.fit(*make_data(n=64))
    assert 'params.pt' in os.listdir(dirname)
    assert modes_unlike_plain(dirname, umask) == {}
    # a save outside training: one file, moved into place at once
    cp.save_model(net)
    assert modes_unlike_plain(dirname, umask) == {}


def test_umask_read_without_setting_it(tmp_path, umask):
    # the file that a plain open creates is the measure of both ways to read it
    assert atomic._umask_from_proc() == umask
    assert atomic._umask_from_probe(str(tmp_path)) == umask
    assert os.listdir(tmp_path) == []
    assert atomic.plain_modes(str(tmp_path)) == (0o666 & ~umask, 0o777 & ~umask)


def test_lock_reached_by_another_path_is_refused_naming_this_process(tmp_path):
    # a hard link: another real path to the same lock file, as a bind mount gives
    held = lock.FolderLock(tmp_path).acquire()
    try:
        os.link(tmp_path / LOCK_NAME, tmp_path / 'alias')
        with pytest.raises(FolderInUseError,
                           match=f"pid {os.getpid()} on host {socket.gethostname()}, "
                                 "this process, through another path to the lock file"):
            lock.FolderLock(tmp_path, name='alias').acquire()
    finally:
        held.release()


def unlink_after(taker, monkeypatch):
    """Has ``taker`` act on the folder just before each unlink of shutil's."""
    real_unlink = os.unlink

    def unlink(name, *, dir_fd=None):
        taker(real_unlink)
        return real_unlink(name, dir_fd=dir_fd)

    monkeypatch.setattr(os, 'unlink', unlink)


def test_removing_a_folder_that_another_remover_empties_meanwhile_succeeds(
        tmp_path, monkeypatch):
    # a fit that raised leaves its discard thread at work; the next fit's
    # claim removes the same leftover folder
    doomed = tmp_path / '.epoch-0001.discard-0123456789ab'
    doomed.mkdir()
    for i in range(4):
        (doomed / f'part-{i}').write_bytes(b'x')
    taken = []

    def other_remover(real_unlink):
        for entry in sorted(os.listdir(doomed)):
            real_unlink(doomed / entry)
            taken.append(entry)

    unlink_after(other_remover, monkeypatch)
    remove_path(doomed)
    assert taken == [f'part-{i}' for i in range(4)]
    assert not doomed.exists()


def test_removing_a_folder_still_raises_what_is_not_a_vanished_file(
        tmp_path, monkeypatch):
    doomed = tmp_path / '.epoch-0001.discard-0123456789ab'
    doomed.mkdir()
    (doomed / 'part').write_bytes(b'x')

    def deny(real_unlink):
        raise PermissionError(13, 'Permission denied', 'part')

    unlink_after(deny, monkeypatch)
    with pytest.raises(PermissionError, match='Permission denied'):
        remove_path(doomed)
    assert (doomed / 'part').exists()
