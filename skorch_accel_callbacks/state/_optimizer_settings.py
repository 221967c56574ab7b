"""The optimizers' settings across a resume: the param-group settings a
checkpoint restores (lr, momentum, ...), and those the net's parameters
give anew, which win over the checkpoint's, with the LR schedulers rebased
on a new lr (:func:`keep_new_base_lrs` states the rule).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    'keep_new_base_lrs',
    'keep_new_optimizer_settings',
    'optimizer_hyperparameters',
    'restore_optimizer_hyperparameters',
]


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
        optimizer_names: Sequence[str],
        names: Collection[str],
        fresh: Sequence[Sequence[dict[str, Any]]],
        saved: Sequence[Sequence[dict[str, Any]]],
) -> None:
    """Make the values that the net's parameters ``names`` give its
    optimizers (``optimizer_names``, in order) now (``fresh``, as
    :func:`optimizer_hyperparameters` read them before the checkpoint was
    loaded) win over those of the checkpoint (``saved``, changed in place):
    ``lr`` sets every optimizer's ``lr``, ``<optimizer>__<key>`` that
    optimizer's ``key``, and ``<optimizer>__param_groups`` all its settings.
    An LR scheduler's view of a new lr follows in :func:`keep_new_base_lrs`."""
    for optimizer, new_groups, old_groups in zip(optimizer_names, fresh, saved, strict=True):
        keys = _new_keys(optimizer, names)
        for new, old in zip(new_groups, old_groups, strict=True):
            taken = new if 'param_groups' in keys else keys & set(new)
            old.update({key: new[key] for key in taken})


def keep_new_base_lrs(optimizers: Mapping[str, torch.optim.Optimizer],
                      callbacks: Iterable[Any], names: Collection[str]) -> None:
    """Make the new lr of the ``optimizers`` (by name) whose ``lr`` the net's
    parameters ``names`` changed (see :func:`keep_new_optimizer_settings`;
    their param groups hold it now) the new base of the LR schedulers
    restored on them (an attribute of one of the ``callbacks``, as skorch's
    ``LRScheduler.lr_scheduler_``), which would else go on from the
    checkpoint's ``base_lrs``.

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
    changed = [optimizer for name, optimizer in optimizers.items()
               if {'lr', 'param_groups'} & _new_keys(name, names)]
    for callback in callbacks:
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
