"""The skorch drop-ins live in modules of their own (params, params_train_end,
params_load); what was pickled (a net's callbacks, in ``f_pickle``) when all
three lived in ``skorch_accel_callbacks.params.checkpoint`` still unpickles."""

import pickle

import pytest

from skorch_accel_callbacks import LoadInitParams, ParamsCheckpoint, TrainEndParamsCheckpoint
from skorch_accel_callbacks.params import checkpoint as params


def _as_pickled_before_the_split(obj):
    """``obj`` pickled as it was when its class lived in ``params``."""
    data = pickle.dumps(obj, protocol=0)
    module = type(obj).__module__.encode()
    old = data.replace(b'c' + module + b'\n', b'cskorch_accel_callbacks.params\n')
    assert module != b'skorch_accel_callbacks.params.checkpoint' and old != data
    return old


@pytest.mark.parametrize('cls', [TrainEndParamsCheckpoint, LoadInitParams])
def test_a_callback_pickled_before_the_split_unpickles(cls):
    callback = cls(ParamsCheckpoint()) if cls is LoadInitParams else cls(dirname='final')

    loaded = pickle.loads(_as_pickled_before_the_split(callback))

    assert type(loaded) is cls
    assert loaded.get_params(deep=False).keys() == callback.get_params(deep=False).keys()


def test_params_names_no_other_attribute():
    assert not hasattr(params, 'NoSuchCallback')
