"""Compiled modules (skorch's ``compile=True``, ``torch.compile``).

A checkpoint, ``export`` and the params drop-ins hold the module's own
parameter names (not ``torch.compile``'s ``_orig_mod.`` prefix), so that a
plain skorch net loads them; a resume of a compiled net is exact; a resume
with ``compile`` switched is refused naming ``compile``. Before, the files
had ``_orig_mod.`` keys and a switch was refused as "saved from another
model", naming a parameter.
"""

import functools

import pytest
import torch
from safetensors import safe_open
from skorch import NeuralNetClassifier

import checkpointed
from common import MLP
from skorch_accel_callbacks import (
    CheckpointError,
    ParamsCheckpoint,
)
from skorch_accel_callbacks.tools.export import export
from testutil import assert_identical

# compiling a small MLP on this CPU takes about 20 s the first time
pytestmark = pytest.mark.slow


# a compiled net, checkpointed and resumed
fit = functools.partial(checkpointed.fit, net_kwargs={'compile': True})


def params_checkpoint(dirname):
    """The module's parameters in skorch's files, beside the checkpoints."""
    return ParamsCheckpoint(dirname=dirname, f_params='params.safetensors', f_optimizer=None,
                            f_history=None, f_criterion=None, use_safetensors=True)


def state(net):
    """What assert_identical compares, the module by its own names."""
    module = net.accelerator.unwrap_model(net.module_, keep_torch_compile=False)
    history = [{key: row.get(key) for key in ('epoch', 'train_loss', 'valid_loss', 'event_lr')}
               for row in net.history]
    return {'params': {'module': module.state_dict()},
            'optimizers': {'optimizer': net.optimizer_.state_dict()},
            'history': history}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp('compiled')
    full, _, _ = fit(folder / 'full', params_checkpoint(folder / 'params'))
    fit(folder / 'resumed', max_epochs=2)
    resumed, _, _ = fit(folder / 'resumed')
    return dict(folder=folder, full=full, resumed=resumed)


def test_the_net_was_compiled(runs):
    assert type(runs['full'].module_).__name__ == 'OptimizedModule'


def test_a_resume_of_a_compiled_net_is_exact(runs):
    assert_identical(state(runs['full']), state(runs['resumed']))


def test_the_checkpoint_holds_the_module_s_own_names(runs):
    path = runs['folder'] / 'full' / 'epoch-0003' / 'model.safetensors'
    with safe_open(path, framework='pt') as f:
        keys = set(f.keys())
    assert keys == set(MLP().state_dict())


@pytest.mark.parametrize('written_by', ['export', 'ParamsCheckpoint'])
def test_a_plain_skorch_net_loads_what_a_compiled_one_saved(runs, written_by):
    if written_by == 'export':
        params = export(runs['folder'] / 'full', out=runs['folder'] / 'exported')['f_params']
    else:
        params = runs['folder'] / 'params' / 'params.safetensors'
    plain = NeuralNetClassifier(MLP, max_epochs=1).initialize()
    plain.load_params(f_params=str(params), use_safetensors=True)
    expected = state(runs['full'])['params']['module']
    for key, value in plain.module_.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_a_resume_with_compile_switched_is_refused_naming_compile(runs, tmp_path):
    fit(tmp_path, max_epochs=2)
    with pytest.raises(CheckpointError) as refused:
        fit(tmp_path, net_kwargs={'compile': False})
    assert 'compile: True in the checkpoint, False now' in str(refused.value)
