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
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import FrameType

__all__ = ['SignalWatch', 'check_signals']

# what cannot be caught, or is not a request to stop
_REFUSED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGCONT}

# the watch whose handlers are set (signal handlers belong to the process)
_installed = None


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
