"""SIGKILLs inside the upload of a checkpoint into an object store, and a
store that refuses the job's credentials.

The fault job (tests/faults/workers/faultjob.py, here in 1 process) saves
into a bucket of the local S3 server; each launch draws (seeded, points
not fired yet first) a kill point inside the upload of one of the
checkpoints still to train: after some of its files, before its manifest,
after its manifest (before ``latest.json``), after ``latest.json``. The
process SIGKILLs itself there in s3fs's own coroutines
(tests/faults/workers/upload_killable.py), after leaving a marker that
proves the point fired, and the same command is launched again on the
same machine (its staging folder) until a launch trains to the end: a
relaunch is the next kill's launch. Each launch must resume from the
newest complete checkpoint: the one its claim finishes uploading from the
staging folder (a job killed while uploading loses nothing), else the
newest complete in the store; none if the store has none (a store without
checkpoints is not filled from a staging folder). Each run must end
bit-identical to the uninterrupted one, with nothing left of the cut
uploads in the store: no unfinished multipart upload, no checkpoint
folder without a manifest. Every point must have fired in the upload of
a checkpoint after the first.
"""

import os
import random

import pytest

from faultjob import EPOCHS
from faultsuite import expected_resume, leftovers, run_job
from s3server import start_auth_server
from skorch_accel_callbacks.format import checkpoint_name
from skorch_accel_callbacks.storage._remote import RemoteStorage, default_staging
from testutil import assert_identical, final_state, read_json

pytestmark = [pytest.mark.faults, pytest.mark.slow]

POINTS = ('files-1', 'files-3', 'files-5', 'before-manifest', 'after-manifest',
          'after-pointer')
KILLS_PER_RUN = 5
MIN_KILLS = 15
MAX_RUNS = 8


def draw(rng, done, fired):
    """A kill point in an epoch that the next launch trains (seeded), first
    among the points not fired yet in such an epoch: the first checkpoint's
    upload (the store holds none: the next job starts afresh), or a later
    one's (the next job finishes the cut upload)."""
    epoch = rng.randrange(done + 1, EPOCHS + 1)
    seen = {point for other, point in fired if (other > 1) == (epoch > 1)}
    return epoch, rng.choice([point for point in POINTS if point not in seen] or POINTS)


def one_run(zygote, seed, url, folder, reference, figures):
    rng = random.Random(seed)
    kills = 0
    for launch_no in range(KILLS_PER_RUN + 1):
        tag = f'launch{launch_no}'
        expected, done = expected_resume(url)
        env = {}
        if kills < KILLS_PER_RUN and done < EPOCHS:
            epoch, point = draw(rng, done, figures['fired'])
            env['KILL'] = f'{epoch}:{point}'
        result = zygote.launch('upload_killable.py', folder, url, tag, nproc=1, timeout=120,
                               **env)
        where = f"run {seed}, {tag}, KILL={env.get('KILL')}"
        assert not result.timed_out, f"{where} hung\n{result.report()}"
        started = folder / f'resumed-{tag}-rank0.json'
        if started.exists():
            assert read_json(started)['loaded_from'] == expected, where
        landed = sorted(folder.glob(f'killed-{tag}-*'))
        if 'KILL' in env:
            marker = folder / f'killed-{tag}-{point}-rank0'
            assert landed == [marker], \
                f"{where}: the drawn kill point did not fire\n{result.report()}"
            assert read_json(marker) == {'point': point, 'epoch': epoch, 'rank': 0}, where
            assert result.returncodes == [-9], f"{where}\n{result.report()}"
            kills += 1
            figures['kills'] += 1
            figures['fired'].add((epoch, point))
            figures['resumes'] += expected is not None
            continue
        assert not landed, where
        result.check()
        outcome = read_json(folder / f'{tag}-rank0.json')
        assert (outcome['error'], outcome['loaded_from']) == (None, expected), where
        figures['resumes'] += expected is not None
        break
    else:
        raise AssertionError(f"run {seed} did not finish in {KILLS_PER_RUN + 1} launches")
    assert_identical(final_state(reference, 'ref'), final_state(folder, tag))
    # retention keeps the checkpoint a launch resumed from besides the newest
    storage = RemoteStorage(url)
    assert storage.committed()[-1] == checkpoint_name(EPOCHS)
    assert [storage.check(name)[1] for name in storage.committed()] == [
        None] * len(storage.committed())
    assert leftovers(url) == []


def test_kills_inside_uploads_lose_nothing(zygote, s3_bucket, tmp_path, record_property):
    reference = tmp_path / 'reference'
    reference.mkdir()
    run_job('upload_killable.py', reference, reference / 'ckpt', 'ref', nproc=1).check()
    figures = {'runs': 0, 'kills': 0, 'resumes': 0, 'fired': set()}
    for seed in range(MAX_RUNS):
        if figures['kills'] >= MIN_KILLS:
            break
        folder = tmp_path / f'run{seed}'
        folder.mkdir()
        one_run(zygote, seed, f's3://{s3_bucket}/run{seed}', folder, reference, figures)
        figures['runs'] += 1
    record_property('summary', 'upload kills: {runs} runs, {kills} kills inside uploads, '
                               '{resumes} resumes; every run bit-identical to the '
                               'uninterrupted one'.format(**figures))
    assert figures['kills'] >= MIN_KILLS, figures
    # every point fired in the upload of a checkpoint after the first
    assert {point for epoch, point in figures['fired'] if epoch > 1} == set(POINTS), figures


def test_refused_credentials_fail_every_rank_before_any_step(s3_bucket, tmp_path,
                                                             monkeypatch):
    """A server that checks signatures refuses the job's keys: every rank
    raises CheckpointError naming the URL when training begins."""
    server, endpoint = start_auth_server()
    try:
        monkeypatch.setenv('AWS_ENDPOINT_URL', endpoint)
        monkeypatch.setenv('AWS_ACCESS_KEY_ID', 'AKIAUNKNOWNKEY000000')
        url = f's3://{s3_bucket}/run'
        result = run_job('upload_killable.py', tmp_path, url, 'refused', nproc=2, timeout=120)
    finally:
        server.kill()
        server.wait()
    result.check()
    outcomes = [read_json(tmp_path / f'refused-rank{rank}.json') for rank in (0, 1)]
    assert [outcome['num_processes'] for outcome in outcomes] == [2, 2]
    assert [outcome['error'] for outcome in outcomes] == ['CheckpointError'] * 2, outcomes
    for outcome in outcomes:
        assert f'cannot save into {url}: PermissionError' in outcome['message'], outcome
        assert outcome['steps'] == 0, outcome
    assert not list(tmp_path.glob('resumed-refused-*'))
    assert not os.path.exists(default_staging(url))
