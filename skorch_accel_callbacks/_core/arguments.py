"""How the package's classes check their arguments: a wrong value or
keyword is refused at once, listing the valid ones and suggesting the
nearest (``resume='lastest'`` -> ``did you mean 'latest'?``), instead of
failing later, or with Python's bare ``TypeError``; an argument of the
skorch class a class stands in for, which means nothing to it, is taken
with a warning that says what happens instead.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ['check_one_of', 'keyword_suggestions', 'suggestion']

T = TypeVar('T')


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
    to what happens instead: ``cls`` takes them and warns with it, so that a
    script written for skorch's class runs (they are no parameters of
    ``cls``: ``get_params`` and ``clone`` leave them out). A decorator, with
    or without ``advice``. (A class whose ``__init__`` takes ``**kwargs``
    checks its own: skorch's ``Checkpoint`` does, and its drop-ins keep
    that.)"""
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
        for key in [key for key in kwargs if key in advice and key not in keywords]:
            warnings.warn(f"{cls.__name__} ignores {key}={kwargs.pop(key)!r}: {advice[key]}",
                          UserWarning, stacklevel=2)
        unknown = [key for key in kwargs if key not in keywords]
        if unknown:
            raise TypeError(
                f"{cls.__name__} has no argument {unknown[0]!r}"
                f"{suggestion(unknown[0], keywords)}; its arguments: {', '.join(keywords)}")
        init(self, *args, **kwargs)

    cls.__init__ = checked_init
    return cls
