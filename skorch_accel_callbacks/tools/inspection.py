"""Read a folder of checkpoints without changing it: what is in it, what is
left over, who holds it, and whether every file of a checkpoint loads.

Used by the command ``python -m skorch_accel_callbacks`` (:mod:`.cli`).
Nothing here writes, renames or removes a file, and nothing runs code from
a file: safetensors files are read as such, other tensor files with
``torch.load(weights_only=True)``, JSON as JSON.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Any

from skorch_accel_callbacks.engine import is_sharded_model, model_files, read_sharded_model
from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.format import (
    LOCK_NAME,
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    PROBE_PREFIX,
    Problem,
    batches_into_epoch,
    check_manifest,
    frozen_parts_of,
    is_leftover,
    kind_of,
    linked_of,
    load_without_code,
    plain_history_name,
    stopped_early,
)
from skorch_accel_callbacks.storage import CheckpointStorage, open_storage, probe

__all__ = ['Verdict', 'checkpoint_bytes', 'describe', 'describe_one', 'leftovers',
           'lock_state', 'verify']


def checkpoint_bytes(saved: dict[str, Any]) -> int | None:
    """The size of a checkpoint, as its save message says it: the total of
    the files its manifest ``saved`` lists (the manifest's ``bytes``), the
    manifest itself not counted; None if the manifest lists no sizes."""
    if type(saved.get('bytes')) is int:
        return saved['bytes']
    files = saved.get('files')
    if not isinstance(files, dict) or not all(type(size) is int for size in files.values()):
        return None
    return sum(files.values())


def _score(storage: CheckpointStorage, name: str,
           saved: dict[str, Any]) -> tuple[str, float] | None:
    """``(column, value)`` of the last complete epoch in a checkpoint's history
    (rank 0's, where the ranks' differed): ``valid_loss``, else
    ``train_loss``; None if neither can be read."""
    try:
        rows = storage.read_json(name, plain_history_name(saved))
        # inside an epoch, the last row has no scores yet
        last = next(row for row in reversed(rows)
                    if isinstance(row, dict) and 'train_loss' in row)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None
    for key in ('valid_loss', 'train_loss'):
        if isinstance(last.get(key), (int, float)):
            return key, float(last[key])
    return None


def _saved_at(path: str | os.PathLike, saved: Any) -> datetime | None:
    """When the checkpoint was committed (UTC): the manifest's ``saved_at``
    or, for a manifest written before it was recorded, its file's time."""
    stamp = saved.get('saved_at') if isinstance(saved, dict) else None
    if isinstance(stamp, str):
        try:
            parsed = datetime.fromisoformat(stamp)
        except ValueError:
            pass
        else:
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    try:
        mtime = os.path.getmtime(os.path.join(path, MANIFEST_NAME))
    except OSError:
        return None
    return datetime.fromtimestamp(mtime, UTC)


def describe(storage: CheckpointStorage | str | os.PathLike) -> list[dict[str, Any]]:
    """One dict per checkpoint of ``storage`` (or of the folder or URL
    ``storage``), in training order
    (:meth:`~skorch_accel_callbacks.storage._interface.CheckpointStorage.committed`).

    Keys: ``name``, ``path`` (its URL in a store), ``epoch`` (complete
    epochs), ``step`` (optimizer steps; None before format 3),
    ``batches_into_epoch`` (0 at an epoch's end), ``best``, ``finished``,
    ``stopped_early``, ``world_size``, ``bytes`` (:func:`checkpoint_bytes`;
    None if the manifest cannot be read), ``saved_at``
    (a UTC datetime), ``save_seconds`` and ``blocked_seconds`` (None if not
    recorded), ``score`` (``(column, value)`` of the last epoch or None),
    ``problem`` (None, or why it is not a complete checkpoint: the quick
    check of resuming, manifest and sizes; :func:`verify` loads the files).
    """
    if not isinstance(storage, CheckpointStorage):
        storage = open_storage(storage)
    return [describe_one(storage, name, *storage.check(name)) for name in storage.committed()]


def describe_one(storage: CheckpointStorage, name: str, saved: Any,
                 problem: str | None) -> dict[str, Any]:
    """The row of :func:`describe` of checkpoint ``name`` of ``storage``, of
    manifest ``saved`` (``{}`` if none can be read) and ``problem``."""
    if not isinstance(saved, dict):
        saved = {}
    path = storage.url(name)
    return {
        'name': name,
        'path': path,
        'epoch': saved.get('epoch'),
        'step': (saved.get('position') or {}).get('step'),
        'batches_into_epoch': batches_into_epoch(saved),
        'best': bool(saved.get('best')),
        'finished': bool(saved.get('finished')),
        'stopped_early': stopped_early(saved) if saved else False,
        'world_size': saved.get('world_size'),
        'bytes': checkpoint_bytes(saved),
        'saved_at': _saved_at(path, saved),
        'save_seconds': saved.get('save_seconds'),
        'blocked_seconds': saved.get('blocked_seconds'),
        'score': _score(storage, name, saved),
        'problem': problem,
    }


def leftovers(dirname: str | os.PathLike) -> list[tuple[str, str]]:
    """``(name, what)`` of each entry of ``dirname`` that a killed or running
    job left: partial checkpoints, temporary and half-removed files, probe
    files. The next job that locks the folder removes them."""
    found = []
    for name in sorted(os.listdir(dirname)):
        if name.endswith(PARTIAL_SUFFIX):
            found.append((name, "partial checkpoint: a save that was interrupted, or is "
                                "being written now"))
        elif is_leftover(name):
            found.append((name, "temporary or half-removed file of an interrupted write"))
        elif name.startswith(PROBE_PREFIX):
            found.append((name, "probe file of save_on_each_node"))
    return found


def lock_state(dirname: str | os.PathLike) -> dict[str, Any]:
    """The folder's lock: ``{'exists', 'held', 'holder'}``.

    See :func:`.lock.probe`.
    """
    return probe(os.path.join(dirname, LOCK_NAME))


class Verdict:
    """What :func:`verify` found in one checkpoint.

    Attributes
    ----------
    path : str
      The checkpoint folder.
    damaged : list of str
      One message per damaged or missing file, naming it; empty when the
      checkpoint is intact.
    notes : list of str
      What does not make the checkpoint unusable (a file it does not list,
      a file hard-linked to an earlier checkpoint's).
    files : int
      Number of files the manifest lists.
    bytes : int
      Their total size, as the save message and ``list`` say it
      (:func:`checkpoint_bytes`).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = path
        self.damaged = []
        self.notes = []
        self.files = 0
        self.bytes = 0

    @property
    def intact(self) -> bool:
        return not self.damaged


def _load(file: str) -> dict[str, list[int]] | None:
    """Read ``file`` completely, as its reader would, without running code
    from it; the tensors of a state dict ``{name: shape}``, else None."""
    obj = load_without_code(file)
    if kind_of(file) != 'json' and isinstance(obj, dict):
        return {key: list(value.shape) for key, value in obj.items() if hasattr(value, 'shape')}
    return None


def verify(path: str | os.PathLike) -> Verdict:
    """Check one checkpoint folder completely; return a :class:`Verdict`.

    The manifest must be a JSON object of a format this version reads,
    listing its files; every listed file must exist, have its listed size
    and load without running code (safetensors, JSON,
    ``torch.load(weights_only=True)``); each model file must hold tensors of
    the names and shapes of the manifest's model layout. Files the manifest
    does not list are noted. Like resuming, it checks the checksums the
    manifest records (a flipped bit inside a tensor); a file that also
    fails to load is reported as such. Unlike resuming, it loads every file:
    it finds a damaged file whose size did not change (a flipped byte in a
    header) also in a checkpoint saved without checksums.
    """
    verdict = Verdict(path)
    sealed = os.path.join(path, MANIFEST_NAME)
    saved, problems = check_manifest(path)
    if saved is None:
        verdict.damaged.append(str(problems[0].error))
        return verdict
    at_fault = {problem.file: problem for problem in problems}
    files = saved['files']
    verdict.files = len(files)
    verdict.bytes = checkpoint_bytes(saved) or 0

    layouts = {}
    parts = frozen_parts_of(saved)
    try:
        for (name, file), entry in zip(model_files(saved, path), saved['models'],
                                       strict=True):
            # a model split in two holds its tensors in either file
            layout = (name, entry[1] if len(entry) > 1 else None, file not in parts)
            layouts[file] = layout
            if file in parts:
                layouts[parts[file]] = layout
    except CheckpointError as exc:  # and CorruptCheckpointError
        verdict.damaged.append(str(exc))

    for rel in sorted(files):
        damage = _damage(os.path.join(path, rel), at_fault.get(rel), layouts.get(rel))
        if damage:
            verdict.damaged.append(damage)
    for file, layout in layouts.items():
        # a sharded model's pieces load only together; not if one is at fault
        if is_sharded_model(os.path.join(path, file)) \
                and not any(rel.split(os.sep)[0] == file for rel in at_fault):
            damage = _sharded_damage(os.path.join(path, file), layout)
            if damage:
                verdict.damaged.append(damage)

    for root, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel != MANIFEST_NAME and rel not in files:
                verdict.notes.append(
                    f"{os.path.join(path, rel)} is not listed in {sealed} (added later?)")
    for rel, origin in sorted(linked_of(saved).items()):
        verdict.notes.append(
            f"{os.path.join(path, rel)} holds the bytes that {origin} wrote (a hard link, "
            "unchanged since): damage to it shows in every checkpoint that links it")
    return verdict


def _damage(file: str, problem: Problem | None,
            layout: tuple[str, dict[str, Any] | None, bool] | None) -> str | None:
    """Why the listed ``file`` is damaged, or None: ``problem`` is what
    :func:`_manifest.check_manifest` found, ``layout`` a model file's in the manifest.
    A file whose checksum differs is loaded all the same: that it does not
    load says more."""
    if problem is not None and not problem.checksum_differs:
        return str(problem.error)
    if kind_of(file) is None:
        return None if problem is None else str(problem.error)
    try:
        shapes = _load(file)
    except Exception as exc:  # pylint: disable=broad-except
        return f"{file} does not load without running code: {type(exc).__name__}: {exc}"
    if problem is not None:
        return str(problem.error)
    wrong = None if layout is None else _layout_problem(layout, shapes)
    return wrong and f"{file}: {wrong}"


def _sharded_damage(folder: str,
                    layout: tuple[str, dict[str, Any] | None, bool]) -> str | None:
    """Why the sharded model ``folder`` is damaged, or None: it must merge
    without running code into the tensors of the manifest's ``layout``."""
    try:
        state = read_sharded_model(folder)
    except CorruptCheckpointError as exc:
        return str(exc)
    wrong = _layout_problem(layout, {key: list(value.shape) for key, value in state.items()})
    return wrong and f"{folder}: {wrong}"


def _layout_problem(
        layout: tuple[str, dict[str, Any] | None, bool], shapes: dict[str, list[int]] | None,
) -> str | None:
    """What differs between a model file's tensors and the manifest's
    layout ``(model name, shapes, whole)``: not ``whole``, the file holds a
    part of the model (beside its frozen part, which holds the rest)."""
    name, expected, whole = layout
    if shapes is None:
        return f"holds no state dict of model {name!r}"
    if not isinstance(expected, dict):
        return None
    # safetensors keeps one name of tied weights: a name may be missing
    for key, shape in shapes.items():
        if key not in expected:
            return f"tensor {key!r} is not a parameter of model {name!r} in the manifest"
        if list(expected[key]) != shape:
            return (f"tensor {key!r} has shape {tuple(shape)}, the manifest says "
                    f"{tuple(expected[key])}")
    if not shapes and expected and whole:
        return f"holds no tensor of model {name!r}"
    return None

