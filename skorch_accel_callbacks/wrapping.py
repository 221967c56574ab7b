"""Unwrap a net's modules for a block and restore the very same wrappers.

skorch's ``AccelerateMixin`` unwraps with ``_unwrap_accelerator`` and wraps
again with ``_initialize_accelerator``, which calls ``accelerator.prepare``:
under DDP that rebuilds the wrapper (a broadcast of all weights) and appends
the module to ``accelerator._models`` once more, so every later
``accelerator.save_state`` writes one more copy of the model. ``unwrapped``
keeps the wrapper objects aside and puts them back instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import torch

from skorch_accel_callbacks import accelerate_io

if TYPE_CHECKING:
    from skorch import NeuralNet

__all__ = ['bare_modules', 'is_wrapped', 'net_optimizers', 'own_registries', 'unwrapped']

# accelerate's unwrap with keep_fp32_wrapper=False (what skorch uses, so that
# an unwrapped module pickles) replaces these instance attributes of the inner
# module under mixed precision; they are put back on exit so the wrapper
# autocasts exactly as before.
_FORWARD_ATTRS = ('forward', '_original_forward')
_MISSING = object()


def is_wrapped(net: NeuralNet) -> bool:
    """Whether the net's modules are currently prepared by accelerate."""
    return bool(getattr(net, '_wrapped_with_accelerator', False))


def _module_names(net: NeuralNet) -> list[str]:
    return [name + '_' for name in list(net._modules) + list(net._criteria)]


def bare_modules(net: NeuralNet) -> dict[str, torch.nn.Module]:
    """Name -> the bare ``nn.Module`` of each module and criterion of ``net``.

    These are the objects that accelerate keeps in ``accelerator._models``,
    whether the net is wrapped or not.
    """
    return {
        attr[:-1]: net.accelerator.unwrap_model(getattr(net, attr))
        for attr in _module_names(net)
        if isinstance(getattr(net, attr, None), torch.nn.Module)
    }


def net_optimizers(net: NeuralNet) -> list[torch.optim.Optimizer]:
    """The optimizers of ``net`` (as prepared by accelerate, if they are)."""
    return [getattr(net, name + '_') for name in net._optimizers
            if getattr(net, name + '_', None) is not None]


def own_registries(net: NeuralNet) -> AbstractContextManager[None]:
    """Context manager: inside, the accelerator's registries hold only the
    modules and optimizers of ``net`` (see
    :func:`skorch_accel_callbacks.accelerate_io.registries_of`)."""
    return accelerate_io.registries_of(
        net.accelerator, bare_modules(net).values(), net_optimizers(net))


@contextmanager
def unwrapped(net: NeuralNet) -> Iterator[NeuralNet]:
    """Context manager: inside, every module and criterion of ``net`` is plain.

    Inside the block ``net.module_`` (and every other module and criterion) is
    the bare ``torch.nn.Module``, without DDP wrapper and without the
    ``module.`` key prefix, and ``net._wrapped_with_accelerator`` is False, so
    skorch's ``save_params``/``load_params`` take their plain path. On exit,
    also when the block raises, the net gets back the very same wrapper
    objects it had; nothing is prepared again and no collective is run.

    It is a no-op for a net that is not wrapped, for a plain skorch net
    without accelerate, and for a nested block.

    Parameters loaded into the bare module inside the block are the
    parameters of the wrapper after it (DDP shares the tensors), so loading the
    same file on every rank keeps the ranks in sync.

    Examples
    --------
    >>> with unwrapped(net):
    ...     state = net.module_.state_dict()  # no 'module.' prefix
    >>> net.module_  # the same DistributedDataParallel object as before

    """
    if not is_wrapped(net):
        yield net
        return

    accelerator = net.accelerator
    wrappers = {}
    forwards = {}
    for attr in _module_names(net):
        wrapper = getattr(net, attr)
        if not isinstance(wrapper, torch.nn.Module):
            continue
        wrappers[attr] = wrapper
        inner = accelerator.unwrap_model(wrapper, keep_fp32_wrapper=True)
        forwards[attr] = (inner, {
            key: inner.__dict__.get(key, _MISSING) for key in _FORWARD_ATTRS})
        setattr(net, attr, accelerator.unwrap_model(wrapper, keep_fp32_wrapper=False))
    net._wrapped_with_accelerator = False
    try:
        yield net
    finally:
        for inner, saved in forwards.values():
            for key, value in saved.items():
                if value is _MISSING:
                    inner.__dict__.pop(key, None)
                else:
                    inner.__dict__[key] = value
        for attr, wrapper in wrappers.items():
            setattr(net, attr, wrapper)
        net._wrapped_with_accelerator = True
