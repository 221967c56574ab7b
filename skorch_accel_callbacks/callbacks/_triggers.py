"""When to save: policy, no I/O.

What depends on the history (the monitor) is evaluated on the main process
and its answer sent to every rank
(:func:`skorch_accel_callbacks._core.sync.run_on_main`), since the ranks'
histories can differ; the rest is the same on every rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from skorch.callbacks import EarlyStopping
from skorch.exceptions import SkorchException

from skorch_accel_callbacks._core import sync

if TYPE_CHECKING:
    from skorch import NeuralNet

__all__ = ['STOPPED_EARLY', 'EpochDecision', 'check_interval', 'check_monitor', 'check_triggers',
           'epoch_decision', 'epoch_due', 'monitor_says', 'step_due', 'stopped_by_callback',
           'time_due']

# the history column in which a callback that ends training on purpose says so
STOPPED_EARLY = 'stopped_early'


def check_monitor(monitor: Any, owner: str) -> None:
    """Raise ``ValueError`` naming ``owner`` if ``monitor`` is not a monitor."""
    if not (monitor is None or isinstance(monitor, str) or callable(monitor)):
        raise ValueError(
            f"{owner}: monitor must be None, a history key or a callable, got {monitor!r}")


def check_interval(value: Any, name: str, owner: str, kind: type) -> None:
    """Raise ``ValueError`` naming ``owner`` and ``name`` unless ``value`` is
    None or a positive number of type ``kind`` (``int`` or a real number)."""
    if value is None:
        return
    if kind is int:
        ok = type(value) is int and value >= 1
        wanted = 'an int >= 1'
    else:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and value > 0 and value == value and value != float('inf'))
        wanted = 'a number of seconds > 0'
    if not ok:
        raise ValueError(f"{owner}: {name} must be None or {wanted}, got {value!r}")


def check_triggers(owner: str, monitor: Any, every_n_epochs: int, every_n_steps: int | None,
                   every_n_seconds: float | None, keep_best: int | None) -> None:
    """Raise ``ValueError`` naming ``owner`` and the argument that is not
    a valid setting of when to save."""
    if type(every_n_epochs) is not int or every_n_epochs < 1:
        raise ValueError(f"{owner}: every_n_epochs must be an int >= 1, got {every_n_epochs!r}")
    check_monitor(monitor, owner)
    check_interval(every_n_steps, 'every_n_steps', owner, int)
    check_interval(every_n_seconds, 'every_n_seconds', owner, float)
    check_interval(keep_best, 'keep_best', owner, int)
    if keep_best is not None and monitor is None:
        raise ValueError(f"{owner}: keep_best keeps the checkpoints that monitor "
                         "marks best; set monitor too")


def step_due(step: int, every_n_steps: int | None) -> bool:
    """Whether optimizer step number ``step`` (counted from the start of
    training, over resumes) is one of every ``every_n_steps``."""
    return every_n_steps is not None and step % every_n_steps == 0


def time_due(seconds_since_save: float, every_n_seconds: float | None) -> bool:
    return every_n_seconds is not None and seconds_since_save >= every_n_seconds


def epoch_due(net: NeuralNet, every_n_epochs: int) -> bool:
    """Whether the epoch that just ended is one of every ``every_n_epochs``
    (counted from the start of training, over resumes)."""
    return len(net.history) % every_n_epochs == 0


class EpochDecision(NamedTuple):
    """Whether to save at the end of an epoch, and whether it is a best one."""

    save: bool
    best: bool


def epoch_decision(net: NeuralNet, every_n_epochs: int, monitor: Any, keep_best: int | None,
                   owner: str) -> EpochDecision:
    """The decision at the end of the epoch just ended, the same on every
    rank: an epoch that is one of every ``every_n_epochs`` is saved if there
    is no ``monitor``, or if the monitor says it is best, or (with
    ``keep_best``) always, marked best when the monitor says so."""
    if not epoch_due(net, every_n_epochs):
        return EpochDecision(False, False)
    if monitor is None:
        return EpochDecision(True, False)
    best = sync.run_on_main(net, lambda: monitor_says(net, monitor, owner),
                            f"evaluating checkpoint monitor {monitor!r}")
    return EpochDecision(best or keep_best is not None, best)


def monitor_says(
        net: NeuralNet, monitor: str | Callable[[NeuralNet], Any] | None, owner: str,
) -> bool:
    """skorch's decision whether to save, from the last epoch of the history.

    ``None`` says yes; a callable is asked with the net; a string is a
    boolean column of the history, such as ``'valid_loss_best'``. As in
    skorch, a monitor ``'X'`` beside a column ``'X_best'`` warns that
    ``'X_best'`` was probably meant (``'X'`` is a number, true in every
    epoch).

    Raises
    ------
    SkorchException
      The column is not in the last epoch of the history.
    """
    if monitor is None:
        return True
    if callable(monitor):
        return bool(monitor(net))
    last = net.history[-1]
    if f"{monitor}_best" in last:
        warnings.warn(
            f"Checkpoint monitor parameter is set to '{monitor}' and the history "
            f"contains '{monitor}_best'. Perhaps you meant to set the parameter "
            f"to '{monitor}_best'", UserWarning)
    if monitor not in last:
        raise SkorchException(
            f"{owner}: monitor {monitor!r} is not in the history of this epoch. "
            "Make sure you have validation data if you use validation scores for "
            "checkpointing.")
    return bool(last[monitor])


def stopped_by_callback(net: NeuralNet) -> bool:
    """Whether a callback decided to end training at the epoch just ended.

    skorch's callbacks stop training by raising ``KeyboardInterrupt``, which
    ``fit`` catches, as it catches a Ctrl-C: only a decision that a callback
    left a trace of counts. ``EarlyStopping`` leaves its own state (as many
    misses as its patience); any other callback records ``True`` in the
    epoch's :data:`STOPPED_EARLY` column before it raises.
    """
    if net.history and net.history[-1].get(STOPPED_EARLY):
        return True
    return any(isinstance(callback, EarlyStopping)
               and getattr(callback, 'misses_', 0) >= callback.patience
               for _, callback in net.callbacks_)
