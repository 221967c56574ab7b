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

What they say and how they check their arguments are in :mod:`.messages`
and :mod:`.arguments`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from skorch.callbacks import PrintLog

if TYPE_CHECKING:
    from skorch import NeuralNet
    from skorch.callbacks import Callback

__all__ = ['FolderStateCallback', 'InitParamsOnly', 'Resumed', 'find_resumed', 'move_callback']


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
