"""Filesystem faults: a read-only checkpoint folder and a full disk, for
AccelerateCheckpoint and ParamsCheckpoint, in 2 processes.

CI runs as root, for whom permission bits do not apply; the ranks run as
root without the capabilities that override them (CAP_DAC_OVERRIDE,
CAP_DAC_READ_SEARCH), dropped before the interpreter starts. (Switching to
``nobody`` does not work here: the interpreter lives under root's private
home.) Where dropping them is not permitted (no CAP_SETPCAP), the tests
skip, saying so. The full disk is a real 4 MiB tmpfs (mounted here as root)
that the job fills in the middle of epoch 2; after the failed save the test
frees it and resumes, which must end bit-identical to the uninterrupted run.
"""

import ctypes
import errno
import os
import subprocess

import pytest

from faultsuite import run_job
from skorch_accel_callbacks.format import read_manifest
from testutil import assert_identical, final_state, machine_lacks, read_json

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.needs_root]

NO_SPACE = os.strerror(errno.ENOSPC)
PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def without_dac_override():
    """In a rank's process before exec: drop the capabilities from the
    bounding set, so the interpreter starts without them."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(err)}")


def capability_drop_refused():
    """Why a process may not drop the capabilities, or None if it may.

    Dropping from the bounding set needs CAP_SETPCAP (root in a container
    may lack it). Tried in a forked child, with the very function the ranks
    run before exec, so this process keeps its capabilities.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and exit without running any cleanup
        try:
            os.close(read_end)
            try:
                without_dac_override()
                reason = b''
            except Exception as exc:  # pylint: disable=broad-except
                reason = f"{type(exc).__name__}: {exc}".encode()
            os.write(write_end, reason)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, 'rb') as f:
        reason = f.read().decode()
    os.waitpid(pid, 0)
    return reason or None


def mount_tmpfs(folder):
    """Mount a small tmpfs at ``folder``; False where this is not permitted."""
    done = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=4m,mode=0777', 'tmpfs',
                           str(folder)], capture_output=True, check=False)
    return done.returncode == 0


@pytest.fixture(scope='module')
def fs(request, tmp_path_factory):
    refused = capability_drop_refused()
    if refused:
        # root here would write the read-only folder: the tests would fail
        machine_lacks("dropping CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH for the ranks "
                      f"(prctl(PR_CAPBSET_DROP) needs CAP_SETPCAP): {refused}")
    # asked for only now: no reference run for tests that skip
    request.getfixturevalue('reference')
    base = tmp_path_factory.mktemp('fs')
    readonly, results, tmpfs = (str(base / name) for name in ('readonly', 'results', 'tmpfs'))
    for folder in (readonly, results, tmpfs):
        os.mkdir(folder)
    os.chmod(readonly, 0o555)
    mounted = mount_tmpfs(tmpfs)
    env = {'TMPFS': tmpfs} if mounted else {}
    try:
        result = run_job('fs_job.py', results, readonly, 'fs', timeout=240,
                         preexec_fn=without_dac_override, **env)
        result.check()
        outcomes = [read_json(os.path.join(results, f'fs-rank{r}.json')) for r in (0, 1)]
        resumed = None
        if mounted:
            for name in os.listdir(tmpfs):
                if name.startswith('filler'):
                    os.remove(os.path.join(tmpfs, name))
            after_failure = {
                'latest': read_json(os.path.join(tmpfs, 'ckpt', 'latest.json')),
                'epoch1_manifest': read_manifest(os.path.join(tmpfs, 'ckpt',
                                                                      'epoch-0001'))}
            run_job('killable.py', results, os.path.join(tmpfs, 'ckpt'), 'resumed').check()
            resumed = {'state': final_state(results, 'resumed'),
                       'loaded_from': read_json(os.path.join(results, 'resumed-rank0.json')),
                       'ckpt': os.path.join(tmpfs, 'ckpt'), **after_failure}
        yield {'outcomes': outcomes, 'resumed': resumed, 'readonly': readonly}
    finally:
        if mounted:
            subprocess.run(['umount', tmpfs], check=False)


def need_tmpfs(fs):
    if fs['resumed'] is None:
        machine_lacks("mount -t tmpfs, not permitted here; the full-disk case with a "
                      "patched write is tests/callbacks/test_checkpoint.py::"
                      "test_failed_save_on_one_rank_raises_on_every_rank")


def test_ranks_ran_without_dac_override(fs):
    dac = (1 << CAP_DAC_OVERRIDE) | (1 << CAP_DAC_READ_SEARCH)
    assert [o['cap_eff'] & dac for o in fs['outcomes']] == [0, 0]


def test_readonly_folder_fails_before_training_on_every_rank(fs):
    main, other = (o['readonly'] for o in fs['outcomes'])
    assert main['type'] == 'PermissionError'
    assert main['text'].startswith(f"checkpoint folder {fs['readonly']} is not writable")
    assert other['type'] == 'RankError' and 'failed on rank 0' in other['text']
    assert fs['readonly'] in other['text']
    assert main['epochs'] == other['epochs'] == 0


def test_params_checkpoint_readonly_folder_fails_at_initialize(fs):
    for outcome in fs['outcomes']:
        params = outcome['params-readonly']
        assert params['type'] == 'PermissionError'
        assert "ParamsCheckpoint cannot write f_" in params['text']
        assert fs['readonly'] in params['text']


def test_full_disk_fails_the_save_on_every_rank(fs):
    need_tmpfs(fs)
    # rank 0 failed writing the model (safetensors); rank 1 failed writing
    # its own files or was told of rank 0's failure; each names the folder
    assert NO_SPACE in fs['outcomes'][0]['full']['text']
    for outcome in fs['outcomes']:
        full = outcome['full']
        assert 'writing checkpoint' in full['text'] and 'epoch-0002.partial' in full['text']
        assert full['epochs'] == 2  # the failure ended training in epoch 2's save
        assert not [w for w in full['warnings'] if 'unclosed file' in w]
        assert 'epoch-0002' not in full['listing'] and 'epoch-0001' in full['listing']
    assert fs['resumed']['latest'] == {'name': 'epoch-0001'}


def test_full_disk_then_resume_is_bit_identical(fs, reference):
    need_tmpfs(fs)
    assert fs['resumed']['loaded_from']['loaded_from'] == os.path.join(
        fs['resumed']['ckpt'], 'epoch-0001')
    assert_identical(final_state(reference, 'ref'), fs['resumed']['state'])


def test_params_checkpoint_full_disk(fs):
    need_tmpfs(fs)
    for rank, outcome in enumerate(fs['outcomes']):
        raised, warned = outcome['params-full-raise'], outcome['params-full-warn']
        # on_error='raise': training stops in epoch 2, naming the file (torch
        # reports the full disk as "unexpected pos"; the note names the file)
        assert raised['epochs'] == 2
        assert os.path.join('params', 'params.pt') in raised['text']
        if rank:
            assert raised['type'] == 'RankError' and 'failed on rank 0' in raised['text']
        # on_error='warn': training goes on, with a warning naming the file
        assert warned['type'] is None and warned['epochs'] == 2
        assert any('Unable to save module state to' in w and 'params.pt' in w
                   for w in warned['warnings'])
        # either way, epoch 1's file stays whole and loadable
        for outcome_ in (raised, warned):
            assert outcome_['saved_digest'] == outcome_['digests']['1']
            assert outcome_['digests']['1'] != outcome_['digests']['2']
