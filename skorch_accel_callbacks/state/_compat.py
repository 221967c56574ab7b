"""Who can resume a checkpoint: the description of a net a manifest records,
and the checks of a net against a checkpoint's manifest.

:func:`checkpoint_record` describes a net as a checkpoint's manifest records
it (:mod:`~skorch_accel_callbacks.format` writes it): the model layout, the
optimizers, the world size, the package versions, and the settings of
:mod:`~skorch_accel_callbacks.state._settings` (the hyper-parameters that change
training, what the position inside an epoch depends on). The ``check_*``
functions here and there raise :class:`CheckpointError` naming what differs
when a run cannot resume a checkpoint exactly, before it trains.
"""

import functools
import os
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from skorch_accel_callbacks._core import accelerate_io, sync
from skorch_accel_callbacks._core.wrapping import state_modules
from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.format import (
    MANIFEST_NAME,
    PER_RANK_ITEMS,
    CheckpointRecord,
    batches_into_epoch,
    epoch_caches_names,
    load_without_code,
    per_rank_files,
    per_rank_of,
    position_name,
    rank_state_name,
    read_naming_fault,
)
from skorch_accel_callbacks.state import _fsdp_layout as fsdp_layout, _settings as settings

__all__ = [
    'check_compatible',
    'check_rank_files',
    'check_same_data',
    'check_world_size',
    'checkpoint_record',
    'frozen_parameters',
    'model_files',
    'model_layout',
    'optimizer_layout',
    'restore_frozen',
]


@functools.cache  # importlib.metadata reads files; versions do not change
def _package_versions() -> dict[str, str | None]:
    versions = {}
    for name in ('torch', 'accelerate', 'skorch', 'skorch-accel-callbacks'):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def model_layout(net: Any) -> list[list[Any]]:
    """Name, parameter names and shapes of each model, in accelerate's order.

    ``accelerator.save_state`` numbers its model files by the position of a
    model in the accelerator's registry; the names make the order checkable.
    Call it inside :func:`~skorch_accel_callbacks._core.wrapping.own_registries`.
    Raises :class:`CheckpointError` if a module of the net with trainable
    parameters was not prepared by the accelerator.
    """
    return _layout_of(net, state_modules(net))


def _layout_of(net: Any, modules: Mapping[str, torch.nn.Module]) -> list[list[Any]]:
    by_id = {id(module): name for name, module in modules.items()}
    registered = accelerate_io.models(net.accelerator)
    registered_ids = {id(model) for model in registered}
    for name, module in modules.items():
        trainable = any(param.requires_grad for param in module.parameters())
        if trainable and id(module) not in registered_ids:
            raise CheckpointError(
                f"module {name!r} of this net is not prepared by its accelerator, so "
                "accelerator.save_state would not save it: skorch's AccelerateMixin "
                "does not prepare the modules of a second initialize(); use "
                "AccelerateFixesMixin")
    layout = []
    for model in registered:
        shapes = {key: list(value.shape) for key, value in model.state_dict().items()}
        layout.append([by_id[id(model)], shapes])
    return layout


def optimizer_layout(net: Any) -> list[list[Any]]:
    """Class and number of parameters in each param group of each optimizer,
    in accelerate's order."""
    layout = []
    for optimizer in accelerate_io.optimizers(net.accelerator):
        inner = getattr(optimizer, 'optimizer', optimizer)
        layout.append([type(inner).__qualname__,
                       [len(group['params']) for group in inner.param_groups]])
    return layout


def checkpoint_record(net: Any, name: str, best: bool, finished: bool, stopped_early: bool,
                      data: Any, position: dict[str, int], loader: Any = None,
                      per_rank: tuple[str, ...] = ()) -> CheckpointRecord:
    """What the manifest of the checkpoint ``name`` of ``net`` records of it.

    ``finished``: training ended with this checkpoint (``max_epochs``
    reached, or a callback stopped it: ``stopped_early``); ``data``: the
    fingerprint of the training data
    (:func:`~skorch_accel_callbacks.state._fingerprint.data_fingerprint`);
    ``position``: ``{'step': optimizer steps, 'batches': training batches
    of the epoch under way}`` (0 batches at an epoch's end), and
    optionally ``'fit_calls'``: ``[[first epoch, last epoch], ...]`` of each
    ``fit``/``partial_fit`` call since ``initialize``, the last the one it is
    taken in (:func:`~skorch_accel_callbacks.format.fit_calls`); ``loader``: the
    training loader of the epoch (for its number of rows); ``per_rank``: the
    states that each rank stores in files of its own.
    """
    # unwrapping costs a package lookup in accelerate: once a save
    modules = state_modules(net)
    return CheckpointRecord(
        name=name,
        epoch=len(net.history) - (1 if position['batches'] else 0),
        position=position,
        best=bool(best),
        finished=bool(finished),
        stopped_early=bool(stopped_early),
        data=data,
        params=settings.training_params(net),
        epoch_settings=settings.epoch_settings(net, loader),
        world_size=sync.num_processes(net),
        save_on_each_node=accelerate_io.save_on_each_node(net.accelerator),
        models=_layout_of(net, modules),
        frozen=_frozen_of(modules),
        optimizers=optimizer_layout(net),
        versions=_package_versions(),
        fsdp=fsdp_layout.shard_layout(net.accelerator),
        per_rank=tuple(per_rank),
    )


def frozen_parameters(net: Any) -> dict[str, list[str]]:
    """Of each module and criterion of ``net`` by name, its parameters that
    require no gradient: frozen (skorch's ``Freezer``) or built so."""
    return _frozen_of(state_modules(net))


def _frozen_of(modules: Mapping[str, torch.nn.Module]) -> dict[str, list[str]]:
    return {name: sorted(key for key, param in module.named_parameters()
                         if not param.requires_grad)
            for name, module in modules.items()}


def restore_frozen(modules: Mapping[str, torch.nn.Module], manifest: dict[str, Any]) -> None:
    """Freeze the parameters of ``modules`` (a net's modules and criteria by
    name) that the checkpoint of ``manifest`` was saved with frozen
    (:func:`frozen_parameters`) and let the others train: whether a
    parameter trains is training state that skorch's ``Freezer`` sets once,
    at its epoch, which a resume after it never sees again. A manifest from
    before it was recorded changes nothing."""
    saved = manifest.get('frozen')
    if not isinstance(saved, dict):
        return
    for name, module in modules.items():
        if name in saved:
            frozen = set(saved[name])
            for key, param in module.named_parameters():
                param.requires_grad_(key not in frozen)


def model_files(manifest: dict[str, Any], folder: str) -> list[tuple[str, str]]:
    """``(module name, file name)`` of each model file of a checkpoint, in
    accelerate's order: ``[('module', 'model.safetensors'), ...]``.

    Raises :class:`CorruptCheckpointError` naming the file if the manifest
    does not list a model's file.
    """
    path = os.path.join(folder, MANIFEST_NAME)
    models = manifest.get('models')
    if not isinstance(models, list):
        raise CorruptCheckpointError(f"{path} lists no models")
    found = []
    for index, entry in enumerate(models):
        if not (isinstance(entry, list) and entry and isinstance(entry[0], str)):
            raise CorruptCheckpointError(f"{path}: models[{index}] is not [name, shapes]")
        names = [accelerate_io.model_file(index, safe) for safe in (True, False)]
        listed = [name for name in names if name in manifest.get('files', {})]
        if not listed:
            raise CorruptCheckpointError(
                f"{os.path.join(folder, names[0])} is missing: the manifest lists "
                f"model {entry[0]!r} but not its file")
        found.append((entry[0], listed[0]))
    return found


def _layout_differences(saved: list[Any], current: list[Any]) -> list[str]:
    saved_names = [name for name, _ in saved]
    current_names = [name for name, _ in current]
    if saved_names != current_names:
        return [f"models {saved_names} in the checkpoint, {current_names} in the net"]
    problems = []
    for (name, old), (_, new) in zip(saved, current, strict=True):
        for key in sorted(set(old) | set(new)):
            if key not in new:
                problems.append(f"{name}: parameter {key!r} is in the checkpoint, not in the net")
            elif key not in old:
                problems.append(f"{name}: parameter {key!r} is in the net, not in the checkpoint")
            elif old[key] != new[key]:
                problems.append(
                    f"{name}: {key!r} has shape {tuple(old[key])} in the checkpoint, "
                    f"{tuple(new[key])} in the net")
    return problems


def check_same_data(manifest: dict[str, Any], data: Any, path: str) -> None:
    """Raise :class:`CheckpointError` naming the difference if ``data`` (a
    fingerprint) is not the fingerprint of the data ``path`` was trained on."""
    saved = manifest.get('data')
    if saved is None or saved == data:
        return
    differences = _fingerprint_differences(saved, data, '')
    raise CheckpointError(
        f"{path} was trained on other data: " + '; '.join(differences[:3])
        + ". Resuming it would continue another training (in a cross-validation "
        "every fit needs its own dirname); pass check_data=False to "
        "AccelerateLoadInitState to resume on this data on purpose")


def _fingerprint_differences(saved: Any, current: Any, where: str) -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        differences = []
        for key in sorted(set(saved) | set(current)):
            differences += _fingerprint_differences(
                saved.get(key), current.get(key), f"{where}.{key}" if where else key)
        return differences
    if saved != current:
        return [f"{where} is {saved!r} in the checkpoint, {current!r} now"]
    return []


def check_world_size(manifest: dict[str, Any], world_size: int, path: str,
                     reseed: bool) -> bool:
    """Whether ``path`` was written by another number of processes than
    ``world_size``, this run's; raise :class:`CheckpointError` if so unless
    ``reseed``."""
    saved = manifest.get('world_size')
    if saved == world_size:
        return False
    if type(saved) is not int or saved < 1:
        raise CorruptCheckpointError(
            f"{os.path.join(path, MANIFEST_NAME)} has world_size {saved!r}, "
            "not a number of processes")
    if not reseed:
        raise CheckpointError(
            f"{path} was written by {saved} process{'' if saved == 1 else 'es'}, "
            f"this run has {world_size}: "
            "every rank resumes its own random state and data order, so resume "
            "with the same number of processes, or pass "
            "on_world_size_change='reseed' to AccelerateLoadInitState to derive "
            "new ones (the run then continues statistically, not bitwise)")
    return True


def check_compatible(manifest: dict[str, Any], path: str, *, models: list[list[Any]],
                     optimizers: list[list[Any]], shards: dict[str, Any] | None) -> None:
    """Raise :class:`CheckpointError` if a net of ``models``
    (:func:`model_layout`), ``optimizers`` (:func:`optimizer_layout`) and
    FSDP2 ``shards`` (:func:`~skorch_accel_callbacks.state._fsdp_layout.shard_layout`)
    cannot load ``path``."""
    fsdp_layout.check_shards(manifest, shards, path)
    problems = _layout_differences(manifest.get('models', []), models)
    if problems:
        raise CheckpointError(
            f"{path} was saved from another model: " + '; '.join(problems[:5])
            + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ''))
    saved, current = manifest.get('optimizers'), optimizers
    if isinstance(saved, int):  # written by 0.1.0: the number of optimizers
        current = len(current)
    if saved != current:
        raise CheckpointError(
            f"{path} holds the state of the optimizer(s) {_describe_optimizers(saved)}, "
            f"the net has {_describe_optimizers(current)}: resume with the "
            "optimizer(s) the checkpoint was saved with")


def _describe_optimizers(layout: int | list[Any]) -> str:
    if isinstance(layout, int):
        return f"{layout} optimizer(s)"
    return ', '.join(f"{name} ({len(groups)} param group(s) of "
                     f"{'/'.join(map(str, groups))} tensors)" for name, groups in layout)


def check_rank_files(path: str, manifest: dict[str, Any], rank: int) -> None:
    """Check that this rank's own files are there and load without code:
    its random and loader states, its place inside an epoch, and its copy of
    each state the manifest says is stored per rank (``per_rank``).

    Raises :class:`CorruptCheckpointError` naming the file and the rank.
    """
    names = [accelerate_io.rng_file(rank), rank_state_name(rank)]
    if batches_into_epoch(manifest):
        names += [position_name(rank), *epoch_caches_names(rank)]
    per_rank = per_rank_of(manifest)
    for item in PER_RANK_ITEMS:
        if item in per_rank:
            names += per_rank_files(item, rank)
    for name in names:
        if name not in manifest['files']:
            raise CorruptCheckpointError(
                f"{os.path.join(path, name)} is missing: {path} has no state for rank {rank}"
                + (" (its manifest says the ranks' states differ: "
                   f"{', '.join(sorted(per_rank))} per rank)" if per_rank else ''))
    rng_file = os.path.join(path, accelerate_io.rng_file(rank))
    # accelerate's load_state silently skips random states it cannot read
    read_naming_fault([rng_file], lambda: load_without_code(rng_file),
                      failed='cannot be loaded (weights_only)')
