"""The engine's save against accelerate itself: from accelerate's parts
(the state dicts after save_state's hooks, its small files) it writes the
files ``Accelerator.save_state`` writes, with the same contents. An
accelerate upgrade that changes ``save_state`` fails here."""

import filecmp
import os

import pytest
import torch
from safetensors.torch import load_file

from common import Counter, make_accelerator, make_data, make_net
from skorch_accel_callbacks.engine import _state_files as state_files


def files(folder):
    return sorted(os.listdir(folder))


@pytest.mark.parametrize('safe_serialization', [True, False])
def test_the_save_writes_what_save_state_writes(tmp_path, safe_serialization):
    accelerator = make_accelerator()
    accelerator.register_for_checkpointing(Counter())
    net = make_net(accelerator, max_epochs=1)
    net.fit(*make_data(n=96))
    scheduler = torch.optim.lr_scheduler.StepLR(net.optimizer_, step_size=1)
    accelerator.prepare(scheduler)

    whole, in_two = tmp_path / 'whole', tmp_path / 'in_two'
    accelerator.save_state(str(whole), safe_serialization=safe_serialization)
    state_files.save_state(accelerator, str(in_two), safe_serialization)

    assert files(whole) == files(in_two)
    assert any(name.startswith('optimizer') for name in files(whole))
    assert any(name.startswith('scheduler') for name in files(whole))
    assert any(name.startswith('custom_checkpoint') for name in files(whole))
    for name in files(whole):
        a, b = whole / name, in_two / name
        if filecmp.cmp(a, b, shallow=False):
            continue
        # zip archives of torch.save can differ in their record headers only
        if name.endswith('.safetensors'):
            left, right = load_file(a), load_file(b)
        else:
            left = torch.load(a, weights_only=False)
            right = torch.load(b, weights_only=False)
        assert repr(left) == repr(right), name
