"""AccelerateFixesMixin's consistent decisions across ranks: the epoch's
metrics reduced over every rank (``reduce_metrics``), and a callback that
stops training on some ranks only raising on every rank, never hanging.

The 2-process checks share one launch of tests/workers/mixin_decisions.py
(see there for the data: the ranks' own valid losses part ways)."""

import functools
import json
import pickle

import numpy as np
import pytest
import torch
from sklearn.base import clone
from skorch.callbacks import EarlyStopping

from common import (
    FixedNet,
    StockNet,
    history_rows,
    make_accelerator,
    make_data,
    make_net,
    plain_criterion,
)
from launcher import launch
from skorch_accel_callbacks import (
    AccelerateCheckpoint,
    AccelerateLoadInitState,
    CheckpointError,
    DivergedDecisionError,
)
from skorch_accel_callbacks.callbacks.mixin import _verdict
from skorch_accel_callbacks.state import check_same_params, training_params
from testutil import read_results

# a hang fails the launch after this long; the checks that raise must be far quicker
COLLECTIVE_TIMEOUT = 30


@pytest.fixture(scope='module')
def decisions(tmp_path_factory):
    folder = tmp_path_factory.mktemp('decisions')
    result = launch('mixin_decisions.py', str(folder), nproc=2, timeout=240,
                    env={'RESULT_DIR': str(folder),
                         'COLLECTIVE_TIMEOUT': str(COLLECTIVE_TIMEOUT)})
    result.check()
    results = read_results(folder, 'decisions', 2)
    assert [res['num_processes'] for res in results] == [2, 2]
    return results


def both(results, scenario):
    return results[0][scenario], results[1][scenario]


def own_rows(runs, epoch, training):
    """Both ranks' own batch losses and sizes of ``epoch``, rank 0's first."""
    rows = [row for run in runs for row in run['own_losses']
            if row['epoch'] == epoch and row['training'] == training]
    return [row['loss'] for row in rows], [row['size'] for row in rows]


@pytest.mark.slow
def test_ranks_that_decide_apart_raise_on_every_rank_within_seconds(decisions):
    """Without the reduction, EarlyStopping stops rank 1 (its valid loss
    rises) and not rank 0: both raise DivergedDecisionError naming the
    callback and the ranks, long before a collective's timeout (the code
    before this change left rank 0 waiting in its next collective)."""
    for run in both(decisions, 'early_stopping_off'):
        raised = run['raised']
        assert raised is not None and raised['type'] == 'DivergedDecisionError'
        assert raised['callback'] == "'early_stopping' (EarlyStopping)"
        assert raised['hook'] == 'on_epoch_end'
        assert (raised['stopped'], raised['went_on']) == ([1], [0])
        assert 'reduce_metrics=True' in raised['message']
        assert run['seconds'] < COLLECTIVE_TIMEOUT / 2
    assert both(decisions, 'early_stopping_off')[0]['history'] != \
        both(decisions, 'early_stopping_off')[1]['history']


@pytest.mark.slow
def test_reduced_metrics_stop_every_rank_at_the_same_epoch(decisions):
    """With the reduction, both ranks record the losses over both ranks'
    batches (the weighted mean of skorch's PassthroughScoring over all of
    them), the accuracies (caching EpochScorings, on valid and on train)
    over the whole data, and stop together."""
    runs = both(decisions, 'early_stopping_on')
    for run in runs:
        assert run['raised'] is None
        # EarlyStopping stopped it: the validation data's loss rises
        assert run['epochs'] < 15
    assert runs[0]['history'] == runs[1]['history']
    history = runs[0]['history']
    for epoch, row in enumerate(history, start=1):
        for prefix, training in (('train', True), ('valid', False)):
            losses, sizes = own_rows(runs, epoch, training)
            assert row[f'{prefix}_loss'] == np.average(losses, weights=sizes), (epoch, prefix)
        assert sum(sizes) == 128  # every validation row once
    # the last epoch's valid_loss is the trained module's over all 128 rows
    assert runs[0]['predicted_rows'] == 128
    assert history[-1]['valid_loss'] == pytest.approx(runs[0]['loss_by_hand'], rel=1e-6)
    # valid_acc (a caching EpochScoring) scores the predictions of all 128 rows
    assert history[-1]['valid_acc'] == runs[0]['acc_by_hand']
    assert all('train_acc' in row for row in history)


@pytest.mark.slow
def test_a_caching_epoch_scoring_scores_each_row_once(decisions):
    """With 120 validation rows accelerate fills rank 1's last batch up
    with 8 repeated rows: valid_acc is still over the 120 rows (the losses
    of a filled batch count its repeated rows, as the rank's own did)."""
    runs = both(decisions, 'early_stopping_uneven')
    assert runs[0]['history'] == runs[1]['history']
    assert runs[0]['predicted_rows'] == 120
    for run in runs:
        assert run['history'][-1]['valid_acc'] == run['acc_by_hand']
    _, sizes = own_rows(runs, 1, training=False)
    assert sum(sizes) == 128


@pytest.mark.slow
def test_early_stopping_after_a_resume_stops_where_the_uninterrupted_run_did(decisions):
    """The issue's case (a checkpoint holds rank 0's history and
    EarlyStopping state, restored on every rank): with the reduction they
    are every rank's, and a run preempted at the end of epoch 1 and resumed
    stops at the uninterrupted run's epoch with its history and parameters,
    on both ranks."""
    runs = both(decisions, 'resume')
    for run in runs:
        assert run['preempted'] and run['loaded_from'] == 'epoch-0001'
        assert run['resumed']['raised'] is None
        assert run['resumed']['epochs'] == run['uninterrupted']['epochs'] < 15
        assert run['resumed']['history'] == run['uninterrupted']['history']
        assert run['same_params']
    assert runs[0]['resumed']['history'] == runs[1]['resumed']['history']


@pytest.mark.slow
def test_reduce_lr_on_plateau_decides_the_same_on_every_rank(decisions):
    off = both(decisions, 'plateau_off')
    # the ranks' own losses had them lower the learning rate apart
    assert off[0]['lrs'] != off[1]['lrs']
    on = both(decisions, 'plateau_on')
    assert on[0]['lrs'] == on[1]['lrs']
    assert on[0]['lrs'][-1] < on[0]['lrs'][0]
    assert on[0]['history'] == on[1]['history']


@pytest.mark.slow
def test_a_checkpoint_monitor_agrees_with_every_rank_history(decisions):
    """The checkpoint saves on rank 0's decision anyway; with the reduction
    every rank's history says the same epochs were best."""
    off = both(decisions, 'monitor_off')
    best = [[row['valid_loss_best'] for row in run['history']] for run in off]
    assert best[0] != best[1]
    on = both(decisions, 'monitor_on')
    best = [[row['valid_loss_best'] for row in run['history']] for run in on]
    assert best[0] == best[1]
    assert on[0]['committed'] == on[1]['committed']
    # the best epoch and the last one (retention keeps the newest ones)
    best_epochs = [f'epoch-{i:04d}' for i, is_best in enumerate(best[0], start=1) if is_best]
    assert on[0]['committed'] == [best_epochs[-1], f"epoch-{len(best[0]):04d}"]


@pytest.mark.slow
def test_a_users_callback_that_stops_one_rank_at_an_epochs_begin_raises(decisions):
    for run in both(decisions, 'user_stop'):
        raised = run['raised']
        assert raised['callback'] == "'stop_on_rank' (StopOnRank)"
        assert (raised['hook'], raised['epoch']) == ('on_epoch_begin', 2)
        assert (raised['stopped'], raised['went_on']) == ([1], [0])
        # reduced already: the advice is to decide on the main process
        assert 'main process' in raised['message']


@pytest.mark.slow
def test_a_ctrl_c_on_one_rank_stops_every_rank(decisions):
    """A real SIGINT in a callback's end of epoch 2 on rank 0 only (no
    checkpoint watches signals): no DivergedDecisionError, both ranks end
    their fit after epoch 2 as skorch's Ctrl-C does (the code before this
    change left rank 1 training into a collective that rank 0 never
    joined), and Python's SIGINT handler is back."""
    runs = both(decisions, 'ctrl_c')
    assert [run['sent'] for run in runs] == [True, False]
    for run in runs:
        assert run['raised'] is None and run['epochs'] == 2
        assert run['sigint_handler_restored']


# ------------------------------------------------------------------ one process

def fitted_history(net_cls, **kwargs):
    torch.manual_seed(0)
    X, y = make_data()
    net = make_net(make_accelerator(), net_cls=net_cls, criterion=plain_criterion,
                   max_epochs=4, callbacks=[EarlyStopping(patience=1)], **kwargs)
    net.fit(X, y)
    return history_rows(net.history)


def test_one_process_histories_are_stock_skorchs_either_way():
    stock = fitted_history(StockNet)
    assert fitted_history(FixedNet) == stock
    assert fitted_history(FixedNet, reduce_metrics=False) == stock


def test_reduce_metrics_is_a_parameter_that_clones_and_pickles():
    net = make_net(make_accelerator(), reduce_metrics=False)
    assert net.get_params()['reduce_metrics'] is False
    assert clone(net).reduce_metrics is False
    assert make_net(make_accelerator()).reduce_metrics is True
    X, y = make_data(n=64)
    net.fit(X, y)
    again = pickle.loads(pickle.dumps(net))
    assert again.reduce_metrics is False and clone(again).reduce_metrics is False
    net.set_params(reduce_metrics=True)
    assert net.reduce_metrics is True


def test_reduce_metrics_must_be_a_bool():
    with pytest.raises(ValueError, match="reduce_metrics must be True or False, got 'yes'"):
        make_net(make_accelerator(), reduce_metrics='yes').initialize()


@pytest.mark.parametrize('outcomes, verdict', [
    ([0, 0], 'go'),
    ([1, 1], 'stop'),
    ([1, 0], 'diverged'),
    ([0, 1, 0], 'diverged'),
    # a Ctrl-C that reached some ranks stops every rank
    ([2, 0], 'stop'),
    ([2, 1], 'stop'),
    # a failure anywhere raises everywhere
    ([3, 0], 'failed'),
    ([1, 3], 'failed'),
])
def test_what_the_ranks_do_after_a_hook(outcomes, verdict):
    assert _verdict(outcomes) == verdict


def test_the_error_pickles_with_what_it_names():
    error = DivergedDecisionError("'es' (EarlyStopping)", 'on_epoch_end', 3, (1,), (0,), 'fix')
    again = pickle.loads(pickle.dumps(error))
    assert (again.callback, again.hook, again.epoch, again.stopped, again.went_on) == \
        ("'es' (EarlyStopping)", 'on_epoch_end', 3, (1,), (0,))
    assert str(again) == str(error)


def checkpointed_net(folder, **kwargs):
    """A net that checkpoints into ``folder`` and resumes from it."""
    checkpoint = AccelerateCheckpoint(dirname=str(folder))
    return make_net(make_accelerator(), criterion=plain_criterion,
                    callbacks=[AccelerateLoadInitState(checkpoint), checkpoint], **kwargs)


def test_a_change_of_reduce_metrics_between_launches_is_refused(tmp_path):
    """It changes what EarlyStopping and the monitors decide on, so the
    resume's hyper-parameter check covers it."""
    X, y = make_data(n=64)

    net = functools.partial(checkpointed_net, tmp_path)
    net(max_epochs=1).fit(X, y)
    with pytest.raises(CheckpointError, match="reduce_metrics: True in the checkpoint, False now"):
        net(max_epochs=2, reduce_metrics=False).fit(X, y)


def test_a_checkpoint_from_before_reduce_metrics_is_checked_as_what_it_trained(tmp_path):
    """A checkpoint written before the parameter existed records none: one
    process resumes it whatever the setting (it changes nothing there); of
    several processes each rank had logged its own losses, so it counts as
    ``reduce_metrics=False``."""
    X, y = make_data(n=64)

    net = functools.partial(checkpointed_net, tmp_path)
    net(max_epochs=1).fit(X, y)
    manifest_path = tmp_path / 'epoch-0001' / 'manifest.json'
    manifest = json.loads(manifest_path.read_text())
    del manifest['params']['reduce_metrics']
    def check(manifest: dict, **net_params: object) -> list[str]:
        resuming = net(**net_params).initialize()
        return check_same_params(manifest, training_params(resuming), 'old',
                                 callbacks=dict(resuming.callbacks_))

    assert check(manifest) == []
    with pytest.raises(CheckpointError, match="reduce_metrics: False in the checkpoint, True now"):
        check(dict(manifest, world_size=2))
    assert check(dict(manifest, world_size=2), reduce_metrics=False) == []
