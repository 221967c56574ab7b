"""A durable save's failed flush to disk fails the save, naming the file.

The model and optimizer files begin to be flushed (``fdatasync``) as soon
as each is complete, before the seal flushes every file (``fsync``):
Linux reports a failed writeback to the first flush after it only, so an
error of the early one must fail the save although the seal's later fsync
of the same file succeeds. ``strace`` injects ``EIO`` into the early flush
of the model file alone (the seal's is an fsync), in one process under a
timeout, for a save in the training thread and one in the background; the
log proves that it fired, and that it began before the optimizer file was
complete.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from crashpoints import STRACE, require_strace
from faultsuite import WORKERS
from launcher import REPO, WORKERS as JOB_WORKERS
from skorch_accel_callbacks.format import PARTIAL_SUFFIX

pytestmark = [pytest.mark.faults, pytest.mark.slow]


@pytest.mark.parametrize('mode', ['sync', 'async'])
def test_a_failed_early_flush_of_the_model_file_fails_the_save_naming_it(tmp_path, mode):
    require_strace()
    dirname = tmp_path / 'ck'
    partial = dirname / f'epoch-0001{PARTIAL_SUFFIX}'
    model, optimizer = partial / 'model.safetensors', partial / 'optimizer.bin'
    log, out = tmp_path / 'strace.log', tmp_path / 'outcome.json'
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(JOB_WORKERS), str(REPO), os.environ.get('PYTHONPATH', '')]))
    subprocess.run(
        [STRACE, '-f', '-y', '-qq', '-o', str(log), '-e', 'trace=fdatasync,fsync,close',
         '-e', 'inject=fdatasync:error=EIO:when=1', '-P', str(model), '-P', str(optimizer),
         sys.executable, str(WORKERS / 'fsync_job.py'), str(dirname), str(out), mode],
        env=env, check=True, timeout=120)
    text = log.read_text()
    lines = text.splitlines()
    injected = [i for i, line in enumerate(lines)
                if line.split(None, 1)[1].startswith('fdatasync(')
                and 'model.safetensors' in line and 'EIO' in line and '(INJECTED)' in line]
    assert len(injected) == 1, f"the flush of the model file was not injected into:\n{text}"
    optimizer_closed = [i for i, line in enumerate(lines)
                        if re.search(r'\bclose\(\d+<[^>]*optimizer\.bin>', line)]
    assert optimizer_closed and injected[0] < optimizer_closed[0], (
        f"the model file's flush did not begin before the optimizer file was complete:\n{text}")
    # strace splits a call that another thread interrupts into
    # '<pid> fsync(<fd><path> <unfinished ...>' and '<pid> <... fsync resumed>) = 0'
    unfinished = {line.split(None, 1)[0] for line in lines
                  if 'fsync(' in line and 'model.safetensors' in line and 'unfinished' in line}
    assert any(('fsync(' in line and 'model.safetensors' in line and '= 0' in line)
               or (line.split(None, 1)[0] in unfinished and '<... fsync resumed>' in line
                   and '= 0' in line)
               for line in lines), f"the seal's fsync of the model file did not succeed:\n{text}"

    outcome = json.loads(out.read_text())
    assert outcome['type'] == 'OSError' and outcome['errno'] == 5, outcome
    assert outcome['filename'] == str(model), outcome
    assert 'latest' not in outcome, "a checkpoint was committed although its flush failed"
    assert not (dirname / 'epoch-0001').exists()
