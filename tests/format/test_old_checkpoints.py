"""Checkpoints written before the package was split into subpackages (commit
f5cb08a, format 4) resume with the code of now, bit for bit, and the command
line lists and verifies them.

tests/support/old_format_run.py, run against that commit's package, writes them:
``epoch-end`` at the end of epoch 2, ``in-epoch`` at step 6, inside epoch 2.
The resume tests have it write them on this machine (``old_version``: the
uninterrupted fit they are compared with is computed here); each is resumed
from a copy, trained to the end of epoch 3 and compared with an
uninterrupted fit of 3 epochs made now. tests/data/f5cb08a-1proc/ keeps the
folders it wrote when the commit was new, which the command line lists and
verifies, and which the fresh ones match file for file. Those of 2 processes
(each rank's state its own) resume in the launch of tests/state/test_per_rank.py.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import old_format_run
import old_version
from checkpointed import state
from testutil import CLI_TIMEOUT, assert_identical, cli

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / 'tests' / 'data' / 'f5cb08a-1proc'
MAX_EPOCHS = 3
# the case, the AccelerateCheckpoint arguments it was written with, the checkpoint resumed
CASES = [
    ('epoch-end', {}, 'epoch-0002'),
    ('in-epoch', {'every_n_steps': old_format_run.EVERY_N_STEPS}, 'epoch-0001-step-00000006'),
]


@pytest.fixture(scope='module')
def written_now(tmp_path_factory):
    """The folders of tests/data/f5cb08a-1proc/, written on this machine by
    the package at f5cb08a (tests/data/README.rst's command)."""
    tree = old_version.old_tree(tmp_path_factory.mktemp('old-tree'))
    out = tmp_path_factory.mktemp('old-checkpoints')
    # the old package first on the path: the script imports only the root's names
    ran = subprocess.run(
        [sys.executable, str(REPO / 'tests' / 'support' / 'old_format_run.py'), str(out)], cwd=tree,
        env=old_version.old_environment(tree, REPO / 'tests' / 'support'),
        capture_output=True, text=True, timeout=CLI_TIMEOUT)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    return out


def test_the_kept_folders_are_what_the_old_version_writes(written_now):
    # the same checkpoints, files and format as users of that version have
    for case, _, _ in CASES:
        kept = sorted(p.relative_to(DATA / case) for p in (DATA / case).rglob('*')
                      if p.name != '.lock')
        fresh = sorted(p.relative_to(written_now / case) for p in (written_now / case).rglob('*')
                       if p.name != '.lock')
        assert kept == fresh, case
        for manifest in (DATA / case).glob('epoch-*/manifest.json'):
            kept_manifest = json.loads(manifest.read_text())
            fresh_manifest = json.loads(
                (written_now / case / manifest.parent.name / manifest.name).read_text())
            assert kept_manifest['format_version'] == fresh_manifest['format_version']
            assert sorted(kept_manifest['files']) == sorted(fresh_manifest['files'])


# StopAt, which acts on every batch, has no state_dict: the warning says so
@pytest.mark.filterwarnings('ignore:.*was taken inside an epoch:UserWarning')
@pytest.mark.parametrize('case, cp_kwargs, resumed_from', CASES, ids=[c[0] for c in CASES])
def test_an_old_checkpoint_resumes_bit_for_bit(tmp_path, written_now, case, cp_kwargs,
                                              resumed_from):
    copy = tmp_path / case
    shutil.copytree(written_now / case, copy)
    resumed = old_format_run.fit(str(copy), MAX_EPOCHS, **cp_kwargs)
    load = dict(resumed.callbacks_)['AccelerateLoadInitState']
    # a fit that found nothing to load would train from scratch to the same numbers
    assert load.loaded_from_ is not None and Path(load.loaded_from_).name == resumed_from
    assert resumed.accelerator.num_processes == 1
    straight = old_format_run.fit(str(tmp_path / 'straight'), MAX_EPOCHS, **cp_kwargs)
    assert len(resumed.history) == len(straight.history) == MAX_EPOCHS
    assert_identical(state(resumed), state(straight))


@pytest.mark.slow  # two fresh interpreters that import torch, skorch and accelerate
@pytest.mark.parametrize('case', [c[0] for c in CASES])
def test_the_command_line_lists_and_verifies_an_old_checkpoint(case):
    listed = cli('list', DATA / case)
    assert listed.returncode == 0, listed.stderr
    for name in os.listdir(DATA / case):
        if name.startswith('epoch-'):
            assert name in listed.stdout, listed.stdout
    verified = cli('verify', DATA / case)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    for name in os.listdir(DATA / case):
        if name.startswith('epoch-'):
            assert f'{name}: intact' in verified.stdout, verified.stdout
