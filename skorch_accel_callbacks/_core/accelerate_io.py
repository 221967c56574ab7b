"""Every use of accelerate's internals, in one place.

The package needs more of an ``Accelerator`` than its public API gives: the
registries of prepared models, optimizers and loaders, accelerate's file
names, and the body of ``Accelerator.save_state`` in its parts: the state
dicts of the models and optimizers after its hooks (:func:`large_states`),
the rule of which process writes their files (:func:`writes_large_files`),
a model's file (:func:`save_model_file`), and every other file
(:func:`save_small_files`). The engine writes a checkpoint from these parts
(the optimizer files by the format's archive writer), in the background or
not; ``tests/engine/test_state_files.py`` checks that its save writes the
same files with the same contents as ``Accelerator.save_state``, so an
accelerate upgrade that moves these internals fails one obvious test.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.checkpointing import save_accelerator_state, save_custom_state
from accelerate.state import GradientState, is_initialized
from accelerate.utils import (
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_NAME,
    DistributedType,
    GradientAccumulationPlugin,
    is_compiled_module,
    load,
    load_fsdp_model,
    save,
)
from accelerate.utils.constants import FSDP_MODEL_NAME
from safetensors import safe_open
from safetensors.torch import load_model

from skorch_accel_callbacks._core import releases
from skorch_accel_callbacks.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = [
    'accelerator_of_this_process',
    'accumulation_step',
    'accumulation_steps',
    'at_end_of_loader',
    'base_loader',
    'batch_sampler',
    'accelerator_settings',
    'check_plain_state',
    'dataloaders',
    'fsdp2_buffers',
    'fsdp_model_file',
    'fsdp_state_dict_type',
    'frozen_keys',
    'frozen_optimizer_entries',
    'gradients_applied',
    'ATTRIBUTES',
    'GRADIENT_STATE',
    'check_internals',
    'is_fsdp2',
    'is_fsdp_model_path',
    'large_states',
    'leave_loader',
    'load_sharded_models',
    'load_state',
    'missing_internals',
    'model_file',
    'optimizer_file',
    'optimizer_map_location',
    'models',
    'optimizers',
    'param_groups',
    'prune_registries',
    'read_and_drop_first_batches_once',
    'read_optimizer_states',
    'registries_of',
    'rng_file',
    'rows_of_data_in_last_batch',
    'save_model_file',
    'save_on_each_node',
    'save_small_files',
    'save_state_in_two',
    'save_state_with_accelerate',
    'set_batch_sampler',
    'shard_folders',
    'set_accumulation_step',
    'set_fsdp2_buffers',
    'training_settings',
    'uncompiled',
    'uses_automatic_naming',
    'writes_large_files',
]

#: the private attributes of an ``Accelerator`` that the package reads,
#: which its ``__init__`` sets: the registries of what ``prepare`` and
#: ``register_for_checkpointing`` took, and ``save_state``'s hooks
ATTRIBUTES = ('_models', '_optimizers', '_schedulers', '_dataloaders', '_custom_objects',
              '_save_model_state_pre_hook')
#: what the package reads of its ``gradient_state`` (where a pass over a
#: loader is, and the accumulation's settings)
GRADIENT_STATE = ('plugin_kwargs', 'dataloader_references', 'end_of_dataloader', 'remainder')

# back-ends that save models through collectives of their own -> what
# selects them
_NOT_PLAIN = {
    DistributedType.FSDP: 'FullyShardedDataParallelPlugin',
    DistributedType.DEEPSPEED: 'DeepSpeedPlugin',
    DistributedType.MEGATRON_LM: 'MegatronLMPlugin',
    DistributedType.XLA: 'TPU',
}
# why each is refused (measured with accelerate 1.15, torch 2.13)
_WHY_NOT = {
    DistributedType.FSDP: (
        " other than FSDP2 (fsdp_version=1, or no plugin): its full state dict "
        "(gathered with offload_to_cpu=True) crashed rank 0 on CPU, a sharded load "
        "dropped the optimizer state and failed for parameters of which a rank holds "
        "no shard"),
    DistributedType.DEEPSPEED: (
        ": its engine partitions the model and optimizer and saves them itself, "
        "and needs transformers and a compiled op"),
    None: (": it shards or places the models itself and saves them with "
           "collectives of its own"),
}


# ---------------------------------------------------------------- internals

def missing_internals(accelerator: Accelerator) -> list[str]:
    """What of accelerate's internals the package uses ``accelerator`` lacks,
    as ``'Accelerator._models'`` (:data:`ATTRIBUTES`) or
    ``'GradientState.remainder'`` (:data:`GRADIENT_STATE`)."""
    missing = [f'Accelerator.{name}' for name in ATTRIBUTES if not hasattr(accelerator, name)]
    state = getattr(accelerator, 'gradient_state', None)
    missing += [f'GradientState.{name}' for name in GRADIENT_STATE
                if not hasattr(state, name)]
    return missing


def check_internals(accelerator: Accelerator, owner: str) -> None:
    """Refuse an accelerate release that moved an internal the package uses
    (:func:`missing_internals`), before training; ``owner`` begins the
    message.

    Raises
    ------
    RuntimeError
      Naming what is missing, the installed accelerate and the tested range.
    """
    releases.refuse_moved_internals(owner, 'accelerate', missing_internals(accelerator))


# ---------------------------------------------------------------- registries

def models(accelerator: Accelerator) -> list[torch.nn.Module]:
    """The bare models ``save_state`` saves, in the order of its files."""
    return accelerator._models


def optimizers(accelerator: Accelerator) -> list[torch.optim.Optimizer]:
    """The prepared optimizers, in the order of ``save_state``'s files."""
    return accelerator._optimizers


def dataloaders(accelerator: Accelerator) -> list[DataLoader]:
    """The prepared data loaders, oldest first."""
    return accelerator._dataloaders


def prune_registries(accelerator: Accelerator, keep: Callable[[Any, set[int]], bool]) -> None:
    """Remove objects from the model, optimizer and scheduler registries.

    ``keep(obj, seen)`` says whether ``obj`` stays; ``seen`` is the set of
    ids kept so far in that registry.
    """
    for registry in (accelerator._models, accelerator._optimizers,
                     accelerator._schedulers):
        seen = set()
        kept = []
        for obj in registry:
            if keep(obj, seen):
                seen.add(id(obj))
                kept.append(obj)
        registry[:] = kept


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without ``torch.compile``'s wrapper (skorch's
    ``compile=True``): the module whose ``state_dict()`` has the module's
    own names, without the ``_orig_mod.`` prefix, and shares its tensors."""
    return model._orig_mod if is_compiled_module(model) else model


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, 'optimizer', optimizer)


@contextmanager
def registries_of(
        accelerator: Accelerator,
        own_models: Iterable[torch.nn.Module],
        own_optimizers: Iterable[torch.optim.Optimizer],
) -> Iterator[None]:
    """Inside the block, the accelerator's registries hold only these
    models (without ``torch.compile``'s wrapper, so that ``save_state`` and
    ``load_state`` use the module's own names) and optimizers (in registry
    order) and the schedulers of these optimizers.

    Several nets can share one ``Accelerator`` (two nets in a script; every
    ``sklearn.base.clone`` of a net, since ``Accelerator.__deepcopy__``
    returns the same object): ``save_state`` and ``load_state`` then see
    only the net being checkpointed. The lists are changed in place and
    restored on exit.
    """
    model_ids = {id(model) for model in own_models}
    inner_ids = {id(_inner(optimizer)) for optimizer in own_optimizers}
    registries = (accelerator._models, accelerator._optimizers, accelerator._schedulers)
    saved = [list(registry) for registry in registries]
    accelerator._models[:] = [uncompiled(m) for m in saved[0] if id(m) in model_ids]
    accelerator._optimizers[:] = [o for o in saved[1] if id(_inner(o)) in inner_ids]
    accelerator._schedulers[:] = [
        s for s in saved[2]
        if id(getattr(getattr(s, 'scheduler', s), 'optimizer', None)) in inner_ids]
    try:
        yield
    finally:
        for registry, content in zip(registries, saved, strict=True):
            registry[:] = content


# ---------------------------------------------------------------- settings

# the handlers of an Accelerator that a new one in another process gets too
_HANDLERS = ('ddp_handler', 'scaler_handler', 'autocast_handler', 'init_handler')


def accelerator_settings(accelerator: Accelerator) -> dict[str, Any]:
    """What an ``Accelerator`` was made with, less its processes: the
    arguments that make an equivalent one in another process."""
    handlers = [getattr(accelerator, name, None) for name in _HANDLERS]
    return {
        'cpu': accelerator.device.type == 'cpu',
        'mixed_precision': accelerator.mixed_precision,
        'device_placement': accelerator.device_placement,
        'dataloader_config': accelerator.dataloader_config,
        'step_scheduler_with_optimizer': accelerator.step_scheduler_with_optimizer,
        'rng_types': list(accelerator.rng_types),
        'gradient_accumulation_plugin': GradientAccumulationPlugin(
            **accelerator.gradient_state.plugin_kwargs),
        'kwargs_handlers': [handler for handler in handlers if handler is not None],
    }


def training_settings(accelerator: Accelerator) -> dict[str, Any]:
    """The settings of ``accelerator`` that change what is trained, by name:
    its mixed precision, gradient accumulation, how it prepares data
    loaders (``dataloader_config``) and the random states it synchronizes."""
    config = accelerator.dataloader_config
    accumulation = accelerator.gradient_state.plugin_kwargs
    return {
        'mixed_precision': str(accelerator.mixed_precision),
        'gradient_accumulation_steps': int(accelerator.gradient_accumulation_steps),
        'gradient_accumulation_adjust_scheduler': bool(accumulation.get('adjust_scheduler', True)),
        'gradient_accumulation_sync_with_dataloader': bool(
            accumulation.get('sync_with_dataloader', True)),
        'gradient_accumulation_sync_each_batch': bool(accumulation.get('sync_each_batch', False)),
        'split_batches': bool(config.split_batches),
        'even_batches': bool(config.even_batches),
        'dispatch_batches': config.dispatch_batches,
        'use_seedable_sampler': bool(config.use_seedable_sampler),
        'data_seed': config.data_seed,
        'use_stateful_dataloader': bool(getattr(config, 'use_stateful_dataloader', False)),
        'step_scheduler_with_optimizer': bool(accelerator.step_scheduler_with_optimizer),
        'rng_types': [str(kind) for kind in accelerator.rng_types],
    }


def accelerator_of_this_process(settings: Mapping[str, Any]) -> Accelerator:
    """The ``Accelerator`` of an unpickled net: one of the process that
    unpickles it, never the pickled one's processes.

    Where this process already runs accelerate (a job that made its
    ``Accelerator``), the new one shares that state, as every
    ``Accelerator`` of a process does: its processes, device, mixed
    precision and gradient accumulation stay as they are. Elsewhere it is a
    new accelerator of this process alone (unless the environment says it is
    one of a launched job's processes: unpickle after making the job's
    ``Accelerator`` there), with the pickled one's settings; a mixed
    precision this process cannot run is dropped with a warning.
    """
    settings = dict(settings)
    if is_initialized():
        del settings['cpu'], settings['mixed_precision']
        settings['gradient_accumulation_plugin'] = GradientAccumulationPlugin(
            **GradientState().plugin_kwargs)
        return Accelerator(**settings)
    try:
        return Accelerator(**settings)
    except ValueError as exc:
        if settings['mixed_precision'] in (None, 'no'):
            raise
        warnings.warn(
            f"the unpickled net's accelerator runs without mixed precision: "
            f"mixed_precision={settings['mixed_precision']!r} cannot run in this "
            f"process ({exc})", UserWarning)
        settings['mixed_precision'] = 'no'
        return Accelerator(**settings)



def is_fsdp2(accelerator: Accelerator) -> bool:
    """Whether the accelerator shards its model with FSDP2 (``fully_shard``)."""
    plugin = getattr(accelerator.state, 'fsdp_plugin', None)
    return (accelerator.distributed_type == DistributedType.FSDP
            and getattr(plugin, 'fsdp_version', None) == 2)


def fsdp_state_dict_type(accelerator: Accelerator) -> str:
    """The FSDP plugin's ``state_dict_type``: ``'SHARDED_STATE_DICT'`` or
    ``'FULL_STATE_DICT'``."""
    kind = accelerator.state.fsdp_plugin.state_dict_type
    return getattr(kind, 'name', str(kind))


def shard_folders(accelerator: Accelerator) -> list[str]:
    """The folders of a sharded FSDP save: one per model, then one per optimizer."""
    return ([fsdp_model_file(i, sharded=True) for i in range(len(accelerator._models))]
            + [f'{OPTIMIZER_NAME}_{i}' for i in range(len(accelerator._optimizers))])


def param_groups(accelerator: Accelerator) -> list[list[dict[str, Any]]]:
    """The param groups of each prepared optimizer, in ``save_state``'s order."""
    return [_inner(optimizer).param_groups for optimizer in accelerator._optimizers]


def fsdp2_buffers(accelerator: Accelerator) -> dict[str, torch.Tensor]:
    """This rank's persistent buffers of each prepared model under FSDP2
    (``'<model index>/<buffer name>'`` -> a copy on the CPU); empty without
    FSDP2 or buffers.

    ``fully_shard`` shards the parameters only: each rank keeps its own
    buffers (BatchNorm's running statistics from its own batches), which
    DDP would broadcast from rank 0 and FSDP2 does not synchronise, and
    the sharded checkpoint holds one rank's.
    """
    if not is_fsdp2(accelerator):
        return {}
    found = {}
    for index, model in enumerate(models(accelerator)):
        persistent = set(model.state_dict(keep_vars=True))
        for name, buffer in model.named_buffers():
            if name in persistent:
                found[f'{index}/{name}'] = buffer.detach().cpu().clone()
    return found


def set_fsdp2_buffers(accelerator: Accelerator, buffers: Mapping[str, torch.Tensor]) -> None:
    """Give the prepared models the buffers :func:`fsdp2_buffers` read
    (after ``load_state``, which gave every rank the checkpoint's one copy).
    Raises ``KeyError`` naming a buffer that a model lacks or that ``buffers``
    lacks."""
    expected = set(fsdp2_buffers(accelerator))
    if set(buffers) != expected:
        raise KeyError(f"buffers {sorted(expected - set(buffers))} missing, "
                       f"{sorted(set(buffers) - expected)} unknown")
    registered = models(accelerator)
    for key, value in buffers.items():
        index, name = key.split('/', 1)
        with torch.no_grad():
            registered[int(index)].get_buffer(name).copy_(value)


def save_on_each_node(accelerator: Accelerator) -> bool:
    return bool(accelerator.project_configuration.save_on_each_node)


def uses_automatic_naming(accelerator: Accelerator) -> bool:
    return bool(accelerator.project_configuration.automatic_checkpoint_naming)


def check_plain_state(accelerator: Accelerator, what: str, async_save: bool = False) -> None:
    """Raise ``ValueError`` naming the back-end if ``what`` cannot save and
    load its state: FSDP1, DeepSpeed, Megatron-LM and XLA, which shard or
    place the models themselves; FSDP2 with ``async_save``.

    accelerate picks the back-end from its plugin (or the launcher's
    configuration) and reports it as ``accelerator.distributed_type``; a
    plugin it ignores (an FSDP plugin on CPU) selects nothing, and the
    models are then prepared as without it.
    """
    kind = accelerator.distributed_type
    if is_fsdp2(accelerator):
        if async_save:
            raise ValueError(
                f"{what} cannot save in the background under FSDP2: each rank's shard "
                "is written by torch.distributed.checkpoint in collectives of all ranks, "
                "which a background thread cannot run beside training's collectives; "
                "use async_save=False")
        return
    if kind in _NOT_PLAIN:
        name = getattr(kind, 'value', kind)
        raise ValueError(
            f"{what} does not support accelerate's {name} back-end ({_NOT_PLAIN[kind]})"
            f"{_WHY_NOT.get(kind, _WHY_NOT[None])}. Supported are one process and "
            "DistributedDataParallel (distributed_type NO, MULTI_CPU, MULTI_GPU and the "
            "other MULTI_* devices), and for a model that does not fit one device, FSDP2: "
            "FullyShardedDataParallelPlugin(fsdp_version=2)")


# ---------------------------------------------------------------- files

def rng_file(rank: int) -> str:
    """accelerate's name for a rank's random states."""
    return f'{RNG_STATE_NAME}_{rank}.pkl'


def model_file(index: int, safe_serialization: bool) -> str:
    """accelerate's name for the file of the ``index``-th model."""
    name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    return name if index == 0 else name.replace('.', f'_{index}.')


_FSDP_MODEL_FILE = re.compile(rf'^{re.escape(FSDP_MODEL_NAME)}(?:_(\d+))?(?:\.bin)?$')


def fsdp_model_file(index: int, sharded: bool) -> str:
    """accelerate's name for the ``index``-th model of an FSDP save: the
    folder of a sharded state dict (``pytorch_model_fsdp_0``) or the file
    of a full one (``pytorch_model_fsdp.bin``, ``pytorch_model_fsdp_1.bin``)."""
    if sharded:
        return f'{FSDP_MODEL_NAME}_{index}'
    return f'{FSDP_MODEL_NAME}.bin' if index == 0 else f'{FSDP_MODEL_NAME}_{index}.bin'


def is_fsdp_model_path(rel: str) -> bool:
    """Whether the relative path ``rel`` of a checkpoint is an FSDP model's
    file or lies in one's folder."""
    return _FSDP_MODEL_FILE.match(rel.replace(os.sep, '/').split('/')[0]) is not None


def optimizer_file(index: int) -> str:
    """The name ``save_state`` gives the file of the optimizer at ``index``."""
    return f'{OPTIMIZER_NAME}.bin' if index == 0 else f'{OPTIMIZER_NAME}_{index}.bin'


# ---------------------------------------------------------------- save / load

def save_state_with_accelerate(accelerator: Accelerator, folder: str | os.PathLike,
                               safe_serialization: bool) -> None:
    """``Accelerator.save_state`` itself: under FSDP2, whose shards go
    through torch.distributed.checkpoint."""
    accelerator.save_state(folder, safe_serialization=safe_serialization)


def optimizer_map_location(accelerator: Accelerator) -> str | torch.device:
    """Where ``Accelerator.load_state`` puts the optimizers' states as it
    reads them: the process's device in a job of several processes on
    several devices, else the CPU (``torch.load``'s ``map_location``)."""
    if (accelerator.num_processes > 1 and accelerator.multi_device
            and accelerator.distributed_type != DistributedType.MULTI_XPU):
        return accelerator.device
    return 'cpu'


def read_optimizer_states(folder: str | os.PathLike, count: int,
                          map_location: str | torch.device,
                          frozen_parts: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The states of the files of the first ``count`` optimizers in
    ``folder`` (:func:`optimizer_file`), read with
    ``torch.load(weights_only=True)`` onto ``map_location``
    (:func:`optimizer_map_location`), as ``load_state`` reads them, with the
    state of the frozen parameters merged in from the file ``frozen_parts``
    names beside an optimizer's (:func:`_with_frozen_state`); on any thread
    (accelerate's own loader widens torch's allowed types for the whole
    process, for the time of each read: a type that only it allows fails
    here)."""
    return [_optimizer_state(folder, index, frozen_parts,
                             partial(torch.load, map_location=map_location, weights_only=True))
            for index in range(count)]


def _optimizer_state(folder: str | os.PathLike, index: int,
                     frozen_parts: Mapping[str, str] | None,
                     read: Callable[[str], Any]) -> dict[str, Any]:
    """The state of the optimizer at ``index`` that ``read`` reads from its
    file in ``folder``, with its frozen part's merged in."""
    name = optimizer_file(index)
    path = os.path.join(folder, name)
    part = (frozen_parts or {}).get(name)
    if part is None:
        return read(path)
    part_path = os.path.join(folder, part)
    return _with_frozen_state(read(path), path, read(part_path), part_path)


def _with_frozen_state(state: Any, path: str, frozen: Any, frozen_path: str) -> dict[str, Any]:
    """The optimizer state ``state`` (read from ``path``) with the state of
    its frozen parameters, ``frozen`` (``{'state': {index: ...}}``, read
    from ``frozen_path``), merged in, in the order of the parameters.

    Raises
    ------
    CorruptCheckpointError
      Naming the file at fault, where either holds no such state, or the
      frozen part holds a parameter that the optimizer's file holds too or
      that no group of the optimizer has.
    """
    if not (isinstance(state, dict) and isinstance(state.get('state'), dict)
            and isinstance(state.get('param_groups'), list)):
        raise CorruptCheckpointError(f"{path} holds no optimizer state")
    if not (isinstance(frozen, dict) and set(frozen) == {'state'}
            and isinstance(frozen['state'], dict)):
        raise CorruptCheckpointError(
            f"{frozen_path} holds no optimizer state of frozen parameters")
    twice = sorted(set(frozen['state']) & set(state['state']))
    if twice:
        raise CorruptCheckpointError(
            f"{frozen_path} holds the state of parameters {twice}, which {path} holds too")
    params = {index for group in state['param_groups'] for index in group.get('params', ())}
    unknown = sorted(set(frozen['state']) - params)
    if unknown:
        raise CorruptCheckpointError(
            f"{frozen_path} holds the state of parameters {unknown}, which no group of "
            f"{path} has")
    merged = {**state['state'], **frozen['state']}
    return dict(state, state={index: merged[index] for index in sorted(merged)})


def load_state(accelerator: Accelerator, folder: str | os.PathLike,
               frozen_parts: Mapping[str, str] | None = None,
               optimizer_states: Callable[[], Sequence[dict[str, Any]] | None] | None = None,
               ) -> None:
    """``accelerator.load_state(folder)``; with ``frozen_parts`` (model or
    optimizer file -> the file of its frozen parameters beside it, the
    model or optimizer file holding the rest) each such model's two files,
    each loaded with ``strict=False`` once it is proven that together they
    hold every entry of the model's state dict, and each such optimizer's
    two files merged (:func:`_with_frozen_state`). With
    ``optimizer_states``, the optimizers load last, once everything else is
    loaded, what it then returns (the states of the folder's optimizer
    files read ahead, :func:`read_optimizer_states`: a read that may still
    be under way while the models load), or where it returns None their
    files, read as ``load_state`` reads them.

    Raises
    ------
    CorruptCheckpointError
      Naming the file at fault, where a model's two files lack an entry of
      its state dict or hold one it does not have, or an optimizer's two
      files do not merge.
    """
    optimizers = accelerator._optimizers
    parts = dict(frozen_parts or {})
    split_optimizers = any(optimizer_file(index) in parts for index in range(len(optimizers)))
    if optimizer_states is None and not split_optimizers:
        _load_state(accelerator, folder, parts)
        return
    # load_state loads the optimizers of this registry: none, for the time
    # of the call, and each then loads its state as load_state would have
    accelerator._optimizers = []
    try:
        _load_state(accelerator, folder, parts)
    finally:
        accelerator._optimizers = optimizers
    states = None if optimizer_states is None else optimizer_states()
    if states is None:
        read = partial(load, map_location=optimizer_map_location(accelerator))
        states = [_optimizer_state(folder, index, parts, read) for index in range(len(optimizers))]
    if len(states) != len(optimizers):
        raise ValueError(f"{len(states)} optimizer states for {len(optimizers)} optimizers")
    for optimizer, state in zip(optimizers, states, strict=True):
        optimizer.load_state_dict(state)


def _load_state(accelerator: Accelerator, folder: str | os.PathLike,
                frozen_parts: Mapping[str, str]) -> None:
    """:func:`load_state`, the optimizers loaded by ``accelerator.load_state``."""
    split = [(model, model_file(index, safe_serialization=True))
             for index, model in enumerate(accelerator._models)]
    split = [(model, name) for model, name in split if name in frozen_parts]
    if not split:
        accelerator.load_state(folder)
        return
    for model, name in split:
        whole, part = os.path.join(folder, name), frozen_parts[name]
        with safe_open(whole, framework='pt') as opened:
            in_whole = set(opened.keys())
        unknown = in_whole - set(model.state_dict())
        if unknown:
            raise CorruptCheckpointError(
                f"{whole} holds {sorted(unknown)}, which the model's state dict lacks")
        split_path = os.path.join(folder, part)
        missing, unknown = load_model(model, split_path, strict=False)
        missing = set(missing) - in_whole
        if unknown:
            raise CorruptCheckpointError(
                f"{split_path} holds {sorted(unknown)}, which the model's state dict lacks")
        if missing:
            raise CorruptCheckpointError(
                f"{whole} and {split_path} lack {sorted(missing)} of the model's state dict")
    # every entry not in a frozen part is in its model file: a strict load
    # of the model files alone would miss the entries of the parts
    accelerator.load_state(folder, strict=False)


def frozen_keys(accelerator: Accelerator) -> list[set[str]]:
    """Of each model ``save_state`` saves, the names its state dict gives
    the parameters that require no gradient: frozen (skorch's ``Freezer``,
    ``requires_grad_(False)``), which no optimizer step changes."""
    return [{key for key, value in model.state_dict(keep_vars=True).items()
             if isinstance(value, torch.nn.Parameter) and not value.requires_grad}
            for model in accelerator._models]


def frozen_optimizer_entries(accelerator: Accelerator) -> list[set[int]]:
    """Of each optimizer ``save_state`` saves, the entries of its state
    dict's ``state`` (a parameter's place in its groups, as
    ``Optimizer.state_dict`` numbers them) of the parameters that require
    no gradient: an optimizer state that no step changes while they stay
    frozen (Adam's moments of a base trained before it was frozen)."""
    frozen = []
    for optimizer in accelerator._optimizers:
        params = [param for group in optimizer.param_groups for param in group['params']]
        frozen.append({index for index, param in enumerate(params) if not param.requires_grad})
    return frozen


def load_sharded_models(accelerator: Accelerator, models: Mapping[str, torch.nn.Module],
                        folder: str | os.PathLike, files: Sequence[tuple[str, str]]) -> None:
    """Load the model files of FSDP checkpoint ``folder`` into the prepared
    ``models`` (by module name), as ``Accelerator.load_state`` loads its
    models, without the optimizers, schedulers or random states; every rank
    calls it. ``files``: ``(module name, file name)``, accelerate's names
    (``pytorch_model_fsdp_0``, ``pytorch_model_fsdp.bin``), whose index is
    the model's."""
    for name, file in files:
        match = _FSDP_MODEL_FILE.match(file)
        if match is None:
            raise ValueError(f"{os.path.join(folder, file)} is no FSDP model file of accelerate's")
        load_fsdp_model(accelerator.state.fsdp_plugin, accelerator, models[name],
                        os.fspath(folder), int(match.group(1) or 0))


def accumulation_step(accelerator: Accelerator) -> int:
    """The gradient-accumulation step counter, which ``save_state`` writes
    into each rank's random-state file: a rank without that file (resuming
    on more processes) keeps its own count when the state is loaded."""
    return accelerator.step


def set_accumulation_step(accelerator: Accelerator, step: int) -> None:
    accelerator.step = step


def accumulation_steps(accelerator: Accelerator) -> int:
    return accelerator.gradient_accumulation_steps


def gradients_applied(accelerator: Accelerator) -> bool:
    """Whether the batch just trained ended with an optimizer step (with
    gradient accumulation, only every n-th batch and the last one does)."""
    return accelerator.sync_gradients


def base_loader(loader: DataLoader) -> DataLoader:
    """The torch ``DataLoader`` that a loader prepared by accelerate iterates."""
    return getattr(loader, 'base_dataloader', loader)


def batch_sampler(loader: DataLoader) -> Any:
    """The batch sampler that the torch loader under ``loader`` iterates."""
    return base_loader(loader).batch_sampler


def set_batch_sampler(loader: DataLoader, sampler: Any) -> None:
    """Give the torch loader under ``loader`` another batch sampler.

    torch's ``DataLoader`` refuses a new batch sampler once built; it is set
    past that check because the loader skorch iterates is built once per
    ``fit`` (``accelerate.skip_first_batches`` would build a new one, which
    skorch would not iterate).
    """
    object.__setattr__(base_loader(loader), 'batch_sampler', sampler)


def read_and_drop_first_batches_once(loader: DataLoader, count: int) -> Callable[[], None]:
    """Make the next pass over ``loader`` read its first ``count`` batches
    and drop them (accelerate's ``skip_batches``: each batch is read as
    usual, by the workers that would have read it, and not handed out);
    return the function that ends it after that pass."""
    loader.skip_batches = count

    def undo() -> None:
        loader.skip_batches = 0

    return undo


def leave_loader(loader: DataLoader | None) -> None:
    """Tell accelerate that the pass over ``loader`` under way ends here (as
    its last batch would): a pass left by an exception stays registered in
    accelerate's shared gradient state, as a weak reference that makes every
    ``Accelerator`` of the process unpicklable from then on."""
    if loader is not None and loader in loader.gradient_state.dataloader_references:
        loader.end()


def rows_of_data_in_last_batch(accelerator: Accelerator) -> int | None:
    """How many of the first rows of a batch gathered from every process
    are data, not the samples that accelerate repeated to fill up the last
    batch of a pass; None where all are. ``Accelerator.gather_for_metrics``'
    rule: at the end of the loader under way, if its data set has a length
    that the processes' batches do not divide."""
    remainder = accelerator.gradient_state.remainder
    if accelerator.gradient_state.end_of_dataloader and remainder > 0:
        return remainder
    return None


def at_end_of_loader(loader: DataLoader) -> bool:
    """Whether ``loader`` (prepared by accelerate) yielded its last batch."""
    return bool(getattr(loader, 'end_of_dataloader', False))


def save_state_in_two(
        accelerator: Accelerator, folder: str | os.PathLike, safe_serialization: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Write what ``save_state`` writes except the model and optimizer files.

    Returns the model and optimizer state dicts (live tensors), whose files
    the engine writes later (in the background); together the two write what
    ``Accelerator.save_state`` writes, for one process and DDP. The random
    states written now are those of now.
    """
    check_plain_state(accelerator, 'a save in two steps', async_save=True)
    states = large_states(accelerator, folder)
    save_small_files(accelerator, folder, safe_serialization)
    return states


def large_states(
        accelerator: Accelerator, folder: str | os.PathLike,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The model and optimizer state dicts ``save_state`` writes, after its
    pre-hooks (which may edit the model states)."""
    model_states = [accelerator.get_state_dict(model, unwrap=False)
                    for model in accelerator._models]
    optimizer_states = [optimizer.state_dict() for optimizer in accelerator._optimizers]
    for hook in accelerator._save_model_state_pre_hook.values():
        hook(accelerator._models, model_states, folder)
    return model_states, optimizer_states


def save_small_files(
        accelerator: Accelerator, folder: str | os.PathLike, safe_serialization: bool,
) -> None:
    """``save_state``'s other files: schedulers, samplers, random states,
    custom objects; and its count of saves."""
    each_node = save_on_each_node(accelerator)
    save_accelerator_state(
        folder, [], [], accelerator._schedulers, accelerator._dataloaders,
        accelerator.state.process_index, accelerator.step, accelerator.scaler,
        save_on_each_node=each_node, safe_serialization=safe_serialization)
    for i, obj in enumerate(accelerator._custom_objects):
        save_custom_state(obj, folder, i, save_on_each_node=each_node)
    accelerator.project_configuration.iteration += 1


def writes_large_files(each_node: bool) -> bool:
    """Whether this process writes the model and optimizer files (accelerate's
    ``save`` rule): the main process, or each node's with ``each_node``."""
    state = PartialState()
    return state.is_local_main_process if each_node else state.is_main_process


def save_model_file(state: dict[str, Any], path: str, each_node: bool,
                    safe_serialization: bool) -> None:
    """A model's file as ``save_state`` writes it (safetensors or torch's
    format; on the processes of :func:`writes_large_files` only)."""
    save(state, path, save_on_each_node=each_node, safe_serialization=safe_serialization)
