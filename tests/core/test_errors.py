"""The package's exceptions: one root, each also the builtin class of its
kind, so that ``except SkorchAccelError`` catches every error of the
package's own and skorch's ``except ValueError`` still catches bad input."""

import pickle
import signal

import pytest

import skorch_accel_callbacks
from skorch_accel_callbacks import errors

EXCEPTIONS = [getattr(errors, name) for name in errors.__all__]


@pytest.mark.parametrize('cls', EXCEPTIONS, ids=lambda cls: cls.__name__)
def test_every_exception_has_the_root(cls):
    assert issubclass(cls, errors.SkorchAccelError)


def test_bad_input_is_a_value_error_and_an_outage_or_a_held_folder_is_not():
    assert issubclass(errors.CheckpointError, ValueError)
    assert issubclass(errors.CorruptCheckpointError, errors.CheckpointError)
    assert issubclass(errors.StoreUnavailableError, ConnectionError)
    for cls in (errors.StoreUnavailableError, errors.FolderInUseError, errors.LeaseLostError,
                errors.RankError, errors.DivergedDecisionError, errors.TrainingPreempted):
        assert not issubclass(cls, ValueError), cls


def test_the_root_and_every_exception_but_the_lease_s_are_in_the_package_root():
    exported = set(skorch_accel_callbacks.__all__)
    assert {cls.__name__ for cls in EXCEPTIONS} - exported == {'LeaseLostError'}


def test_exceptions_with_arguments_of_their_own_pickle():
    # a rank's error crosses processes pickled (sync.agree)
    preempted = errors.TrainingPreempted(signal.SIGTERM, 'ck/epoch-0002')
    again = pickle.loads(pickle.dumps(preempted))
    assert (again.signal, again.checkpoint, str(again)) == (
        signal.SIGTERM, 'ck/epoch-0002', str(preempted))
    diverged = errors.DivergedDecisionError('stop (EarlyStopping)', 'on_epoch_end', 3, (0,),
                                            (1,), 'decide on the main process')
    assert str(pickle.loads(pickle.dumps(diverged))) == str(diverged)
