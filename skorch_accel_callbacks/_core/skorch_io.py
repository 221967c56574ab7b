"""Every use of skorch's internals, in one place.

The package needs more of a net than skorch's public API gives: the names
of the net's modules, criteria and optimizers (``NeuralNet._modules``,
``_criteria``, ``_optimizers``, which skorch fills in ``initialize``) and
whether ``AccelerateMixin`` has prepared them (``_wrapped_with_accelerator``).
Every other module reads them through the functions here. The net's mixin
(:class:`~skorch_accel_callbacks.AccelerateFixesMixin`) is a subclass of the
net and overrides private methods of skorch (:data:`OVERRIDDEN`): an
override of a method that a skorch release renamed would be skipped without
a word, and :func:`check_internals` refuses such a release at ``initialize``
instead, naming what moved and the tested range. The tests check each of
these on every release the test matrix (noxfile.py) installs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from skorch import NeuralNet
from skorch.hf import AccelerateMixin

from skorch_accel_callbacks._core import releases

__all__ = [
    'ATTRIBUTES',
    'OVERRIDDEN',
    'WRAPPED',
    'check_internals',
    'criteria_limited_to',
    'criterion_names',
    'is_wrapped',
    'missing_internals',
    'module_names',
    'optimizer_names',
    'set_wrapped',
]

#: the private attributes of an initialized net that the package reads:
#: the names of its modules, criteria and optimizers, in skorch's order
ATTRIBUTES = ('_modules', '_criteria', '_optimizers')
#: AccelerateMixin's attribute that says whether it prepared the modules
WRAPPED = '_wrapped_with_accelerator'
#: skorch's class -> its private methods that AccelerateFixesMixin overrides
#: or calls; AccelerateMixin sets and reads :data:`WRAPPED` in the last two
OVERRIDDEN: dict[type, tuple[str, ...]] = {
    NeuralNet: ('_validate_params', '_get_param_names'),
    AccelerateMixin: ('_initialize_accelerator', '_unwrap_accelerator'),
}


def module_names(net: NeuralNet) -> list[str]:
    """The names of the net's modules (``'module'``, and any more a
    subclass registers), without the trailing ``_``."""
    return list(net._modules)


def criterion_names(net: NeuralNet) -> list[str]:
    """The names of the net's criteria, without the trailing ``_``."""
    return list(net._criteria)


def optimizer_names(net: NeuralNet) -> list[str]:
    """The names of the net's optimizers, without the trailing ``_``."""
    return list(net._optimizers)


@contextmanager
def criteria_limited_to(net: NeuralNet, names: list[str]) -> Iterator[None]:
    """Inside, the net has only the criteria ``names`` (of its own), which
    is what ``AccelerateMixin._initialize_accelerator`` prepares."""
    every = net._criteria
    net._criteria = names
    try:
        yield
    finally:
        net._criteria = every


def is_wrapped(net: NeuralNet) -> bool:
    """Whether ``AccelerateMixin`` has prepared the net's modules (False for
    a plain net and before ``initialize``)."""
    return bool(getattr(net, WRAPPED, False))


def set_wrapped(net: NeuralNet, wrapped: bool) -> None:
    """Say to ``AccelerateMixin`` whether the net's modules are prepared:
    skorch's ``save_params`` and ``load_params`` take their plain path when
    they are not."""
    setattr(net, WRAPPED, wrapped)


def missing_internals() -> list[str]:
    """What of skorch's internals the package uses is not there, as
    ``'NeuralNet._validate_params'``: a method of :data:`OVERRIDDEN`, or a
    list of names of :data:`ATTRIBUTES` (class attributes of ``NeuralNet``
    that ``initialize`` extends)."""
    missing = [f'{cls.__name__}.{name}' for cls, names in OVERRIDDEN.items()
               for name in names if not callable(getattr(cls, name, None))]
    missing += [f'NeuralNet.{name}' for name in ATTRIBUTES
                if not isinstance(getattr(NeuralNet, name, None), list)]
    return missing


def check_internals(owner: str) -> None:
    """Refuse a skorch release that moved an internal the package uses
    (:func:`missing_internals`), before training; ``owner`` begins the
    message.

    Raises
    ------
    RuntimeError
      Naming what is missing, the installed skorch and the tested range.
    """
    releases.refuse_moved_internals(owner, 'skorch', missing_internals())
