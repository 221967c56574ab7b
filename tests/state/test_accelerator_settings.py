"""The Accelerator's settings that change what is trained are recorded in a
checkpoint, and a relaunch with other values is refused by name before a
step, unless ``check_params`` names them: mixed precision, gradient
accumulation (at an epoch's end too, not only inside an epoch) and the data
loader configuration. Before, a bf16 checkpoint relaunched without mixed
precision trained on silently.
"""

import pytest
import torch
from accelerate import DataLoaderConfiguration

from checkpointed import fit
from common import make_accelerator, make_net
from skorch_accel_callbacks import CheckpointError
from skorch_accel_callbacks.state import _settings as settings

CHANGES = [
    ('accelerator.mixed_precision', {'mixed_precision': 'bf16'}, {},
     "accelerator.mixed_precision: 'bf16' in the checkpoint, 'no' now"),
    ('accelerator.gradient_accumulation_steps', {'gradient_accumulation_steps': 2}, {},
     'accelerator.gradient_accumulation_steps: 2 in the checkpoint, 1 now'),
    ('accelerator.even_batches', {},
     {'dataloader_config': DataLoaderConfiguration(even_batches=False)},
     'accelerator.even_batches: True in the checkpoint, False now'),
]


@pytest.mark.parametrize('name, before, after, said', CHANGES, ids=[c[0] for c in CHANGES])
def test_a_changed_setting_is_refused_by_name_before_a_step(tmp_path, name, before, after,
                                                            said):
    saved, _, _ = fit(tmp_path, max_epochs=2, accelerator=make_accelerator(**before))
    weights = saved.module_.lin.weight.detach().clone()
    with pytest.raises(CheckpointError) as refused:
        fit(tmp_path, accelerator=make_accelerator(**after))
    message = str(refused.value)
    assert said in message, message
    assert f'check_params={(name,)!r}' in message, message
    # nothing was trained past the checkpoint: the folder holds its 2 epochs only
    assert sorted(p.name for p in tmp_path.glob('epoch-*')) == ['epoch-0001', 'epoch-0002']
    assert torch.equal(saved.module_.lin.weight, weights)


def test_a_setting_named_in_check_params_may_change(tmp_path):
    fit(tmp_path, max_epochs=2, accelerator=make_accelerator(mixed_precision='bf16'))
    net, _, _ = fit(tmp_path, load_kwargs={'check_params': ('accelerator.mixed_precision',)})
    assert len(net.history) == 3
    assert net.accelerator.mixed_precision == 'no'


def test_the_recorded_settings_are_those_of_the_accelerator():
    net = make_net(make_accelerator(mixed_precision='bf16', gradient_accumulation_steps=3))
    recorded = settings.accelerator_params(net)
    assert recorded['accelerator.mixed_precision'] == 'bf16'
    assert recorded['accelerator.gradient_accumulation_steps'] == 3
    assert {'accelerator.split_batches', 'accelerator.dispatch_batches',
            'accelerator.use_seedable_sampler', 'accelerator.rng_types'} <= set(recorded)
