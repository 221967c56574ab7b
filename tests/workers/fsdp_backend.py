"""accelerate's FSDP back-end on CPU, for the tests: the one place that forces it.

accelerate 1.15 selects FSDP only for GPU-like devices: on CPU it ignores a
``FullyShardedDataParallelPlugin`` and runs DistributedDataParallel
(``MULTI_CPU``) without a word. The tests run the real ``fully_shard`` with
gloo on CPU by setting, after the ``Accelerator`` is made, the distributed
type of the process state and of the accelerator's state, and the
accelerator state's ``fsdp_plugin`` (measured in ../shared/FACTS.md,
"FSDP on CPU": setting only ``accelerator.state`` is reverted). Written for
accelerate 1.15: another version, or an accelerate that no longer ignores
the plugin on CPU, fails here loudly instead of the tests passing on DDP.
The package itself never patches accelerate.
"""

import os

import accelerate
from accelerate import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from common import make_accelerator

WRITTEN_FOR = '1.15'


def _check_shape(accelerator):
    if not accelerate.__version__.startswith(WRITTEN_FOR + '.') \
            and accelerate.__version__ != WRITTEN_FOR:
        raise RuntimeError(
            f"tests/workers/fsdp_backend.py forces FSDP the way accelerate {WRITTEN_FOR} "
            f"needs; accelerate {accelerate.__version__} is installed: check that it "
            "still ignores an FSDP plugin on CPU and how, then update the helper")
    if accelerator.distributed_type != DistributedType.MULTI_CPU \
            or getattr(accelerator.state, 'fsdp_plugin', None) is not None:
        raise RuntimeError(
            "accelerate no longer ignores an FSDP plugin on CPU (distributed type "
            f"{accelerator.distributed_type}): tests/workers/fsdp_backend.py is not "
            "needed any more, or needs updating")


def fsdp_accelerator(fsdp_version=2, **plugin_kwargs):
    """An ``Accelerator`` of this launch (``common.make_accelerator``) that
    prepares and saves with accelerate's FSDP back-end on CPU."""
    before = dict(os.environ)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=fsdp_version, **plugin_kwargs)
    accelerator = make_accelerator(fsdp_plugin=plugin)
    # the plugin and the Accelerator announce FSDP in the environment, which
    # every later Accelerator of the process would read
    for key in set(os.environ) - set(before):
        if key.startswith(('FSDP_', 'ACCELERATE_USE_FSDP')):
            del os.environ[key]
    _check_shape(accelerator)
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    if accelerator.distributed_type != DistributedType.FSDP \
            or accelerator.state.fsdp_plugin is not plugin \
            or accelerator.is_fsdp2 != (fsdp_version == 2):
        raise RuntimeError(
            "tests/workers/fsdp_backend.py could not force the FSDP back-end: "
            f"distributed type {accelerator.distributed_type}, plugin "
            f"{accelerator.state.fsdp_plugin!r}")
    return accelerator
