"""What the package says to its user: messages go to a callback's ``sink``
on the main process only (``print`` only when the net is verbose, as
skorch's callbacks do), with sizes and counts written for a reader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from skorch_accel_callbacks._core import sync

if TYPE_CHECKING:
    from skorch import NeuralNet

__all__ = ['check_sink', 'format_bytes', 'processes', 'say']


def check_sink(sink: Any, owner: str) -> None:
    """Raise ``ValueError`` naming ``owner`` if ``sink`` is not callable."""
    if not callable(sink):
        raise ValueError(
            f"{owner}: sink must be a callable such as print or noop, got {sink!r}")


def say(net: NeuralNet, sink: Callable[[str], Any], text: str) -> None:
    """Send ``text`` to ``sink`` on the main process; ``print`` only when the
    net is verbose (as skorch's callbacks do)."""
    if sync.is_main_process(net) and (sink is not print or net.verbose):
        sink(text)


def processes(count: int) -> str:
    """``'1 process'``, ``'2 processes'``."""
    return f"{count} process" + ('' if count == 1 else 'es')


def format_bytes(size: float) -> str:
    """``size`` bytes for a reader: ``'512 B'``, ``'30.1 KiB'``, ``'1.2 GiB'``."""
    value = float(size)
    for unit in ('B', 'KiB', 'MiB', 'GiB'):
        if value < 1024 or unit == 'GiB':
            break
        value /= 1024
    return f"{int(value)} B" if unit == 'B' else f"{value:.1f} {unit}"
