"""Signals that make a run save and stop: which ones, and watching for them.

A scheduler announces a preemption with a signal some seconds before it
kills the job: SLURM with SIGTERM (and, with ``--signal=USR1@90``, SIGUSR1
ninety seconds ahead), a cloud with SIGTERM to a spot VM's processes,
``torchrun`` by passing its own SIGTERM on to every worker. The handler
only notes the signal; the checkpoint callback saves at the next batch
boundary, where every rank is in a consistent state.
"""

import signal
import threading
import warnings

__all__ = ['SignalWatch', 'check_signals']

# what cannot be caught, or is not a request to stop
_REFUSED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGCONT}


def check_signals(signals, owner):
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
    """Notes the first of ``signals`` that this process gets while installed.

    Installed in the main thread only (Python runs signal handlers there);
    the handlers that were set before are put back when uninstalled, and
    called after this one notes the signal where they were functions (so a
    user's own handler still runs; Python's KeyboardInterrupt for SIGINT
    is not). A second signal, after one was noted, puts the previous
    handlers back and gets the previous behaviour at once (by default, the
    process ends): a training that does not reach its next step can still
    be stopped.

    Attributes
    ----------
    received : signal.Signals or None
      The first signal noted since installed.
    """

    def __init__(self, signals):
        self.signals = tuple(signals)
        self.received = None
        self._previous = {}

    def install(self, owner):
        """Set the handlers; warn naming ``owner`` and do nothing outside
        the main thread."""
        self.received = None
        if not self.signals or self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                f"{owner}: fit runs outside the main thread, where no signal handler "
                f"can be set: {', '.join(s.name for s in self.signals)} will not save "
                "a checkpoint", UserWarning, stacklevel=3)
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum, frame):
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

    def uninstall(self):
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            # None: set by code outside Python, which cannot be put back
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def __getstate__(self):
        # handlers belong to this process and may not pickle
        return dict(self.__dict__, _previous={}, received=None)
