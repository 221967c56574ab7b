"""The settings of a net that a resume must match: its hyper-parameters, and
what the position inside an epoch depends on.

A checkpoint's manifest records them (:func:`training_params`,
:func:`epoch_settings`, written by
:func:`~skorch_accel_callbacks.compat.build_manifest`); a resume with other
values is refused, naming each (:func:`check_same_params`,
:func:`check_epoch_settings`, :func:`check_train_rows`), instead of silently
continuing another training. Values are compared as
:func:`~skorch_accel_callbacks.fingerprint.describe` says
them: the same in every run with the same value, without pickling.
"""

from collections.abc import Collection
from typing import Any, NoReturn

from skorch_accel_callbacks import accelerate_io, format
from skorch_accel_callbacks.errors import CheckpointError
from skorch_accel_callbacks.fingerprint import describe

__all__ = ['check_epoch_settings', 'check_same_params', 'check_train_rows', 'epoch_end_advice',
           'epoch_settings', 'train_batch_size', 'training_params']


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
    # how fast the loader reads rows, not which ones
    'iterator_train__num_workers', 'iterator_train__pin_memory',
    'iterator_train__pin_memory_device', 'iterator_train__persistent_workers',
    'iterator_train__prefetch_factor', 'iterator_train__timeout',
})
# callbacks have their own state in a checkpoint; names with a leading
# underscore are skorch's bookkeeping (_params_to_validate)
_UNCHECKED_PREFIXES = ('callbacks__', 'iterator_valid__', '_')


def _checked(name: str) -> bool:
    return name not in _UNCHECKED_PARAMS and not name.startswith(_UNCHECKED_PREFIXES)


def training_params(net: Any) -> dict[str, Any]:
    """The net's parameters that change what training does (``get_params``
    without those in ``_UNCHECKED_PARAMS``), described by :func:`describe`."""
    return {name: describe(value) for name, value in sorted(net.get_params(deep=False).items())
            if _checked(name)}


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


def _show(description: Any) -> str:
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


def check_same_params(net: Any, manifest: dict[str, Any], path: str,
                      check: bool | Collection[str] = True) -> list[str]:
    """Raise :class:`CheckpointError` naming each parameter of ``net`` that
    changes training (:func:`training_params`) whose value differs from the
    one ``path`` was trained with, if ``check`` is True or does not name it
    (``check=False``: none); return the names of the allowed ones that
    differ. A manifest without ``params`` (before 0.3) is not checked."""
    saved = manifest.get('params')
    if not isinstance(saved, dict):
        return []
    current = training_params(net)
    names = sorted(name for name in set(saved) | set(current) if _checked(name))
    changes = _changes(saved, current, names)
    refused = [change for change in changes
               if check is True or (check is not False and change[0] not in check)]
    if refused:
        # with the names allowed already, if any
        names = tuple(dict.fromkeys(
            [*(() if isinstance(check, bool) else check), *(name for name, _, _ in refused)]))
        raise CheckpointError(
            f"{path} was trained with other hyper-parameters: {_said(refused)}. "
            "Resuming it would continue another training (in a hyper-parameter "
            "search every fit needs its own dirname); to resume it with the new "
            f"values on purpose, pass check_params={names!r} (or check_params=False) "
            "to AccelerateLoadInitState")
    return [name for name, _, _ in changes]


def epoch_end_advice(storage: Any, manifest: dict[str, Any]) -> str:
    """How to go on instead of from the checkpoint of ``manifest``, taken
    inside an epoch: from the newest checkpoint of ``storage`` (a
    :class:`~skorch_accel_callbacks.storage.CheckpointStorage`) taken at an
    epoch's end before it, named by its URL and its name for ``resume``
    (retention keeps one while those inside epochs rotate); if there is
    none, by training to the end of the checkpoint's epoch first, which
    saves there."""
    epochs = manifest.get('epoch', 0)
    name = None if storage is None else format.newest_at_epoch_end(storage.committed(), epochs)
    if name is not None:
        return (f"resume from {storage.url(name)}, taken at an epoch's end: pass "
                f"resume={name!r} to AccelerateLoadInitState")
    return ("there is no checkpoint taken at an epoch's end to resume instead: resume "
            f"it as it was saved, with max_epochs={epochs + 1}, which ends and saves at "
            f"the end of epoch {epochs + 1}, then go on from there")


def _refuse_inside_epoch(manifest: dict[str, Any], path: str,
                         changes: list[tuple[str, Any, Any]], storage: Any) -> NoReturn:
    raise CheckpointError(
        f"{path} was taken inside an epoch, after {format.batches_into_epoch(manifest)} "
        f"training batches, and what resuming it skips of that epoch depends on "
        f"settings that changed: {_said(changes)}. Rows would be trained twice or "
        "not at all (what an epoch's end resumes, these settings do not affect): resume "
        "with the checkpoint's settings, or " + epoch_end_advice(storage, manifest))


def check_epoch_settings(net: Any, manifest: dict[str, Any], path: str,
                         storage: Any = None) -> None:
    """Raise :class:`CheckpointError` naming each setting the position inside
    an epoch depends on (:func:`epoch_settings`, but the number of training
    rows: see :func:`check_train_rows`) whose value changed, if ``path`` was
    taken inside an epoch; the message advises a checkpoint of ``storage``
    (:func:`epoch_end_advice`). A checkpoint of an epoch's end, or one
    without ``epoch_settings`` (before 0.3), is not checked."""
    saved = manifest.get('epoch_settings')
    if not format.batches_into_epoch(manifest) or not isinstance(saved, dict):
        return
    current = epoch_settings(net)
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
    if format.batches_into_epoch(manifest) and saved is not None and saved != rows:
        _refuse_inside_epoch(manifest, path, [('train_rows', saved, rows)], storage)

