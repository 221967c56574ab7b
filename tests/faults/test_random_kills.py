"""Random SIGKILLs of the 2-process fault job, relaunched until it finishes.

Each run draws (seeded) up to three kill points, one per launch, among the
batch ends and the numbered points inside the save, the commit and the
retention of the epochs still to train (tests/faults/workers/faultjob.py);
the process at that point SIGKILLs itself, the launcher kills the other rank
a second later (as torchrun would), and the same command is launched again
(through the fork server of tests/faults/conftest.py)
until a launch trains to the end. Odd-numbered runs save with
``async_save=True`` (commit in a writer thread, while the next epoch trains).
Every drawn kill point must fire: the rank that dies there leaves a marker
naming the point, its epoch and the rank just before its SIGKILL; a launch
with a drawn kill that ends without that marker fails the run (a hook that
is never called would otherwise pass as a clean finish). Every run must end
bit-identical to the uninterrupted reference run, every launch must resume
from exactly the complete checkpoint that ``latest.json`` named when it
started, and no launch may hang (launch deadline).

The same with a frozen base (``FROZEN_BASE=1``): each save after a
launch's first links the frozen part of the checkpoint before it (which
retention then removes, ``keep_last=1``); besides the above, every
checkpoint left in the folder must verify (no link to bytes that a kill
lost), and the runs must have linked.
"""

import os
import random

import pytest

from faultjob import BATCH_POINTS, EPOCHS, RANK_POINTS, SAVE_POINTS
from faultsuite import pointed, run_job, sampled
from skorch_accel_callbacks.format import MANIFEST_NAME, PARTIAL_SUFFIX, linked_of
from skorch_accel_callbacks.tools.inspection import verify
from testutil import assert_identical, final_state, read_json

pytestmark = [pytest.mark.faults, pytest.mark.slow]

KILLS_PER_RUN = 3
MIN_KILLS = sampled(10, 20)
# with a frozen base (make test: a shorter sample)
MIN_FROZEN_KILLS = sampled(4, 20)
FROZEN = {'FROZEN_BASE': '1'}
# runs go on until MIN_KILLS kills landed (a run can finish before its third
# kill); this many runs at most
MAX_RUNS = 12


def draw(rng, resumed_epoch):
    """A kill point in an epoch that the next launch trains."""
    options = []
    for epoch in range(resumed_epoch + 1, EPOCHS + 1):
        for point in BATCH_POINTS + SAVE_POINTS:
            # retention removes a folder only from the second epoch this
            # launch commits (it keeps the one it resumed from)
            if 'discard' in point and epoch < max(2, resumed_epoch + 2):
                continue
            options.append((epoch, point))
    epoch, point = rng.choice(options)
    who = rng.randrange(2) if point in RANK_POINTS else 0
    return epoch, point, who


def one_run(zygote, seed, folder, reference, figures, job_env=None):
    rng = random.Random(seed)
    ckpt = folder / 'ckpt'
    kills = 0
    mode = dict(job_env or {}, **({'ASYNC': '1'} if seed % 2 else {}))
    for launch_no in range(KILLS_PER_RUN + 1):
        tag = f'launch{launch_no}'
        expected = pointed(ckpt)
        epoch_done = read_json(os.path.join(expected, MANIFEST_NAME))['epoch'] \
            if expected else 0
        env = dict(mode)
        if kills < KILLS_PER_RUN and epoch_done < EPOCHS:
            epoch, point, who = draw(rng, epoch_done)
            env['KILL'] = f'{epoch}:{point}:{who}'
        result = zygote.launch('killable.py', folder, ckpt, tag, nproc=2, grace=1.0,
                               timeout=120, **env)
        where = f"run {seed}, {tag}, KILL={env.get('KILL')}"
        assert not result.timed_out, f"{where} hung\n{result.report()}"
        started = [folder / f'resumed-{tag}-rank{r}.json' for r in (0, 1)]
        for path in started:
            if path.exists():
                assert read_json(path)['loaded_from'] == expected, where
                assert read_json(path)['num_processes'] == 2, where
        landed = sorted(folder.glob(f'killed-{tag}-*'))
        if 'KILL' in env:
            # the drawn point fired, in its epoch, on its rank, and killed it
            marker = folder / f'killed-{tag}-{point}-rank{who}'
            assert landed == [marker], \
                f"{where}: the drawn kill point did not fire\n{result.report()}"
            assert read_json(marker) == {'point': point, 'epoch': epoch, 'rank': who}, where
            assert result.returncodes[who] == -9, f"{where}\n{result.report()}"
            kills += 1
            figures['kills'] += 1
            figures['inside save'] += point in SAVE_POINTS
            figures['resumes'] += expected is not None
            continue
        assert not landed, where
        result.check()
        assert read_json(folder / f'{tag}-rank0.json')['loaded_from'] == expected, where
        figures['resumes'] += expected is not None
        break
    else:
        raise AssertionError(f"run {seed} did not finish in {KILLS_PER_RUN + 1} launches")
    assert_identical(final_state(reference, 'ref'), final_state(folder, tag))
    assert not [name for name in os.listdir(ckpt) if name.endswith(PARTIAL_SUFFIX)]
    for path in sorted(ckpt.glob('epoch-*')):
        damaged = verify(path).damaged
        assert not damaged, f"run {seed}: {damaged}"
        figures['links'] += bool(linked_of(read_json(path / MANIFEST_NAME)))


def run_until_killed(zygote, reference, tmp_path, min_kills, job_env=None):
    """Runs of seeds 0, 1, ... until ``min_kills`` kills landed; the figures."""
    figures = {'runs': 0, 'kills': 0, 'inside save': 0, 'resumes': 0, 'links': 0}
    for seed in range(MAX_RUNS):
        if figures['kills'] >= min_kills:
            break
        folder = tmp_path / f'run{seed}'
        folder.mkdir()
        one_run(zygote, seed, folder, reference, figures, job_env)
        figures['runs'] += 1
    assert figures['kills'] >= min_kills, figures
    return figures


SUMMARY = ('{runs} runs, {kills} kills ({inside save} inside a save), {resumes} resumes; '
           'every run bit-identical to the uninterrupted one')


def test_random_kills_lose_nothing(zygote, reference, tmp_path, record_property):
    figures = run_until_killed(zygote, reference, tmp_path, MIN_KILLS)
    record_property('summary', 'random kills: ' + SUMMARY.format(**figures))


@pytest.fixture(scope='module')
def frozen_reference(tmp_path_factory):
    """The fault job with a frozen base, never interrupted, in 2 processes."""
    folder = tmp_path_factory.mktemp('frozen-reference')
    run_job('killable.py', folder, folder / 'ckpt', 'ref', **FROZEN).check()
    return folder


def test_random_kills_of_a_frozen_base_lose_nothing(zygote, frozen_reference, tmp_path,
                                                    record_property):
    figures = run_until_killed(zygote, frozen_reference, tmp_path, MIN_FROZEN_KILLS, FROZEN)
    # a launch that saved twice linked its second save's frozen part
    assert figures['links'], figures
    record_property('summary', 'random kills, frozen base: ' + SUMMARY.format(**figures)
                    + ', every checkpoint left verified ({links} of them linked)'
                    .format(**figures))
