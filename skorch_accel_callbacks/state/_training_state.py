"""What a resume needs beside ``accelerator.save_state``, one function per artefact.

- the skorch history (JSON);
- the state of the net's callbacks by name (JSON, tensors in safetensors);
- under FSDP2, the models' buffers (safetensors), which FSDP2 does not
  synchronise across ranks and its sharded checkpoint holds once;
- per rank: the training loader's shuffling generator and epoch counter
  (:func:`~skorch_accel_callbacks.state._rng_state.loader_state`), which
  accelerate creates when the loader is prepared and does not save, and the
  callbacks' scratch space of the epoch under way.

The callbacks' states and caches are pairs of JSON and safetensors files
(:mod:`~skorch_accel_callbacks.state._json_tensors`). Under skorch's
``AccelerateMixin`` every rank logs its own losses, so the history, the
callbacks' states and the buffers exist per rank: :func:`encode_rank_states`
gives this rank's as bytes, the ranks compare their digests
(:func:`per_rank_items`), and :func:`write_rank_states` writes one copy of
what every rank holds alike (the files of before; the buffers then stay in
accelerate's checkpoint) and every rank's own of the rest. Nothing here is pickled, so
loading executes no code. The files are written into a checkpoint's partial
folder, which nobody reads before it is committed, and the commit flushes
every file of the folder to disk: so they are written plainly, without a
temporary name and a flush of their own each.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file
from skorch.callbacks import (
    BatchScoring,
    Callback,
    EpochScoring,
    EpochTimer,
    GradientNormClipping,
    LRScheduler,
    PassthroughScoring,
    PrintLog,
    ProgressBar,
)
from skorch.history import History

from skorch_accel_callbacks._core import accelerate_io, skorch_io
from skorch_accel_callbacks.format import (
    PER_RANK_ITEMS,
    buffers_name,
    callbacks_names,
    epoch_caches_names,
    history_name,
    per_rank_files,
    rank_state_name,
)
from skorch_accel_callbacks.state._json_tensors import (
    Encode,
    encode_pair,
    read_pair,
    write_bytes,
    write_pair,
)
from skorch_accel_callbacks.state._rng_state import loader_state

if TYPE_CHECKING:
    from skorch import NeuralNet
    from torch.utils.data import DataLoader

__all__ = [
    'keep_new_base_lrs',
    'keep_new_optimizer_settings',
    'epoch_completed',
    'optimizer_steps',
    'find_train_loader',
    'optimizer_hyperparameters',
    'restore_optimizer_hyperparameters',
    'RankStates',
    'encode_rank_states',
    'per_rank_items',
    'write_rank_states',
    'load_history',
    'encode_callback_states',
    'load_callback_states',
    'load_buffers',
    'apply_callback_states',
    'save_epoch_caches',
    'load_epoch_caches',
    'apply_epoch_caches',
    'unknown_batch_state',
    'save_rank_state',
    'load_rank_state',
]

# Fitted attributes that are scratch space of one epoch, not state: saving
# them would only cost disk (they are reset when the next epoch begins).
_TRANSIENT = {
    EpochScoring: ('y_trues_', 'y_preds_'),
}
# Fitted attributes that hold a wall-clock time: saved as the seconds since
# then and given back as that long before the resume, so that a resumed
# epoch's ``dur`` counts the time spent training, not the time the job was down.
_CLOCKS = {
    EpochTimer: ('epoch_start_time_',),
}
# Callbacks with nothing to resume: restoring PrintLog would only suppress
# the table header of the resumed run.
_SKIPPED = (PrintLog,)
# key under which a callback's own state_dict() is stored
_OWN_STATE = '<state_dict>'


# ---------------------------------------------------------------- history

def epoch_completed(net: NeuralNet) -> bool:
    """Whether the last epoch of the history ran to its end (skorch records
    ``train_loss`` when an epoch's training batches are all done)."""
    return bool(net.history) and 'train_loss' in net.history[-1]


def optimizer_steps(history: Iterable[Mapping[str, Any]], accumulation_steps: int) -> int:
    """The optimizer steps of the complete epochs of ``history``, with a
    step every ``accumulation_steps`` batches and at each epoch's last."""
    return sum(math.ceil(row['train_batch_count'] / accumulation_steps)
               for row in history if 'train_batch_count' in row)


def _encode_history(net: NeuralNet) -> bytes:
    # as History.to_file writes it
    return json.dumps(net.history.to_list()).encode('utf-8')


def load_history(folder: str | os.PathLike, rank: int | None = None) -> History:
    """The history of ``folder``: the one that every rank shares (``rank``
    None), or rank ``rank``'s own."""
    return History.from_file(f"{folder}/{history_name(rank)}")


# ---------------------------------------------------------------- optimizer

def optimizer_hyperparameters(
        optimizers: Iterable[torch.optim.Optimizer],
) -> list[list[dict[str, Any]]]:
    """Each optimizer's param-group settings (lr, momentum, ...) without the params."""
    return [[{key: value for key, value in group.items() if key != 'params'}
             for group in optimizer.param_groups] for optimizer in optimizers]


def _new_keys(optimizer: str, names: Collection[str]) -> set[str]:
    """The settings of the optimizer ``optimizer`` that the net's parameters
    ``names`` decide: ``lr`` every optimizer's ``lr``, ``<optimizer>__<key>``
    its ``key``, ``<optimizer>__param_groups`` all of them."""
    keys = {'lr'} if 'lr' in names else set()
    return keys | {name[len(optimizer) + 2:] for name in names
                   if name.startswith(optimizer + '__')}


def keep_new_optimizer_settings(
        net: NeuralNet,
        names: Collection[str],
        fresh: Sequence[Sequence[dict[str, Any]]],
        saved: Sequence[Sequence[dict[str, Any]]],
) -> None:
    """Make the values that the net's parameters ``names`` give its
    optimizers now (``fresh``, as :func:`optimizer_hyperparameters` read
    them before the checkpoint was loaded) win over those of the checkpoint
    (``saved``, changed in place): ``lr`` sets every optimizer's ``lr``,
    ``<optimizer>__<key>`` that optimizer's ``key``, and
    ``<optimizer>__param_groups`` all its settings. An LR scheduler's view
    of a new lr follows in :func:`keep_new_base_lrs`."""
    present = [name for name in skorch_io.optimizer_names(net)
               if getattr(net, name + '_', None) is not None]
    for optimizer, new_groups, old_groups in zip(present, fresh, saved, strict=True):
        keys = _new_keys(optimizer, names)
        for new, old in zip(new_groups, old_groups, strict=True):
            taken = new if 'param_groups' in keys else keys & set(new)
            old.update({key: new[key] for key in taken})


def keep_new_base_lrs(net: NeuralNet, names: Collection[str]) -> None:
    """Make the new lr of the optimizers whose ``lr`` the net's parameters
    ``names`` changed (see :func:`keep_new_optimizer_settings`; their param
    groups hold it now) the new base of the LR schedulers restored on them
    (an attribute of a callback, as skorch's ``LRScheduler.lr_scheduler_``),
    which would else go on from the checkpoint's ``base_lrs``.

    The rule: the new lr replaces the base lr, and the schedule keeps its
    position. The scheduler's ``base_lrs`` and each group's
    ``initial_lr`` become the new lr; the lr the batches run at until the
    scheduler's next step (and that ``get_last_lr()``, and so the history's
    ``event_lr``, says) is the schedule's value at its position from the new
    base: ``new_lr * lr_lambda(last_epoch)`` for ``LambdaLR``, the lr the
    schedule had reached times ``new_lr / old base lr`` for the others (the
    same for schedules proportional to their base lr: ``StepLR``,
    ``MultiStepLR``, ``ExponentialLR``, ``MultiplicativeLR``,
    ``CosineAnnealingLR`` with ``eta_min=0``...). ``ReduceLROnPlateau`` keeps
    no base lr: the new lr is the lr from now on, reduced further on
    plateaus."""
    present = [name for name in skorch_io.optimizer_names(net)
               if getattr(net, name + '_', None) is not None]
    changed = [getattr(net, name + '_') for name in present
               if {'lr', 'param_groups'} & _new_keys(name, names)]
    for _, callback in net.callbacks_:
        for value in list(vars(callback).values()):
            if isinstance(value, torch.optim.lr_scheduler.LRScheduler) and any(
                    value.optimizer is optimizer for optimizer in changed):
                _rebase(value)


def _rebased(last: float, base: float, before: float) -> float:
    """The lr ``last`` that a schedule from the base lr ``before`` had
    reached, from the base lr ``base`` instead."""
    if base == before:
        return last
    return last * base / before if before else base


def _rebase(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """See :func:`keep_new_base_lrs`: the scheduler's optimizer holds the new lrs."""
    groups = scheduler.optimizer.param_groups
    new = [group['lr'] for group in groups]
    state = scheduler.state_dict()
    old = getattr(scheduler, 'base_lrs', None)
    if old is None:
        lrs = new
    elif isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        lrs = [base * lr_lambda(scheduler.last_epoch)
               for base, lr_lambda in zip(new, scheduler.lr_lambdas, strict=True)]
    else:
        lrs = [_rebased(last, base, before)
               for last, base, before in zip(scheduler.get_last_lr(), new, old, strict=True)]
    if old is not None:
        state['base_lrs'] = new
    # what get_last_lr() says, and skorch's LRScheduler records
    state['_last_lr'] = lrs
    scheduler.load_state_dict(state)
    for group, base, lr in zip(groups, new, lrs, strict=True):
        group['lr'] = lr
        if 'initial_lr' in group:
            group['initial_lr'] = base


def restore_optimizer_hyperparameters(
        optimizers: Iterable[torch.optim.Optimizer],
        saved: Sequence[Sequence[Mapping[str, Any]]],
) -> None:
    """Undo what was done to the loaded settings since, e.g. by skorch's
    LRScheduler, which steps a new scheduler (changing the lr) when it is
    created at the start of training."""
    for optimizer, groups in zip(optimizers, saved, strict=True):
        for group, settings in zip(optimizer.param_groups, groups, strict=True):
            group.update(settings)


# ---------------------------------------------------------------- loader

def find_train_loader(net: NeuralNet, dataset_train: Any) -> DataLoader | None:
    """The loader that accelerate prepared for ``dataset_train``, if any."""
    accelerator = getattr(net, 'accelerator', None)
    if accelerator is None or dataset_train is None:
        return None
    for loader in reversed(accelerate_io.dataloaders(accelerator)):
        if getattr(loader, 'dataset', None) is dataset_train:
            return loader
    return None


def save_rank_state(folder: str | os.PathLike, rank: int, loader: DataLoader | None,
                    workers_drew: bool = False) -> None:
    """Save the shuffling state of this rank's training loader, and whether
    its worker processes drew random numbers in this fit.

    With more than one process accelerate gives the sampler a generator of
    its own, seeded when the loader is prepared; ``save_state`` writes no
    file for it with map-style data sets, nor for the generators of the
    loader and of a user's sampler.
    """
    state = loader_state(loader)
    tensors = {'generator': state['generator']} if 'generator' in state else {}
    tensors.update({f'generators.{path}': generator
                    for path, generator in state['generators'].items()})
    metadata = {'loader_iteration': str(state['loader_iteration']),
                'workers_drew': str(int(workers_drew))}
    # safetensors refuses an empty file
    tensors.setdefault('_', torch.zeros(0))
    save_file(tensors, f"{folder}/{rank_state_name(rank)}", metadata=metadata)


def load_rank_state(folder: str | os.PathLike, rank: int) -> dict[str, Any]:
    """What :func:`save_rank_state` saved: the loader state
    (:func:`~skorch_accel_callbacks.state._rng_state.loader_state`'s form)
    and ``'workers_drew'``."""
    path = f"{folder}/{rank_state_name(rank)}"
    with safe_open(path, framework='pt') as f:
        metadata = f.metadata() or {}
        state = {'loader_iteration': int(metadata.get('loader_iteration', 0)),
                 'workers_drew': bool(int(metadata.get('workers_drew', 0))),
                 'generators': {key.removeprefix('generators.'): f.get_tensor(key)
                                for key in f.keys() if key.startswith('generators.')}}
        if 'generator' in f.keys():
            state['generator'] = f.get_tensor('generator')
    return state


# ---------------------------------------------------------------- callbacks

def _is_configuration(value: Any) -> bool:
    # classes and functions are set up by the user's code, not learned
    return isinstance(value, type) or (
        callable(value) and not hasattr(value, 'state_dict'))


def _callback_state(callback: Callback) -> dict[str, dict[str, Any]]:
    """The attributes of a callback that a resumed run needs."""
    if hasattr(callback, 'state_dict') and hasattr(callback, 'load_state_dict'):
        return {_OWN_STATE: {'state_dict': callback.state_dict()}}
    transient, clocks = (), ()
    for cls, names in _TRANSIENT.items():
        if isinstance(callback, cls):
            transient = names
    for cls, names in _CLOCKS.items():
        if isinstance(callback, cls):
            clocks = names
    state = {}
    for attr, value in vars(callback).items():
        if not attr.endswith('_') or attr.startswith('_') or attr in transient:
            continue
        if _is_configuration(value):
            continue
        if attr in clocks and value is not None:
            state[attr] = {'elapsed': time.time() - value}
        elif hasattr(value, 'state_dict') and not isinstance(value, type):
            state[attr] = {'state_dict': value.state_dict()}
        else:
            state[attr] = {'value': value}
    return state


def encode_callback_states(
        net: NeuralNet, skip: Collection[Callback] = (), warn: bool = True,
) -> tuple[bytes, bytes]:
    """The state of every callback of ``net`` by name, as the bytes of its
    pair of files (:func:`~skorch_accel_callbacks.state._json_tensors.encode_pair`).

    A callback with ``state_dict()``/``load_state_dict()`` methods decides
    itself what is saved; for the others, the fitted attributes (names ending
    in ``_``) are saved, and objects with a ``state_dict`` (such as the
    scheduler of skorch's ``LRScheduler``) through it. An attribute that is
    neither data nor has a ``state_dict`` is left out with a warning.
    """
    def states(encode: Encode) -> dict[str, dict[str, dict[str, Any]]]:
        encoded_states = {}
        for name, callback in net.callbacks_:
            if isinstance(callback, _SKIPPED) or any(callback is s for s in skip):
                continue
            encoded = {}
            for attr, entry in _callback_state(callback).items():
                key = f"{name}/{attr}"
                try:
                    encoded[attr] = {kind: encode(value, key) for kind, value in entry.items()}
                except TypeError as exc:
                    if not warn:
                        continue
                    # the writer, past encode_pair and encode_rank_states
                    warnings.warn(
                        f"callback {name!r}: attribute {attr!r} of type {exc} cannot "
                        "be saved without pickle and is not restored on resume; give "
                        "the callback state_dict()/load_state_dict() methods to "
                        "control what is saved", UserWarning, stacklevel=5)
            encoded_states[name] = encoded
        return encoded_states

    return encode_pair(states)


def load_callback_states(folder: str | os.PathLike,
                         rank: int | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Read the callbacks' states of ``folder`` (the copy that every rank
    shares, or with ``rank`` that rank's own): name -> attr -> entry."""
    json_name, tensors_name = callbacks_names(rank)
    return read_pair(f"{folder}/{json_name}", f"{folder}/{tensors_name}", depth=3)


def apply_callback_states(
        net: NeuralNet, states: Mapping[str, Mapping[str, Mapping[str, Any]]],
        changed: Mapping[str, Collection[str] | None] | None = None,
) -> None:
    """Give the net's callbacks the state they had when it was saved.

    ``changed``: the settings (``get_params`` names) of each callback by name
    that a resume let differ from the checkpoint's
    (:func:`~skorch_accel_callbacks.state._settings.changed_callback_settings`);
    their new values win over the restored state. They are set again after
    the state is loaded, and in a restored object's ``state_dict`` (the
    scheduler of skorch's ``LRScheduler`` holds its ``gamma``,
    ``step_size``...) the keys of their names keep the new object's values,
    and keys it has no more (those of another policy) are dropped. A callback
    whose class changed (None) starts afresh.
    """
    changed = changed or {}
    for name, callback in net.callbacks_:
        attrs = states.get(name)
        new = changed.get(name, ())
        if attrs is None or new is None:
            continue
        kept = {param: value for param, value in callback.get_params(deep=False).items()
                if param in new}
        _apply_state(name, callback, attrs, new)
        for param, value in kept.items():
            setattr(callback, param, value)


def _with_new_settings(fresh: Mapping[str, Any], saved: Mapping[str, Any],
                       new: Collection[str]) -> Mapping[str, Any]:
    """``saved``, a state_dict, with the keys ``new`` of ``fresh`` (the
    state_dict of the object it is loaded into), and without the keys that
    ``fresh`` lacks; unchanged without ``new``."""
    if not new:
        return saved
    state = {key: value for key, value in saved.items() if key in fresh}
    state.update({key: fresh[key] for key in new if key in fresh})
    return state


def _apply_state(name: str, callback: Callback, attrs: Mapping[str, Mapping[str, Any]],
                 new: Collection[str]) -> None:
    if _OWN_STATE in attrs:
        callback.load_state_dict(attrs[_OWN_STATE]['state_dict'])
        return
    for attr, entry in attrs.items():
        if 'state_dict' in entry:
            target = getattr(callback, attr, None)
            if target is None or not hasattr(target, 'load_state_dict'):
                raise ValueError(
                    f"callback {name!r} has no {attr!r} to load the saved "
                    "state into")
            target.load_state_dict(
                _with_new_settings(target.state_dict(), entry['state_dict'], new))
        elif 'elapsed' in entry:
            setattr(callback, attr, time.time() - entry['elapsed'])
        else:
            setattr(callback, attr, entry['value'])


# ---------------------------------------------------------------- per rank

@dataclass(frozen=True)
class RankStates:
    """This rank's states that may differ between ranks, encoded."""

    #: item of :data:`~skorch_accel_callbacks.format._manifest.PER_RANK_ITEMS` -> the
    #: bytes of its files, in the order of their names
    #: (:func:`~skorch_accel_callbacks.format._manifest.per_rank_files`)
    files: dict[str, tuple[bytes, ...]]

    def digests(self) -> dict[str, str]:
        """Item -> a digest of its files' bytes, which the ranks compare."""
        digests = {}
        for item, parts in self.files.items():
            hasher = xxhash.xxh3_128()
            for part in parts:
                # the parts' lengths too: the same bytes split otherwise differ
                hasher.update(len(part).to_bytes(8, 'little'))
                hasher.update(part)
            digests[item] = hasher.hexdigest()
        return digests


def encode_rank_states(net: NeuralNet, warn: bool) -> RankStates:
    """This rank's history, callbacks' states and (under FSDP2) buffers,
    as the bytes that a checkpoint stores of them; ``warn`` of a
    callback's attribute that cannot be saved (on one rank: every rank
    leaves it out)."""
    files = {'history': (_encode_history(net),),
             'callbacks': encode_callback_states(net, warn=warn)}
    buffers = accelerate_io.fsdp2_buffers(net.accelerator)
    if buffers:
        files['buffers'] = (save(buffers),)
    return RankStates(files)


def per_rank_items(digests: Sequence[Mapping[str, str]]) -> list[str]:
    """The items whose copies differ between the ranks (``digests``: every
    rank's :meth:`RankStates.digests`, by rank), in the order of
    :data:`~skorch_accel_callbacks.format._manifest.PER_RANK_ITEMS`."""
    return [item for item in PER_RANK_ITEMS
            if item in digests[0] and len({each[item] for each in digests}) > 1]


def write_rank_states(folder: str | os.PathLike, states: RankStates, rank: int,
                      per_rank: Collection[str], shared: bool) -> None:
    """Write rank ``rank``'s own copy of the items ``per_rank``, and with
    ``shared`` (on the committing process) the one copy of each other item,
    under the names of before. Buffers that every rank holds alike are not
    written: accelerate's checkpoint holds them."""
    for item, parts in states.files.items():
        if item in per_rank:
            names = per_rank_files(item, rank)
        elif shared and item == 'history':
            names = (history_name(),)
        elif shared and item == 'callbacks':
            names = callbacks_names()
        else:
            continue
        for name, data in zip(names, parts, strict=True):
            write_bytes(f"{folder}/{name}", data)


def load_buffers(folder: str | os.PathLike, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s buffers, as :func:`encode_rank_states` saved them."""
    return load_file(f"{folder}/{buffers_name(rank)}")


# ---------------------------------------------------------------- within an epoch

def save_epoch_caches(folder: str | os.PathLike, rank: int, net: NeuralNet) -> None:
    """Save this rank's scratch space of the epoch under way (the
    predictions EpochScoring collects on the training batches), which a
    checkpoint in the middle of an epoch needs: at the epoch's end they are
    scored together."""
    def caches(encode: Encode) -> dict[str, dict[str, Any]]:
        encoded = {}
        for name, callback in net.callbacks_:
            for cls, attrs in _TRANSIENT.items():
                if isinstance(callback, cls):
                    encoded[name] = {attr: encode(getattr(callback, attr, None),
                                                  f"{name}/{attr}")
                                     for attr in attrs}
        return encoded

    json_name, tensors_name = epoch_caches_names(rank)
    write_pair(f"{folder}/{json_name}", f"{folder}/{tensors_name}", caches)


def load_epoch_caches(folder: str | os.PathLike, rank: int) -> dict[str, dict[str, Any]]:
    json_name, tensors_name = epoch_caches_names(rank)
    return read_pair(f"{folder}/{json_name}", f"{folder}/{tensors_name}", depth=2)


def apply_epoch_caches(
        net: NeuralNet,
        caches: Mapping[str, Mapping[str, Any]],
        device: torch.device | str | None = None,
) -> None:
    """Give the callbacks their scratch space of the epoch back; tensors go
    to ``device`` (where the net's predictions are)."""
    def place(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and device is not None:
            return value.to(device)
        if isinstance(value, list):
            return [place(v) for v in value]
        return value

    for name, callback in net.callbacks_:
        for attr, value in caches.get(name, {}).items():
            setattr(callback, attr, place(value))


# skorch's callbacks whose state within an epoch a checkpoint holds: their
# fitted attributes (LRScheduler's batch count and scheduler), EpochScoring's
# caches, the history's batch rows; or that have none (GradientNormClipping:
# its settings only, which the checkpoint records)
_BATCH_STATE_KNOWN = (BatchScoring, EpochScoring, EpochTimer, GradientNormClipping,
                      LRScheduler, PassthroughScoring, PrintLog, ProgressBar)


def unknown_batch_state(net: NeuralNet, own: Iterable[type[Callback]] = ()) -> list[str]:
    """Names of the net's callbacks that act on every batch and whose state
    within an epoch no checkpoint is known to hold: not one of skorch's
    handled above nor ``own``, and without ``state_dict()`` (only their
    fitted attributes, as the main process saved them, come back)."""
    names = []
    for name, callback in net.callbacks_:
        if isinstance(callback, _BATCH_STATE_KNOWN + tuple(own)) or hasattr(
                callback, 'state_dict'):
            continue
        hooks = ('on_batch_begin', 'on_batch_end', 'on_grad_computed')
        if any(getattr(type(callback), hook) is not getattr(Callback, hook) for hook in hooks):
            names.append(name)
    return names
