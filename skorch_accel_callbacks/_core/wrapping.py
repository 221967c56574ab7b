"""Unwrap a net's modules for a block and restore the very same wrappers.

skorch's ``AccelerateMixin`` unwraps with ``_unwrap_accelerator`` and wraps
again with ``_initialize_accelerator``, which calls ``accelerator.prepare``:
under DDP that rebuilds the wrapper (a broadcast of all weights) and appends
the module to ``accelerator._models`` once more, so every later
``accelerator.save_state`` writes one more copy of the model. ``unwrapped``
keeps the wrapper objects aside and puts them back instead.

FSDP2 (accelerate's FSDP back-end, ``fsdp_version=2``) wraps nothing:
``fully_shard`` turns the module itself into the sharded one, whose
parameters each rank holds a shard of. ``unwrapped`` leaves it as it is;
:func:`gathered` stands in its full parameters for a save, and
:func:`check_plain` refuses what needs the plain module.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch

from skorch_accel_callbacks._core import accelerate_io, skorch_io

if TYPE_CHECKING:
    from skorch import NeuralNet

__all__ = ['bare_modules', 'check_plain', 'gathered', 'is_sharded', 'is_wrapped',
           'named_optimizers', 'net_optimizers', 'own_registries', 'state_modules', 'unwrapped']

# accelerate's unwrap with keep_fp32_wrapper=False (what skorch uses, so that
# an unwrapped module pickles) replaces these instance attributes of the inner
# module under mixed precision; they are put back on exit so the wrapper
# autocasts exactly as before.
_FORWARD_ATTRS = ('forward', '_original_forward')
_MISSING = object()


def is_wrapped(net: NeuralNet) -> bool:
    """Whether the net's modules are currently prepared by accelerate."""
    return skorch_io.is_wrapped(net)


def is_sharded(net: NeuralNet) -> bool:
    """Whether the net's modules are sharded by FSDP2: under accelerate's
    FSDP2 back-end, once the net is initialized (it prepares them then)."""
    accelerator = getattr(net, 'accelerator', None)
    return (accelerator is not None and bool(getattr(net, 'initialized_', False))
            and accelerate_io.is_fsdp2(accelerator))


def check_plain(net: NeuralNet, needs: str, instead: str) -> None:
    """Raise ``ValueError`` saying what ``needs`` a plain module and what to
    do ``instead`` if the net's modules are sharded by FSDP2
    (:func:`is_sharded`): no rank holds more than a shard of them.

    ``needs`` begins the message: ``"LoadInitParams needs a plain module to
    load into"``.
    """
    if is_sharded(net):
        names = ', '.join(f'net.{name}_' for name in skorch_io.module_names(net))
        raise ValueError(
            f"{needs}, and {names} is sharded by FSDP2 (each rank holds a shard of its "
            f"parameters): {instead}")


class _FullParameters:
    """Stands for a module sharded by FSDP2 inside :func:`gathered`: its
    ``state_dict()`` is the module's full parameters, on the main process
    (empty on the other ranks)."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self._state = state

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        return self._state


@contextmanager
def gathered(net: NeuralNet) -> Iterator[NeuralNet]:
    """Context manager: inside, each module of ``net`` sharded by FSDP2
    stands as its full parameters, gathered onto the CPU of the main process
    (``accelerator.get_state_dict``), for skorch's ``save_params`` to write
    there: ``net.module_.state_dict()`` is the full state dict on the main
    process, empty on the others. On exit the net gets back its sharded
    modules. Enter it on every rank: gathering is a collective.

    A no-op for a net whose modules are not sharded (:func:`is_sharded`).
    """
    if not is_sharded(net):
        yield net
        return
    sharded: dict[str, Any] = {
        name + '_': getattr(net, name + '_') for name in skorch_io.module_names(net)}
    for attr, module in sharded.items():
        if isinstance(module, torch.nn.Module):
            setattr(net, attr, _FullParameters(net.accelerator.get_state_dict(module)))
    try:
        yield net
    finally:
        for attr, module in sharded.items():
            setattr(net, attr, module)


def _module_names(net: NeuralNet) -> list[str]:
    return [name + '_' for name in skorch_io.module_names(net) + skorch_io.criterion_names(net)]


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


def state_modules(net: NeuralNet) -> dict[str, torch.nn.Module]:
    """Name -> the module of each module and criterion of ``net`` whose
    state a checkpoint holds: bare, and without ``torch.compile``'s wrapper
    (skorch's ``compile=True``), so that its parameters have the module's
    own names, as a plain skorch net of the same module has them."""
    return {name: accelerate_io.uncompiled(module)
            for name, module in bare_modules(net).items()}


def named_optimizers(net: NeuralNet) -> dict[str, torch.optim.Optimizer]:
    """The optimizers of ``net`` by name (``'optimizer'``), in skorch's order
    (as prepared by accelerate, if they are)."""
    return {name: getattr(net, name + '_') for name in skorch_io.optimizer_names(net)
            if getattr(net, name + '_', None) is not None}


def net_optimizers(net: NeuralNet) -> list[torch.optim.Optimizer]:
    """The optimizers of ``net`` (as prepared by accelerate, if they are)."""
    return list(named_optimizers(net).values())


def own_registries(net: NeuralNet) -> AbstractContextManager[None]:
    """Context manager: inside, the accelerator's registries hold only the
    modules and optimizers of ``net`` (see
    :func:`skorch_accel_callbacks._core.accelerate_io.registries_of`)."""
    return accelerate_io.registries_of(
        net.accelerator, bare_modules(net).values(), net_optimizers(net))


@contextmanager
def unwrapped(net: NeuralNet) -> Iterator[NeuralNet]:
    """Context manager: inside, every module and criterion of ``net`` is plain.

    Inside the block ``net.module_`` (and every other module and criterion) is
    the bare ``torch.nn.Module``, without DDP wrapper and without the
    ``module.`` key prefix, and skorch takes the net for not wrapped, so
    skorch's ``save_params``/``load_params`` take their plain path. On exit,
    also when the block raises, the net gets back the very same wrapper
    objects it had; nothing is prepared again and no collective is run.

    It is a no-op for a net that is not wrapped, for a plain skorch net
    without accelerate, and for a nested block.

    Under FSDP2 nothing wraps the module: ``fully_shard`` made the module
    itself the sharded one, and it stays sharded inside the block (its
    ``state_dict()`` holds each rank's shards as ``DTensor``): skorch's
    ``save_params`` writes the full parameters inside ``gathered``, and
    what needs the plain module (loading a state dict into it, pickling it)
    raises a ``ValueError`` saying so (``check_plain``).

    Parameters loaded into the bare module inside the block are the
    parameters of the wrapper after it (DDP shares the tensors), so loading the
    same file on every rank keeps the ranks in sync.

    Parameters
    ----------
    net : skorch.NeuralNet
      The net, initialized, with or without ``AccelerateMixin``.

    Examples
    --------
    >>> import torch
    >>> from accelerate import Accelerator
    >>> from skorch import NeuralNetClassifier
    >>> from skorch.hf import AccelerateMixin
    >>> from skorch_accel_callbacks import AccelerateFixesMixin, unwrapped
    >>> class AcceleratedNet(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    ...     pass
    >>> net = AcceleratedNet(torch.nn.Linear, module__in_features=4, module__out_features=2,
    ...                      accelerator=Accelerator(cpu=True)).initialize()
    >>> wrapper = net.module_  # DistributedDataParallel in several processes
    >>> with unwrapped(net):
    ...     state = net.module_.state_dict()  # no 'module.' prefix
    >>> sorted(state)
    ['bias', 'weight']
    >>> net.module_ is wrapper  # the same object as before
    True

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
        # without torch.compile's wrapper too: skorch's save_params and
        # load_params then use the module's own parameter names
        inner = accelerator.unwrap_model(wrapper, keep_fp32_wrapper=True,
                                         keep_torch_compile=False)
        forwards[attr] = (inner, {
            key: inner.__dict__.get(key, _MISSING) for key in _FORWARD_ATTRS})
        setattr(net, attr, accelerator.unwrap_model(wrapper, keep_fp32_wrapper=False,
                                                    keep_torch_compile=False))
    skorch_io.set_wrapped(net, False)
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
        skorch_io.set_wrapped(net, True)
