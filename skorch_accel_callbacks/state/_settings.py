"""The settings of a net that a resume must match: its hyper-parameters,
its callbacks' settings, and what the position inside an epoch depends on.

A checkpoint's manifest records them (:func:`training_params`,
:func:`epoch_settings`, written by
:func:`~skorch_accel_callbacks.state._compat.checkpoint_record`); a resume with other
values is refused, naming each (:func:`check_same_params`,
:func:`check_epoch_settings`, :func:`check_train_rows`), instead of silently
continuing another training. Values are compared as
:func:`~skorch_accel_callbacks.state._fingerprint.describe` says
them: the same in every run with the same value, without pickling.
"""

import fnmatch
import hashlib
import inspect
import json
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any, NoReturn

from skorch.callbacks import (
    Checkpoint,
    LoadInitState,
    PrintLog,
    ProgressBar,
    TrainEndCheckpoint,
    logging as skorch_logging,
)

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.errors import CheckpointError
from skorch_accel_callbacks.format import batches_into_epoch, newest_at_epoch_end
from skorch_accel_callbacks.state._fingerprint import describe

__all__ = [
    'CALLBACKS_KEY', 'UNRECORDED_ATTRIBUTE', 'USERS_CALLBACKS_KEY', 'allowed', 'callback_params',
    'changed_callback_settings', 'check_epoch_settings', 'check_same_params', 'check_train_rows',
    'epoch_end_advice', 'epoch_settings', 'train_batch_size', 'training_params',
    'accelerator_params', 'ACCELERATOR_PREFIX', 'fit_id']


# Net parameters that change nothing of what a resumed run trains: they
# decide how long (the resume trains the epochs left of max_epochs) or how
# verbosely it trains, where it runs (the world size is checked apart), or
# only prediction, validation and loading outside training.
_UNCHECKED_PARAMS = frozenset({
    'max_epochs', 'verbose', 'warm_start', 'callbacks', 'accelerator', 'device',
    'iterator_valid', 'predict_nonlinearity', 'use_caching', 'torch_load_kwargs',
    'unwrap_after_train',
    # move only the position inside an epoch: epoch_settings, checked for a
    # checkpoint taken inside one
    'batch_size', 'iterator_train__batch_size',
    # how fast the loader reads rows, not which ones; how its workers start
    # (seeded from the training process alike: switched to forkserver to
    # escape CPython gh-112275, state/_worker_start.py)
    'iterator_train__num_workers', 'iterator_train__pin_memory',
    'iterator_train__pin_memory_device', 'iterator_train__persistent_workers',
    'iterator_train__prefetch_factor', 'iterator_train__timeout',
    'iterator_train__multiprocessing_context',
})
# callbacks have their own state in a checkpoint; names with a leading
# underscore are skorch's bookkeeping (_params_to_validate)
_UNCHECKED_PREFIXES = ('callbacks__', 'iterator_valid__', '_')
#: the recorded settings of the net's Accelerator (accelerator_params)
ACCELERATOR_PREFIX = 'accelerator.'



def _checked(name: str) -> bool:
    return name not in _UNCHECKED_PARAMS and not name.startswith(_UNCHECKED_PREFIXES)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


#: The class attribute with which a callback's author declares which of its
#: settings change nothing of what training does, so that a checkpoint does
#: not record them and a resume lets them change: ``True`` for all of them
#: and the callback itself (one that only observes, logs or injects a fault
#: may come and go between launches), or a collection of patterns
#: (:func:`fnmatch.fnmatchcase`) of its ``get_params()`` names. A class
#: attribute, so that instances stay clonable and hold nothing public but
#: their arguments and fitted state; subclasses inherit it.
UNRECORDED_ATTRIBUTE = 'unrecorded_params'


# The settings of callbacks that change nothing of what a resumed run trains,
# by class (and its subclasses), as patterns of get_params() names; None: the
# whole callback. Named by module and class, so that this module imports none
# of the package's callbacks (which import it).
_NOT_TRAINING = None
_UNRECORDED_CALLBACK_SETTINGS: dict[str, frozenset[str] | None] = {
    # they only say what happens, on the terminal or to a tracking service
    **{_qualified(cls): _NOT_TRAINING for cls in (
        PrintLog, ProgressBar, skorch_logging.TensorBoard, skorch_logging.WandbLogger,
        skorch_logging.NeptuneLogger, skorch_logging.SacredLogger,
        skorch_logging.MlflowLogger)},
    # it holds the check itself: its check_params decides what is compared
    'skorch_accel_callbacks.callbacks.load_state.AccelerateLoadInitState': _NOT_TRAINING,
    # every argument says where, when and how checkpoints are written, kept
    # and marked best (dirname, local_dir, storage_options, durable,
    # async_save, safe_serialization, reuse_frozen, keep_last, keep_best, sink, every_n_*,
    # save_on_signal, monitor, event_name), none what is trained, and the
    # name it is listed under does not matter (the loader finds it by folder)
    'skorch_accel_callbacks.callbacks.checkpoint.AccelerateCheckpoint': _NOT_TRAINING,
    # the files skorch's (and our drop-in) checkpoints write and read, and
    # what a failed save does; their monitor and load_best change the net
    _qualified(Checkpoint): frozenset({'f_*', 'fn_prefix', 'dirname', 'use_safetensors'}),
    _qualified(TrainEndCheckpoint): frozenset({'f_*', 'fn_prefix', 'dirname',
                                               'use_safetensors'}),
    _qualified(LoadInitState): frozenset({'checkpoint', 'use_safetensors'}),
    'skorch_accel_callbacks.params.checkpoint.ParamsCheckpoint': frozenset({'on_error'}),
    'skorch_accel_callbacks.params.train_end.TrainEndParamsCheckpoint': frozenset({'on_error'}),
}
# in every callback: where its messages go and how many; names with a
# leading underscore are private state, not settings
_UNRECORDED_ANYWHERE = frozenset({'sink', 'verbose', '_*'})

#: the key of a manifest's ``params`` that lists the callbacks whose settings
#: it records (absent before callbacks were recorded: they are not checked)
CALLBACKS_KEY = 'callbacks'
#: the key of a manifest's ``params`` that says the user's own callbacks are
#: recorded too (absent before they were: only skorch's and this package's)
USERS_CALLBACKS_KEY = 'callbacks_of_users'
_CALLBACK_PREFIX = 'callbacks__'
_NOT_COMPARED = frozenset({CALLBACKS_KEY, USERS_CALLBACKS_KEY})


def _declared(callback: Any) -> frozenset[str] | None:
    """The patterns ``callback``'s class declares unrecorded
    (:data:`UNRECORDED_ATTRIBUTE`); None: all of them."""
    declared = getattr(type(callback), UNRECORDED_ATTRIBUTE, ())
    if declared is True:
        return None
    if isinstance(declared, str) or not all(isinstance(p, str) for p in declared):
        raise TypeError(
            f"{_qualified(type(callback))}.{UNRECORDED_ATTRIBUTE} must be True or a "
            f"collection of patterns of its get_params() names, not {declared!r}")
    return frozenset(declared)


def _unrecorded(callback: Any) -> frozenset[str] | None:
    """The patterns of ``callback``'s unrecorded settings; None: all of them."""
    declared = _declared(callback)
    if declared is None:
        return None
    patterns = set(_UNRECORDED_ANYWHERE) | declared
    for cls in type(callback).__mro__:
        entry = _UNRECORDED_CALLBACK_SETTINGS.get(_qualified(cls), frozenset())
        if entry is _NOT_TRAINING:
            return None
        patterns |= entry
    return frozenset(patterns)


def callback_params(net: Any) -> dict[str, Any]:
    """The settings of the net's callbacks that change training, by
    ``net.callbacks_`` name, of every callback (skorch's, this package's and
    the user's own): ``callbacks__<name>`` its class,
    ``callbacks__<name>__<param>`` each of its ``get_params(deep=False)``
    (without those of ``_UNRECORDED_CALLBACK_SETTINGS``, ``sink``,
    ``verbose``, and those its class declares in
    :data:`UNRECORDED_ATTRIBUTE`), described by :func:`describe`;
    :data:`CALLBACKS_KEY` the names recorded."""
    params, names = {}, []
    for name, callback in net.callbacks_:
        unrecorded = _unrecorded(callback)
        if unrecorded is None:
            continue
        names.append(name)
        params[_CALLBACK_PREFIX + name] = describe(type(callback))
        for param, value in sorted(callback.get_params(deep=False).items()):
            if not any(fnmatch.fnmatchcase(param, pattern) for pattern in unrecorded):
                params[f"{_CALLBACK_PREFIX}{name}__{param}"] = describe(value)
    params[CALLBACKS_KEY] = names
    params[USERS_CALLBACKS_KEY] = True
    return params


def accelerator_params(net: Any) -> dict[str, Any]:
    """The settings of the net's ``Accelerator`` that change what is trained
    (mixed precision, gradient accumulation, the data loader configuration),
    as ``accelerator.<setting>``; none for a net without one."""
    accelerator = getattr(net, 'accelerator', None)
    if accelerator is None:
        return {}
    return {f'{ACCELERATOR_PREFIX}{name}': describe(value)
            for name, value in accelerate_io.training_settings(accelerator).items()}


def training_params(net: Any) -> dict[str, Any]:
    """The net's parameters that change what training does (``get_params``
    without those in ``_UNCHECKED_PARAMS``), its accelerator's settings
    (:func:`accelerator_params`) and its callbacks' settings
    (:func:`callback_params`), described by :func:`describe`."""
    params = {name: describe(value) for name, value in sorted(net.get_params(deep=False).items())
              if _checked(name)}
    params.update(accelerator_params(net))
    params.update(callback_params(net))
    return params


def fit_id(net: Any, data: Any) -> str:
    """A short digest of one fit: the net's recorded settings
    (:func:`training_params`), its ``max_epochs`` (which the resume check
    lets change, but which decides what a finished fit returns) and the
    fingerprint of its training data, ``data``. The same for a clone fitted
    on the same data, on every rank and in every run."""
    described = {'params': training_params(net), 'max_epochs': net.max_epochs, 'data': data}
    text = json.dumps(described, sort_keys=True, default=repr)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def train_batch_size(net: Any) -> Any:
    """The batch size of the net's training loader."""
    return net.get_params_for('iterator_train').get('batch_size', net.batch_size)


def epoch_settings(net: Any, loader: Any = None) -> dict[str, Any]:
    """What the position inside an epoch (a number of training batches on
    each rank, skipped by a resume) depends on, besides the world size:
    the training loader's batch size, gradient accumulation, shuffling,
    the train split and the number of training rows (``None`` without
    ``loader``)."""
    dataset = getattr(loader, 'dataset', None)
    return {
        'batch_size': describe(train_batch_size(net)),
        'accumulation_steps': accelerate_io.accumulation_steps(net.accelerator),
        'shuffle': describe(net.get_params_for('iterator_train').get('shuffle', False)),
        'train_split': describe(net.train_split),
        'train_rows': len(dataset) if hasattr(dataset, '__len__') else None,
    }


_MISSING = object()


# a value shown in a message is cut to about this many characters
_SHOWN_CHARACTERS = 80


def _show(description: Any) -> str:
    """A description as a message shows it, a long one shortened."""
    shown = _show_whole(description)
    if len(shown) <= _SHOWN_CHARACTERS:
        return shown
    return f"{shown[:_SHOWN_CHARACTERS - 20]}... ({len(shown)} characters)"


def _show_whole(description: Any) -> str:
    """A description as a message shows it."""
    if description is _MISSING:
        return 'not set'
    if isinstance(description, dict) and 'callable' in description:
        return description['callable']
    if isinstance(description, dict) and 'float' in description:
        return description['float']
    if isinstance(description, dict) and 'repr' in description:
        return description['repr']
    if isinstance(description, dict) and isinstance(description.get('data'), dict):
        data = description['data']
        return (f"{description['type']} of shape {tuple(data['shape'])}, {data['dtype']} "
                f"(rows hashed {data['sample']})")
    if isinstance(description, dict) and 'type' in description:
        inner = description.get('params', description.get('attrs'))
        if inner is None:
            return description['type']
        return f"{description['type']}(" + ', '.join(
            f"{key}={_show(value)}" for key, value in inner.items()) + ')'
    return repr(description)


def _changes(saved: dict[str, Any], current: dict[str, Any],
             names: list[str]) -> list[tuple[str, Any, Any]]:
    return [(name, saved.get(name, _MISSING), current.get(name, _MISSING)) for name in names
            if saved.get(name, _MISSING) != current.get(name, _MISSING)]


def _said(changes: list[tuple[str, Any, Any]]) -> str:
    return '; '.join(f"{name}: {_show(old)} in the checkpoint, {_show(new)} now"
                     for name, old, new in changes)


def _callback_of(name: str) -> tuple[str, str | None] | None:
    """``(callback name, setting or None for its class)`` of a recorded
    callback setting's name; None for a net parameter."""
    if not name.startswith(_CALLBACK_PREFIX):
        return None
    callback, _, param = name[len(_CALLBACK_PREFIX):].partition('__')
    return callback, param or None


def allowed(name: str, check: bool | Collection[str]) -> bool:
    """Whether ``check`` (``check_params`` of AccelerateLoadInitState) lets
    the setting ``name`` differ: ``False`` every one, ``True`` none, a tuple
    the names it lists, and all settings of a callback it lists by
    ``callbacks__<name>``."""
    if isinstance(check, bool):
        return not check
    return any(name == entry or (entry.startswith(_CALLBACK_PREFIX)
                                 and name.startswith(entry + '__')) for entry in check)


def changed_callback_settings(names: Iterable[str]) -> dict[str, frozenset[str] | None]:
    """Of the settings ``names`` that differ from a checkpoint's (as
    :func:`check_same_params` returns them), those of each callback by name:
    the names of its changed ``get_params``, or None where its class
    changed (or it is new)."""
    settings: dict[str, set[str] | None] = {}
    for name in names:
        of = _callback_of(name)
        if of is None:
            continue
        callback, param = of
        if param is None:
            settings[callback] = None
        elif settings.get(callback, set()) is not None:
            settings.setdefault(callback, set()).add(param)
    return {name: None if params is None else frozenset(params)
            for name, params in settings.items()}


# the name skorch gives an unnamed callback that shares its class name with
# another: <class>_<position among them, from 1>
_POSITIONAL = re.compile(r'(?P<base>.+)_[1-9][0-9]*')


def _settings_of(params: dict[str, Any], callback: str) -> str | None:
    """The recorded class and settings of ``callback``, comparable; None if
    ``params`` has none."""
    prefix = _CALLBACK_PREFIX + callback
    if prefix not in params:
        return None
    return json.dumps({key[len(prefix):]: value for key, value in params.items()
                       if key == prefix or key.startswith(prefix + '__')}, sort_keys=True)


def _positional_base(params: dict[str, Any], callback: str) -> str | None:
    """The class name skorch numbered ``callback`` after, if it is unnamed."""
    match = _POSITIONAL.fullmatch(callback)
    kind = params.get(_CALLBACK_PREFIX + callback)
    if match is None or not isinstance(kind, dict):
        return None
    class_name = str(kind.get('callable', '')).rsplit('.', 1)[-1]
    return match['base'] if class_name == match['base'] else None


def _reordered(changes: list[tuple[str, Any, Any]], saved: dict[str, Any],
               current: dict[str, Any]) -> dict[str, list[str]]:
    """The unnamed callbacks (by the class name they are numbered after)
    whose settings are those of the checkpoint's, but in another order."""
    bases = {base for name, _, _ in changes if (of := _callback_of(name)) is not None
             for base in (_positional_base(saved, of[0]), _positional_base(current, of[0]))
             if base is not None}
    reordered = {}
    for base in sorted(bases):
        group = sorted({name for params in (saved, current)
                        for name in params.get(CALLBACKS_KEY, [])
                        if _positional_base(params, name) == base},
                       key=lambda name: int(name.rsplit('_', 1)[1]))
        before = sorted(filter(None, (_settings_of(saved, name) for name in group)))
        after = sorted(filter(None, (_settings_of(current, name) for name in group)))
        if before == after:
            reordered[base] = group
    return reordered


# the packages whose callbacks declare their unrecorded settings here, in
# _UNRECORDED_CALLBACK_SETTINGS; a refusal of another's setting says how its
# author declares one that changes nothing of training
_LIBRARIES = ('skorch.', 'skorch_accel_callbacks.')


def _of_users(changes: list[tuple[str, Any, Any]], saved: dict[str, Any],
              current: dict[str, Any]) -> list[str]:
    """The names of the user's own callbacks (of no library) among ``changes``."""
    names = []
    for name, _, _ in changes:
        of = _callback_of(name)
        kinds = [params.get(_CALLBACK_PREFIX + of[0]) for params in (current, saved)] \
            if of is not None else []
        kind = next((k for k in kinds if isinstance(k, dict)), None)
        if kind is not None and not _of_library(kind) and of[0] not in names:
            names.append(of[0])
    return names


def _plain_state(changes: list[tuple[str, Any, Any]],
                 callbacks: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(callback, attribute)`` of each change that is a plain public
    attribute of one of ``callbacks`` (by name) rather than an argument of
    its ``__init__``: state kept where skorch's ``get_params`` reports it as
    a setting (a counter)."""
    plain = []
    for name, _, _ in changes:
        of = _callback_of(name)
        callback = callbacks.get(of[0]) if of is not None and of[1] is not None else None
        if callback is None or '__' in of[1]:
            continue
        try:
            arguments = inspect.signature(type(callback).__init__).parameters
        except (TypeError, ValueError):
            continue
        if of[1] not in arguments:
            plain.append((of[0], of[1]))
    return plain


def _plain_state_advice(plain: list[tuple[str, str]]) -> str:
    """How to keep the state of callbacks' plain attributes exact across a
    resume, first, then the other ways and what each gives up."""
    attributes = ', '.join(f"{callback}.{attr}" for callback, attr in plain)
    renamed = ', '.join(f"{attr!r} -> {attr + '_'!r}" for _, attr in plain)
    return (
        f"{attributes} {'is' if len(plain) == 1 else 'are'} not an argument of the "
        "callback's __init__ but state it keeps, which skorch's get_params reports as a "
        "setting. To resume it exactly, make it fitted state: a name ending in '_' "
        f"({renamed}), set in the callback's initialize(); a checkpoint holds it and a "
        "resume restores it (or give the callback state_dict()/load_state_dict()). "
        "Naming it in check_params or in the class's unrecorded_params lets the resume "
        "through instead, but the resumed run then starts it as a new run sets it, not "
        "as it was saved. ")


def _of_library(kind: Any) -> bool:
    """Whether a callback's recorded class (:func:`describe`) is skorch's or
    this package's (a class it cannot tell counts as one: not the user's)."""
    return not (isinstance(kind, dict) and 'callable' in kind) \
        or kind['callable'].startswith(_LIBRARIES)


def _show_class(description: Any) -> str:
    return 'no such callback' if description is _MISSING else _show(description)


def _explained(changes: list[tuple[str, Any, Any]], saved: dict[str, Any],
               current: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
    """The refused ``changes`` said: ``(name to allow, text)`` for each
    change, one for a callback whose class changed (or that is new or
    gone), and a text for unnamed callbacks listed in another order."""
    reordered = _reordered(changes, saved, current)
    moved = {name for group in reordered.values() for name in group}
    whole = {of[0] for name, _, _ in changes
             if (of := _callback_of(name)) is not None and of[1] is None}
    said = []
    for name, old, new in changes:
        of = _callback_of(name)
        if of is not None and (of[0] in moved or (of[0] in whole and of[1] is not None)):
            continue
        shown = _show_class if of is not None and of[1] is None else _show
        said.append((name, f"{name}: {shown(old)} in the checkpoint, {shown(new)} now"))
    orders = [
        f"the unnamed {base} callbacks ({', '.join(group)}) are listed in another order "
        "than in the checkpoint: skorch names them by their position and their states "
        "are restored by name, so each would resume another's; list them in the "
        "checkpoint's order, or give each a name of its own in a new run "
        f"(callbacks=[('name', {base}(...)), ...])" for base, group in reordered.items()]
    return said, orders


def _with_introduced(saved: dict[str, Any], manifest: dict[str, Any],
                     current: dict[str, Any]) -> dict[str, Any]:
    """The recorded parameters, with those that a checkpoint written before
    they existed was trained as: without ``reduce_metrics`` each rank
    logged its own losses (False), which makes no difference in one
    process (then as this run has it); without the accelerator's settings,
    as this run has them."""
    if not any(name.startswith(ACCELERATOR_PREFIX) for name in saved):
        # written before the accelerator's settings were recorded: what they
        # were cannot be told, and a checkpoint inside an epoch was checked
        # for its gradient accumulation (epoch_settings)
        saved = dict(saved, **{name: value for name, value in current.items()
                               if name.startswith(ACCELERATOR_PREFIX)})
    if 'reduce_metrics' in saved or 'reduce_metrics' not in current:
        return saved
    one_process = manifest.get('world_size', 1) == 1
    return dict(saved, reduce_metrics=current['reduce_metrics'] if one_process else False)


def _as_recorded_then(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """``current`` as a checkpoint written before the user's own callbacks
    were recorded (:data:`USERS_CALLBACKS_KEY`) recorded it: without them,
    so that upgrading the package does not refuse every checkpoint of a
    net with a callback of its own."""
    if CALLBACKS_KEY not in saved or USERS_CALLBACKS_KEY in saved:
        return current
    users = {name for name in current.get(CALLBACKS_KEY, ())
             if not _of_library(current.get(_CALLBACK_PREFIX + name))}
    then = {key: value for key, value in current.items()
            if (_callback_of(key) or (None,))[0] not in users}
    then[CALLBACKS_KEY] = [name for name in current[CALLBACKS_KEY] if name not in users]
    return then


def check_same_params(manifest: dict[str, Any], current: dict[str, Any], path: str,
                      check: bool | Collection[str] = True, *,
                      callbacks: Mapping[str, Any]) -> list[str]:
    """Raise :class:`CheckpointError` naming each parameter that changes
    training, or setting of a callback, whose value in ``current`` (the
    :func:`training_params` of the net that resumes) differs from the one
    ``path`` was trained with, unless ``check`` allows it (:func:`allowed`);
    return the names of the allowed ones that differ. ``callbacks``, the
    net's callbacks by name, tell which refused setting is a callback's
    plain attribute, for the advice. A callback whose class changed
    under its name, that is new or that is gone is named once; unnamed
    callbacks of a class listed in another order are refused as such. A
    manifest without ``params`` (the earliest checkpoints) is not checked; one without
    callbacks' settings (:data:`CALLBACKS_KEY`) is checked for the net's
    parameters only."""
    saved = manifest.get('params')
    if not isinstance(saved, dict):
        return []
    saved = _with_introduced(saved, manifest, current)
    current = _as_recorded_then(saved, current)
    recorded = CALLBACKS_KEY in saved
    names = sorted(name for name in set(saved) | set(current) if name not in _NOT_COMPARED and (
        _checked(name) or (recorded and name.startswith(_CALLBACK_PREFIX))))
    changes = _changes(saved, current, names)
    refused = [change for change in changes if not allowed(change[0], check)]
    if refused:
        said, orders = _explained(refused, saved, current)
        message = f"{path} was trained with other hyper-parameters: " + '; '.join(
            [text for _, text in said] + orders) + '. '
        plain = _plain_state(refused, callbacks)
        if plain:
            message += _plain_state_advice(plain)
        if said:
            # with the names allowed already, if any
            names = tuple(dict.fromkeys(
                [*(() if isinstance(check, bool) else check), *(name for name, _ in said)]))
            message += (
                "Resuming it would continue another training (in a hyper-parameter "
                "search every fit needs its own dirname); to resume it with the new "
                f"values on purpose, pass check_params={names!r} (or check_params=False) "
                "to AccelerateLoadInitState")
        users = _of_users(refused, saved, current)
        if users:
            message += ('. ' if said else '') + (
                f"A callback of your own ({', '.join(users)}) whose settings change "
                f"nothing of training declares them in its class, {UNRECORDED_ATTRIBUTE} "
                "= True (or a tuple of its parameters' names), and is not recorded")
        raise CheckpointError(message.rstrip(' '))
    return [name for name, _, _ in changes]


def epoch_end_advice(storage: Any, manifest: dict[str, Any]) -> str:
    """How to go on instead of from the checkpoint of ``manifest``, taken
    inside an epoch: from the newest checkpoint of ``storage`` (a
    :class:`~skorch_accel_callbacks.storage._interface.CheckpointStorage`) taken at an
    epoch's end before it, named by its URL and its name for ``resume``
    (retention keeps one while those inside epochs rotate); if there is
    none, by training to the end of the checkpoint's epoch first, which
    saves there."""
    epochs = manifest.get('epoch', 0)
    name = None if storage is None else newest_at_epoch_end(storage.committed(), epochs)
    if name is not None:
        return (f"resume from {storage.url(name)}, taken at an epoch's end: pass "
                f"resume={name!r} to AccelerateLoadInitState")
    return ("there is no checkpoint taken at an epoch's end to resume instead: resume "
            f"it as it was saved, with max_epochs={epochs + 1}, which ends and saves at "
            f"the end of epoch {epochs + 1}, then go on from there")


def _refuse_inside_epoch(manifest: dict[str, Any], path: str,
                         changes: list[tuple[str, Any, Any]], storage: Any) -> NoReturn:
    raise CheckpointError(
        f"{path} was taken inside an epoch, after {batches_into_epoch(manifest)} "
        f"training batches, and what resuming it skips of that epoch depends on "
        f"settings that changed: {_said(changes)}. Rows would be trained twice or "
        "not at all (what an epoch's end resumes, these settings do not affect): resume "
        "with the checkpoint's settings, or " + epoch_end_advice(storage, manifest))


def check_epoch_settings(manifest: dict[str, Any], current: dict[str, Any], path: str,
                         storage: Any = None) -> None:
    """Raise :class:`CheckpointError` naming each setting the position inside
    an epoch depends on whose value in ``current`` (the
    :func:`epoch_settings` of the net that resumes; the number of training
    rows is not compared: see :func:`check_train_rows`) changed, if ``path`` was
    taken inside an epoch; the message advises a checkpoint of ``storage``
    (:func:`epoch_end_advice`). A checkpoint of an epoch's end, or one
    without ``epoch_settings`` (the earliest checkpoints), is not checked."""
    saved = manifest.get('epoch_settings')
    if not batches_into_epoch(manifest) or not isinstance(saved, dict):
        return
    changes = _changes(saved, current, [name for name in current if name != 'train_rows'])
    if changes:
        _refuse_inside_epoch(manifest, path, changes, storage)


def check_train_rows(manifest: dict[str, Any], rows: int, path: str,
                     storage: Any = None) -> None:
    """Raise :class:`CheckpointError` if ``path`` was taken inside an epoch
    of another number of training rows than ``rows`` (known once the train
    split is made, when the first epoch begins), advising a checkpoint of
    ``storage`` (:func:`epoch_end_advice`)."""
    saved = (manifest.get('epoch_settings') or {}).get('train_rows')
    if batches_into_epoch(manifest) and saved is not None and saved != rows:
        _refuse_inside_epoch(manifest, path, [('train_rows', saved, rows)], storage)

