"""Run tests/workers/resume.py uninterrupted, killed and resumed; compare."""

import os

import torch

from testutil import read_results
from launcher import launch


def run(folder, tag, nproc=2, nnodes=1, expect_ok=True, dirname='ckpt', **env):
    """One launch of resume.py writing into ``folder``; returns rank results."""
    env = dict(env, RESULT_DIR=str(folder))
    result = launch('resume.py', os.path.join(folder, dirname), tag,
                    nproc=nproc, nnodes=nnodes, env=env)
    if expect_ok:
        result.check()
        return read_results(folder, tag, nproc * nnodes)
    return result


def final_state(folder, tag):
    return torch.load(os.path.join(folder, f'{tag}-rank0.pt'), weights_only=False)


def assert_identical(a, b):
    """Bit-identical parameters and optimizer states, equal per-epoch losses."""
    assert a['params'].keys() == b['params'].keys()
    for name in a['params']:
        for key, tensor in a['params'][name].items():
            assert torch.equal(tensor, b['params'][name][key]), f"{name}.{key} differs"
    assert a['optimizers'].keys() == b['optimizers'].keys()
    for name in a['optimizers']:
        _assert_nested_equal(a['optimizers'][name], b['optimizers'][name], name)
    assert len(a['history']) == len(b['history'])
    for row_a, row_b in zip(a['history'], b['history']):
        for key in ('train_loss', 'valid_loss', 'event_lr'):
            assert row_a[key] == row_b[key], (row_a['epoch'], key, row_a[key], row_b[key])


def _assert_nested_equal(a, b, where):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_nested_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_nested_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where
