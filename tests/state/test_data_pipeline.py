"""Exact resumes wherever the training data flows: loader workers (persistent
or not, pinned, prefetching, forked or started by ``forkserver``), shuffling
with a generator of the loader's own, a user's samplers, and random
augmentation in ``__getitem__`` drawing from torch's, numpy's or Python's
global generator.

Each case trains uninterrupted, then the same command SIGKILLed on every rank
(at an epoch's end: after the first batch of epoch 4, resuming from epoch
3's checkpoint; inside an epoch: after the batch that follows the step-27
checkpoint of epoch 4 in 1 process, 8 batches an epoch, or the step-15 one in
2, 4 batches an epoch on each rank) and launched again right away, unchanged
but for the workers' start method in one case (the killed job's workers may
still run: the folder's lock is not theirs); every rank ends bit-identical
to the uninterrupted run. Before these, a persistent loader's resume, a
loader's own generator and augmentation inside an epoch (with or without
workers) each resumed silently differently.
"""

import json

import pytest

from resume_runs import run
from skorch_accel_callbacks.state._worker_start import python_can_hang_at_fork
from testutil import assert_identical, final_state

# (name, processes, DATA of tests/workers/resume.py, kill, every_n_steps)
CASES = [
    ('persistent-epoch-end', 1, {'num_workers': 2, 'persistent_workers': True},
     'batch:4:1', None),
    ('persistent-pinned-prefetch-inside', 2,
     {'num_workers': 2, 'persistent_workers': True, 'pin_memory': True,
      'prefetch_factor': 3, 'generator': 11}, 'batch:4:4', 3),
    ('persistent-epoch-end', 2, {'num_workers': 2, 'persistent_workers': True},
     'batch:4:1', None),
    ('augment-torch-in-process-inside', 1, {'augment': 'torch'}, 'batch:4:5', 3),
    ('augment-numpy-in-process-inside', 2, {'augment': 'numpy'}, 'batch:4:4', 3),
    ('augment-torch-workers-inside', 2, {'augment': 'torch', 'num_workers': 2},
     'batch:4:4', 3),
    ('augment-python-workers-inside', 1, {'augment': 'python', 'num_workers': 2},
     'batch:4:5', 3),
    ('augment-torch-workers-epoch-end', 2, {'augment': 'torch', 'num_workers': 2},
     'batch:4:1', None),
    # forked workers until the kill, then started by forkserver (the way out
    # of CPython gh-112275 that the warning names): the resume is exact, and
    # the switch is not refused
    ('augment-torch-workers-forkserver-at-resume-inside', 2,
     {'augment': 'torch', 'num_workers': 2,
      'at_resume': {'multiprocessing_context': 'forkserver'}}, 'batch:4:4', 3),
    ('loader-generator-inside', 1, {'generator': 5}, 'batch:4:5', 3),
    ('loader-generator-epoch-end', 1, {'generator': 5, 'num_workers': 2}, 'batch:4:1', None),
    ('weighted-sampler-augment-inside', 1,
     {'sampler': 'weighted', 'generator': 3, 'augment': 'torch'}, 'batch:4:5', 3),
    ('batch-sampler-inside', 2, {'sampler': 'batch', 'generator': 3}, 'batch:4:4', 3),
]


# make test runs these: each mechanism once, in 1 and 2 processes (the
# others: make test-extended); the first two also in make test-quick
IN_MAKE_TEST = {('persistent-epoch-end', 1), ('augment-torch-in-process-inside', 1),
                ('persistent-pinned-prefetch-inside', 2), ('augment-torch-workers-inside', 2),
                ('augment-torch-workers-forkserver-at-resume-inside', 2),
                ('loader-generator-inside', 1)}
QUICK = {('persistent-epoch-end', 1), ('augment-torch-in-process-inside', 1)}


def case_param(case):
    name, nproc, *_ = case
    marks = [] if (name, nproc) in QUICK else [pytest.mark.slow]
    if (name, nproc) not in IN_MAKE_TEST:
        marks.append(pytest.mark.extended)
    return pytest.param(case, id=f'{name}-{nproc}proc', marks=marks)


@pytest.fixture(scope='module', params=[case_param(case) for case in CASES])
def case(request, tmp_path_factory):
    name, nproc, data, kill, every = request.param
    folder = tmp_path_factory.mktemp(f'data-{name}-{nproc}')
    data = dict(data)
    # the pipeline of the relaunch, where it differs
    data_at_resume = dict(data, **data.pop('at_resume', {}))
    ckpt_options = json.dumps({'every_n_steps': every} if every else {})
    full = run(folder, 'full', nproc, dirname='full', DATA=json.dumps(data),
               CKPT_OPTIONS=ckpt_options)
    killed = run(folder, 'killed', nproc, expect_ok=False, KILL=kill, DATA=json.dumps(data),
                 CKPT_OPTIONS=ckpt_options)
    resumed = run(folder, 'resumed', nproc, DATA=json.dumps(data_at_resume),
                  CKPT_OPTIONS=ckpt_options)
    return dict(nproc=nproc, folder=folder, full=full, killed=killed, resumed=resumed,
                inside=every is not None, data={'full': data, 'resumed': data_at_resume})


def test_runs_are_really_distributed(case):
    for res in case['full'] + case['resumed']:
        assert res['num_processes'] == case['nproc']


def test_the_kill_was_a_sigkill_on_every_rank(case):
    assert case['killed'].returncodes == [-9] * case['nproc'], case['killed'].report()


def test_resumed_from_where_it_was_killed(case):
    for res in case['resumed']:
        name = res['loaded_from'].rsplit('/', 1)[-1]
        assert name.startswith('epoch-0003'), name
        assert ('-step-' in name) == case['inside'], name


def test_every_rank_ends_bit_identical(case):
    assert_identical(final_state(case['folder'], 'full'),
                     final_state(case['folder'], 'resumed'))
    for full, resumed in zip(case['full'], case['resumed'], strict=True):
        # each rank's own history (its losses of its own shard) and parameters
        assert full['digest'] == resumed['digest']
        assert full['history'] == resumed['history']


FORK_HANG_WARNING = 'CPython gh-112275'


def test_forked_workers_are_warned_of_on_the_main_process_where_python_can_hang(case):
    """On Python 3.11 before 3.11.10 a worker forked in a run of several
    processes can hang (``state/_worker_start.py``): rank 0 warns once a
    launch, naming the loader; workers that ``forkserver`` starts, one
    process, and a Python that resets the lock are not warned of."""
    for launch in ('full', 'resumed'):
        data = case['data'][launch]
        expected = (case['nproc'] > 1 and data.get('num_workers', 0) > 0
                    and data.get('multiprocessing_context') != 'forkserver'
                    and python_can_hang_at_fork())
        for rank, res in enumerate(case[launch]):
            warned = [text for text in res['warnings'] if FORK_HANG_WARNING in text]
            if expected and rank == 0:
                assert len(warned) == 1, res['warnings']
                assert 'iterator_train (2 workers' in warned[0]
                assert "multiprocessing_context='forkserver'" in warned[0]
            else:
                assert warned == [], (rank, warned)


def test_persistent_workers_that_draw_are_refused_at_the_first_batch(tmp_path):
    data = {'augment': 'torch', 'num_workers': 2, 'persistent_workers': True}
    result = run(tmp_path, 'refused', 2, expect_ok=False, DATA=json.dumps(data))
    assert not result.ok
    with open(tmp_path / 'refused-started-rank1.json') as f:
        assert json.load(f)['num_processes'] == 2
    for output in result.outputs:
        assert 'persistent_workers=True keeps their generators' in output, result.report()
        assert 'iterator_train__persistent_workers=False' in output
    # before any step: nothing was saved
    assert not list((tmp_path / 'ckpt').glob('epoch-*'))


def test_a_net_fitted_with_persistent_workers_pickles(tmp_path):
    """skorch's AccelerateMixin makes PrintLog's sink the accelerator's
    print: pickling it pickled the accelerator, whose registry holds the
    loader of persistent workers, which torch cannot pickle."""
    import pickle

    import torch

    from common import make_accelerator, make_data, make_net
    from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState

    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    torch.manual_seed(0)
    net = make_net(make_accelerator(), callbacks=[AccelerateLoadInitState(cp), cp],
                   max_epochs=1, iterator_train__num_workers=2,
                   iterator_train__persistent_workers=True)
    X, y = make_data(n=96)
    net.fit(X, y)
    sink = dict(net.callbacks_)['print_log'].sink
    again = pickle.loads(pickle.dumps(net))
    assert (again.predict(X) == net.predict(X)).all()
    # the net pickled keeps its own sink; the unpickled one prints as it did
    assert dict(net.callbacks_)['print_log'].sink is sink
    dict(again.callbacks_)['print_log'].sink('printed on the main process')
