"""``AccelerateCheckpoint(load_best=True)``: when training ends the net holds
the best checkpoint's model, on every rank, in one process, DDP and FSDP2,
as skorch's ``Checkpoint(load_best=True)`` holds its best parameters."""

import os

import pytest
import torch

from common import make_accelerator, make_data, make_net
from launcher import launch
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
from skorch_accel_callbacks.engine import is_sharded_model, model_files, read_checkpoint_model
from skorch_accel_callbacks.format import read_manifest


def best_at_epoch_2(net):
    return len(net.history) == 2


def saved_model(checkpoint):
    """The module's parameters in checkpoint folder ``checkpoint`` (merged
    in this process where FSDP2 sharded them)."""
    manifest = read_manifest(checkpoint)
    files = dict(model_files(manifest, checkpoint))
    return read_checkpoint_model(checkpoint, manifest, files['module'])


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def differs(a, b):
    return any(not torch.equal(a[key], b[key]) for key in a)


def test_one_process_ends_with_the_best_checkpoint_s_model(tmp_path, capsys):
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), monitor=best_at_epoch_2,
                              keep_best=1, load_best=True, sink=print)
    torch.manual_seed(0)
    net = make_net(make_accelerator(), max_epochs=4, verbose=1,
                   callbacks=[cp, AccelerateLoadInitState(cp)])
    net.fit(*make_data(n=160))
    best = cp.find('best')
    assert os.path.basename(best) == 'epoch-0002'
    module = net.accelerator.unwrap_model(net.module_)
    assert_same(module.state_dict(), saved_model(best))
    last = saved_model(cp.find('latest'))
    assert os.path.basename(cp.find('latest')) == 'epoch-0004' and differs(last, saved_model(best))
    assert f"Loaded the model(s) of the best checkpoint, {best}" in capsys.readouterr().out
    # the history stays the whole run's
    assert len(net.history) == 4


def test_load_best_without_monitor_is_refused_at_initialize():
    with pytest.raises(ValueError, match=r"load_best=True loads the best checkpoint when "
                                         r"training ends, and monitor \(None\) marks none best"):
        AccelerateCheckpoint(load_best=True).initialize()


def test_no_best_checkpoint_keeps_the_last_model_and_says_so(tmp_path, capsys):
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), monitor=lambda net: False,
                              keep_best=1, load_best=True, sink=print)
    net = make_net(make_accelerator(), max_epochs=2, verbose=1,
                   callbacks=[cp, AccelerateLoadInitState(cp)])
    net.fit(*make_data(n=64))
    assert_same(net.accelerator.unwrap_model(net.module_).state_dict(),
                saved_model(cp.find('latest')))
    assert "load_best: no checkpoint in" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize('backend', ['ddp', 'fsdp2'])
def test_every_rank_ends_with_the_best_checkpoint_s_model(tmp_path, backend):
    result = launch('load_best.py', tmp_path / 'ck', 'run', nproc=2, timeout=240,
                    env={'RESULT_DIR': str(tmp_path), 'BACKEND': backend})
    result.check()
    ranks = [torch.load(tmp_path / f'run-rank{r}.pt', weights_only=False) for r in (0, 1)]
    assert [rank['num_processes'] for rank in ranks] == [2, 2]
    best = ranks[0]['best']
    assert os.path.basename(best) == 'epoch-0002'
    if backend == 'fsdp2':
        assert is_sharded_model(os.path.join(best, 'pytorch_model_fsdp_0'))
    expected = saved_model(best)
    for rank in ranks:
        assert_same(rank['params'], expected)
        # the last epoch's model was another
        assert differs(rank['last'], expected)
    assert "Loaded the model(s) of the best checkpoint" in result.outputs[0]
    assert "Loaded the model(s)" not in result.outputs[1]
