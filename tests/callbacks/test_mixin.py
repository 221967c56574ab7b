"""AccelerateFixesMixin: clone and pickle after any fit, and the gather of
its predictions, in the test's process and in 2 real processes."""

import pytest

from common import make_accelerator
from launcher import launch
from mixin_predict import ROWS, predictions
from mixin_roundtrip import ENDINGS, roundtrips
from testutil import read_results

RAISED = {'preempted': 'TrainingPreempted', 'normal': None, 'error': 'ValueError'}
# a net fitted normally is unwrapped by AccelerateMixin's on_train_end
WRAPPED = {'preempted': True, 'normal': False, 'error': True}
FITS = {'device': None, 'fit': True, 'partial_fit': True, 'predict': True}


def assert_roundtrips(result):
    for ending in ENDINGS:
        res = result[ending]
        assert res['raised'] == RAISED[ending], ending
        assert res['wrapped'] == WRAPPED[ending], ending
        assert res['clone'] == {'params_as_new': True, 'fitted': False, **FITS}, ending
        assert res['unpickled'] == {'same_proba': True, **FITS}, ending
        assert res['net'] == FITS, ending


def test_clone_and_pickle_after_any_fit_in_one_process(tmp_path):
    """After a fit that was preempted (left wrapped: skorch's on_train_end
    never ran), one that ended and one that raised: ``clone`` makes an
    unfitted net that fits; the unpickled net keeps ``device=None``,
    predicts as the net did, fits and partially fits."""
    assert_roundtrips(roundtrips(make_accelerator(), str(tmp_path)))


@pytest.fixture(scope='module')
def two_processes(tmp_path_factory):
    folder = tmp_path_factory.mktemp('mixin_roundtrip')
    launch('mixin_roundtrip.py', 'roundtrip', str(folder), nproc=2, timeout=300,
           env={'RESULT_DIR': str(folder)}).check()
    return folder, read_results(folder, 'roundtrip', 2)


@pytest.mark.slow
def test_clone_and_pickle_after_any_fit_in_two_processes(two_processes):
    _, results = two_processes
    for result in results:
        assert result['num_processes'] == 2
        assert_roundtrips(result)


@pytest.mark.slow
def test_net_pickled_in_two_processes_fits_in_a_fresh_one(two_processes):
    folder, _ = two_processes
    launch('mixin_roundtrip.py', 'unpickle', str(folder / 'rank0'), nproc=1,
           timeout=300, env={'RESULT_DIR': str(folder)}).check()
    [result] = read_results(folder, 'unpickle', 1)
    for ending in ENDINGS:
        assert result[ending] == {'num_processes': 1, 'same_proba': True, **FITS}, ending


def assert_predictions(result):
    assert result['rows'] == ROWS
    assert result['same_as_stock'] and result['same_as_module']
    assert result['same_gathers'] == {'tensors': True, 'objects': True}


def test_predictions_in_one_process():
    _, _, result = predictions(make_accelerator())
    assert result['num_processes'] == 1
    assert_predictions(result)
    # one process gathers nothing
    assert result['held_by_gloo'] == {'gathered': 0, 'after_steps': [0] * 64,
                                      'after_predict': 0}


@pytest.mark.slow  # a launch of its own
def test_predictions_gathered_in_two_processes_are_held_until_gloo_let_go(run_workers):
    """Predictions of a last batch that accelerate filled up come back as
    skorch's own mixin's; right after each evaluation step, gloo holds none
    of the gathered tensors, so that a script that ends with a prediction
    cannot abort at exit (pytorch/pytorch#190489), as the launch (ending
    with predict_proba, without settle_gloo) shows."""
    for result in run_workers('mixin_predict.py', 'predict', nproc=2):
        assert result['num_processes'] == 2
        assert_predictions(result)
        held = result['held_by_gloo']
        # 32 steps of 16 rows per process, 3 tensors passed per step
        assert held['gathered'] == 32 * 3
        assert held['after_steps'] == [0] * 32 and held['after_predict'] == 0


def test_a_pickle_of_0_2_0_finds_the_accelerators_print_where_it_named_it():
    """0.2.0 pickled the stand-in of an accelerator's print under the mixin's
    module; the pickling module holds it now, and those pickles still load."""
    import pickle

    from skorch_accel_callbacks.callbacks._pickling import MainProcessPrint
    old = b'cskorch_accel_callbacks.callbacks.mixin\n_MainProcessPrint\n)\x81.'
    assert isinstance(pickle.loads(old), MainProcessPrint)
    assert b'callbacks._pickling' in pickle.dumps(MainProcessPrint())
