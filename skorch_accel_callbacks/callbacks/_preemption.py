"""Signals that make a run save and stop: which ones, and watching for them.

A scheduler announces a preemption with a signal some seconds before it
kills the job: SLURM with SIGTERM (and, with ``--signal=USR1@90``, SIGUSR1
ninety seconds ahead), a cloud with SIGTERM to a spot VM's processes,
``torchrun`` by passing its own SIGTERM on to every worker. The handler
only notes the signal; the checkpoint callback saves at the next batch
boundary, where every rank is in a consistent state.
"""

from __future__ import annotations

import signal
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from types import FrameType

from skorch_accel_callbacks._core import sync
from skorch_accel_callbacks.callbacks import _triggers as triggers

__all__ = ['Ballot', 'SignalWatch', 'StepPoll', 'check_signals']

# what cannot be caught, or is not a request to stop
_REFUSED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGCONT}

# the watch whose handlers are set (signal handlers belong to the process)
_installed = None

# steps between two votes on signals and time: about this many seconds, and
# at most this many steps
_VOTE_SECONDS = 0.5
_MAX_VOTE_STEPS = 1000


def check_signals(
        signals: str | signal.Signals | Sequence[str | signal.Signals], owner: str,
) -> tuple[signal.Signals, ...]:
    """``signals`` (names such as ``'SIGTERM'`` or ``signal.Signals``) as a
    tuple of ``signal.Signals``; raise ``ValueError`` naming ``owner`` and
    the entry at fault if one is not a signal that can be caught."""
    if isinstance(signals, (str, signal.Signals)):
        signals = (signals,)
    if not isinstance(signals, (tuple, list)):
        raise ValueError(f"{owner}: save_on_signal must be a tuple of signal names, "
                         f"got {signals!r}")
    found = []
    for entry in signals:
        try:
            sig = entry if isinstance(entry, signal.Signals) else signal.Signals[entry]
        except KeyError:
            sig = None
        if sig is None or sig in _REFUSED:
            raise ValueError(
                f"{owner}: save_on_signal entry {entry!r} is not a signal that can be "
                "caught to save and stop (use names such as 'SIGTERM' or 'SIGUSR1')")
        if sig not in found:
            found.append(sig)
    return tuple(found)


class SignalWatch:
    """Notes the signals this process gets while installed.

    Two kinds of signals are watched:

    - ``stop`` signals are only noted (:attr:`received`, the first one): the
      checkpoint callback saves at the next step and stops every rank. A
      second one, after one was noted, puts the previous handlers back and
      gets the previous behaviour at once (by default, the process ends): a
      training that does not reach its next step can still be stopped.
      Where the previous handler was a Python function it is called after
      the signal is noted (a user's own handler still runs), except
      Python's KeyboardInterrupt for SIGINT.
    - ``passed_on`` signals are noted (:attr:`interrupted`) and then get the
      previous handler at once: SIGINT in one process still raises
      KeyboardInterrupt as skorch expects, and the checkpoint callback can
      tell a Ctrl-C from a callback that stopped training. A signal whose
      handler is not a Python function (ignored, or the default action) is
      not watched this way.

    Installed in the main thread only (Python runs signal handlers there);
    the handlers that were set before are put back when uninstalled. One
    watch is installed at a time: installing one uninstalls another that a
    fit which raised left behind, so that a signal never reaches a watch of
    a training that is over (one that had noted a signal would take the
    next for a second one, and end the process).

    Attributes
    ----------
    received : signal.Signals or None
      The first ``stop`` signal noted since installed.

    interrupted : signal.Signals or None
      The first ``passed_on`` signal noted since installed.
    """

    def __init__(self) -> None:
        self.received = None
        self.interrupted = None
        self._previous = {}
        self._stop = ()

    def install(
            self, owner: str, stop: Iterable[signal.Signals],
            passed_on: Iterable[signal.Signals] = (),
    ) -> None:
        """Set the handlers, after forgetting what an earlier installation
        noted; warn naming ``owner`` and do nothing outside the main thread."""
        global _installed
        self.uninstall()
        self.received = None
        self.interrupted = None
        self._stop = tuple(stop)
        if not self._stop and not passed_on:
            return
        if threading.current_thread() is not threading.main_thread():
            if self._stop:
                warnings.warn(
                    f"{owner}: fit runs outside the main thread, where no signal handler "
                    f"can be set: {', '.join(s.name for s in self._stop)} will not save "
                    "a checkpoint", UserWarning, stacklevel=3)
            return
        if _installed is not None:
            _installed.uninstall()
        _installed = self
        for sig in self._stop:
            self._previous[sig] = signal.signal(sig, self._note)
        for sig in passed_on:
            if sig not in self._stop and callable(signal.getsignal(sig)):
                self._previous[sig] = signal.signal(sig, self._pass_on)

    @property
    def stop_signals(self) -> tuple[signal.Signals, ...]:
        """The ``stop`` signals of the installation under way (a tuple)."""
        return self._stop

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            # asked twice: a job that does not stop must still be stoppable
            handler = self._previous.get(signum)
            self.uninstall()
            if callable(handler):
                handler(signum, frame)
            else:
                signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum)
        previous = self._previous.get(signum)
        # Python's own SIGINT handler would raise KeyboardInterrupt at once
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupted is None:
            self.interrupted = signal.Signals(signum)
        self._previous[signum](signum, frame)

    def uninstall(self) -> None:
        global _installed
        if _installed is self:
            _installed = None
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            # None: set by code outside Python, which cannot be put back
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def __getstate__(self) -> dict[str, Any]:
        # handlers belong to this process and may not pickle
        return dict(self.__dict__, _previous={}, received=None, interrupted=None)


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
        return self.every_n_seconds is not None and triggers.time_due(
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
