"""When to save: policy, no I/O.

What depends on the history (the monitor) is evaluated on the main process
and its answer sent to every rank
(:func:`skorch_accel_callbacks._core.sync.run_on_main`), since the ranks'
histories can differ; the rest is the same on every rank. After an
optimizer step, :class:`StepPoll` says whether a stop signal (noted by
:class:`~skorch_accel_callbacks.callbacks._preemption.SignalWatch`) or the
time since the last save asks for one, the same answer on every rank.
"""

from __future__ import annotations

import signal
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from skorch.callbacks import EarlyStopping
from skorch.exceptions import SkorchException

from skorch_accel_callbacks._core import sync
from skorch_accel_callbacks.callbacks._preemption import SignalWatch

if TYPE_CHECKING:
    from skorch import NeuralNet

__all__ = [
    'STOPPED_EARLY',
    'Ballot',
    'EpochDecision',
    'StepPoll',
    'check_interval',
    'check_monitor',
    'check_triggers',
    'epoch_decision',
    'epoch_due',
    'monitor_says',
    'step_due',
    'stopped_by_callback',
    'time_due',
]

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


# ---------------------------------------------------------------- signals and time, at a step

# steps between two votes on signals and time: about this many seconds, and
# at most this many steps
_VOTE_SECONDS = 0.5
_MAX_VOTE_STEPS = 1000


class Ballot(NamedTuple):
    """One process's vote on saving, posted at an optimizer step."""

    #: the number of a stop signal this process received, 0 for none
    signal: int
    #: (main process) ``every_n_seconds`` passed since the last save
    time_due: bool
    #: (main process) optimizer steps until the vote after this one
    interval: int


class StepPoll:
    """Whether a signal or the time since the last save asks for a save
    after an optimizer step: the same answer on every rank at the same step.

    A signal may reach one rank only, and the time is measured on the main
    process, so with several processes the ranks vote (:class:`sync.Vote`)
    without waiting: a vote is posted and counted when the next one is,
    a number of steps later that the votes themselves agree on. The main
    process proposes as many steps as take about ``_VOTE_SECONDS`` (or half
    of ``every_n_seconds``, if shorter), so that posting one (a few hundred
    microseconds on gloo) costs well under 1% of training, and a signal is
    seen within about two such intervals.

    Parameters
    ----------
    every_n_seconds : float or None
      Seconds between two saves asked for by time; None asks for none.

    Attributes
    ----------
    watch : SignalWatch
      The handlers that note the signals.
    """

    def __init__(self, every_n_seconds: float | None = None) -> None:
        self.every_n_seconds = every_n_seconds
        self.watch = SignalWatch()
        self._vote: sync.Vote | None = None
        self._last_save = time.monotonic()
        self._is_main = True
        self._next_vote = 0
        self._interval = 1
        self._voted_at = (0, self._last_save)

    def begin(self, net: Any) -> None:
        """Start counting time; with several processes, open the vote (every
        rank needs to hear of a signal, SIGINT at least)."""
        self._last_save = time.monotonic()
        self._is_main = sync.is_main_process(net)
        if sync.is_distributed(net):
            self._vote = sync.Vote(net)
            self._next_vote = 0
            self._interval = 1
            self._voted_at = (0, self._last_save)

    def install(self, net: Any, owner: str, stop: tuple[signal.Signals, ...]) -> None:
        """Watch the signals ``stop``, which save and stop training. A
        Ctrl-C (SIGINT) stops every rank so too when there are several (one
        rank's KeyboardInterrupt would leave the others waiting in a
        collective); in one process it ends ``fit`` as skorch's does, noted
        (:attr:`interrupted`) so that it is not taken for a callback's
        decision."""
        stop = tuple(stop)
        if signal.SIGINT in stop:
            self.watch.install(owner, stop)
        elif sync.is_distributed(net):
            self.watch.install(owner, stop + (signal.SIGINT,))
        else:
            self.watch.install(owner, stop, (signal.SIGINT,))

    @property
    def stop_signals(self) -> tuple[signal.Signals, ...]:
        """The signals that save and stop training, while installed."""
        return self.watch.stop_signals

    @property
    def interrupted(self) -> signal.Signals | None:
        """A signal passed on to its previous handler (SIGINT in one process)."""
        return self.watch.interrupted

    def saved(self) -> None:
        """A save was taken: the time until the next one starts now."""
        self._last_save = time.monotonic()

    def _time_due(self, now: float) -> bool:
        return self.every_n_seconds is not None and time_due(
            now - self._last_save, self.every_n_seconds)

    def at_step(self, step: int) -> tuple[signal.Signals | None, bool]:
        """``(signal, time due)`` after the optimizer step ``step`` (counted
        over resumes, the same on every rank)."""
        if self._vote is None:
            received = self.watch.received
            return received, self._time_due(time.monotonic())
        if step < self._next_vote:
            return None, False
        now = time.monotonic()
        proposed = 0
        if self._is_main:
            steps = step - self._voted_at[0]
            seconds = max(now - self._voted_at[1], 1e-9)
            wanted = (_VOTE_SECONDS if self.every_n_seconds is None
                      else min(_VOTE_SECONDS, self.every_n_seconds / 2))
            proposed = max(1, min(_MAX_VOTE_STEPS, round(wanted * steps / seconds)))
        self._voted_at = (step, now)
        mine = Ballot(int(self.watch.received or 0), self._is_main and self._time_due(now),
                      proposed)
        # none under way at an epoch's first vote: the interval agreed before
        counted = self._count() or Ballot(0, False, self._interval)
        self._vote.post(mine)
        self._interval = counted.interval
        self._next_vote = step + counted.interval
        return _signal(counted.signal), bool(counted.time_due)

    def at_epoch_end(self, step: int) -> signal.Signals | None:
        """The signal any rank got by the end of this epoch: every rank
        counts the vote under way and one more (the end of an epoch waits
        for collectives anyway)."""
        received = int(self.watch.received or 0)
        if self._vote is not None:
            counted = self._count() or Ballot(0, False, 1)
            self._vote.post(Ballot(received, False, 0))
            received = max(received, counted.signal, self._count().signal)
            # the next epoch votes at its first step
            self._next_vote = step + 1
        return _signal(received)

    def at_train_end(self, net: Any) -> signal.Signals | None:
        """The signal any rank got that training did not stop for (it came
        during the end of training): every rank counts the vote under way
        and what every rank got since."""
        received = int(self.watch.received or 0)
        if self._vote is not None:
            counted = self._count()
            received = max(sync.gather(net, max(received, counted.signal if counted else 0)))
        return _signal(received)

    def _count(self) -> Ballot | None:
        counted = self._vote.count()
        return None if counted is None else Ballot(*counted)

    def close(self) -> None:
        """Put the signal handlers back and let go of the vote."""
        self.watch.uninstall()
        vote, self._vote = self._vote, None
        if vote is not None:
            vote.close()


def _signal(number: int) -> signal.Signals | None:
    return signal.Signals(number) if number else None
