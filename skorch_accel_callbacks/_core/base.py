"""What the package's callbacks share.

- Their parameters are their ``__init__`` arguments only: skorch's
  ``Callback.get_params`` takes every attribute that does not end in ``_``,
  so a private attribute (``_lock``) would become a constructor argument
  and break ``sklearn.base.clone`` and ``set_params``.
- Their place among the net's callbacks: a checkpoint runs after the
  callbacks whose end-of-epoch state it saves (EarlyStopping, LRScheduler,
  scoring), a resume before the callbacks whose state it restores, whatever
  order the user listed them in (Lightning runs its ModelCheckpoint last for
  the same reason).
- Messages go to ``sink`` on the main process only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from skorch.callbacks import PrintLog

from skorch_accel_callbacks._core import sync

if TYPE_CHECKING:
    from skorch import NeuralNet
    from skorch.callbacks import Callback

__all__ = ['FolderStateCallback', 'InitParamsOnly', 'Resumed', 'check_sink', 'find_resumed',
           'format_bytes', 'move_callback', 'processes', 'say']


@dataclass(frozen=True, eq=False)
class Resumed:
    """What a fit was resumed from, as :class:`AccelerateLoadInitState`
    publishes it (``resumed_``) for the checkpoint callback of its folder.

    A new record is made for each ``fit``/``partial_fit`` call that the
    resume is for: the calls from the one that loaded the checkpoint up to
    the one that continues it (the call it was taken in, counted from the
    net's ``initialize``). A later call (``partial_fit``, ``warm_start``)
    finds no new record, and continues the same training.
    """

    #: the folder of checkpoints it was looked for in (a real path)
    dirname: str
    #: the checkpoint folder
    path: str
    #: its name, e.g. ``epoch-0003``
    name: str
    #: optimizer steps taken when it was saved
    step: int
    #: training batches of the epoch under way (0 at an epoch's end)
    batches: int
    #: complete epochs after which the call ends: where the call that
    #: continues the checkpoint began plus ``max_epochs``, or the epochs done
    #: if a callback had stopped training or they are more; the epochs done
    #: in a call before that one (its work is done)
    last_epoch: int
    #: the fit calls since ``initialize`` up to this one: for each, the
    #: complete epochs when it began and those after which it ends
    fit_calls: tuple[tuple[int, int], ...]


def find_resumed(net: NeuralNet, dirname: str | os.PathLike) -> Resumed | None:
    """The record of the resume of ``net`` from the folder ``dirname``, if
    any callback of the net resumed it."""
    wanted = os.path.realpath(dirname)
    for _, callback in net.callbacks_:
        record = getattr(callback, 'resumed_', None)
        if isinstance(record, Resumed) and record.dirname == wanted:
            return record
    return None


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


class InitParamsOnly:
    """Mixin: ``get_params`` lists public attributes only, never private state."""

    def _get_param_names(self) -> list[str]:
        return [key for key in self.__dict__
                if not key.endswith('_') and not key.startswith('_')]


class FolderStateCallback(InitParamsOnly):
    """Mixin for a callback whose state is its checkpoint folder: resuming
    carries nothing for it in callbacks.json."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def move_callback(net: NeuralNet, callback: Callback, where: str) -> None:
    """Move ``callback`` to the start (``'first'``) or the end (``'last'``,
    before PrintLog, so that its history column is printed) of
    ``net.callbacks_``.

    A new list is assigned, so a ``notify`` that is iterating over the old
    one is not disturbed.
    """
    entries = list(net.callbacks_)
    index = next((i for i, (_, cb) in enumerate(entries) if cb is callback), None)
    if index is None:
        return
    entry = entries.pop(index)
    if where == 'first':
        entries.insert(0, entry)
    elif where == 'last':
        position = len(entries)
        while position > 0 and isinstance(entries[position - 1][1], PrintLog):
            position -= 1
        entries.insert(position, entry)
    else:
        raise ValueError(f"where must be 'first' or 'last', got {where!r}")
    net.callbacks_ = entries
