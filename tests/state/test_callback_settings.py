"""The settings of a net's callbacks are recorded with its hyper-parameters:
a resume that changes one is refused naming it, and one that check_params
lets through takes effect, also inside the restored state of a callback
and in an LR scheduler's base lr (issue 28, items 3, 4 and 5)."""

import json

import pytest
import torch
from skorch.callbacks import (
    Callback,
    EarlyStopping,
    Freezer,
    GradientNormClipping,
    LRScheduler,
    ProgressBar,
)
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, StepLR

from common import FailAt, NotTrainingState, make_accelerator, make_data, make_net
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    CheckpointError,
)

# 160 rows: 128 training rows, 4 batches of 32 an epoch
N_ROWS = 160


class LrSeen(NotTrainingState, Callback):
    """The first param group's lr at every training batch: (epoch, lr)."""

    def initialize(self):
        self.seen_ = []
        return self

    def on_batch_begin(self, net, training=False, **kwargs):
        if training:
            self.seen_.append((len(net.history) - 1, net.optimizer_.param_groups[0]['lr']))


def decay(epoch):
    return 0.9 ** epoch


def build(dirname, callbacks=(), load_kwargs=None, every_n_steps=None, keep_last=5,
          **net_kwargs):
    cp = AccelerateCheckpoint(dirname=str(dirname), every_n_steps=every_n_steps,
                              keep_last=keep_last)
    load = AccelerateLoadInitState(cp, **(load_kwargs or {}))
    torch.manual_seed(0)
    net_kwargs.setdefault('max_epochs', 2)
    return make_net(make_accelerator(), callbacks=[cp, load, *callbacks], **net_kwargs)


def scheduler(policy=StepLR, **kwargs):
    if policy is StepLR:
        kwargs.setdefault('step_size', 1)
    return ('lr_scheduler', LRScheduler(policy=policy, **kwargs))


def callback(net, name):
    return dict(net.callbacks_)[name]


def loaded_from(net):
    return callback(net, 'AccelerateLoadInitState').loaded_from_


def refused(net):
    """Fit ``net``, expect a refusal before any training step; its message."""
    with pytest.raises(CheckpointError) as info:
        net.fit(*make_data(n=N_ROWS))
    assert len(net.history) == 0
    return str(info.value)


# ---------------------------------------------------------------- a setting changed

def test_a_gamma_loop_on_one_folder_is_refused(tmp_path):
    build(tmp_path / 'ck', callbacks=[scheduler(gamma=0.8)]).fit(*make_data(n=N_ROWS))
    message = refused(build(tmp_path / 'ck', callbacks=[scheduler(gamma=0.3)]))
    assert 'epoch-0002 was trained with other hyper-parameters: ' \
           'callbacks__lr_scheduler__gamma: 0.8 in the checkpoint, 0.3 now.' in message
    assert "check_params=('callbacks__lr_scheduler__gamma',)" in message


def gamma_schedule(lr, gamma, new_gamma, resumed_at, epochs):
    """The lr of each epoch of a StepLR(step_size=1) whose gamma becomes
    ``new_gamma`` at the epoch ``resumed_at``, as torch computes it."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=lr)
    steps = StepLR(optimizer, step_size=1, gamma=gamma)
    lrs = []
    for epoch in range(epochs):
        if epoch == resumed_at:
            steps.gamma = new_gamma
        lrs.append(optimizer.param_groups[0]['lr'])
        optimizer.step()
        steps.step()
    return lrs


@pytest.mark.parametrize('check_params', [
    ('callbacks__lr_scheduler__gamma',), ('callbacks__lr_scheduler',), False])
def test_an_allowed_gamma_takes_effect(tmp_path, check_params):
    build(tmp_path / 'ck', callbacks=[scheduler(gamma=0.5), LrSeen()]).fit(
        *make_data(n=N_ROWS))
    seen = LrSeen()
    net = build(tmp_path / 'ck', callbacks=[scheduler(gamma=0.3), seen], max_epochs=4,
                load_kwargs={'check_params': check_params})
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net).endswith('epoch-0002')
    # the scheduler's own state holds the new gamma, not the checkpoint's
    assert callback(net, 'lr_scheduler').lr_scheduler_.gamma == 0.3
    expected = gamma_schedule(0.1, 0.5, 0.3, resumed_at=2, epochs=4)
    assert [lr for _, lr in seen.seen_] == [lr for lr in expected[2:] for _ in range(4)]
    assert list(net.history[:, 'event_lr']) == expected


def test_a_gamma_changed_before_a_mid_epoch_resume_is_refused(tmp_path):
    net = build(tmp_path / 'ck', callbacks=[scheduler(gamma=0.8), FailAt(4)], every_n_steps=3)
    with pytest.raises(RuntimeError, match='crash'):
        net.fit(*make_data(n=N_ROWS))
    message = refused(build(tmp_path / 'ck', callbacks=[scheduler(gamma=0.3)], every_n_steps=3))
    assert 'epoch-0000-step-00000003 was trained with other hyper-parameters: ' \
           'callbacks__lr_scheduler__gamma: 0.8 in the checkpoint, 0.3 now.' in message


def test_another_policy_under_the_same_name_is_refused(tmp_path):
    build(tmp_path / 'ck', callbacks=[scheduler(gamma=0.8)]).fit(*make_data(n=N_ROWS))
    message = refused(build(tmp_path / 'ck', callbacks=[
        scheduler(policy=CosineAnnealingLR, T_max=4)]))
    assert ('callbacks__lr_scheduler__policy: torch.optim.lr_scheduler.StepLR in the '
            'checkpoint, torch.optim.lr_scheduler.CosineAnnealingLR now') in message
    assert 'callbacks__lr_scheduler__T_max: not set in the checkpoint, 4 now' in message
    assert 'callbacks__lr_scheduler__gamma: 0.8 in the checkpoint, not set now' in message
    assert 'callbacks__lr_scheduler__step_size: 1 in the checkpoint, not set now' in message


def test_an_allowed_policy_goes_on_without_the_old_ones_settings(tmp_path):
    build(tmp_path / 'ck', callbacks=[scheduler(gamma=0.8)]).fit(*make_data(n=N_ROWS))
    seen = LrSeen()
    net = build(tmp_path / 'ck', max_epochs=3, callbacks=[
        scheduler(policy=CosineAnnealingLR, T_max=4), seen],
        load_kwargs={'check_params': ('callbacks__lr_scheduler',)})
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net).endswith('epoch-0002')
    cosine = callback(net, 'lr_scheduler').lr_scheduler_
    # no mixed state: the cosine's own settings, the position of the schedule
    state = cosine.state_dict()
    assert 'gamma' not in state and 'step_size' not in state and state['T_max'] == 4
    assert state['last_epoch'] == 3 and state['base_lrs'] == [0.1]


def test_another_class_under_the_same_name_is_refused_once(tmp_path):
    build(tmp_path / 'ck', callbacks=[('guard', EarlyStopping(patience=3))]).fit(
        *make_data(n=N_ROWS))
    message = refused(build(tmp_path / 'ck', callbacks=[
        ('guard', GradientNormClipping(gradient_clip_value=1.0))]))
    assert ('trained with other hyper-parameters: callbacks__guard: '
            'skorch.callbacks.training.EarlyStopping in the checkpoint, '
            'skorch.callbacks.regularization.GradientNormClipping now.') in message
    # named once, with the name that allows it
    assert 'callbacks__guard__' not in message
    assert "check_params=('callbacks__guard',)" in message


def test_clipping_and_patience_changes_are_refused(tmp_path):
    build(tmp_path / 'ck', callbacks=[GradientNormClipping(gradient_clip_value=0.01),
                                      EarlyStopping(patience=1)]).fit(*make_data(n=N_ROWS))
    message = refused(build(tmp_path / 'ck', callbacks=[
        GradientNormClipping(gradient_clip_value=10.0), EarlyStopping(patience=5)]))
    assert 'callbacks__EarlyStopping__patience: 1 in the checkpoint, 5 now' in message
    assert ('callbacks__GradientNormClipping__gradient_clip_value: 0.01 in the '
            'checkpoint, 10.0 now') in message


def test_an_early_stopping_added_or_removed_is_refused(tmp_path):
    build(tmp_path / 'ck', max_epochs=1).fit(*make_data(n=N_ROWS))
    net = build(tmp_path / 'ck', callbacks=[EarlyStopping(patience=1)])
    message = refused(net)
    assert ('callbacks__EarlyStopping: no such callback in the checkpoint, '
            'skorch.callbacks.training.EarlyStopping now.') in message
    assert "check_params=('callbacks__EarlyStopping',)" in message
    net = build(tmp_path / 'ck', callbacks=[EarlyStopping(patience=1)],
                load_kwargs={'check_params': ('callbacks__EarlyStopping',)})
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net).endswith('epoch-0001') and len(net.history) == 2
    # the other way round: the checkpoint's EarlyStopping is gone
    message = refused(build(tmp_path / 'ck', max_epochs=3))
    assert ('callbacks__EarlyStopping: skorch.callbacks.training.EarlyStopping in the '
            'checkpoint, no such callback now.') in message


def test_unnamed_callbacks_in_another_order_are_refused(tmp_path):
    def stoppers():
        return [EarlyStopping(monitor='valid_loss', patience=2),
                EarlyStopping(monitor='valid_acc', lower_is_better=False, patience=3)]

    build(tmp_path / 'ck', callbacks=stoppers()).fit(*make_data(n=N_ROWS))
    message = refused(build(tmp_path / 'ck', callbacks=stoppers()[::-1], max_epochs=4))
    assert ('the unnamed EarlyStopping callbacks (EarlyStopping_1, EarlyStopping_2) are '
            'listed in another order than in the checkpoint') in message
    assert 'give each a name of its own' in message
    # a swap is not offered as a new value to resume with
    assert 'check_params' not in message and 'monitor:' not in message
    # in the same order they resume
    net = build(tmp_path / 'ck', callbacks=stoppers(), max_epochs=3)
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net).endswith('epoch-0002')


# ---------------------------------------------------------------- lr and schedulers

@pytest.mark.parametrize('policy, step_every, old_lr, new_lr, factor', [
    (LambdaLR, 'epoch', 0.05, 0.5, decay),
    (LambdaLR, 'batch', 0.05, 0.5, decay),
    (StepLR, 'epoch', 0.125, 0.5, lambda epoch: 0.5 ** epoch),
])
def test_a_new_lr_is_the_schedulers_new_base(tmp_path, policy, step_every, old_lr, new_lr,
                                              factor):
    kwargs = ({'lr_lambda': decay} if policy is LambdaLR else {'step_size': 1, 'gamma': 0.5})
    build(tmp_path / 'ck', lr=old_lr, callbacks=[
        scheduler(policy=policy, step_every=step_every, **kwargs)]).fit(*make_data(n=N_ROWS))
    seen = LrSeen()
    net = build(tmp_path / 'ck', lr=new_lr, max_epochs=4, load_kwargs={'check_params': ('lr',)},
                callbacks=[scheduler(policy=policy, step_every=step_every, **kwargs), seen])
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net).endswith('epoch-0002')
    # the schedule goes on from its position, from the new lr
    steps = [(epoch, 4 * epoch + batch) for epoch in (2, 3) for batch in range(4)]
    at = [epoch if step_every == 'epoch' else step for epoch, step in steps]
    assert [lr for _, lr in seen.seen_] == [new_lr * factor(k) for k in at]
    scheduled = callback(net, 'lr_scheduler').lr_scheduler_
    assert scheduled.base_lrs == [new_lr]
    assert net.optimizer_.param_groups[0]['initial_lr'] == new_lr
    # the history says the lr the batches ran at
    if step_every == 'epoch':
        recorded = list(net.history[2:, 'event_lr'])
    else:
        # the training batches' rows
        recorded = [row['event_lr'] for epoch in net.history[2:] for row in epoch['batches']
                    if 'event_lr' in row]
    assert recorded == [lr for _, lr in seen.seen_][::4 if step_every == 'epoch' else 1]


def test_parameters_a_freezer_froze_stay_frozen_after_a_resume(tmp_path):
    """skorch's Freezer freezes once, when its epoch begins: a resume after
    it trains on with the parameters as the checkpoint has them."""
    def net(dirname, max_epochs=3):
        return build(tmp_path / dirname, callbacks=[Freezer('lin.bias')],
                     max_epochs=max_epochs, module__dropout=0.0)

    straight = net('a')
    straight.fit(*make_data(n=N_ROWS))
    net('b', max_epochs=2).fit(*make_data(n=N_ROWS))
    resumed = net('b')
    resumed.fit(*make_data(n=N_ROWS))
    assert loaded_from(resumed).endswith('epoch-0002') and len(resumed.history) == 3
    assert not resumed.module_.lin.bias.requires_grad
    assert resumed.module_.lin.weight.requires_grad
    for (name, a), (_, b) in zip(straight.module_.state_dict().items(),
                                 resumed.module_.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # the frozen bias never trained: it is still the initial one
    assert torch.equal(resumed.module_.lin.bias, net('c').initialize().module_.lin.bias)


# ---------------------------------------------------------------- what is not checked

def say_nothing(*args, **kwargs):
    pass


def test_what_only_speaks_or_stores_may_change(tmp_path):
    build(tmp_path / 'ck', max_epochs=1, keep_last=5, callbacks=[FailAt(99)]).fit(
        *make_data(n=N_ROWS))
    # FailAt declares its settings unrecorded (NotTrainingState): it changes
    net = build(tmp_path / 'ck', keep_last=2, callbacks=[ProgressBar(), FailAt(100)],
                callbacks__print_log__sink=say_nothing)
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net).endswith('epoch-0001') and len(net.history) == 2


class Scaled(Callback):
    """A user's callback whose settings change training: it scales the
    gradients by ``factor`` before each step; ``log_every`` only says how
    often it would print."""

    def __init__(self, factor=1.0, log_every=10):
        self.factor = factor
        self.log_every = log_every

    def on_grad_computed(self, net, named_parameters, **kwargs):
        for _, parameter in named_parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(self.factor)


class ScaledLoudly(Scaled):
    """Scaled, declaring that ``log_every`` changes nothing of training."""

    unrecorded_params = ('log_*',)


class Watcher(Callback):
    """A user's observer, declared unrecorded: it may come and go."""

    unrecorded_params = True

    def __init__(self, every=1):
        self.every = every


def test_a_users_callback_setting_changed_is_refused(tmp_path):
    build(tmp_path / 'ck', callbacks=[('scaled', Scaled(0.5))]).fit(*make_data(n=N_ROWS))
    message = refused(build(tmp_path / 'ck', callbacks=[('scaled', Scaled(2.0))]))
    assert 'callbacks__scaled__factor: 0.5 in the checkpoint, 2.0 now' in message
    assert "check_params=('callbacks__scaled__factor',)" in message
    # its author is told how to declare a setting that changes nothing
    assert 'A callback of your own (scaled)' in message and 'unrecorded_params' in message
    # undeclared, a setting that only speaks is recorded as well
    message = refused(build(tmp_path / 'ck', callbacks=[('scaled', Scaled(0.5, log_every=3))]))
    assert 'callbacks__scaled__log_every: 10 in the checkpoint, 3 now' in message
    # and the user's callback is missed when it is gone
    message = refused(build(tmp_path / 'ck', max_epochs=3))
    assert 'callbacks__scaled: test_callback_settings.Scaled in the checkpoint, ' \
           'no such callback now' in message


def test_check_params_lets_a_users_setting_change_in_force(tmp_path):
    build(tmp_path / 'ck', callbacks=[('scaled', Scaled(0.5))]).fit(*make_data(n=N_ROWS))
    net = build(tmp_path / 'ck', callbacks=[('scaled', Scaled(2.0))], max_epochs=3,
                load_kwargs={'check_params': ('callbacks__scaled__factor',)})
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net).endswith('epoch-0002') and len(net.history) == 3
    assert callback(net, 'scaled').factor == 2.0
    # the next resume checks against the value that trained epoch 3
    message = refused(build(tmp_path / 'ck', callbacks=[('scaled', Scaled(0.5))], max_epochs=4))
    assert 'epoch-0003 was trained with other hyper-parameters: ' \
           'callbacks__scaled__factor: 2.0 in the checkpoint, 0.5 now' in message


def test_a_callback_declares_what_is_not_recorded(tmp_path):
    build(tmp_path / 'ck', callbacks=[('scaled', ScaledLoudly(0.5)), Watcher(1)]).fit(
        *make_data(n=N_ROWS))
    saved = json.loads((tmp_path / 'ck' / 'epoch-0002' / 'manifest.json').read_text())
    recorded = [name for name in saved['params'] if name.startswith('callbacks__')]
    assert recorded.count('callbacks__scaled__factor') == 1
    assert not [name for name in recorded if 'log_every' in name or 'Watcher' in name]
    # the declared setting changes, the observer is gone: resumed
    net = build(tmp_path / 'ck', callbacks=[('scaled', ScaledLoudly(0.5, log_every=3))],
                max_epochs=3)
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net).endswith('epoch-0002') and len(net.history) == 3
    # what it does not declare is still checked
    message = refused(build(tmp_path / 'ck', callbacks=[('scaled', ScaledLoudly(2.0))],
                            max_epochs=4))
    assert 'callbacks__scaled__factor: 0.5 in the checkpoint, 2.0 now' in message


def test_a_declaration_that_is_no_collection_of_names_is_an_error(tmp_path):
    class Misdeclared(Callback):
        unrecorded_params = 'log_every'

    net = build(tmp_path / 'ck', callbacks=[Misdeclared()], max_epochs=1)
    with pytest.raises(TypeError, match=r"Misdeclared.unrecorded_params must be True or a "
                                        r"collection of patterns.*not 'log_every'"):
        net.fit(*make_data(n=N_ROWS))


def test_a_manifest_without_callback_settings_resumes_unchecked(tmp_path):
    build(tmp_path / 'ck', callbacks=[scheduler(gamma=0.8)], max_epochs=1).fit(
        *make_data(n=N_ROWS))
    path = tmp_path / 'ck' / 'epoch-0001'
    assert 'gamma' in refused(build(tmp_path / 'ck', callbacks=[scheduler(gamma=0.3)]))
    # what was written before callbacks were recorded
    manifest_file = path / 'manifest.json'
    saved = json.loads(manifest_file.read_text())
    saved['params'] = {name: value for name, value in saved['params'].items()
                       if not name.startswith('callbacks')}
    manifest_file.write_text(json.dumps(saved))
    net = build(tmp_path / 'ck', callbacks=[scheduler(gamma=0.3)])
    net.fit(*make_data(n=N_ROWS))
    assert loaded_from(net) == str(path) and len(net.history) == 2


class KeepsACounter(Callback):
    """A user's callback that keeps state in a plain public attribute."""

    def __init__(self):
        self.seen = []

    def on_batch_end(self, net, **kwargs):
        self.seen.append(len(self.seen))


class KeepsFittedState(Callback):
    """The same, kept as fitted state (the advice's remedy)."""

    def initialize(self):
        self.seen_ = []
        return self

    def on_batch_end(self, net, **kwargs):
        self.seen_.append(len(self.seen_))


def _fit_with(dirname, counter, max_epochs):
    cp = AccelerateCheckpoint(dirname=str(dirname))
    torch.manual_seed(0)
    net = make_net(make_accelerator(), max_epochs=max_epochs,
                   callbacks=[AccelerateLoadInitState(cp), cp, ('counter', counter)])
    return net.fit(*make_data(n=320))


def test_a_plain_attribute_s_refusal_says_first_how_to_keep_it_exact(tmp_path):
    _fit_with(tmp_path, KeepsACounter(), 4)
    with pytest.raises(CheckpointError) as refused:
        _fit_with(tmp_path, KeepsACounter(), 5)
    message = str(refused.value)
    remedy = message.index("make it fitted state: a name ending in '_' ('seen' -> 'seen_')")
    assert 'counter.seen is not an argument of the callback' in message
    assert remedy < message.index('check_params=') < message.index('unrecorded_params = True')
    assert 'not as it was saved' in message
    # the saved list (40 numbers) is shortened
    assert 'characters) in the checkpoint' in message


def test_the_advice_s_remedy_resumes_exactly(tmp_path):
    full = _fit_with(tmp_path / 'full', KeepsFittedState(), 3)
    _fit_with(tmp_path / 'resumed', KeepsFittedState(), 2)
    resumed = _fit_with(tmp_path / 'resumed', KeepsFittedState(), 3)
    assert dict(resumed.callbacks_)['counter'].seen_ == dict(full.callbacks_)['counter'].seen_
    assert torch.equal(resumed.module_.lin.weight, full.module_.lin.weight)
