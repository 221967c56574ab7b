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

import difflib
import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from skorch.callbacks import PrintLog

from skorch_accel_callbacks._core import sync

if TYPE_CHECKING:
    from skorch import NeuralNet
    from skorch.callbacks import Callback

__all__ = ['FolderStateCallback', 'InitParamsOnly', 'Resumed', 'check_one_of', 'check_sink',
           'find_resumed', 'format_bytes', 'keyword_suggestions', 'move_callback', 'processes',
           'say', 'suggestion']

T = TypeVar('T')


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


def suggestion(word: str, valid: Iterable[str]) -> str:
    """``" (did you mean 'latest'?)"`` for the valid name nearest ``word``,
    or ``''`` if none is near."""
    close = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ''


def check_one_of(owner: str, name: str, value: Any, valid: Sequence[str]) -> None:
    """Raise ``ValueError`` if ``value`` is none of ``valid``, listing them
    and suggesting the nearest."""
    if value not in valid:
        hint = suggestion(value, valid) if isinstance(value, str) else ''
        raise ValueError(f"{owner}: {name} must be one of {', '.join(map(repr, valid))}, "
                         f"got {value!r}{hint}")


def keyword_suggestions(cls: type[T] | None = None, *,
                        advice: Mapping[str, str] | None = None) -> Any:
    """Make a wrong keyword argument of ``cls(...)`` name the nearest
    valid one and list them all, instead of Python's bare ``TypeError``;
    ``advice`` maps arguments of a class that ``cls`` stands in for (skorch's)
    to what to do instead. A decorator, with or without ``advice``. (A class
    whose ``__init__`` takes ``**kwargs`` checks its own: skorch's
    ``Checkpoint`` does, and its drop-ins keep that.)"""
    if cls is None:
        return functools.partial(keyword_suggestions, advice=advice)
    init = cls.__init__
    signature = inspect.signature(init)
    if any(param.kind == param.VAR_KEYWORD for param in signature.parameters.values()):
        raise TypeError(f"{cls.__name__}.__init__ takes **kwargs: it checks its own")
    keywords = [name for name, param in signature.parameters.items()
                if name != 'self' and param.kind in (param.POSITIONAL_OR_KEYWORD,
                                                     param.KEYWORD_ONLY)]
    advice = dict(advice or {})

    @functools.wraps(init)
    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = [key for key in kwargs if key not in keywords]
        if unknown and unknown[0] in advice:
            raise TypeError(f"{cls.__name__} has no argument {unknown[0]!r}: "
                            f"{advice[unknown[0]]}")
        if unknown:
            raise TypeError(
                f"{cls.__name__} has no argument {unknown[0]!r}"
                f"{suggestion(unknown[0], keywords)}; its arguments: {', '.join(keywords)}")
        init(self, *args, **kwargs)

    cls.__init__ = checked_init
    return cls


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
