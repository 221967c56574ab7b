"""Only rank 1 dies (SIGKILL) or hangs (SIGSTOP) in epoch 2.

Rank 0 must end by itself with an error, not wait for ever: at once when
the peer's connection drops, at the latest after the collective timeout
(``InitProcessGroupKwargs(timeout=...)``, COLLECTIVE_TIMEOUT seconds here)
when the peer is alive but stuck. Where rank 1 was killed, the launcher's
grace is longer than that timeout, so a rank 0 that ended did so on its
own. The checkpoint of epoch 1 stays complete, and resuming from it ends
bit-identical.
"""

import pytest

from faultsuite import COLLECTIVE_TIMEOUT, run_job
from skorch_accel_callbacks.format import read_manifest
from testutil import assert_identical, final_state, read_json

pytestmark = [pytest.mark.faults, pytest.mark.slow]

GRACE = 3 * COLLECTIVE_TIMEOUT


def assert_rank0_failed_on_its_own(result, folder, tag):
    assert not result.timed_out, result.report()
    for rank in (0, 1):
        assert read_json(folder / f'resumed-{tag}-rank{rank}.json')['num_processes'] == 2
    # -9 would be the launcher's kill after GRACE; an exit code is its own end
    assert result.returncodes[0] not in (0, -9), result.report()


def assert_epoch1_intact(ckpt):
    assert read_json(ckpt / 'latest.json') == {'name': 'epoch-0001'}
    read_manifest(ckpt / 'epoch-0001')
    assert not (ckpt / 'epoch-0002').exists()


def test_rank1_killed(reference, tmp_path):
    ckpt = tmp_path / 'ckpt'
    result = run_job('killable.py', tmp_path, ckpt, 'killed', grace=GRACE,
                     KILL='2:batch-1:1')
    assert result.returncodes[1] == -9, result.report()
    assert_rank0_failed_on_its_own(result, tmp_path, 'killed')
    assert_epoch1_intact(ckpt)
    run_job('killable.py', tmp_path, ckpt, 'resumed').check()
    assert read_json(tmp_path / 'resumed-rank0.json')['loaded_from'] == str(ckpt / 'epoch-0001')
    assert_identical(final_state(reference, 'ref'), final_state(tmp_path, 'resumed'))


def test_rank1_hangs(tmp_path):
    ckpt = tmp_path / 'ckpt'
    # rank 0 is the first to end, with nothing failed before it: no grace
    # runs for it. The grace after it is the stopped rank 1's, which only
    # the launcher's kill ends: a long one would only be waited out
    result = run_job('killable.py', tmp_path, ckpt, 'frozen', grace=5.0, FREEZE='2:1')
    assert_rank0_failed_on_its_own(result, tmp_path, 'frozen')
    # rank 1 was stopped; only the launcher could end it
    assert result.returncodes[1] == -9, result.report()
    assert 'timeout' in result.outputs[0].lower() or 'timed out' in result.outputs[0].lower(), \
        result.report()
    assert_epoch1_intact(ckpt)
