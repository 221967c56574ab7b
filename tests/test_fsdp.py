"""FSDP2 through skorch: training, checkpoints and resumes, in 2 real
processes on CPU (the FSDP back-end forced by tests/workers/fsdp_backend.py,
``fully_shard`` with gloo)."""

import numpy as np
import pytest
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState, accelerate_io

# a hang in a collective fails the launch in seconds
SHORT_COLLECTIVES = {'COLLECTIVE_TIMEOUT': '30'}


@pytest.mark.slow
def test_fsdp2_trains_predicts_and_fits_again_as_ddp(run_workers):
    """The module and optimizer are prepared together and sharded; fit,
    predict on every rank, a warm partial_fit and a second fit give the
    losses and predictions of the same net under DDP; a criterion with
    parameters (a second model for FSDP2) is refused at initialize."""
    results = run_workers('fsdp_train.py', 'train', nproc=2, timeout=240,
                          env=SHORT_COLLECTIVES)
    for result in results:
        assert result['fsdp2']['num_processes'] == result['ddp']['num_processes'] == 2
        assert result['fsdp2']['sharded'] and not result['ddp']['sharded']
        for step in ('fit', 'partial_fit', 'second_fit'):
            fsdp2, ddp = result['fsdp2'][step], result['ddp'][step]
            np.testing.assert_allclose(fsdp2['losses'], ddp['losses'], rtol=1e-5)
            np.testing.assert_allclose(fsdp2['proba'], ddp['proba'], atol=1e-6)
        assert len(result['fsdp2']['partial_fit']['losses']) == 4
        assert len(result['fsdp2']['second_fit']['losses']) == 2
        assert result['refused']['trained_criterion'].startswith(
            'under FSDP2 the net must have exactly one module with trainable parameters '
            'and one optimizer')
        assert "criteria with trainable parameters ['criterion']" in \
            result['refused']['trained_criterion']
    # each rank's losses are those of its share of the data; the
    # predictions are gathered from every rank
    for step in ('fit', 'partial_fit', 'second_fit'):
        assert results[0]['fsdp2'][step]['proba'] == results[1]['fsdp2'][step]['proba']


# ---------------------------------------------------------------- refused back-ends

@pytest.fixture
def accelerator():
    """A real accelerator of this process, whose state a test may set to
    another back-end (restored afterwards)."""
    accelerator = make_accelerator()
    state = accelerator.state
    saved = state.distributed_type, getattr(state, 'fsdp_plugin', None)
    yield accelerator
    state.distributed_type, state.fsdp_plugin = saved


def refusal(accelerator, tmp_path, kind, plugin=None, **cp_kwargs):
    """What AccelerateCheckpoint refuses when training begins on a net
    prepared as usual whose accelerator then reports ``kind``."""
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'), **cp_kwargs)
    net = make_net(accelerator, callbacks=[cp], max_epochs=1).initialize()
    accelerator.state.distributed_type = kind
    accelerator.state.fsdp_plugin = plugin
    with pytest.raises(ValueError) as info:
        net.partial_fit(*make_data(n=64))
    assert len(net.history) == 0 and list(tmp_path.iterdir()) == []
    return str(info.value)


def test_fsdp1_is_refused_naming_fsdp2_and_why(accelerator, tmp_path):
    message = refusal(accelerator, tmp_path, DistributedType.FSDP,
                      FullyShardedDataParallelPlugin(fsdp_version=1))
    assert message.startswith(
        "AccelerateCheckpoint does not support accelerate's FSDP back-end "
        "(FullyShardedDataParallelPlugin) other than FSDP2 (fsdp_version=1, or no plugin): "
        "its full state dict (gathered with offload_to_cpu=True) crashed rank 0")
    assert message.endswith(
        "for a model that does not fit one device, FSDP2: "
        "FullyShardedDataParallelPlugin(fsdp_version=2)")


def test_deepspeed_is_refused_naming_fsdp2(accelerator, tmp_path):
    message = refusal(accelerator, tmp_path, DistributedType.DEEPSPEED)
    assert message.startswith(
        "AccelerateCheckpoint does not support accelerate's DEEPSPEED back-end "
        "(DeepSpeedPlugin): its engine partitions the model and optimizer")
    assert message.endswith("FSDP2: FullyShardedDataParallelPlugin(fsdp_version=2)")


def test_async_save_under_fsdp2_is_refused_when_training_begins(accelerator, tmp_path):
    """The sharded save is collectives of every rank: it cannot run on the
    background writer's thread; the synchronous save is what FSDP2 gets."""
    message = refusal(accelerator, tmp_path, DistributedType.FSDP,
                      FullyShardedDataParallelPlugin(fsdp_version=2), async_save=True)
    assert message.startswith(
        "AccelerateCheckpoint(async_save=True) cannot save in the background under FSDP2")
    assert message.endswith("use async_save=False")
    accelerate_io.check_plain_state(accelerator, 'AccelerateCheckpoint')


def test_resume_under_fsdp1_is_refused_naming_fsdp2(accelerator, tmp_path):
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    net = make_net(accelerator, callbacks=[AccelerateLoadInitState(cp), cp],
                   max_epochs=1).initialize()
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=1)
    with pytest.raises(ValueError, match=(
            r"^AccelerateLoadInitState does not support accelerate's FSDP back-end "
            r"\(FullyShardedDataParallelPlugin\) other than FSDP2")):
        net.partial_fit(*make_data(n=64))
    assert list(tmp_path.iterdir()) == []
