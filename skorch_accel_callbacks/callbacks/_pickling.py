"""How a net with an accelerator is pickled: as its settings, unpickled as
an accelerator of the unpickling process (:func:`dump_net`, and the
mixin's ``__getstate__``: :func:`picklable_state`)."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, BinaryIO

from accelerate import Accelerator, PartialState
from accelerate.optimizer import AcceleratedOptimizer

from skorch_accel_callbacks._core import accelerate_io, skorch_io

if TYPE_CHECKING:
    from skorch import NeuralNet

__all__ = ['MainProcessPrint', 'bare_optimizers', 'dump_net', 'picklable_state']


class _ThisProcessAccelerator:
    """Stands for an ``Accelerator`` in a pickle (or deep copy): unpickled,
    it is :func:`accelerator_of_this_process` of the pickled one's settings."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.settings = accelerate_io.accelerator_settings(accelerator)

    def __reduce__(self) -> tuple[Callable[..., Accelerator], tuple[dict[str, Any]]]:
        return accelerate_io.accelerator_of_this_process, (self.settings,)


class MainProcessPrint:
    """Stands for an accelerator's ``print`` (skorch's ``AccelerateMixin``
    makes it ``PrintLog``'s sink) in a pickle: prints on the main process of
    the process that unpickled it, as ``Accelerator.print`` does, without
    pickling the accelerator (whose registry holds the training loaders, and
    a loader of persistent workers cannot be pickled)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        PartialState().print(*args, **kwargs)


def _print_of(value: Any, accelerator: Any) -> bool:
    """Whether ``value`` is ``accelerator.print``, bound."""
    return (accelerator is not None and getattr(value, '__self__', None) is accelerator
            and getattr(value, '__func__', None) is getattr(type(accelerator), 'print', None))


def _without_print_of(accelerator: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with :class:`MainProcessPrint` for ``accelerator.print``
    where a net's parameter or a callback's ``sink`` holds it (a copy of that
    callback: the net pickled keeps its own)."""
    state = {key: MainProcessPrint() if _print_of(value, accelerator) else value
             for key, value in state.items()}
    callbacks = state.get('callbacks_')
    if isinstance(callbacks, list):
        replaced = []
        for name, callback in callbacks:
            if _print_of(getattr(callback, 'sink', None), accelerator):
                callback = copy.copy(callback)
                callback.sink = MainProcessPrint()
            replaced.append((name, callback))
        state['callbacks_'] = replaced
    return state


class _NetPickler(pickle.Pickler):
    """A pickler that pickles every ``Accelerator`` as
    :class:`_ThisProcessAccelerator`."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Accelerator):
            return _ThisProcessAccelerator(obj).__reduce__()
        return NotImplemented


def dump_net(net: NeuralNet, file: BinaryIO) -> None:
    """Pickle ``net`` into ``file`` (open for binary writing) without its
    accelerator's processes.

    The accelerator is pickled as its settings and unpickled as
    :func:`accelerator_of_this_process`: a net pickled in a job of several
    processes predicts on its own after unpickling in one process, instead
    of believing it runs in the job's processes (skorch's ``AccelerateMixin``
    with a plain ``pickle.dump``: its predictions came back with padding
    rows of the job's data sharding). Other objects pickle as with
    ``pickle.dump``.
    """
    _NetPickler(file, protocol=pickle.DEFAULT_PROTOCOL).dump(net)


@contextmanager
def bare_optimizers(net: NeuralNet) -> Iterator[None]:
    """Inside, the net's optimizers are the torch optimizers that accelerate's
    ``AcceleratedOptimizer`` wraps (which carry the process state)."""
    wrappers = {}
    for name in skorch_io.optimizer_names(net):
        optimizer = getattr(net, name + '_', None)
        if isinstance(optimizer, AcceleratedOptimizer):
            wrappers[name + '_'] = optimizer
            setattr(net, name + '_', optimizer.optimizer)
    try:
        yield
    finally:
        for attr, wrapper in wrappers.items():
            setattr(net, attr, wrapper)


def picklable_state(state: dict[str, Any]) -> dict[str, Any]:
    """A net's ``state`` (``__getstate__``'s) with stand-ins that pickle
    for its accelerator and the accelerator's ``print``."""
    state = _without_print_of(state.get('accelerator'), state)
    if isinstance(state.get('accelerator'), Accelerator):
        state['accelerator'] = _ThisProcessAccelerator(state['accelerator'])
    return state
