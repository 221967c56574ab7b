"""AccelerateCheckpoint(async_save=True): background writes, same guarantees.

The launches run tests/workers/async_resume.py (resume.py with the option
and hooks in the background writer): bit-identical resume in 1 and 2
processes, a SIGKILL in the middle of a background write, and a failed
background write raised on every rank at the next save or at the end of
training. No collective may run outside the main thread.
"""

import json
import threading

import pytest
import torch
from sklearn.base import clone
from skorch.callbacks import Callback

from common import make_accelerator, make_data, make_net
from launcher import launch
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
from skorch_accel_callbacks.engine import _state_files as state_files
from testutil import assert_identical, final_state, read_results


def run(folder, tag, nproc=2, expect_ok=True, dirname='ckpt', **env):
    result = launch('async_resume.py', folder / dirname, tag, nproc=nproc,
                    env=dict(env, RESULT_DIR=str(folder)))
    if expect_ok:
        result.check()
    # a killed rank writes none
    for path in folder.glob(f'{tag}-threads-rank*.json'):
        assert json.loads(path.read_text()) in ([], ['MainThread']), path.read_text()
    return read_results(folder, tag, nproc) if expect_ok else result


def latest(ckpt):
    return json.loads((ckpt / 'latest.json').read_text())['name']


@pytest.mark.slow
@pytest.mark.parametrize('nproc', [1, 2])
def test_kill_during_background_write_then_resume_is_bit_identical(tmp_path, nproc):
    full = run(tmp_path, 'full', nproc, dirname='full')
    assert [r['committed'] for r in full][0] == ['epoch-0005', 'epoch-0006']
    # epoch 3's model file is written, its optimizer file not yet: killed then
    killed = run(tmp_path, 'killed', nproc, expect_ok=False,
                 SLOW_WRITE='3:60', KILL='batch:4:2')
    assert killed.returncodes == [-9] * nproc, killed.report()
    ckpt = tmp_path / 'ckpt'
    assert latest(ckpt) == 'epoch-0002'
    partial = ckpt / 'epoch-0003.partial'
    assert (partial / 'model.safetensors').exists()
    assert not (partial / 'optimizer.bin').exists()

    resumed = run(tmp_path, 'resumed', nproc)
    assert all(r['loaded_from'].endswith('epoch-0002') for r in resumed)
    assert len({r['digest'] for r in resumed}) == 1
    assert not partial.exists()
    assert_identical(final_state(tmp_path, 'full'), final_state(tmp_path, 'resumed'))


@pytest.mark.slow  # a launch of its own each
@pytest.mark.parametrize('epoch', [2, 6], ids=['at-next-save', 'at-end-of-training'])
def test_failed_background_write_raises_on_every_rank(tmp_path, epoch):
    result = run(tmp_path, 'fail', expect_ok=False, BG_FAIL=str(epoch))
    assert not result.timed_out, result.report()
    assert [r['num_processes'] for r in read_results(tmp_path, 'fail-started', 2)] == [2, 2]
    assert all(rc not in (0, None) for rc in result.returncodes), result.report()
    assert 'No space left on device' in result.outputs[0]
    assert 'RankError' in result.outputs[1] and 'failed on rank 0' in result.outputs[1]
    assert f'epoch-{epoch:04d} in the background' in result.outputs[1]
    ckpt = tmp_path / 'ckpt'
    assert latest(ckpt) == f'epoch-{epoch - 1:04d}'
    assert not (ckpt / f'epoch-{epoch:04d}').exists()
    assert not (ckpt / f'epoch-{epoch + 1:04d}').exists()


class EpochsEnded(Callback):
    """Counts the epochs that ended, each before the checkpoint's hook of
    the same epoch runs (it comes first in the callbacks)."""

    unrecorded_params = True

    def __init__(self, count):
        self.count = count

    def on_epoch_end(self, net, **kwargs):
        with self.count:
            self.count.ended += 1
            self.count.notify_all()


class Count(threading.Condition):
    ended = 0


def test_at_most_one_save_in_flight(tmp_path, monkeypatch):
    writing, overlaps, written = [], [], []
    count, next_epoch_ended = Count(), []
    original = state_files.write_large_state

    def held_write(folder, *args):
        overlaps.append(len(writing))
        writing.append(folder)
        epoch = len(overlaps)
        # in flight until the next epoch has ended and asked for its save
        # (none after the last: the end of fit waits for this one)
        if epoch < 4:
            with count:
                next_epoch_ended.append(count.wait_for(lambda: count.ended > epoch, 60))
        original(folder, *args)
        written.append(folder)
        writing.remove(folder)

    monkeypatch.setattr(state_files, 'write_large_state', held_write)
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), async_save=True)
    torch.manual_seed(0)
    net = make_net(make_accelerator(), max_epochs=4, callbacks=[
        EpochsEnded(count), cp, AccelerateLoadInitState(cp)])
    net.fit(*make_data(n=64))
    assert next_epoch_ended == [True] * 3
    assert overlaps == [0, 0, 0, 0]
    assert len(written) == 4 and not cp.writer_.busy()
    assert cp.committed() == ['epoch-0003', 'epoch-0004']
    assert latest(tmp_path / 'ck') == 'epoch-0004'
    assert not any(t.name.startswith('checkpoint-writer') for t in threading.enumerate())


def test_snapshot_is_taken_when_saving(tmp_path, monkeypatch):
    """Weights changed while the files are written do not reach the files."""
    release = threading.Event()
    release.set()
    original = state_files.write_large_state

    def held_write(*args):
        release.wait(10)
        original(*args)

    monkeypatch.setattr(state_files, 'write_large_state', held_write)
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), async_save=True).initialize()
    net = make_net(make_accelerator(), callbacks=[cp], max_epochs=1).initialize()
    net.partial_fit(*make_data(n=64))  # trains, saves, waits
    saved = {k: v.clone() for k, v in net.module_.state_dict().items()}
    net.history.new_epoch()
    net.history.record('train_loss', 0.0)
    release.clear()
    cp.save_model(net)
    with torch.no_grad():
        for p in net.module_.parameters():
            p.add_(1.0)
    release.set()
    cp.wait_for_saves(net)
    from safetensors.torch import load_file
    on_disk = load_file(str(tmp_path / 'ck' / 'epoch-0002' / 'model.safetensors'))
    for key, value in saved.items():
        assert torch.equal(on_disk[key], value), key


def test_options_survive_clone_and_are_checked():
    cp = AccelerateCheckpoint(async_save=True, durable=False)
    cloned = clone(cp)
    assert cloned is not cp
    assert cloned.async_save is True and cloned.durable is False
    cloned.set_params(async_save=False)
    assert cloned.async_save is False and cp.async_save is True
    with pytest.raises(ValueError, match='async_save'):
        AccelerateCheckpoint(async_save='yes').initialize()
