"""How FSDP2 lays out a checkpoint's model and optimizer, and its checks.

Under FSDP2 ``accelerator.save_state`` writes, for a sharded state dict,
a folder per model and per optimizer in which every rank writes its shard
(torch.distributed.checkpoint: ``__<rank>_0.distcp`` and an index,
``.metadata``); for a full state dict rank 0 writes one file of each.
:func:`shard_layout` is what a manifest records of it (``fsdp``),
:func:`check_shards` what a resume checks against the net before anything
loads, and :func:`make_room_for_group_settings` what a sharded load needs.

``fully_shard`` shards parameters only: every rank keeps its own buffers
(BatchNorm's running statistics, from its own batches), which DDP would
broadcast from rank 0 and FSDP2 leaves apart; the sharded checkpoint holds
one rank's. A checkpoint stores every rank's besides when they differ
(:mod:`~skorch_accel_callbacks.state._training_state`), and
:func:`warn_per_rank_buffers` tells the user when training begins.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.format import DCP_METADATA_NAME

__all__ = ['check_shards', 'make_room_for_group_settings', 'per_rank_buffer_modules',
           'shard_layout', 'warn_per_rank_buffers']

SHARDED = 'SHARDED_STATE_DICT'


def _shard_name(rank: int) -> str:
    return f'__{rank}_0.distcp'


def shard_layout(accelerator: Any) -> dict[str, Any] | None:
    """What ``save_state`` writes under FSDP2 (None without FSDP2):
    ``fsdp_version``, ``state_dict_type``, ``shard_files`` (the files of
    every rank in each folder of shards; none for a full state dict) and
    ``param_group_keys`` (the settings of each param group of each
    optimizer)."""
    if not accelerate_io.is_fsdp2(accelerator):
        return None
    kind = accelerate_io.fsdp_state_dict_type(accelerator)
    folders = []
    if kind == SHARDED:
        folders = accelerate_io.shard_folders(accelerator)
    names = [DCP_METADATA_NAME] + [_shard_name(rank) for rank in range(accelerator.num_processes)]
    return {
        'fsdp_version': 2,
        'state_dict_type': kind,
        'shard_files': {folder: names for folder in folders},
        'param_group_keys': [
            [sorted(key for key in group if key != 'params') for group in groups]
            for groups in accelerate_io.param_groups(accelerator)],
    }


def _describe(layout: dict[str, Any] | None) -> str:
    if layout is None:
        return 'without FSDP2'
    return f"with FSDP2 and state_dict_type={layout.get('state_dict_type')}"


def check_shards(manifest: dict[str, Any], current: dict[str, Any] | None, path: str) -> None:
    """Raise :class:`CheckpointError` if ``path`` was saved with another
    FSDP2 layout than ``current`` (the :func:`shard_layout` of the
    accelerator that loads it; one of them without FSDP2), and
    :class:`CorruptCheckpointError` naming a rank's shard that the manifest
    does not list (one written outside the committed folder)."""
    saved = manifest.get('fsdp')
    if (saved or {}).get('state_dict_type') != (current or {}).get('state_dict_type'):
        raise CheckpointError(
            f"{path} was saved {_describe(saved)}, this run loads {_describe(current)}: "
            "resume it with the accelerator (and the FullyShardedDataParallelPlugin's "
            "state_dict_type) it was saved with")
    for folder, names in (saved or {}).get('shard_files', {}).items():
        for name in names:
            rel = f'{folder}/{name}'
            if rel not in manifest['files']:
                raise CorruptCheckpointError(
                    f"{os.path.join(path, rel)} is missing: the manifest of {path} does "
                    f"not list it among the shards of {folder}")


def make_room_for_group_settings(accelerator: Any, manifest: dict[str, Any]) -> None:
    """Give each param group of the optimizers every setting that the
    checkpoint holds for it, as a placeholder that the load replaces.

    accelerate loads a sharded optimizer state into the keys of the
    optimizer's own state dict (torch.distributed.checkpoint reads what its
    template asks for): a setting that a fresh optimizer lacks, such as the
    ``initial_lr`` an LR scheduler adds, was dropped, and the scheduler
    built on the resumed optimizer then failed.
    """
    saved = (manifest.get('fsdp') or {}).get('param_group_keys', [])
    for groups, keys in zip(accelerate_io.param_groups(accelerator), saved, strict=False):
        for group, names in zip(groups, keys, strict=False):
            for name in names:
                group.setdefault(name, group.get('lr'))


def per_rank_buffer_modules(modules: Mapping[str, torch.nn.Module]) -> list[str]:
    """``'<module>.<submodule>' (<class>)`` of each submodule of the net's
    ``modules`` (name -> module) that holds buffers of its own which FSDP2
    does not synchronise: every one but :class:`torch.nn.SyncBatchNorm`'s,
    whose forward synchronises the statistics."""
    found = []
    for name, module in modules.items():
        for path, sub in module.named_modules():
            if isinstance(sub, torch.nn.SyncBatchNorm):
                continue
            if next(sub.named_buffers(recurse=False), None) is not None:
                where = f"{name}.{path}" if path else name
                found.append(f"{where!r} ({_user_class(sub).__name__})")
    return found


def _user_class(module: torch.nn.Module) -> type:
    """The class a module was made of: ``fully_shard`` changes a module's
    class into one of its own (``FSDPBatchNorm1d``) derived from it."""
    return next(cls for cls in type(module).__mro__
                if not cls.__module__.startswith('torch.distributed.'))


def warn_per_rank_buffers(accelerator: Any, modules: Mapping[str, torch.nn.Module]) -> None:
    """Warn (on the main process) when a net under FSDP2 has modules whose
    buffers each rank keeps its own of, naming them; ``modules``: the net's
    (name -> bare module), of which those that ``accelerator`` prepared count."""
    if not (accelerate_io.is_fsdp2(accelerator) and accelerator.is_main_process):
        return
    # a criterion's buffers (a class weight) are no model's: they never change
    sharded = {id(model) for model in accelerate_io.models(accelerator)}
    found = per_rank_buffer_modules(
        {name: module for name, module in modules.items() if id(module) in sharded})
    if not found:
        return
    warnings.warn(
        f"under FSDP2 every rank keeps its own buffers of {', '.join(found)} (BatchNorm's "
        "running statistics come from the rank's own batches; DDP would broadcast rank "
        "0's, FSDP2 does not): the ranks' models differ, checkpoints store every rank's "
        "buffers, and an export or load_params(checkpoint=...) takes rank 0's. For "
        "statistics of the whole batch on every rank, convert the module with "
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm", UserWarning, stacklevel=4)
