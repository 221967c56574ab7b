"""ParamsCheckpoint, TrainEndParamsCheckpoint, LoadInitParams and
AccelerateFixesMixin behave as skorch's own where skorch's work: the lock
covers a checkpoint's own files, not the folder; a criterion without state is
skipped, not the whole save; a pickled net is usable on its own; bad
arguments fail at ``initialize``; nothing makes a net unpicklable or
unclonable.

Jobs that must run beside each other run in real processes
(tests/workers/params_parity.py); the 2-process checks through the
``run_workers`` fixture.
"""

import copy
import fcntl
import inspect
import os
import pickle
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from sklearn.base import clone
from sklearn.model_selection import cross_validate
from skorch.callbacks import Callback, Checkpoint, TrainEndCheckpoint
from skorch.exceptions import DeviceWarning, SkorchException
from skorch.tests.callbacks import test_training as skorch_tests

from common import make_accelerator, make_data, make_net, plain_criterion, plain_net
from launcher import REPO, WORKERS
from skorch_accel_callbacks import (
    FolderInUseError,
    LoadInitParams,
    ParamsCheckpoint,
    TrainEndParamsCheckpoint,
)
from skorch_accel_callbacks.format import TEMP_MARK
from skorch_accel_callbacks.storage import PrefixLock

DEADLINE_S = 180
FILES = ['criterion.pt', 'history.json', 'optimizer.pt', 'params.pt']


# ---------------------------------------------------------------- the lock


def start_holder(cwd: Path, prefix: str, markers: Path) -> subprocess.Popen:
    """A job in its own process, in ``cwd`` with ParamsCheckpoint's default
    ``dirname=''``, holding the lock of its ``prefix`` files after epoch 1."""
    env = {key: value for key, value in os.environ.items()
           if key not in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')}
    env.update(OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join([str(WORKERS), str(REPO)]))
    log = markers / 'holder.log'
    holder = subprocess.Popen(
        [sys.executable, str(WORKERS / 'params_parity.py'), 'hold', prefix, str(markers)],
        cwd=cwd, env=env, stdout=open(log, 'wb'), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + DEADLINE_S
    while not (markers / 'held').exists():
        if holder.poll() is not None or time.monotonic() > deadline:
            holder.kill()
            pytest.fail("the holder never held its lock:\n" + log.read_text())
        time.sleep(0.1)
    return holder


@pytest.mark.slow
def test_jobs_of_other_prefixes_share_a_folder_and_leave_no_lock_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """skorch's run (dirname='', fn_prefix='') and one with another prefix run
    beside a job in the same working directory; the same prefix is refused;
    no lock file is left in the working directory."""
    work, markers = tmp_path / 'work', tmp_path / 'markers'
    work.mkdir()
    markers.mkdir()
    X, y = make_data(n=64)
    holder = start_holder(work, 'a_', markers)
    try:
        monkeypatch.chdir(work)
        # a save of the holder's in flight: not a leftover of these jobs
        in_flight = f'.a_params.pt{TEMP_MARK}0123456789ab'
        (work / in_flight).write_bytes(b'')
        for prefix in ('', 'b_'):
            net = plain_net([ParamsCheckpoint(monitor=None, fn_prefix=prefix)])
            net.fit(X, y)
            assert len(net.history) == 2
        assert (work / in_flight).exists()
        assert (work / '.a_lock').exists()
        net = plain_net([ParamsCheckpoint(monitor=None, fn_prefix='a_')])
        with pytest.raises(FolderInUseError,
                           match=rf"in use by another running job \(pid {holder.pid} on host"
                                 r".*fn_prefix='a_'"):
            net.fit(X, y)
        assert len(net.history) == 0
    finally:
        (markers / 'go').touch()
        returncode = holder.wait(timeout=DEADLINE_S)
    assert returncode == 0, (markers / 'holder.log').read_text()
    (work / in_flight).unlink()
    # what skorch's Checkpoint leaves for these three prefixes
    skorch_folder = tmp_path / 'skorch'
    for prefix in ('', 'a_', 'b_'):
        plain_net([Checkpoint(monitor=None, fn_prefix=prefix, dirname=str(skorch_folder))],
                  max_epochs=1).fit(X, y)
    assert sorted(os.listdir(work)) == sorted(os.listdir(skorch_folder))
    assert sorted(os.listdir(work)) == sorted(
        prefix + name for prefix in ('', 'a_', 'b_') for name in FILES)


def _contend(folder: str, inside: str, until: float) -> NoReturn:
    """In a forked child: take and release the lock of one prefix as often as
    possible; exit 3 if another holder was inside at the same time."""

    rounds = 0
    while time.monotonic() < until:
        lock = PrefixLock(folder, 'x_')
        try:
            lock.acquire()
        except FolderInUseError:
            continue
        try:
            fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            os._exit(3)
        os.close(fd)
        os.remove(inside)
        lock.release()
        rounds += 1
    os._exit(0 if rounds else 4)


def test_lock_removed_on_release_still_excludes(tmp_path: Path) -> None:
    """Holders that remove the lock file on release, in a race with others
    that opened it just before: never two holders at once (a flock on a file
    that was unlinked would make a second one)."""
    inside = str(tmp_path / 'inside')
    until = time.monotonic() + 4
    children = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            try:
                _contend(str(tmp_path), inside, until)
            finally:
                os._exit(5)
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    assert codes == [0, 0, 0, 0], "3: two holders at once; 4: never got the lock"
    assert not (tmp_path / '.x_lock').exists()


def held_by_another_process(path: str) -> bool:
    """Whether a job in another process would be refused the lock at ``path``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os._exit(0)
        except BlockingIOError:
            os._exit(1)
        except BaseException:
            os._exit(2)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 1


# ---------------------------------------------------------------- no state


@pytest.mark.parametrize('ours, theirs, kwargs', [
    (ParamsCheckpoint, Checkpoint, {'monitor': 'train_loss_best'}),
    (TrainEndParamsCheckpoint, TrainEndCheckpoint, {}),
], ids=['ParamsCheckpoint', 'TrainEndParamsCheckpoint'])
def test_criterion_without_state_is_skipped_as_skorch_does(
        tmp_path: Path, ours: type, theirs: type, kwargs: dict[str, Any]) -> None:
    """A criterion that is a plain function (f_criterion left at its
    default): params, optimizer and history are saved, as skorch's
    Checkpoint does, with one warning; and they load."""
    X, y = make_data()
    listings, events = {}, {}
    for cls in (theirs, ours):
        folder = tmp_path / cls.__name__
        cp = cls(dirname=str(folder), **kwargs)
        # the same initial weights: the two checkpoints' events are compared
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            net = plain_net([cp], criterion=plain_criterion, max_epochs=3).fit(X, y)
        listings[cls] = sorted(os.listdir(folder))
        if 'monitor' in kwargs:
            events[cls] = net.history[:, 'event_cp']
    texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert not [text for text in texts if 'Unable to save' in text]
    skipped = [text for text in texts if 'f_criterion' in text]
    assert len(skipped) == 1, texts
    assert skipped[0].startswith(f"{ours.__name__}: f_criterion='criterion.pt' is not saved")
    assert 'net.criterion_ (log_nll, a function) has no state_dict' in skipped[0]
    prefix = cp.fn_prefix
    assert listings[ours] == listings[theirs] == [
        prefix + name for name in ('history.json', 'optimizer.pt', 'params.pt')]
    if events:
        assert events[ours] == events[theirs] and any(events[ours])
    # loaded without a criterion file: by LoadInitParams, and by load_params
    fresh = plain_net([LoadInitParams(cp)], criterion=plain_criterion, max_epochs=0)
    fresh.fit(X, y)
    assert len(fresh.history) == 3
    np.testing.assert_allclose(fresh.predict_proba(X), net.predict_proba(X), atol=1e-6)
    by_hand = plain_net([], criterion=plain_criterion).initialize()
    by_hand.load_params(checkpoint=getattr(cp, 'checkpoint_', cp))
    np.testing.assert_allclose(by_hand.predict_proba(X), net.predict_proba(X), atol=1e-6)


class SavesThroughParamsCheckpoint(Callback):
    """A user's callback that saves at the end of training through a
    ParamsCheckpoint, as TrainEndParamsCheckpoint does."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, dirname: str) -> None:
        self.dirname = dirname

    def initialize(self) -> 'SavesThroughParamsCheckpoint':
        self.checkpoint_ = ParamsCheckpoint(
            monitor=None, dirname=self.dirname, event_name=None).initialize()
        return self

    def on_train_begin(self, net: Any, X: Any = None, y: Any = None, **kwargs: Any) -> None:
        self.checkpoint_.on_train_begin(net, X=X, y=y, owner=type(self).__name__, **kwargs)

    def on_train_end(self, net: Any, **kwargs: Any) -> None:
        try:
            self.checkpoint_.save_model(net)
        finally:
            self.checkpoint_.release_folder()


def test_owner_of_a_params_checkpoint_names_itself_in_its_warnings(tmp_path: Path) -> None:
    """The owner's name is passed to ``on_train_begin``, not set as a private
    attribute of the inner checkpoint: TrainEndParamsCheckpoint's
    checkpoint_ has the attributes of a ParamsCheckpoint of the same
    arguments, and a user's callback gets its own name in the warning."""
    te = TrainEndParamsCheckpoint(dirname=str(tmp_path / 'te')).initialize()
    alike = ParamsCheckpoint(monitor=None, fn_prefix='train_end_', dirname=str(tmp_path / 'te'),
                             event_name=None).initialize()
    assert vars(te.checkpoint_).keys() == vars(alike).keys()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        plain_net([SavesThroughParamsCheckpoint(str(tmp_path / 'own'))],
                  criterion=plain_criterion, max_epochs=1).fit(*make_data(n=64))
    skipped = [str(w.message) for w in caught if 'f_criterion' in str(w.message)]
    assert len(skipped) == 1, skipped
    assert skipped[0].startswith(
        "SavesThroughParamsCheckpoint: f_criterion='criterion.pt' is not saved")
    assert sorted(os.listdir(tmp_path / 'own')) == ['history.json', 'optimizer.pt', 'params.pt']


def test_load_best_with_a_criterion_without_state(tmp_path: Path) -> None:
    X, y = make_data()
    cp = ParamsCheckpoint(monitor='train_loss_best', dirname=str(tmp_path), load_best=True)
    net = plain_net([cp], criterion=plain_criterion, max_epochs=3)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', UserWarning)
        net.fit(X, y)
    best = plain_net([], criterion=plain_criterion).initialize()
    best.load_params(f_params=str(tmp_path / 'params.pt'))
    np.testing.assert_allclose(net.predict_proba(X), best.predict_proba(X), atol=1e-6)


# ---------------------------------------------------------------- pickling


@pytest.mark.slow  # a launch of its own
def test_net_pickled_in_two_processes_is_usable_in_one(
        run_workers: Any, tmp_path: Path) -> None:
    """Pickled in a job of 2 processes (by ParamsCheckpoint's f_pickle, and
    by hand while wrapped in DDP), unpickled in a process that runs no job:
    the net has an accelerator of this process and predicts X[:20] as the
    job did, 20 rows."""
    folder = tmp_path / 'pickles'
    folder.mkdir()
    results = run_workers('params_parity.py', 'pickle', nproc=2, timeout=300,
                          args=('pickle', str(folder)))
    for res in results:
        assert res['num_processes'] == 2
        assert res['fixed']['is_ddp']
        for kind in ('fixed', 'stock'):
            assert res[kind]['rows'] == 20
            assert res[kind]['in_job'] == {'num_processes': 2, 'rows': 20}
    X, y = make_data(n=128)
    for name in ('fixed/net.pkl', 'fixed/direct.pkl', 'stock/net.pkl'):
        # as in a new process: no accelerate state of any job
        AcceleratorState._reset_state(True)
        with open(folder / name, 'rb') as f, warnings.catch_warnings():
            warnings.simplefilter('ignore', DeviceWarning)
            net = pickle.load(f)
        assert net.accelerator.num_processes == 1, name
        proba = net.predict_proba(X[:20])
        assert proba.shape == (20, 2), name
        reference = np.load(folder / name.split('/')[0] / 'proba.npy')
        np.testing.assert_allclose(proba, reference, atol=1e-6, err_msg=name)
        if name.startswith('fixed'):
            # and trains on (max_epochs=2 more), in this process alone
            net.partial_fit(X, y)
            assert len(net.history) == 4
    AcceleratorState._reset_state(True)


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize('callback, error, match', [
    (ParamsCheckpoint(sink=None), ValueError, r"ParamsCheckpoint: sink must be a callable"),
    (ParamsCheckpoint(sink='print'), ValueError,
     r"ParamsCheckpoint: sink must be a callable .*got 'print'"),
    (TrainEndParamsCheckpoint(sink=None), ValueError,
     r"TrainEndParamsCheckpoint: sink must be a callable"),
    (TrainEndParamsCheckpoint(sink='print'), ValueError,
     r"TrainEndParamsCheckpoint: sink must be a callable .*got 'print'"),
    (ParamsCheckpoint(event_name=123), ValueError,
     r"ParamsCheckpoint: event_name must be a str \(the history column\) or None, got 123"),
    (LoadInitParams('runs/params.pt'), TypeError,
     r"LoadInitParams: checkpoint must be a skorch Checkpoint or TrainEndCheckpoint "
     r".*got 'runs/params.pt' of type str"),
], ids=['sink-None', 'sink-str', 'te-sink-None', 'te-sink-str', 'event_name-int',
        'load-str'])
def test_bad_arguments_raise_at_initialize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           callback: Callback, error: type,
                                           match: str) -> None:
    monkeypatch.chdir(tmp_path)
    net = plain_net([callback])
    with pytest.raises(error, match=match):
        net.initialize()
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- copies


class LockProbe(Callback):
    """At every epoch's end: whether a job in another process would be
    refused the lock of each of ``paths``."""

    # observes or injects a fault, trains nothing: not recorded, may come and go
    unrecorded_params = True

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def initialize(self) -> 'LockProbe':
        self.held_ = []
        return self

    def on_epoch_end(self, net: Any, **kwargs: Any) -> None:
        self.held_.append([held_by_another_process(path) for path in self.paths])


@pytest.fixture
def fitted(tmp_path: Path) -> SimpleNamespace:
    """A net of this package's mixin with all three params callbacks, fitted
    in this process alone."""
    X, y = make_data(n=128)
    cp = ParamsCheckpoint(monitor=None, dirname=str(tmp_path / 'cp'), f_pickle='net.pkl')
    te = TrainEndParamsCheckpoint(dirname=str(tmp_path / 'te'))
    locks = [str(tmp_path / 'cp' / '.lock'), str(tmp_path / 'te' / '.train_end_lock')]
    net = make_net(make_accelerator(), max_epochs=2, train_split=None, callbacks=[
        ('cp', cp), ('te', te), ('load', LoadInitParams(cp)), ('probe', LockProbe(locks))])
    net.fit(X, y)
    assert dict(net.callbacks_)['probe'].held_ == [[True, True], [True, True]]
    return SimpleNamespace(net=net, X=X, y=y, locks=locks, folder=tmp_path)


def test_copies_of_a_fitted_net_predict_and_train_on(fitted: SimpleNamespace) -> None:
    """pickle, deepcopy, and the net that f_pickle pickled while training
    (its callbacks then held their locks): each predicts as the net, and
    trains on with the locks of its checkpoint files held again."""
    X, y = fitted.X, fitted.y
    with open(fitted.folder / 'cp' / 'net.pkl', 'rb') as f:
        from_f_pickle = pickle.load(f)
    copies = {'pickle': pickle.loads(pickle.dumps(fitted.net)),
              'deepcopy': copy.deepcopy(fitted.net), 'f_pickle': from_f_pickle}
    reference = fitted.net.predict_proba(X)
    for name, net in copies.items():
        assert net.accelerator is not fitted.net.accelerator
        np.testing.assert_allclose(net.predict_proba(X), reference, atol=1e-6,
                                   err_msg=name)
        net.partial_fit(X, y)
        assert len(net.history) == 4, name
        assert dict(net.callbacks_)['probe'].held_[-2:] == [[True, True]] * 2, name
        assert not [path for path in fitted.locks if os.path.exists(path)], name


def test_clone_of_a_fitted_net_fits_also_in_cross_validate(fitted: SimpleNamespace) -> None:
    X, y = fitted.X, fitted.y
    cloned = clone(fitted.net)
    assert not getattr(cloned, 'initialized_', False)
    cloned.fit(X, y)
    # LoadInitParams loaded the fitted net's checkpoint, then 2 epochs
    assert len(cloned.history) == 4
    scores = cross_validate(fitted.net, X, y, cv=2)
    assert len(scores['test_score']) == 2


def test_get_params_lists_init_arguments_only(fitted: SimpleNamespace) -> None:
    copied = pickle.loads(pickle.dumps(fitted.net))
    for net in (fitted.net, copied):
        for name in ('cp', 'te', 'load'):
            callback = dict(net.callbacks_)[name]
            arguments = set(inspect.signature(type(callback)).parameters) - {'kwargs'}
            assert set(callback.get_params(deep=False)) == arguments, name
            cloned = clone(callback)
            assert cloned.get_params(deep=False).keys() == arguments


# ---------------------------------------------------------------- skorch's messages

# skorch's own tests of the errors and warnings of its Checkpoint,
# TrainEndCheckpoint and LoadInitState, run against ours. skorch's other
# tests there mock save_params and expect the final file names in its calls;
# ours writes temporary names that are moved into place together.
_SKORCH_CP = skorch_tests.TestCheckpoint
_SKORCH_TE = skorch_tests.TestTrainEndCheckpoint
_SKORCH_LOAD = skorch_tests.TestLoadInitState


@pytest.fixture
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # skorch's tests write their checkpoints into the working folder
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope='module')
def data() -> tuple[np.ndarray, np.ndarray]:
    # skorch's data of these tests, 10 examples; skorch's own fixture is a
    # method of its test classes, which pytest deprecates for a module scope
    return np.zeros((10, 1), dtype='float32'), np.zeros((10, 1), dtype='float32')


@pytest.mark.usefixtures('in_tmp_path')
class TestParamsCheckpointAsSkorchCheckpoint:
    checkpoint_cls = pytest.fixture(lambda self: ParamsCheckpoint)
    net_cls = _SKORCH_CP.net_cls
    save_params_mock = _SKORCH_CP.save_params_mock

    test_init_with_wrong_kwarg_name_raises = _SKORCH_CP.test_init_with_wrong_kwarg_name_raises
    test_init_with_f_params_and_f_module_raises = (
        _SKORCH_CP.test_init_with_f_params_and_f_module_raises)
    test_init_with_f_optimizer_and_safetensors_raises = (
        _SKORCH_CP.test_init_with_f_optimizer_and_safetensors_raises)
    test_init_with_dirname_and_file_like_object_error = (
        _SKORCH_CP.test_init_with_dirname_and_file_like_object_error)
    test_initialize_with_dirname_and_file_like_object_error = (
        _SKORCH_CP.test_initialize_with_dirname_and_file_like_object_error)
    test_default_without_validation_raises_meaningful_error = (
        _SKORCH_CP.test_default_without_validation_raises_meaningful_error)
    test_warnings_when_monitor_appears_in_history = (
        _SKORCH_CP.test_warnings_when_monitor_appears_in_history)
    test_outputs_to_sink_when_save_params_errors = (
        _SKORCH_CP.test_outputs_to_sink_when_save_params_errors)


@pytest.mark.usefixtures('in_tmp_path')
class TestTrainEndParamsCheckpointAsSkorchTrainEndCheckpoint:
    trainendcheckpoint_cls = pytest.fixture(lambda self: TrainEndParamsCheckpoint)

    test_init_with_f_params_and_f_module_raises = (
        _SKORCH_TE.test_init_with_f_params_and_f_module_raises)
    test_init_with_f_optimizer_and_safetensors_raises = (
        _SKORCH_TE.test_init_with_f_optimizer_and_safetensors_raises)


@pytest.mark.usefixtures('in_tmp_path')
class TestLoadInitParamsAsSkorchLoadInitState:
    loadinitstate_cls = pytest.fixture(lambda self: LoadInitParams)
    checkpoint_cls = pytest.fixture(lambda self: ParamsCheckpoint)
    net_cls = _SKORCH_LOAD.net_cls
    use_safetensors = _SKORCH_LOAD.use_safetensors

    # the first fit finds no files: nothing is loaded, and no error
    test_load_initial_state = _SKORCH_LOAD.test_load_initial_state
    test_load_initial_state_custom_scoring = _SKORCH_LOAD.test_load_initial_state_custom_scoring


def test_wrong_kwarg_name_message_is_skorchs_with_our_class_name() -> None:
    # skorch's own test expects its class name in the text, which skorch
    # formats from the class (as for any subclass of its TrainEndCheckpoint)
    for cls in (ParamsCheckpoint, TrainEndParamsCheckpoint):
        with pytest.raises(TypeError, match=f"^{cls.__name__} got an unexpected argument "
                                            "'foobar', did you mean 'f_foobar'\\?$"):
            cls(foobar='foobar.pt').initialize()


def test_missing_monitor_column_adds_our_context_after_skorchs_text() -> None:
    net = plain_net([ParamsCheckpoint()])
    with pytest.raises(SkorchException) as raised:
        net.fit(*make_data(n=64))
    assert str(raised.value).startswith(
        "Key 'valid_loss_best' was not found in history. Make sure you have validation "
        "data if you use validation scores for checkpointing. (ParamsCheckpoint: "
        "monitor='valid_loss_best'; the history of this epoch has ['batches', 'dur', "
        "'epoch', ")


def test_monitor_of_a_wrong_type_raises_as_in_skorch() -> None:
    for cp in (ParamsCheckpoint(monitor=3), Checkpoint(monitor=3)):
        with pytest.raises(TypeError, match="History access with given types not supported"):
            plain_net([cp]).fit(*make_data(n=64))
