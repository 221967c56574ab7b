"""One job per checkpoint folder: a second job is refused, naming the folder
and the holder; a holder that was SIGKILLed leaves no stale lock.

The holder is the fault job in its own process, stopped inside its save of
epoch 2 (its partial folder written, not committed; for ParamsCheckpoint,
its files written under temporary names, not moved); the second job runs in
this process.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from faultsuite import WORKERS
import faultjob
from common import make_accelerator, make_data, make_net
from launcher import REPO
from skorch_accel_callbacks import LoadInitParams, ParamsCheckpoint
from skorch_accel_callbacks.format import LOCK_NAME, TEMP_MARK, read_json
from skorch_accel_callbacks.storage import _lock as lock

pytestmark = [pytest.mark.faults, pytest.mark.slow]

DEADLINE_S = 180


def start_holder(tmp_path, ckpt, script='killable.py', point='2:before-manifest:0'):
    env = {key: value for key, value in os.environ.items()
           if key not in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')}
    env.update(RESULT_DIR=str(tmp_path), HOLD=point, OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([str(WORKERS), str(REPO / 'tests' / 'workers'),
                                           str(REPO)]))
    holder = subprocess.Popen(
        [sys.executable, str(WORKERS / script), str(ckpt), 'holder'], env=env,
        stdout=open(tmp_path / 'holder.log', 'wb'), stderr=subprocess.STDOUT)
    held = tmp_path / f"held-holder-{point.split(':')[1]}-rank0"
    deadline = time.monotonic() + DEADLINE_S
    while not held.exists():
        if holder.poll() is not None or time.monotonic() > deadline:
            holder.kill()
            pytest.fail("the holder never reached its save:\n"
                        + (tmp_path / 'holder.log').read_text())
        time.sleep(0.1)
    return holder


def test_second_job_refused_and_killed_holder_leaves_no_stale_lock(tmp_path):
    ckpt = tmp_path / 'ckpt'
    holder = start_holder(tmp_path, ckpt)
    try:
        net, _ = faultjob.build(str(ckpt))
        with pytest.raises(lock.FolderInUseError,
                           match=f"checkpoint folder {ckpt} is in use by another running "
                                 rf"job \(pid {holder.pid} on host {socket.gethostname()}"):
            net.fit(*faultjob.data())
        # refused before reading the holder's checkpoint, and trained nothing
        assert len(net.history) == 0
        # the refused job removed nothing of the running one's
        assert (ckpt / 'epoch-0002.partial').is_dir()
        assert read_json(ckpt / 'latest.json') == {'name': 'epoch-0001'}
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel released the dead holder's flock; the lock file stays
    assert (ckpt / LOCK_NAME).exists()
    net, cp = faultjob.build(str(ckpt))
    net.fit(*faultjob.data())
    assert faultjob.loaded_from(net) == str(ckpt / 'epoch-0001')
    assert len(net.history) == faultjob.EPOCHS
    assert not (ckpt / 'epoch-0002.partial').exists()
    # and this job released it at the end of training
    lock.FolderLock(ckpt).acquire().release()


def params_job(ckpt):
    cp = ParamsCheckpoint(monitor=None, dirname=str(ckpt), f_criterion=None)
    net = make_net(make_accelerator(), max_epochs=2, batch_size=16,
                   train_split=None, callbacks=[LoadInitParams(cp), cp])
    return net, cp


def test_params_checkpoint_second_job_refused_then_lock_free(tmp_path):
    ckpt = tmp_path / 'ckpt'
    holder = start_holder(tmp_path, ckpt, 'params_killable.py', '2:before-journal:0')
    try:
        staged = sorted(p.name.split(TEMP_MARK)[0] for p in ckpt.iterdir()
                        if TEMP_MARK in p.name)
        assert staged == ['.history.json', '.optimizer.pt', '.params.pt']
        net, _ = params_job(ckpt)
        with pytest.raises(lock.FolderInUseError,
                           match=f"checkpoint folder {ckpt} is in use by another running "
                                 rf"job \(pid {holder.pid} on host"):
            net.fit(*make_data(n=64))
        # refused before its first epoch: its history is the holder's saved
        # epoch 1 that LoadInitParams read; none of the holder's files touched
        assert len(net.history) == 1
        assert sorted(p.name.split(TEMP_MARK)[0] for p in ckpt.iterdir()
                      if TEMP_MARK in p.name) == staged
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    net, _ = params_job(ckpt)
    net.fit(*make_data(n=64))
    # epoch 1's save loaded, then 2 epochs trained (skorch's LoadInitState)
    assert len(net.history) == 3
    assert not [p.name for p in ckpt.iterdir() if TEMP_MARK in p.name]
    # released at the end of training
    lock.FolderLock(ckpt).acquire().release()
