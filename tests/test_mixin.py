"""AccelerateFixesMixin: clone and pickle after any fit, and the gather of
its predictions, in the test's process and in 2 real processes."""

import pytest

from common import make_accelerator
from launcher import launch
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


def test_clone_and_pickle_after_any_fit_in_two_processes(two_processes):
    _, results = two_processes
    for result in results:
        assert result['num_processes'] == 2
        assert_roundtrips(result)


def test_net_pickled_in_two_processes_fits_in_a_fresh_one(two_processes):
    folder, _ = two_processes
    launch('mixin_roundtrip.py', 'unpickle', str(folder / 'rank0'), nproc=1,
           timeout=300, env={'RESULT_DIR': str(folder)}).check()
    [result] = read_results(folder, 'unpickle', 1)
    for ending in ENDINGS:
        assert result[ending] == {'num_processes': 1, 'same_proba': True, **FITS}, ending
