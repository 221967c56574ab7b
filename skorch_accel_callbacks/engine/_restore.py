"""Read a checkpoint once, into a record that the resume hooks apply.

:func:`choose_checkpoint` finds the checkpoint to resume from, the same on
every rank; :func:`read_checkpoint` checks it against the net (every check
before anything is loaded), loads the model, optimizer and accelerator
state with ``accelerator.load_state`` (the optimizers' files read while the
checkpoint's files were checked: :mod:`._read_ahead`), reads this
package's own files, and returns a :class:`Restored`. On another number of processes
(``on_world_size_change='reseed'``) the record holds random states derived
for this rank (:func:`_reseed`). Nothing here changes the net beyond its
accelerator's state: :class:`~skorch_accel_callbacks.AccelerateLoadInitState`
applies the record, each part in the hook where skorch's loop allows it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from skorch_accel_callbacks._core import accelerate_io, sync
from skorch_accel_callbacks._core.messages import processes
from skorch_accel_callbacks._core.wrapping import named_optimizers, own_registries, state_modules
from skorch_accel_callbacks.engine import _consolidate as consolidate
from skorch_accel_callbacks.engine._read_ahead import OptimizerReadAhead
from skorch_accel_callbacks.errors import CheckpointError
from skorch_accel_callbacks.format import (
    PER_RANK_ITEMS,
    POINTERS,
    batches_into_epoch,
    buffers_name,
    callbacks_names,
    epoch_caches_names,
    frozen_parts_of,
    history_name,
    is_checkpoint_name,
    kind_of,
    per_rank_of,
    position_name,
    rank_state_name,
    read_manifest,
    read_naming_fault,
    stopped_early,
)
from skorch_accel_callbacks.state import (
    EpochStart,
    capture_rng,
    check_compatible,
    check_epoch_settings,
    check_rank_files,
    check_same_data,
    check_same_params,
    check_world_size,
    data_fingerprint,
    derived_rank_state,
    derived_rng,
    epoch_settings,
    keep_new_optimizer_settings,
    load_buffers,
    load_callback_states,
    load_epoch_caches,
    load_history,
    load_position,
    load_rank_state,
    make_room_for_group_settings,
    model_layout,
    optimizer_hyperparameters,
    optimizer_layout,
    optimizer_steps,
    reseed_origin,
    restore_frozen,
    restore_optimizer_hyperparameters,
    shard_layout,
    training_params,
)
from skorch_accel_callbacks.storage import CheckpointStorage, is_committer

__all__ = ['Chosen', 'InsideEpoch', 'ResumeChecks', 'Restored', 'choose_checkpoint',
           'load_best_models',
           'read_checkpoint']


@dataclass(frozen=True)
class ResumeChecks:
    """What a resume refuses (see ``AccelerateLoadInitState``)."""

    #: refuse other training data
    data: bool = True
    #: refuse other hyper-parameters: True, False or the names allowed to differ
    params: bool | tuple[str, ...] = True
    #: derive new random states on another number of processes, instead of refusing
    reseed: bool = False
    #: the checkpoints a refusal may advise instead (a CheckpointStorage)
    storage: Any = None


@dataclass(frozen=True)
class InsideEpoch:
    """Where inside its epoch a checkpoint was taken, for this rank."""

    #: training batches of the epoch that this rank skips
    batches: int
    #: the random states the epoch began with, which draw its order again
    start: EpochStart
    #: the epoch's caches (scores of its training batches so far)
    caches: dict
    #: give the random states of the saved batch back at the first batch
    #: (not when they were derived anew: the epoch's draws go on from its start)
    rng_at_batch: bool = True
    #: the random states before the fetches the saved run had made ahead of
    #: training, in its process
    read_ahead: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Restored:
    """A checkpoint as read for this rank, before it is applied."""

    #: the checkpoint folder
    path: str
    #: its manifest
    manifest: dict
    history: Any
    #: the callbacks' states, by callback name
    callbacks: dict
    #: this process's random states, as saved
    rng: dict
    #: the training loader's shuffling state (None on a rank that read none)
    rank_state: dict | None
    #: the optimizers' settings, as saved (or allowed to change)
    hyperparameters: list
    #: where inside an epoch it was taken, or None at an epoch's end
    inside: InsideEpoch | None
    #: optimizer steps taken when it was saved
    step: int
    #: the number of processes that wrote it, if another than now
    reseeded_from: int | None = None
    #: the states stored per rank (the manifest's ``per_rank``: the ranks'
    #: copies differed), which this rank resumed its own copy of ...
    per_rank: frozenset[str] = frozenset()
    #: ... or, on another number of processes, the saved rank whose copy
    #: every rank resumed (0); None when it resumed its own or the one copy
    states_of_rank: int | None = None
    #: the net's parameters and callbacks' settings that differ from the
    #: checkpoint's, as check_params allowed (they take effect)
    changed_params: tuple[str, ...] = ()

    @property
    def epochs_done(self) -> int:
        """Complete epochs (the history's last row is the epoch under way, if any)."""
        return len(self.history) - (1 if self.inside else 0)

    @property
    def stopped_early(self) -> bool:
        """A callback stopped its training: resuming it trains nothing."""
        return stopped_early(self.manifest)


@dataclass(frozen=True)
class Chosen:
    """The checkpoint to resume from, as this process knows it."""

    path: str
    #: its manifest, on a process that read it to choose (None elsewhere)
    manifest: dict | None = None
    #: its optimizers' files, read while it was checked to be chosen (where
    #: asked for; on a process that did not check it, the folder it
    #: expected: taken only if it is this one)
    read_ahead: OptimizerReadAhead | None = None


def choose_checkpoint(net: Any, storage: CheckpointStorage, which: str | os.PathLike, *,
                      read_optimizers: bool = False) -> Chosen | None:
    """The checkpoint to resume from, the same on every rank, or None.

    The committing process(es) look in ``storage``
    (:meth:`~CheckpointStorage.find_checkpoint`); rank 0's choice is sent
    to every rank. With ``read_optimizers``, a process that checks a
    checkpoint reads its optimizers' files meanwhile
    (:class:`~skorch_accel_callbacks.engine._read_ahead.OptimizerReadAhead`),
    for :func:`read_checkpoint`, and a process that waits for the choice
    reads those of the folder that would be checked first
    (:meth:`~CheckpointStorage.folder_to_check`). Raises
    :class:`CheckpointError` when committers of ``save_on_each_node`` would
    choose different ones.
    """
    committer = is_committer(net)
    found = read_ahead = None
    if read_optimizers:
        with own_registries(net):  # the files are numbered among the net's own
            read_ahead = OptimizerReadAhead(net.accelerator)
        if not committer:
            _read_expected_choice(read_ahead, storage, which)
    with sync.agree(net, f"finding a checkpoint in {storage.dirname}"):
        if committer:
            found = storage.find_checkpoint(
                which, read_ahead=None if read_ahead is None else read_ahead.begin)
    name = None if found is None else CheckpointStorage.name_of(found.path)
    chosen = sync.broadcast(net, name)
    with sync.agree(net, "choosing the checkpoint to resume from"):
        if committer and name != chosen:
            raise CheckpointError(
                f"rank {sync.process_index(net)} would resume from {found.path}, but "
                f"rank 0 from {chosen}: the nodes' checkpoint folders differ")
    if chosen is None:
        return None
    if found is not None:
        return Chosen(found.path, found.manifest, read_ahead)
    if which in POINTERS or is_checkpoint_name(os.fspath(which)):
        return Chosen(storage.path(chosen), read_ahead=read_ahead)
    return Chosen(os.fspath(which), read_ahead=read_ahead)


def _read_expected_choice(read_ahead: OptimizerReadAhead, storage: CheckpointStorage,
                          which: str | os.PathLike) -> None:
    """Begin to read the optimizers' files of the folder the committer will
    most likely choose, while it checks its files: a rank that read them
    only once the choice reached it would add that read to the check's
    time (the choice decides whether the read is taken, and nothing is
    applied before it)."""
    try:
        folder = storage.folder_to_check(which)
    except (OSError, ValueError):  # the committer's search reports it to every rank
        return
    if folder is not None:
        read_ahead.begin(folder)


def load_best_models(net: Any, storage: CheckpointStorage) -> str | None:
    """Load the model(s) of the checkpoint of ``storage`` marked best into
    ``net`` on every rank (its modules and criteria with parameters; not
    the optimizers, the history nor the random states): the path loaded,
    or None where no checkpoint is marked best."""
    marked = sync.broadcast(net, storage.pointed('best') if is_committer(net) else None)
    if marked is None:
        return None
    chosen = choose_checkpoint(net, storage, 'best')
    manifest = chosen.manifest or read_manifest(chosen.path)
    files = consolidate.model_files(manifest, chosen.path)
    modules = state_modules(net)
    with sync.agree(net, f"loading the best checkpoint's model(s), {chosen.path}"):
        if accelerate_io.is_fsdp2(net.accelerator):
            accelerate_io.load_sharded_models(net.accelerator, modules, chosen.path, files)
        else:
            for name, file in files:
                modules[name].load_state_dict(
                    consolidate.read_checkpoint_model(chosen.path, manifest, file))
    return chosen.path


def read_checkpoint(net: Any, chosen: Chosen, checks: ResumeChecks, X: Any = None,
                    y: Any = None) -> Restored:
    """Check ``chosen`` against ``net`` and the data ``X``, ``y``, load its
    accelerator state into the net's accelerator, and read the rest for
    this rank; on every rank, raising on every rank if one fails.

    Raises :class:`CheckpointError` naming what differs, or the file that
    could not be loaded; :class:`CorruptCheckpointError` naming a damaged
    file.
    """
    rank, path = sync.process_index(net), chosen.path
    read_ahead = chosen.read_ahead
    with sync.agree(net, f"loading checkpoint {path}"), own_registries(net):
        if chosen.manifest is not None:
            saved = chosen.manifest
        else:
            if read_ahead is None or not read_ahead.reading(path):
                # checked here, not where it was chosen: read ahead meanwhile
                read_ahead = OptimizerReadAhead(net.accelerator)
                read_ahead.begin(path)
            saved = read_manifest(path)
        changed = check_world_size(saved, sync.num_processes(net), path, checks.reseed)
        check_compatible(saved, path, models=model_layout(net),
                         optimizers=optimizer_layout(net),
                         shards=shard_layout(net.accelerator))
        if checks.data:
            check_same_data(saved, data_fingerprint(X, y), path)
        changed_params = check_same_params(saved, training_params(net), path, checks.params,
                                           callbacks=dict(net.callbacks_))
        # the number of training rows is checked when the first epoch begins
        check_epoch_settings(saved, epoch_settings(net), path, checks.storage)
        # on another number of processes the new ranks' random states
        # derive from rank 0's: the other saved ranks' files are not read
        reads_own_rank = not changed or rank == 0
        if reads_own_rank:
            check_rank_files(path, saved, rank)
        hyperparameters = _load_accelerator_state(
            net, path, saved, changed_params,
            partial(read_ahead.take, path) if read_ahead is not None
            and read_ahead.reading(path) else None)
        rng = capture_rng()
        history, callbacks = _read_rank_states(net, path, saved, rank if reads_own_rank
                                               else None)
        rank_state = None
        if reads_own_rank:
            rank_state = _read_own(path, rank_state_name(rank),
                                   lambda folder: load_rank_state(folder, rank))
        inside = None
        if batches_into_epoch(saved) and reads_own_rank:
            inside = _read_position(path, rank, with_caches=not changed)
    restored = Restored(path, saved, history, callbacks, rng, rank_state, hyperparameters,
                        inside, _saved_step(net, saved, history),
                        per_rank=per_rank_of(saved),
                        changed_params=tuple(changed_params))
    return _reseed(net, restored) if changed else restored


def _read_rank_states(net: Any, path: str, manifest: dict,
                      rank: int | None) -> tuple[Any, dict | None]:
    """The history and callbacks' states of ``path`` for ``rank``: the copy
    that every rank shares, or of what is stored per rank the rank's own
    (None for ``rank`` None: a new rank, which rank 0's reach in
    :func:`_reseed`); the rank's own buffers are put back into the models
    (``load_state`` gave every rank the checkpoint's one copy)."""
    per_rank = per_rank_of(manifest)
    if 'buffers' in per_rank and rank is not None:
        _read_own(path, buffers_name(rank),
                  lambda folder: accelerate_io.set_fsdp2_buffers(
                      net.accelerator, load_buffers(folder, rank)))

    def copy_of(item: str) -> int | None:
        return rank if item in per_rank else None

    history = callbacks = None
    if 'history' not in per_rank or rank is not None:
        own = copy_of('history')
        history = _read_own(path, history_name(own),
                            lambda folder: load_history(folder, own))
    if 'callbacks' not in per_rank or rank is not None:
        own = copy_of('callbacks')
        callbacks = _read_own(path, callbacks_names(own),
                              lambda folder: load_callback_states(folder, own))
    return history, callbacks


def _load_accelerator_state(net: Any, path: str, manifest: dict, changed_params: Any,
                            optimizer_states: Callable[[], list | None] | None) -> list:
    """``accelerator.load_state(path)``, the optimizers loading, after
    everything else, what ``optimizer_states`` returns where they were
    read ahead (:func:`accelerate_io.load_state`); the optimizers'
    settings to restore (the new values of the parameters allowed to change
    take effect)."""
    # load_state fills these objects: they are read before and after it
    optimizers = named_optimizers(net)
    fresh = optimizer_hyperparameters(optimizers.values())
    make_room_for_group_settings(net.accelerator, manifest)
    # before the optimizers' state: under FSDP2 accelerate loads it with
    # torch.distributed.checkpoint, planned after the state a fresh
    # optimizer makes for every parameter that trains (a step of zero
    # gradients), which for a frozen one the checkpoint lacks
    restore_frozen(state_modules(net), manifest)
    read_naming_fault(_model_and_optimizer_files(path),
                      lambda: accelerate_io.load_state(net.accelerator, path,
                                                       frozen_parts_of(manifest),
                                                       optimizer_states),
                      error=CheckpointError, failed='could not be loaded', fallback=path)
    saved = optimizer_hyperparameters(optimizers.values())
    if accelerate_io.is_fsdp2(net.accelerator):
        # from a full state dict rank 0 alone read the optimizers: the
        # settings that a fresh optimizer lacks (an LR scheduler's
        # initial_lr) reach the other ranks from it
        saved = sync.broadcast(net, saved)
        restore_optimizer_hyperparameters(optimizers.values(), saved)
    keep_new_optimizer_settings(list(optimizers), changed_params, fresh, saved)
    return saved


def _model_and_optimizer_files(folder: str) -> list[str]:
    """The files of ``folder`` that ``load_state`` may have read."""
    return [os.path.join(folder, name) for name in sorted(os.listdir(folder))
            if kind_of(name) in ('safetensors', 'torch')]


def _read_position(path: str, rank: int, with_caches: bool) -> InsideEpoch:
    names = [position_name(rank)]
    if with_caches:
        names += list(epoch_caches_names(rank))

    def load(folder: str) -> InsideEpoch:
        position = load_position(folder, rank)
        caches = load_epoch_caches(folder, rank) if with_caches else {}
        return InsideEpoch(position.batches, position.start, caches,
                           read_ahead=position.read_ahead)

    return _read_own(path, names, load)


def _read_own(folder: str, names: str | list[str] | tuple[str, ...],
              load: Callable[[str], Any]) -> Any:
    """``load(folder)`` for this package's own files ``names``; an error names
    the file (JSON and safetensors readers do not always say which)."""
    names = (names,) if isinstance(names, str) else names
    return read_naming_fault([os.path.join(folder, name) for name in names],
                             lambda: load(folder))


def _saved_step(net: Any, saved: dict, history: Any) -> int:
    position = saved.get('position')
    if position is None:  # format 2 recorded no steps: count them
        return optimizer_steps(
            history, accelerate_io.accumulation_steps(net.accelerator))
    return position['step']


_ITEMS = {'history': 'history', 'callbacks': "callbacks' states", 'buffers': 'module buffers'}


def _describe_items(items: frozenset[str]) -> str:
    return ', '.join(_ITEMS[item] for item in PER_RANK_ITEMS if item in items)


def _states_of_rank_0(net: Any, restored: Restored) -> Restored:
    """``restored`` with saved rank 0's history, callbacks' states and
    buffers, of those stored per rank, on every rank (which rank 0 alone
    read: on another number of processes a new rank has no copy of its own)."""
    with sync.agree(net, f"reading rank 0's states of {restored.path}"), own_registries(net):
        buffers = None
        if 'buffers' in restored.per_rank and sync.is_main_process(net):
            buffers = accelerate_io.fsdp2_buffers(net.accelerator)
    history, callbacks, buffers = sync.broadcast(
        net, (restored.history, restored.callbacks, buffers))
    with sync.agree(net, f"giving every rank rank 0's buffers of {restored.path}"), \
            own_registries(net):
        if buffers is not None and not sync.is_main_process(net):
            accelerate_io.set_fsdp2_buffers(net.accelerator, buffers)
    return replace(restored, history=history, callbacks=callbacks, states_of_rank=0)


def _reseed(net: Any, restored: Restored) -> Restored:
    """``restored`` for a run on another number of processes than wrote it:
    this rank's random state, loader state and place in the epoch derived
    from the saved rank 0's and the new number of processes, so that every
    resume of it on that many processes draws the same numbers."""
    world_size = sync.num_processes(net)
    saved_size = restored.manifest['world_size']
    rank_state, inside = restored.rank_state, restored.inside
    origin, iteration, step, position = sync.broadcast(net, (
        reseed_origin(restored.rng, rank_state),
        rank_state['loader_iteration'],
        accelerate_io.accumulation_step(net.accelerator),
        None if inside is None else (inside.batches, inside.start.iteration),
    ) if rank_state is not None else None)
    accelerate_io.set_accumulation_step(net.accelerator, step)
    rng = derived_rng(origin, world_size, sync.process_index(net))
    rank_state = derived_rank_state(origin, world_size, iteration)
    message = (
        f"{restored.path} was written by {processes(saved_size)}, this run has "
        f"{world_size}: the model, optimizer, schedulers, history and callbacks "
        "are resumed exactly, but every rank's random state and data order are "
        "derived anew (on_world_size_change='reseed') and a step now "
        f"averages the batches of {world_size} process(es): the run goes on "
        "statistically, not bitwise, as the uninterrupted one would have")
    if restored.per_rank:
        restored = _states_of_rank_0(net, restored)
        message += (
            f". Its ranks' {_describe_items(restored.per_rank)} differed (each rank "
            "logs its own losses): every rank resumes saved rank 0's")
    if position is not None:
        batches, start_iteration = position
        # as many rows of the epoch as the saved run had trained, in the
        # new order: some rows of the epoch are trained twice, others not
        skipped = batches * saved_size // world_size
        message += (
            f". It was taken inside an epoch, after {batches} batches on each of "
            f"{processes(saved_size)}: each process skips {skipped} "
            "batches of that epoch in the new order, and scores collected on the "
            "epoch's training batches (EpochScoring on_train) cover the rest only")
        start = EpochStart(rng, rank_state['generator'], start_iteration)
        inside = InsideEpoch(skipped, start, {}, rng_at_batch=False)
    if sync.is_main_process(net):
        warnings.warn(message, UserWarning, stacklevel=4)
    return replace(restored, rng=rng, rank_state=rank_state, inside=inside,
                   reseeded_from=saved_size)
