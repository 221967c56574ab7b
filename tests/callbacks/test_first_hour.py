"""A newcomer's first hour: the mistakes a user makes early get an error
that names the way out before training, and a fit says what it resumed."""

import pytest

from common import FixedNet, StockNet, make_accelerator, make_data, make_net, plain_criterion
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    LoadInitParams,
)

MISSPELLED = [
    (AccelerateCheckpoint, 'monitr', 'monitor'),
    (AccelerateCheckpoint, 'keeplast', 'keep_last'),
    (LoadInitParams, 'checkpoints', 'checkpoint'),
]


@pytest.mark.parametrize('cls, wrong, right', MISSPELLED, ids=[m[1] for m in MISSPELLED])
def test_a_misspelled_argument_names_the_nearest_and_lists_them_all(cls, wrong, right):
    with pytest.raises(TypeError) as caught:
        cls(**{wrong: 1})
    message = str(caught.value)
    assert message.startswith(f"{cls.__name__} has no argument {wrong!r} (did you mean "
                              f"{right!r}?); its arguments: "), message
    assert right in message.split('its arguments: ')[1].split(', ')


def test_the_params_drop_ins_keep_skorch_s_own_check():
    # skorch's Checkpoint takes f_<module> names (**kwargs) and checks them
    # at initialize, with its own suggestion (tests/params/test_params_parity.py)
    from skorch_accel_callbacks import ParamsCheckpoint
    with pytest.raises(TypeError, match="^ParamsCheckpoint got an unexpected argument "
                                        "'foobar', did you mean 'f_foobar'"):
        ParamsCheckpoint(foobar='x.pt').initialize()


def test_an_argument_near_none_is_named_without_a_guess():
    with pytest.raises(TypeError, match=r"^AccelerateCheckpoint has no argument 'zzz'; its "):
        AccelerateCheckpoint(zzz=1)


def test_the_suggestions_leave_get_params_and_clone_as_they_were():
    from sklearn.base import clone
    cp = AccelerateCheckpoint(dirname='there', keep_last=3)
    assert clone(cp).get_params() == cp.get_params()
    assert 'keep_last' in cp.get_params()


@pytest.mark.parametrize('resume, hint', [
    ('lastest', " (did you mean 'latest'?)"),
    ('bset', " (did you mean 'best'?)"),
    ('checkpoint-3', ''),
])
def test_a_resume_that_names_nothing_is_refused_at_initialize(resume, hint):
    load = AccelerateLoadInitState(AccelerateCheckpoint(), resume=resume)
    with pytest.raises(ValueError) as caught:
        load.initialize()
    assert str(caught.value) == (
        f"AccelerateLoadInitState: resume={resume!r} is neither 'latest' nor 'best', no "
        "checkpoint's name (epoch-NNNN, epoch-NNNN-step-SSSSSSSS) and no path"
        f"{hint}; for a folder of that name in the working directory, write './{resume}'")


@pytest.mark.parametrize('resume', ['latest', 'best', 'epoch-0003', 'epoch-0002-step-00000040',
                                    './lastest', 'runs/epoch-0001', 's3://bucket/run/epoch-1'])
def test_every_form_of_resume_is_taken(resume):
    AccelerateLoadInitState(AccelerateCheckpoint(), resume=resume).initialize()


def test_a_string_option_lists_the_valid_values_and_suggests_one():
    load = AccelerateLoadInitState(AccelerateCheckpoint(), on_world_size_change='reseeed')
    with pytest.raises(ValueError, match=(
            r"^AccelerateLoadInitState: on_world_size_change must be one of 'raise', 'reseed', "
            r"got 'reseeed' \(did you mean 'reseed'\?\)$")):
        load.initialize()


@pytest.mark.parametrize('url', ['ftp://host/run', 'http://host/run', 'az://container/run'])
def test_an_untested_store_is_refused_at_initialize(url):
    with pytest.raises(ValueError, match=f"dirname='{url}' is in a .*:// store, which this "
                                         "package is not tested with"):
        AccelerateCheckpoint(dirname=url).initialize()


def fit_verbose(net_cls, tmp_path, capsys, **kwargs):
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    net = make_net(make_accelerator(), net_cls=net_cls, max_epochs=1, verbose=1,
                   callbacks=[cp, AccelerateLoadInitState(cp)], **kwargs)
    net.fit(*make_data(n=64))
    return capsys.readouterr().out


def test_a_fit_says_what_it_resumed_by_default(tmp_path, capsys):
    first = fit_verbose(FixedNet, tmp_path, capsys)
    assert f"No checkpoint in {tmp_path / 'ck'}; training from scratch." in first
    again = fit_verbose(FixedNet, tmp_path, capsys)
    assert (f"Resumed from {tmp_path / 'ck'}/epoch-0001 after epoch 1; max_epochs had been "
            "reached.") in again, again


def test_a_net_without_the_fixes_is_warned_of_once_when_training_begins(tmp_path, capsys):
    with pytest.warns(UserWarning, match=(
            r"StockNet is a skorch AccelerateMixin net without AccelerateFixesMixin, which "
            r"AccelerateCheckpoint relies on: .* Put it first")) as caught:
        fit_verbose(StockNet, tmp_path, capsys, criterion=plain_criterion)
    assert len([w for w in caught if 'without AccelerateFixesMixin' in str(w.message)]) == 1


def test_a_net_with_the_fixes_is_not_warned_of(tmp_path, capsys, recwarn):
    fit_verbose(FixedNet, tmp_path, capsys)
    assert not [w for w in recwarn if 'AccelerateFixesMixin' in str(w.message)]


@pytest.mark.parametrize('argument', ['f_params', 'f_optimizer', 'f_criterion', 'f_history',
                                      'f_pickle', 'fn_prefix', 'use_safetensors'])
def test_skorch_s_file_arguments_are_taken_with_a_warning_that_says_what_happens(
        tmp_path, argument):
    # a script written for skorch's Checkpoint runs: the argument is ignored,
    # and the warning says what is written instead and how to get the file
    value = 'x.pt' if argument.startswith('f') else True
    with pytest.warns(UserWarning) as caught:
        cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), **{argument: value})
    message = str(caught[0].message)
    assert message.startswith(f"AccelerateCheckpoint ignores {argument}={value!r}: skorch's "
                              "Checkpoint names its files; AccelerateCheckpoint saves the "
                              "whole training state into <dirname>/epoch-NNNN"), message
    assert f"add ParamsCheckpoint({argument}=...) to the callbacks" in message
    assert argument not in cp.get_params()
    net = make_net(make_accelerator(), max_epochs=1, callbacks=[cp])
    net.fit(*make_data(n=64))
    assert (tmp_path / 'ck' / 'epoch-0001' / 'model.safetensors').is_file()
    assert not list(tmp_path.rglob('x.pt'))
