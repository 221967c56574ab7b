"""Helpers of the fault suite (tests/faults): the fault job's launches and
the oracles the kill suites share (what a relaunch must resume from, what
a cut upload may not leave behind).

Its fixtures (the reference run) are in tests/faults/conftest.py.
"""

import os
from pathlib import Path

from launcher import launch
from skorch_accel_callbacks.format import (
    MANIFEST_NAME,
    SHARED_FOLDER,
    check_manifest,
    is_checkpoint_name,
    read_manifest,
    shared_object,
)
from skorch_accel_callbacks.storage._local import CheckpointFolder
from skorch_accel_callbacks.storage._remote import RemoteStorage
from testutil import read_json

WORKERS = Path(__file__).parent / 'workers'

# `make test-crash` sets it: the suites that sample kills draw as many as
# they did before the crash points were enumerated (tests/faults/test_crash_points.py)
AT_LENGTH = os.environ.get('FAULTS_AT_LENGTH') == '1'


def sampled(in_make_test, at_length):
    """How many kills (or trials) a sampling suite draws: fewer in ``make
    test``, whose crash-point subset covers every kind of point."""
    return at_length if AT_LENGTH else in_make_test

# a hung collective fails a launch after this many seconds, not 30 minutes
COLLECTIVE_TIMEOUT = 20


def run_job(script, folder, dirname, tag, *, nproc=2, timeout=180, grace=10.0,
            preexec_fn=None, **env):
    """Launch ``tests/faults/workers/<script>`` on ``dirname``; results go to ``folder``."""
    env = dict(env, RESULT_DIR=str(folder))
    env.setdefault('COLLECTIVE_TIMEOUT', str(COLLECTIVE_TIMEOUT))
    return launch(WORKERS / script, dirname, tag, nproc=nproc, timeout=timeout,
                  grace=grace, preexec_fn=preexec_fn, env=env)


def pointed(ckpt):
    """The checkpoint that latest.json names, checked complete; None if none."""
    try:
        name = read_json(ckpt / 'latest.json')['name']
    except FileNotFoundError:
        return None
    path = ckpt / name
    read_manifest(path)  # raises naming the file if it is not complete
    return str(path)


def expected_resume(url):
    """The checkpoint a launch on ``url`` must resume from and the epochs
    it holds: the newest complete one in the store, or the newer complete
    one of the staging folder whose upload was cut (if the store has any);
    ``(None, 0)``."""
    storage = RemoteStorage(url)
    remote = {name: storage.check(name) for name in storage.committed()}
    remote = {name: manifest for name, (manifest, problem) in remote.items() if problem is None}
    if not remote:
        return None, 0
    newest = max(remote)
    manifest = remote[newest]
    staged = CheckpointFolder(storage.local_dir).committed()
    if staged and max(staged) > newest:
        staged_manifest, problems = check_manifest(storage.path(max(staged)))
        if not problems:
            newest, manifest = max(staged), staged_manifest
    return storage.url(newest), manifest['epoch']


def leftovers(url):
    """Unfinished multipart uploads, checkpoint folders without a manifest
    and shared frozen parts that no committed checkpoint lists, under ``url``."""
    storage = RemoteStorage(url)
    fs = storage._filesystem()[0]
    bucket, key = url[len('s3://'):].split('/', 1)
    unfinished = fs.call_s3('list_multipart_uploads', Bucket=bucket,
                            Prefix=f'{key}/').get('Uploads', [])
    names = {path.rsplit('/', 1)[-1] for path in fs.ls(f'{bucket}/{key}', refresh=True)}
    committed = storage.committed()
    listed = {shared for name in committed
              for manifest in [storage.read_json(name, MANIFEST_NAME)]
              for rel in manifest.get('frozen_parts', {}).values()
              if (shared := shared_object(manifest, rel)) is not None}
    held = {path[len(f'{bucket}/{key}/'):] for path in fs.find(f'{bucket}/{key}/{SHARED_FOLDER}')}
    return ([upload['Key'] for upload in unfinished]
            + sorted(name for name in names if is_checkpoint_name(name)
                     and name not in committed)
            + sorted(held - listed))
