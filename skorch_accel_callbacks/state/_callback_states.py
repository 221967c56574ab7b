"""The state of the net's callbacks in a checkpoint: what each had learned
by the end of an epoch (by name), and inside an epoch the scratch space of
the epoch under way; both are pairs of JSON and safetensors files
(:mod:`~skorch_accel_callbacks.state._json_tensors`), nothing pickled, so
loading executes no code. A callback whose state inside an epoch no
checkpoint is known to hold is named by :func:`unknown_batch_state`.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from skorch.callbacks import (
    BatchScoring,
    Callback,
    EpochScoring,
    EpochTimer,
    GradientNormClipping,
    LRScheduler,
    PassthroughScoring,
    PrintLog,
    ProgressBar,
)

from skorch_accel_callbacks.format import callbacks_names, epoch_caches_names
from skorch_accel_callbacks.state._json_tensors import Encode, encode_pair, read_pair, write_pair

if TYPE_CHECKING:
    from skorch import NeuralNet

__all__ = [
    'encode_callback_states',
    'load_callback_states',
    'apply_callback_states',
    'save_epoch_caches',
    'load_epoch_caches',
    'apply_epoch_caches',
    'unknown_batch_state',
]

# Fitted attributes that are scratch space of one epoch, not state: saving
# them would only cost disk (they are reset when the next epoch begins).
_TRANSIENT = {
    EpochScoring: ('y_trues_', 'y_preds_'),
}
# Fitted attributes that hold a wall-clock time: saved as the seconds since
# then and given back as that long before the resume, so that a resumed
# epoch's ``dur`` counts the time spent training, not the time the job was down.
_CLOCKS = {
    EpochTimer: ('epoch_start_time_',),
}
# Callbacks with nothing to resume: restoring PrintLog would only suppress
# the table header of the resumed run.
_SKIPPED = (PrintLog,)
# key under which a callback's own state_dict() is stored
_OWN_STATE = '<state_dict>'


def _is_configuration(value: Any) -> bool:
    # classes and functions are set up by the user's code, not learned
    return isinstance(value, type) or (
        callable(value) and not hasattr(value, 'state_dict'))


def _callback_state(callback: Callback) -> dict[str, dict[str, Any]]:
    """The attributes of a callback that a resumed run needs."""
    if hasattr(callback, 'state_dict') and hasattr(callback, 'load_state_dict'):
        return {_OWN_STATE: {'state_dict': callback.state_dict()}}
    transient, clocks = (), ()
    for cls, names in _TRANSIENT.items():
        if isinstance(callback, cls):
            transient = names
    for cls, names in _CLOCKS.items():
        if isinstance(callback, cls):
            clocks = names
    state = {}
    for attr, value in vars(callback).items():
        if not attr.endswith('_') or attr.startswith('_') or attr in transient:
            continue
        if _is_configuration(value):
            continue
        if attr in clocks and value is not None:
            state[attr] = {'elapsed': time.time() - value}
        elif hasattr(value, 'state_dict') and not isinstance(value, type):
            state[attr] = {'state_dict': value.state_dict()}
        else:
            state[attr] = {'value': value}
    return state


def encode_callback_states(
        net: NeuralNet, skip: Collection[Callback] = (), warn: bool = True,
) -> tuple[bytes, bytes]:
    """The state of every callback of ``net`` by name, as the bytes of its
    pair of files (:func:`~skorch_accel_callbacks.state._json_tensors.encode_pair`).

    A callback with ``state_dict()``/``load_state_dict()`` methods decides
    itself what is saved; for the others, the fitted attributes (names ending
    in ``_``) are saved, and objects with a ``state_dict`` (such as the
    scheduler of skorch's ``LRScheduler``) through it. An attribute that is
    neither data nor has a ``state_dict`` is left out with a warning.
    """
    def states(encode: Encode) -> dict[str, dict[str, dict[str, Any]]]:
        encoded_states = {}
        for name, callback in net.callbacks_:
            if isinstance(callback, _SKIPPED) or any(callback is s for s in skip):
                continue
            encoded = {}
            for attr, entry in _callback_state(callback).items():
                key = f"{name}/{attr}"
                try:
                    encoded[attr] = {kind: encode(value, key) for kind, value in entry.items()}
                except TypeError as exc:
                    if not warn:
                        continue
                    # the writer, past encode_pair and encode_rank_states
                    warnings.warn(
                        f"callback {name!r}: attribute {attr!r} of type {exc} cannot "
                        "be saved without pickle and is not restored on resume; give "
                        "the callback state_dict()/load_state_dict() methods to "
                        "control what is saved", UserWarning, stacklevel=5)
            encoded_states[name] = encoded
        return encoded_states

    return encode_pair(states)


def load_callback_states(folder: str | os.PathLike,
                         rank: int | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Read the callbacks' states of ``folder`` (the copy that every rank
    shares, or with ``rank`` that rank's own): name -> attr -> entry."""
    json_name, tensors_name = callbacks_names(rank)
    return read_pair(f"{folder}/{json_name}", f"{folder}/{tensors_name}", depth=3)


def apply_callback_states(
        callbacks: Iterable[tuple[str, Callback]],
        states: Mapping[str, Mapping[str, Mapping[str, Any]]],
        changed: Mapping[str, Collection[str] | None] | None = None,
) -> None:
    """Give ``callbacks`` (a net's ``callbacks_``: name, callback) the state
    they had when the net was saved.

    ``changed``: the settings (``get_params`` names) of each callback by name
    that a resume let differ from the checkpoint's
    (:func:`~skorch_accel_callbacks.state._settings.changed_callback_settings`);
    their new values win over the restored state. They are set again after
    the state is loaded, and in a restored object's ``state_dict`` (the
    scheduler of skorch's ``LRScheduler`` holds its ``gamma``,
    ``step_size``...) the keys of their names keep the new object's values,
    and keys it has no more (those of another policy) are dropped. A callback
    whose class changed (None) starts afresh.
    """
    changed = changed or {}
    for name, callback in callbacks:
        attrs = states.get(name)
        new = changed.get(name, ())
        if attrs is None or new is None:
            continue
        kept = {param: value for param, value in callback.get_params(deep=False).items()
                if param in new}
        _apply_state(name, callback, attrs, new)
        for param, value in kept.items():
            setattr(callback, param, value)


def _with_new_settings(fresh: Mapping[str, Any], saved: Mapping[str, Any],
                       new: Collection[str]) -> Mapping[str, Any]:
    """``saved``, a state_dict, with the keys ``new`` of ``fresh`` (the
    state_dict of the object it is loaded into), and without the keys that
    ``fresh`` lacks; unchanged without ``new``."""
    if not new:
        return saved
    state = {key: value for key, value in saved.items() if key in fresh}
    state.update({key: fresh[key] for key in new if key in fresh})
    return state


def _apply_state(name: str, callback: Callback, attrs: Mapping[str, Mapping[str, Any]],
                 new: Collection[str]) -> None:
    if _OWN_STATE in attrs:
        callback.load_state_dict(attrs[_OWN_STATE]['state_dict'])
        return
    for attr, entry in attrs.items():
        if 'state_dict' in entry:
            target = getattr(callback, attr, None)
            if target is None or not hasattr(target, 'load_state_dict'):
                raise ValueError(
                    f"callback {name!r} has no {attr!r} to load the saved "
                    "state into")
            target.load_state_dict(
                _with_new_settings(target.state_dict(), entry['state_dict'], new))
        elif 'elapsed' in entry:
            setattr(callback, attr, time.time() - entry['elapsed'])
        else:
            setattr(callback, attr, entry['value'])


# ---------------------------------------------------------------- within an epoch

def save_epoch_caches(folder: str | os.PathLike, rank: int, net: NeuralNet) -> None:
    """Save this rank's scratch space of the epoch under way (the
    predictions EpochScoring collects on the training batches), which a
    checkpoint in the middle of an epoch needs: at the epoch's end they are
    scored together."""
    def caches(encode: Encode) -> dict[str, dict[str, Any]]:
        encoded = {}
        for name, callback in net.callbacks_:
            for cls, attrs in _TRANSIENT.items():
                if isinstance(callback, cls):
                    encoded[name] = {attr: encode(getattr(callback, attr, None),
                                                  f"{name}/{attr}")
                                     for attr in attrs}
        return encoded

    json_name, tensors_name = epoch_caches_names(rank)
    write_pair(f"{folder}/{json_name}", f"{folder}/{tensors_name}", caches)


def load_epoch_caches(folder: str | os.PathLike, rank: int) -> dict[str, dict[str, Any]]:
    json_name, tensors_name = epoch_caches_names(rank)
    return read_pair(f"{folder}/{json_name}", f"{folder}/{tensors_name}", depth=2)


def apply_epoch_caches(
        callbacks: Iterable[tuple[str, Callback]],
        caches: Mapping[str, Mapping[str, Any]],
        device: torch.device | str | None = None,
) -> None:
    """Give ``callbacks`` (a net's ``callbacks_``: name, callback) their
    scratch space of the epoch back; tensors go to ``device`` (where the
    net's predictions are)."""
    def place(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and device is not None:
            return value.to(device)
        if isinstance(value, list):
            return [place(v) for v in value]
        return value

    for name, callback in callbacks:
        for attr, value in caches.get(name, {}).items():
            setattr(callback, attr, place(value))


# skorch's callbacks whose state within an epoch a checkpoint holds: their
# fitted attributes (LRScheduler's batch count and scheduler), EpochScoring's
# caches, the history's batch rows; or that have none (GradientNormClipping:
# its settings only, which the checkpoint records)
_BATCH_STATE_KNOWN = (BatchScoring, EpochScoring, EpochTimer, GradientNormClipping,
                      LRScheduler, PassthroughScoring, PrintLog, ProgressBar)


def unknown_batch_state(net: NeuralNet, own: Iterable[type[Callback]] = ()) -> list[str]:
    """Names of the net's callbacks that act on every batch and whose state
    within an epoch no checkpoint is known to hold: not one of skorch's
    handled above nor ``own``, and without ``state_dict()`` (only their
    fitted attributes, as the main process saved them, come back)."""
    names = []
    for name, callback in net.callbacks_:
        if isinstance(callback, _BATCH_STATE_KNOWN + tuple(own)) or hasattr(
                callback, 'state_dict'):
            continue
        hooks = ('on_batch_begin', 'on_batch_end', 'on_grad_computed')
        if any(getattr(type(callback), hook) is not getattr(Callback, hook) for hook in hooks):
            names.append(name)
    return names
