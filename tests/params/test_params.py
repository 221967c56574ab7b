"""ParamsCheckpoint, TrainEndParamsCheckpoint and LoadInitParams.

The accelerate checks run in real processes, 1 and 2 (tests/workers/params_*.py):
one launch kills a run in the middle of a save, a second one runs every other
check and also loads what the killed run left. The drop-in checks run here,
with plain skorch nets.
"""

import inspect
import os
import pickle
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sklearn.base import clone
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, Checkpoint, LoadInitState, TrainEndCheckpoint

from common import MLP, make_data, plain_net
from launcher import launch
from skorch_accel_callbacks import (
    LoadInitParams,
    ParamsCheckpoint,
    RankError,
    TrainEndParamsCheckpoint,
)
from skorch_accel_callbacks.errors import CorruptCheckpointError
from skorch_accel_callbacks.format import TEMP_MARK
from testutil import read_results


def _launch_both(base, nproc):
    killed, work, results = base / 'killed', base / 'work', base / 'results'
    for folder in (killed, work, results):
        folder.mkdir()
    # a short collective timeout: the surviving rank of the killed run fails fast
    kill = launch('params_kill.py', killed, nproc=nproc,
                  env={'RESULT_DIR': str(results), 'COLLECTIVE_TIMEOUT': '20'})
    left_by_kill = sorted(os.listdir(killed))
    torn = []
    for name in left_by_kill:
        if TEMP_MARK in name:
            try:
                torch.load(killed / name)
            except Exception:  # pylint: disable=broad-except
                torn.append(name)
    launch('params_main.py', work, killed, nproc=nproc,
           env={'RESULT_DIR': str(results)}).check()
    return {'kill_returncodes': kill.returncodes, 'kill_report': kill.report(),
            'left_by_kill': left_by_kill, 'torn': torn}


@pytest.fixture(scope='module', params=[
    pytest.param(1, id='1proc', marks=pytest.mark.slow),
    pytest.param(2, id='2proc', marks=pytest.mark.slow)])
def runs(request, tmp_path_factory):
    """Both launches for ``nproc`` processes, once per module (the suite runs
    with ``--dist loadfile``, so one worker builds it). Slow: params_main.py
    runs every check in one long launch."""
    nproc = request.param
    base = tmp_path_factory.mktemp(f'params{nproc}')
    meta = _launch_both(base, nproc)
    results = base / 'results'
    return SimpleNamespace(
        nproc=nproc, results=read_results(results, 'params', nproc),
        kill=read_results(results, 'kill', nproc), killed=base / 'killed',
        **meta)


def without_probes(events):
    # the folder checks of initialize() create and remove an empty probe
    # file; the folder lock's file holds its holder's name, written in place
    return [event for event in events
            if '.probe' not in event[1] and not event[1].endswith('/.lock')]


def test_really_distributed(runs):
    for res, kill in zip(runs.results, runs.kill, strict=True):
        assert res['num_processes'] == runs.nproc
        assert res['decision']['num_processes'] == runs.nproc
        assert res['decision']['is_ddp'] == (runs.nproc == 2)
        assert kill['num_processes'] == runs.nproc
        assert kill['is_ddp'] == (runs.nproc == 2)


def test_one_decision_for_all_ranks(runs):
    """The ranks' own valid_loss_best disagree; they checkpoint together."""
    decisions = [res['decision'] for res in runs.results]
    main_view = decisions[0]['own_valid_loss_best']
    if runs.nproc == 2:
        # rank 1 validates on flipped labels: its own history disagrees
        assert decisions[1]['own_valid_loss_best'] != main_view
    # load_best gave back the history saved with the best epoch, the last
    # one the main process found best (not always the last epoch)
    last_best = len(main_view) - main_view[::-1].index(True)
    for decision in decisions:
        assert decision['event_cp'] == main_view
        assert decision['saved_event_cp'] == main_view[:last_best]


def test_only_main_process_writes_each_file_once(runs):
    decisions = [res['decision'] for res in runs.results]
    for decision in decisions[1:]:
        assert without_probes(decision['audit']) == []
    events = without_probes(decisions[0]['audit'])
    renames = {}
    for event in events:
        if event[0] == 'write':
            assert TEMP_MARK in event[1], f"wrote a final name directly: {event}"
        else:
            _, src, dst = event
            assert TEMP_MARK in src and TEMP_MARK not in dst
            assert os.path.dirname(src) == os.path.dirname(dst)
            renames[dst] = renames.get(dst, 0) + 1
    n_best = sum(decisions[0]['event_cp'])
    epochs = len(decisions[0]['event_cp'])
    # torch.save writes from C++ (no audit event); its rename is recorded
    # each save writes its journal of moves once (and removes it after)
    expected = {'best/params.pt': n_best, 'best/optimizer.pt': n_best,
                'best/history.json': n_best, 'best/.commit.json': n_best,
                'every/optimizer.pt': epochs, 'every/history.json': epochs,
                'every/.commit.json': epochs}
    for epoch in range(1, epochs + 1):
        expected[f'every/params_{epoch}.pt'] = 1
        expected[f'every/net_{epoch}.pkl'] = 1
    assert renames == expected
    for files in decisions[0]['files'].values():
        assert not [name for name in files if TEMP_MARK in name or 'commit' in name]


def test_files_complete_before_any_rank_returns(runs):
    """Every rank reads right after the save (the main process writes slowly)."""
    for res in runs.results:
        reads = res['decision']['reads']
        assert len(reads) == 4
        for epoch, read in enumerate(reads, start=1):
            assert isinstance(read, dict), read
            assert read['keys'] == ['lin.weight', 'lin.bias', 'out.weight', 'out.bias']
            assert read['same_params'] and read['pickle_same_params']
            assert read['history_epochs'] == epoch
            assert not read['pickle_is_wrapped']


def test_stock_mixin_registries_do_not_grow(runs):
    """skorch's own AccelerateMixin, checkpoint every epoch plus load_best."""
    for res in runs.results:
        decision = res['decision']
        assert len(decision['registries']) == 6
        assert all(sizes == [1, 1] for sizes in decision['registries'])
        assert decision['still_wrapped']
        assert decision['loaded_best']


def test_wrapped_and_unwrapped_save_and_load_combinations(runs):
    for res in runs.results:
        combos = res['combinations']
        for source, saved_wrapped in (('wrapped', True), ('unwrapped', False)):
            assert combos[f'{source}/saved_wrapped'] == saved_wrapped
            assert combos[f'{source}/keys'] == [
                'lin.weight', 'lin.bias', 'out.weight', 'out.bias']
            for target, loaded_wrapped in (('init_wrapped', True), ('best_wrapped', True),
                                           ('best_unwrapped', False), ('plain', False)):
                state, diff = combos[f'{source}/{target}']
                assert state == loaded_wrapped, (source, target)
                assert diff <= 1e-6, (source, target, diff)


def test_loads_without_device_warning(runs):
    for res in runs.results:
        assert not [w for w in res['decision']['warnings'] if 'DeviceWarning' in w]
        assert res['combinations']['warnings'] == []
        assert res['load_init']['warnings'] == []


def test_failed_save_warns_on_every_rank_and_training_goes_on(runs):
    for rank, res in enumerate(runs.results):
        warn = res['errors']['warn']
        assert warn['epochs'] == 3 and warn['event_cp'] == [True, True, True]
        failures = [w for w in warn['warnings'] if 'Unable to save' in w]
        # the first file that fails ends the save: one each in epochs 2 and 3
        assert len(failures) == 2
        assert all('gone_warn/' in w for w in failures)
        if rank > 0:
            assert all('RankError' in w and 'rank 0' in w for w in failures)
            assert warn['sink'] == []
        else:
            assert len([m for m in warn['sink'] if m.startswith('Unable to save')]) == 2


def test_failed_save_raises_on_every_rank_with_on_error_raise(runs):
    for rank, res in enumerate(runs.results):
        raised = res['errors']['raise']
        assert raised is not None
        assert raised['epochs'] == 2
        assert any('gone_raise/criterion.pt' in note for note in raised['notes'])
        if rank > 0:
            assert raised['type'] == 'RankError' and 'failed on rank 0' in raised['text']
        else:
            assert raised['type'] != 'RankError' and 'gone_raise' in raised['text']
        assert res['errors']['after_raise_gather'] == list(range(runs.nproc))


def test_problems_before_training_raise_early(runs):
    for rank, res in enumerate(runs.results):
        errors = res['errors']
        assert errors['unwritable']['type'] == 'PermissionError'
        assert "f_criterion='criterion.pt'" in errors['unwritable']['text']
        assert errors['uncreatable']['type'] == 'NotADirectoryError'
        assert 'a_file/sub' in errors['uncreatable']['text']
        assert errors['bad_on_error']['type'] == 'ValueError'
        assert "'ignore'" in errors['bad_on_error']['text']
        unpicklable = errors['unpicklable']
        assert unpicklable['epochs'] == 0
        # nothing saved; a lock's anchor file may stay in the folder the user
        # named (skorch calls no on_train_end after a raising on_train_begin)
        assert [name for name in unpicklable['files']
                if not (name.startswith('.') and name.endswith('lock'))] == []
        assert "f_pickle='net.pkl'" in unpicklable['text']
        assert unpicklable['type'] == ('PicklingError' if rank == 0 else 'RankError')


def test_sink_on_main_process_only(runs):
    sinks = [res['decision']['sink'] for res in runs.results]
    assert sinks[0][-1] == 'Loading best checkpoint after training.'
    assert 'A checkpoint was triggered in epoch 2.' in sinks[0]
    assert all(sink == [] for sink in sinks[1:])


def test_load_init_params(runs):
    for rank, res in enumerate(runs.results):
        load = res['load_init']
        # nothing saved yet: skipped, as skorch does, and training ran
        assert load['missing_everywhere_epochs'] == 2
        some = load['missing_on_some']
        if runs.nproc == 1:
            assert some is None
        elif rank == 0:
            assert some['type'] == 'RankError' and 'rank 1' in some['text']
        else:
            assert some['type'] == 'FileNotFoundError'


def test_kill_during_save_leaves_previous_checkpoint(runs):
    assert runs.kill_returncodes[0] == -9, runs.kill_report
    leftovers = [name for name in runs.left_by_kill if TEMP_MARK in name]
    # the kill hit the params file mid-write: epoch 2's files, still under
    # temporary names, one of them torn, beside epoch 1's files
    assert sorted(name.split(TEMP_MARK)[0] for name in leftovers) == [
        '.criterion.pt', '.optimizer.pt', '.params.pt']
    assert [name.split(TEMP_MARK)[0] for name in runs.torn] == ['.params.pt']
    # the load (LoadInitParams) removed it
    assert not [name for name in os.listdir(runs.killed) if TEMP_MARK in name]
    assert set(torch.load(runs.killed / 'params.pt')) == {
        'lin.weight', 'lin.bias', 'out.weight', 'out.bias'}
    epoch1 = runs.kill[0]['digest_epoch1']
    for res in runs.results:
        assert res['load_init']['killed_digest'] == pytest.approx(epoch1, abs=1e-9)
        assert res['load_init']['killed_history_epochs'] == 1


# ---------------------------------------------------------------- drop-in


@pytest.mark.parametrize('ours, theirs', [
    (ParamsCheckpoint, Checkpoint),
    (TrainEndParamsCheckpoint, TrainEndCheckpoint),
    (LoadInitParams, LoadInitState),
])
def test_same_arguments_and_defaults_as_skorch(ours, theirs):
    assert issubclass(ours, theirs)
    mine = inspect.signature(ours).parameters
    for name, param in inspect.signature(theirs).parameters.items():
        assert name in mine and mine[name].default == param.default, name
    extra = set(mine) - set(inspect.signature(theirs).parameters)
    assert extra <= {'on_error'}


def test_clone_and_get_params():
    cp = ParamsCheckpoint(monitor=None, dirname='d', on_error='raise', f_mymodule='m.pt',
                          fn_prefix='x_', load_best=True)
    cloned = clone(cp)
    assert cloned is not cp
    assert cloned.get_params() == cp.get_params()
    assert cloned.get_params()['on_error'] == 'raise'
    assert cloned.f_mymodule == 'm.pt'
    te = clone(TrainEndParamsCheckpoint(dirname='d', on_error='raise', f_pickle='n.pkl'))
    assert te.on_error == 'raise' and te.f_pickle == 'n.pkl'
    load = clone(LoadInitParams(cp, use_safetensors=True))
    assert load.use_safetensors and isinstance(load.checkpoint, ParamsCheckpoint)
    assert load.checkpoint.get_params() == cp.get_params()


def test_clone_after_fit(tmp_path):
    cp = ParamsCheckpoint(monitor=None, dirname=str(tmp_path), on_error='raise')
    seeded_plain_net([cp, LoadInitParams(cp)], max_epochs=1).fit(*make_data(n=64))
    cloned = clone(cp)
    assert cloned is not cp and cloned.on_error == 'raise'


def seeded_plain_net(callbacks, **kwargs):
    """plain_net of 3 epochs, its weights drawn from the same seed each time."""
    torch.manual_seed(0)
    return plain_net(callbacks, **{'max_epochs': 3, **kwargs})


def test_plain_net_same_files_and_events_as_skorch(tmp_path):
    X, y = make_data()
    listings, events, probas = [], [], []
    for cls in (Checkpoint, ParamsCheckpoint):
        folder = tmp_path / cls.__name__
        cp = cls(monitor='train_loss_best', dirname=str(folder), fn_prefix='run_',
                 f_params='params_{last_epoch[epoch]}.pt', f_pickle='net.pkl',
                 load_best=True)
        net = seeded_plain_net([cp]).fit(X, y)
        listings.append(sorted(os.listdir(folder)))
        events.append(net.history[:, 'event_cp'])
        with open(folder / 'run_net.pkl', 'rb') as f:
            probas.append(pickle.load(f).predict_proba(X))
        fresh = seeded_plain_net([cp]).initialize()
        fresh.load_params(checkpoint=cp)
        np.testing.assert_allclose(fresh.predict_proba(X), net.predict_proba(X))
    # ours removes the lock of its files when training ends: no lock file left
    assert listings[0] == listings[1]
    assert 'run_params_3.pt' in listings[1]
    assert events[0] == events[1]
    np.testing.assert_allclose(probas[0], probas[1], atol=1e-6)


def test_overridden_save_model_and_save_params_are_used(tmp_path):
    X, y = make_data()
    calls = []

    class MyCheckpoint(ParamsCheckpoint):
        def save_model(self, net):
            calls.append('save_model')
            super().save_model(net)

    class MyNet(NeuralNetClassifier):
        def save_params(self, **kwargs):
            calls.append(sorted(kwargs))
            assert all(TEMP_MARK in str(v) for k, v in kwargs.items() if k.startswith('f_'))
            super().save_params(**kwargs)

    cp = MyCheckpoint(monitor=None, dirname=str(tmp_path), f_optimizer=None,
                      f_criterion=None)
    net = MyNet(MLP, max_epochs=1, callbacks=[cp], train_split=None, verbose=0)
    net.fit(X, y)
    assert calls == ['save_model', ['f_module', 'use_safetensors'],
                     ['f_history', 'use_safetensors']]
    assert sorted(os.listdir(tmp_path)) == ['history.json', 'params.pt']


def test_train_end_checkpoint_and_load_init_resume(tmp_path):
    X, y = make_data()
    sink = []
    te = TrainEndParamsCheckpoint(dirname=str(tmp_path), sink=sink.append)
    first = seeded_plain_net([te, LoadInitParams(te)], max_epochs=2).fit(X, y)
    assert sink == ['Final checkpoint triggered']
    assert sorted(os.listdir(tmp_path)) == [
        'train_end_criterion.pt', 'train_end_history.json',
        'train_end_optimizer.pt', 'train_end_params.pt']
    second = seeded_plain_net([te, LoadInitParams(te)], max_epochs=0).fit(X, y)
    # the history and parameters of the first run were loaded
    assert len(second.history) == 2
    np.testing.assert_allclose(second.predict_proba(X), first.predict_proba(X))


def test_safetensors_round_trip(tmp_path):
    X, y = make_data()
    cp = ParamsCheckpoint(monitor='train_loss_best', dirname=str(tmp_path), f_optimizer=None,
                          use_safetensors=True, load_best=True)
    net = seeded_plain_net([cp]).fit(X, y)
    fresh = seeded_plain_net([LoadInitParams(cp, use_safetensors=True)], max_epochs=0)
    fresh.fit(X, y)
    np.testing.assert_allclose(fresh.predict_proba(X), net.predict_proba(X))


def test_raise_mode_in_one_process_names_the_file(tmp_path):
    X, y = make_data()
    cp = ParamsCheckpoint(monitor=None, dirname=str(tmp_path / 'out'), on_error='raise',
                          f_optimizer=None, f_criterion=None)

    class FolderGone(Callback):
        """The folder is gone (a lost mount) when the first save begins."""

        # observes or injects a fault, trains nothing: not recorded, may come and go
        unrecorded_params = True

        def on_epoch_end(self, net, **kwargs):
            shutil.rmtree(tmp_path / 'out', ignore_errors=True)

    net = seeded_plain_net([FolderGone(), cp], max_epochs=2)
    with pytest.raises(Exception) as info:
        net.fit(X, y)
    assert not isinstance(info.value, RankError)
    assert any(str(tmp_path / 'out' / 'params.pt') in note
               for note in info.value.__notes__)


def test_damaged_journal_is_named_before_anything_loads(tmp_path):
    X, y = make_data()
    cp = ParamsCheckpoint(monitor=None, dirname=str(tmp_path), f_optimizer=None,
                          f_criterion=None)
    seeded_plain_net([cp], max_epochs=1).fit(X, y)
    with open(cp.journal_path, 'w') as f:
        f.write('{"moves": [["only one path"]]}')
    net = seeded_plain_net([LoadInitParams(cp)], max_epochs=1)
    with pytest.raises(CorruptCheckpointError, match=re.escape(cp.journal_path)):
        net.fit(X, y)
    assert len(net.history) == 0
