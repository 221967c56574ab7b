"""The on-disk format: the name of every file and folder this package
writes, and the manifest that seals a checkpoint folder.

A folder of checkpoints holds checkpoint folders ``epoch-NNNN`` (or
``epoch-NNNN-step-SSSSSSSS`` inside an epoch), each written as
``<name>.partial`` and renamed once complete, the pointers ``latest.json``
and ``best.json`` (``{"name": <checkpoint>}``) and the lock file ``.lock``.
Besides accelerate's files, a checkpoint folder holds the history, the
callbacks' states, per rank the training loader's state (and inside an
epoch the position and the epoch's caches), and ``manifest.json``.

``manifest.json`` is written last into a checkpoint folder, once every file
is complete (and flushed, for a durable save): a folder with a readable
manifest whose files all have the listed sizes is a complete checkpoint.
Its fields:

- ``format_version`` (:data:`FORMAT_VERSION`), the world size, the package
  versions, the model layout (each model's parameter names and shapes, in
  accelerate's order) and the optimizers: a run that cannot resume from it
  is told why before it trains (:mod:`~skorch_accel_callbacks.state` describes
  a net in a :class:`CheckpointRecord`, :func:`manifest_content` makes these
  fields of it, and state checks a net against them);
- ``files`` (relative path -> size) and ``checksums`` (relative path ->
  ``"xxh3_64:<16 hex digits>"``), which :func:`check_manifest` verifies, so
  that a byte changed inside a file of the same size is found;
- ``saved_at`` (UTC), ``bytes``, ``save_seconds`` and, with ``async_save``,
  ``blocked_seconds`` (how long training waited);
- ``params``: the hyper-parameters that change training, and
  ``epoch_settings``: what the position inside an epoch depends on, so that
  a resume with other values is refused instead of continuing another
  training;
- ``per_rank``: which of :data:`PER_RANK_ITEMS` each rank stored in files of
  its own (:func:`history_name`, :func:`callbacks_names`,
  :func:`buffers_name`) because the ranks' copies differed; absent, or an
  item not in it, means one copy that every rank shares;
- ``position``, with ``fit_calls``: the ``fit``/``partial_fit`` calls since
  the net's ``initialize`` up to the one it was taken in (:func:`fit_calls`),
  so that a relaunched script with several calls goes on in the call that
  wrote it;
- ``frozen_parts`` (model or optimizer file -> :func:`frozen_part_name` of
  it): the models whose parameters that require no gradient lie in a file
  of their own beside the model's file, which holds the rest, and the
  optimizers whose state of those parameters lies in a file of their own
  beside the optimizer's (``{'state': {index: ...}}``, the entries of its
  state dict's ``state`` that the optimizer's file lacks); and ``linked`` (such a
  file -> the checkpoint whose save wrote its bytes): the files that are a
  hard link to the same file of an earlier checkpoint, its bytes unchanged
  and not written again. A linked file is an ordinary file of the folder,
  listed, sized and checksummed like any other: each checkpoint stays
  complete on its own, and a removal of another leaves it intact.

Readers take any field but the format version, the files and the layout as
optional: an older checkpoint without one reads as it was written
(CHANGES.rst lists which format and release brought each).

This module imports nothing of the package but ``atomic`` and ``errors``:
every other module may use it.
"""

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any, BinaryIO

import xxhash

from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.format import _atomic as atomic

__all__ = [
    'CALLBACKS_NAME',
    'CALLBACK_TENSORS_NAME',
    'CHECKSUM_ALGORITHM',
    'CheckpointRecord',
    'DCP_METADATA_NAME',
    'FORMAT_VERSION',
    'FROZEN_PARTS_FORMAT',
    'HISTORY_NAME',
    'LEASE_NAME',
    'LOCK_NAME',
    'MANIFEST_NAME',
    'PARTIAL_SUFFIX',
    'PER_RANK_ITEMS',
    'POINTERS',
    'PROBE_PREFIX',
    'SHARED_FOLDER',
    'SHARED_STATES_FORMAT',
    'Problem',
    'batches_into_epoch',
    'buffers_name',
    'callbacks_names',
    'check_manifest',
    'checkpoint_name',
    'checksum_file',
    'checksum_stream',
    'epoch_caches_names',
    'fit_calls',
    'frozen_part_name',
    'frozen_parts_of',
    'history_name',
    'is_checkpoint_name',
    'linked_of',
    'manifest_content',
    'merged_manifest',
    'newest_at_epoch_end',
    'per_rank_of',
    'per_rank_files',
    'plain_history_name',
    'pointed_name',
    'pointer_name',
    'position_name',
    'probe_name',
    'rank_state_name',
    'read_manifest',
    'shared_object',
    'stopped_early',
    'training_order',
    'with_frozen_parts',
    'write_manifest',
]

#: the on-disk format; a change of what is written bumps it, and CHANGES.rst
#: lists what each format holds. A reader refuses a newer one
FORMAT_VERSION = 5
#: the format of a checkpoint whose ranks' states agree (no ``per_rank``):
#: its files are those of format 3, which older versions read
SHARED_STATES_FORMAT = 3
#: the format of a checkpoint with ``per_rank`` states
PER_RANK_FORMAT = 4
#: the format of a checkpoint whose models' frozen parameters, or the
#: optimizers' state of them, lie in files of their own (``frozen_parts``):
#: an older reader would find them missing
FROZEN_PARTS_FORMAT = 5

# ---------------------------------------------------------------- the folder of checkpoints

# what a checkpoint folder is written as until it is complete
PARTIAL_SUFFIX = '.partial'
# the pointers at a checkpoint: pointer_name(which) for each
POINTERS = ('latest', 'best')
# torch.distributed.checkpoint's index of a sharded save (its FileSystemWriter
# writes it beside one file per rank)
DCP_METADATA_NAME = '.metadata'
# the one job that uses a folder of checkpoints holds a lock on this file
LOCK_NAME = '.lock'
# the one-job lease of a folder in an object store (lease.ObjectLease)
LEASE_NAME = '.lease.json'
# files of the check that save_on_each_node committers do not share a folder
PROBE_PREFIX = '.node-probe-'
_CHECKPOINT_NAME_RE = re.compile(r'^epoch-(\d+)(-step-\d+)?$')


def checkpoint_name(epochs: int, step: int | None = None) -> str:
    """The name of the checkpoint after ``epochs`` complete epochs:
    ``epoch-NNNN``, or with ``step`` (taken inside the next epoch, at that
    optimizer step) ``epoch-NNNN-step-SSSSSSSS``."""
    if step is None:
        return f"epoch-{epochs:04d}"
    return f"epoch-{epochs:04d}-step-{step:08d}"


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is the name of a checkpoint folder (``epoch-NNNN``)."""
    return bool(_CHECKPOINT_NAME_RE.match(name))


def newest_at_epoch_end(names: list[str], epochs: int | None = None) -> str | None:
    """The last of the checkpoint ``names`` (oldest first) taken at an
    epoch's end (``epoch-NNNN``), after at most ``epochs`` complete epochs
    if given; None if there is none."""
    for name in reversed(names):
        match = _CHECKPOINT_NAME_RE.match(name)
        if match and match.group(2) is None and (epochs is None or int(match.group(1)) <= epochs):
            return name
    return None


def training_order(name: str) -> tuple[int, int]:
    """The sort key of the checkpoint ``name`` in training order: the
    complete epochs it follows, then the step inside the next epoch
    (an epoch's end, ``epoch-NNNN``, before the steps of the next)."""
    match = _CHECKPOINT_NAME_RE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a checkpoint name (epoch-NNNN)")
    step = match.group(2)
    return int(match.group(1)), -1 if step is None else int(step[len('-step-'):])


def pointer_name(which: str) -> str:
    """The file of the pointer ``which`` (one of :data:`POINTERS`)."""
    return f'{which}.json'


def pointed_name(pointer: object) -> str | None:
    """The checkpoint a pointer's JSON content names, or None if it names none."""
    name = pointer.get('name') if isinstance(pointer, dict) else None
    return name if isinstance(name, str) and is_checkpoint_name(name) else None


def probe_name(rank: int) -> str:
    """The probe file of the committer of rank ``rank``."""
    return f'{PROBE_PREFIX}{rank}'


# ---------------------------------------------------------------- a checkpoint folder

MANIFEST_NAME = 'manifest.json'
HISTORY_NAME = 'history.json'
# the callbacks' states: JSON, their tensors beside it
CALLBACKS_NAME = 'callbacks.json'
CALLBACK_TENSORS_NAME = 'callbacks.safetensors'


#: the states that a checkpoint stores per rank when the ranks' copies differ
PER_RANK_ITEMS = ('history', 'callbacks', 'buffers')


def history_name(rank: int | None = None) -> str:
    """The history: one copy that every rank shares (``rank`` None), or
    rank ``rank``'s own."""
    return HISTORY_NAME if rank is None else f'history_{rank}.json'


def callbacks_names(rank: int | None = None) -> tuple[str, str]:
    """The callbacks' states, JSON and the tensors beside it: one copy that
    every rank shares (``rank`` None), or rank ``rank``'s own."""
    if rank is None:
        return CALLBACKS_NAME, CALLBACK_TENSORS_NAME
    return f'callbacks_{rank}.json', f'callbacks_{rank}.safetensors'


def buffers_name(rank: int) -> str:
    """Rank ``rank``'s module buffers under FSDP2 (which keeps them per rank
    and its sharded checkpoint once)."""
    return f'buffers_{rank}.safetensors'


def rank_state_name(rank: int) -> str:
    """The training loader's state of rank ``rank``."""
    return f'loader_state_{rank}.safetensors'


def position_name(rank: int) -> str:
    """Where rank ``rank`` is inside the epoch under way."""
    return f'position_{rank}.safetensors'


def epoch_caches_names(rank: int) -> tuple[str, str]:
    """The scratch space of the epoch under way of rank ``rank``: the JSON
    file and the tensors beside it."""
    return f'epoch_caches_{rank}.json', f'epoch_caches_{rank}.safetensors'


# ---------------------------------------------------------------- the manifest

@dataclass(frozen=True)
class CheckpointRecord:
    """What a checkpoint's manifest says of the training it holds, besides
    its files: :mod:`~skorch_accel_callbacks.state` describes a net in one,
    :func:`manifest_content` turns it into the manifest's fields (in this
    order), which :func:`write_manifest` seals with the files'."""

    #: the checkpoint's name, e.g. ``epoch-0003``
    name: str
    #: complete epochs
    epoch: int
    #: ``{'step': optimizer steps, 'batches': training batches of the epoch
    #: under way}``, optionally ``'fit_calls'`` (:func:`fit_calls`)
    position: dict[str, Any]
    best: bool
    #: training ended with this checkpoint
    finished: bool
    #: a callback ended the training (:func:`stopped_early`)
    stopped_early: bool
    #: the fingerprint of the training data
    data: Any
    #: the hyper-parameters that change training
    params: dict[str, Any]
    #: what the position inside an epoch depends on
    epoch_settings: dict[str, Any]
    world_size: int
    save_on_each_node: bool
    #: each model's name, parameter names and shapes, in accelerate's order
    models: list[list[Any]]
    #: of each module by name, its parameters that require no gradient
    frozen: dict[str, list[str]]
    #: each optimizer's class and the sizes of its param groups
    optimizers: list[list[Any]]
    #: the versions of torch, accelerate, skorch and this package
    versions: dict[str, str | None]
    #: the FSDP shard layout, for a checkpoint of FSDP
    fsdp: Any = None
    #: which of :data:`PER_RANK_ITEMS` each rank stores in files of its own
    per_rank: tuple[str, ...] = ()


def manifest_content(record: CheckpointRecord) -> dict[str, Any]:
    """The fields of the manifest of ``record``'s checkpoint, before
    :func:`write_manifest` adds the files. A checkpoint whose ranks agree
    (no ``per_rank``) is written in :data:`SHARED_STATES_FORMAT`, so that
    versions which read only that format resume it; ``fsdp`` and
    ``per_rank`` are written only when there are any."""
    content: dict[str, Any] = {
        'format_version': PER_RANK_FORMAT if record.per_rank else SHARED_STATES_FORMAT}
    content.update((field.name, getattr(record, field.name)) for field in fields(record)
                   if field.name not in ('fsdp', 'per_rank'))
    if record.fsdp is not None:
        content['fsdp'] = record.fsdp
    if record.per_rank:
        content['per_rank'] = list(record.per_rank)
    return content


def frozen_part_name(file: str) -> str:
    """The file of the frozen parameters split off the model or optimizer
    file ``file``: ``model.safetensors`` -> ``model_frozen.safetensors``,
    ``model_1.safetensors`` -> ``model_1_frozen.safetensors``,
    ``optimizer.bin`` -> ``optimizer_frozen.bin``."""
    stem, dot, extension = file.partition('.')
    return f'{stem}_frozen{dot}{extension}'


#: in a store, the folder beside the checkpoints that holds their frozen
#: parts (:func:`shared_object`)
SHARED_FOLDER = 'shared'


def shared_object(manifest: dict[str, Any], rel: str) -> str | None:
    """Where in a store the file ``rel`` of ``manifest``'s checkpoint lies
    when it is a frozen part (:func:`frozen_part_name`): once for every
    checkpoint that holds those bytes, in :data:`SHARED_FOLDER`, named by
    its checksum (``shared/model_frozen-<16 hex digits>.safetensors``), so
    that a checkpoint in a store references the object an earlier one sent
    instead of sending a copy. None for any other file, which lies in the
    checkpoint's own folder."""
    checksum = (manifest.get('checksums') or {}).get(rel)
    if rel not in frozen_parts_of(manifest).values() or not isinstance(checksum, str):
        return None
    stem, dot, extension = rel.partition('.')
    return f"{SHARED_FOLDER}/{stem}-{checksum.rpartition(':')[2]}{dot}{extension}"


def with_frozen_parts(content: dict[str, Any], parts: dict[str, str],
                      linked: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """The manifest content ``content`` of a checkpoint whose models and
    optimizers have the frozen parts ``parts`` (model or optimizer file ->
    part file), of which those in
    ``linked`` (part file -> ``(origin, checksum)``) are hard links to the
    bytes that checkpoint ``origin`` wrote: the format that older readers
    refuse, the fields, and the checksums of the linked files as their
    first save computed them, which :func:`write_manifest` then takes
    instead of reading the files again. Without parts, ``content`` as it is.
    """
    if not parts:
        return content
    known = dict(content.get('checksums') or {})
    known.update((file, checksum) for file, (_, checksum) in linked.items())
    return dict(content, format_version=FROZEN_PARTS_FORMAT, frozen_parts=dict(parts),
                linked={file: origin for file, (origin, _) in linked.items()},
                checksums=known)


def _file_sizes(folder: str) -> dict[str, int]:
    """Relative path -> size of every file below ``folder``."""
    sizes = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, folder)] = os.path.getsize(path)
    return sizes


def write_manifest(folder: str, content: dict[str, Any], durable: bool,
          started: float | None = None,
          early: atomic.EarlyFlush | None = None) -> dict[str, Any]:
    """Seal ``folder``: flush its files (if ``durable``), then write the
    manifest ``content`` listing each file with its size and checksum,
    atomically; return what was written.

    ``early``: the fsyncs begun while the files were written, waited for
    (their first failure raised) before the manifest is written.

    ``files``, ``checksums`` (:func:`checksum_file` of each listed file,
    but those ``content['checksums']`` already holds: the files hard-linked
    to an earlier checkpoint's, :func:`with_frozen_parts`), ``bytes`` (the
    total size of the files) and ``saved_at`` (UTC, ISO 8601) are added;
    with ``started`` (a :func:`time.monotonic` stamp of when the save
    began) also ``save_seconds``, measured once the files are flushed.
    ``content`` must hold JSON values only: anything else raises
    ``TypeError`` and writes no manifest.
    """
    files = _file_sizes(folder)
    files.pop(MANIFEST_NAME, None)
    paths = {rel: os.path.join(folder, rel) for rel in files}
    known = content.get('checksums') or {}
    # the files were just written: they are read back from the page cache
    # while the fsyncs wait for the disk, which costs the save little of
    # the time that reading them after the fsyncs would
    with ThreadPoolExecutor(max_workers=1) as pool:
        flushed = (pool.submit(atomic.fsync_files, list(paths.values()), early)
                   if durable else None)
        checksums = {rel: known.get(rel) or checksum_file(path) for rel, path in paths.items()}
        if flushed is not None:
            flushed.result()
    sealed = dict(content)
    if started is not None:
        sealed['save_seconds'] = round(time.monotonic() - started, 3)
    sealed.update(files=files, checksums=checksums, bytes=sum(files.values()),
                  saved_at=datetime.now(UTC).isoformat(timespec='milliseconds'))
    atomic.write_json(os.path.join(folder, MANIFEST_NAME), sealed)
    return sealed


@dataclass(frozen=True)
class Problem:
    """Why a folder is not a complete checkpoint."""

    #: the error a resume raises
    error: CheckpointError
    #: the listed file at fault (relative), or None for the folder or manifest
    file: str | None = None
    #: the file has its listed size, but not its checksum
    checksum_differs: bool = False


def check_manifest(folder: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, list[Problem]]:
    """``(manifest, problems)`` of a committed folder: the manifest is None
    when it is missing, unreadable, malformed or of a newer format (one
    problem says why); else a problem per listed file that is missing, has
    another size than when it was written or (when the manifest records
    checksums) another checksum, in the manifest's order.

    Checking the checksums reads every listed file once.
    """
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isdir(folder):
        return None, [Problem(CorruptCheckpointError(f"{folder} is not a folder"))]
    if not os.path.isfile(path):
        return None, [Problem(CorruptCheckpointError(
            f"{path} is missing: {folder} is not a complete checkpoint"))]
    try:
        manifest = atomic.read_json(path)
    except (OSError, ValueError) as exc:
        error = CorruptCheckpointError(str(exc))
        error.__cause__ = exc
        return None, [Problem(error)]
    problem = _manifest_problem(path, manifest)
    if problem is not None:
        return None, [problem]
    return manifest, _file_problems(folder, path, manifest['files'],
                                    manifest.get('checksums') or {})


def _file_problems(folder: str | os.PathLike[str], manifest: str, files: dict[str, Any],
                   checksums: dict[str, str]) -> list[Problem]:
    """:func:`_file_problem` of each of ``files`` (file -> listed size), in
    their order, checked on :data:`CHECK_THREADS` threads, the largest file
    first."""
    def check(rel: str) -> Problem | None:
        return _file_problem(folder, rel, manifest, files[rel], checksums.get(rel))

    if CHECK_THREADS < 2 or len(files) < 2:
        found = [check(rel) for rel in files]
    else:
        largest_first = sorted(files, reverse=True,
                               key=lambda rel: files[rel] if type(files[rel]) is int else 0)
        with ThreadPoolExecutor(max_workers=CHECK_THREADS,
                                thread_name_prefix='checkpoint-check') as pool:
            checked = {rel: pool.submit(check, rel) for rel in largest_first}
        found = [checked[rel].result() for rel in files]
    return [problem for problem in found if problem is not None]


def _manifest_problem(path: str, manifest: Any) -> Problem | None:
    """Why the JSON of the manifest ``path`` cannot be checked, or None."""
    if not isinstance(manifest, dict):
        return Problem(CorruptCheckpointError(
            f"{path} is not a manifest (not a JSON object)"))
    fmt = manifest.get('format_version')
    if type(fmt) is not int or fmt < 1:
        return Problem(CorruptCheckpointError(
            f"{path} has format_version {fmt!r}, not a format number"))
    if fmt > FORMAT_VERSION:
        return Problem(CheckpointError(
            f"{path} has checkpoint format {fmt}; this version of "
            f"skorch-accel-callbacks reads format {FORMAT_VERSION} and older: upgrade it"))
    if not isinstance(manifest.get('files'), dict):
        return Problem(CorruptCheckpointError(f"{path} lists no files"))
    checksums = manifest.get('checksums', {})
    if not (isinstance(checksums, dict)
            and all(isinstance(value, str) for value in checksums.values())):
        return Problem(CorruptCheckpointError(
            f"{path} has checksums {checksums!r}, not a mapping of files to checksums"))
    items = manifest.get('per_rank', [])
    if not (isinstance(items, list) and all(item in PER_RANK_ITEMS for item in items)):
        return Problem(CorruptCheckpointError(
            f"{path} has per_rank {items!r}, not a list of some of {list(PER_RANK_ITEMS)}"))
    parts = manifest.get('frozen_parts', {})
    if not (isinstance(parts, dict)
            and all(isinstance(part, str) and part == frozen_part_name(model)
                    for model, part in parts.items())):
        return Problem(CorruptCheckpointError(
            f"{path} has frozen_parts {parts!r}, not a mapping of model and optimizer "
            "files to the files of their frozen parameters"))
    linked = manifest.get('linked', {})
    if not (isinstance(linked, dict) and set(linked) <= set(parts.values())
            and all(isinstance(origin, str) and is_checkpoint_name(origin)
                    for origin in linked.values())):
        return Problem(CorruptCheckpointError(
            f"{path} has linked {linked!r}, not a mapping of frozen parts to the "
            "checkpoints that wrote them"))
    return None


def _file_problem(folder: str | os.PathLike[str], rel: str, manifest: str, size: Any,
                  checksum: str | None) -> Problem | None:
    """What is wrong with the listed file ``rel`` (the manifest says
    ``size`` and ``checksum``), or None."""
    file = os.path.join(folder, rel)
    if not os.path.isfile(file):
        return Problem(CorruptCheckpointError(f"{file} is missing (listed in {manifest})"), rel)
    actual = os.path.getsize(file)
    if actual != size:
        return Problem(CorruptCheckpointError(
            f"{file} has {actual} bytes, {manifest} says {size}: the file is damaged"), rel)
    # a checksum of another algorithm (none is written today) cannot be
    # checked here: the file counts as one of a manifest without checksums
    if checksum is not None and checksum.startswith(f'{CHECKSUM_ALGORITHM}:'):
        actual = checksum_file(file)
        if actual != checksum:
            return Problem(CorruptCheckpointError(
                f"{file} has checksum {actual}, {manifest} says {checksum}: "
                "the file is damaged"), rel, checksum_differs=True)
    return None


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and verify a committed folder's manifest.

    Raises :class:`CorruptCheckpointError` naming the file at fault when the
    manifest is missing, unreadable or malformed, or when a file it lists
    is missing or has another size or checksum than when it was written
    (which reads every file); and
    :class:`CheckpointError` if it is of a newer format than this version
    reads (the first problem :func:`check_manifest` finds).
    """
    manifest, problems = check_manifest(folder)
    if problems:
        raise problems[0].error
    return manifest


def merged_manifest(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest of one checkpoint that several nodes committed a part
    of each (``save_on_each_node``, each into its own folder): the first
    one's, listing the files of them all. A file that several list (the
    model, which every node writes) is listed as the first lists it."""
    first = manifests[0]
    files, checksums = {}, {}
    for manifest in manifests:
        for rel, size in manifest['files'].items():
            if rel not in files:
                files[rel] = size
                checksums[rel] = manifest.get('checksums', {}).get(rel)
    checksums = {rel: value for rel, value in checksums.items() if value is not None}
    return dict(first, files=files, checksums=checksums, bytes=sum(files.values()))


def frozen_parts_of(manifest: dict[str, Any]) -> dict[str, str]:
    """Model or optimizer file -> the file of its frozen parameters, of the
    models and optimizers of ``manifest``'s checkpoint that have one (none
    before format 5);
    :func:`check_manifest` refused a malformed field."""
    return dict(manifest.get('frozen_parts') or {})


def linked_of(manifest: dict[str, Any]) -> dict[str, str]:
    """The files of ``manifest``'s checkpoint that are hard links to an
    earlier checkpoint's -> the checkpoint whose save wrote their bytes."""
    return dict(manifest.get('linked') or {})


def stopped_early(manifest: dict[str, Any]) -> bool:
    """Whether a callback stopped the training of this checkpoint: resuming
    it trains nothing, whatever ``max_epochs``."""
    # format 1 marked only the end of training, and said finished for both
    return bool(manifest.get('stopped_early', manifest.get('finished')))


def per_rank_of(manifest: dict[str, Any]) -> frozenset[str]:
    """The items of :data:`PER_RANK_ITEMS` that ``manifest``'s checkpoint
    stores per rank (none before the field existed); :func:`check_manifest` refused
    a malformed field."""
    return frozenset(manifest.get('per_rank') or ())


def plain_history_name(manifest: dict[str, Any]) -> str:
    """The history that a plain net gets of a checkpoint (an export,
    ``load_params(checkpoint=...)``): the one copy, or rank 0's when the
    ranks' histories differed."""
    return history_name(0 if 'history' in per_rank_of(manifest) else None)


def per_rank_files(item: str, rank: int) -> tuple[str, ...]:
    """The files of rank ``rank``'s own copy of the per-rank ``item``."""
    if item == 'history':
        return (history_name(rank),)
    if item == 'callbacks':
        return callbacks_names(rank)
    return (buffers_name(rank),)


def batches_into_epoch(manifest: dict[str, Any]) -> int:
    """The training batches of the epoch under way when the checkpoint was
    taken: 0 at an epoch's end (and in formats before 3)."""
    return (manifest.get('position') or {}).get('batches', 0)


def fit_calls(manifest: dict[str, Any], path: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """The ``fit``/``partial_fit`` calls since the net's ``initialize`` up to
    the one the checkpoint was taken in (its last): for each, the complete
    epochs when it began and those after which it was to end. A manifest
    without them (written before they were recorded) has one: the call
    that began at epoch 0 and was to end after ``epoch`` epochs, the
    checkpoint's.

    Raises :class:`CorruptCheckpointError` naming the manifest of ``path``
    when the entry is not such a list.
    """
    recorded = (manifest.get('position') or {}).get('fit_calls')
    if recorded is None:
        return [(0, manifest.get('epoch', 0))]
    epochs = manifest.get('epoch')
    if (isinstance(recorded, list) and recorded
            and all(isinstance(call, list) and len(call) == 2
                    and all(type(epoch) is int and epoch >= 0 for epoch in call)
                    and call[0] <= call[1] for call in recorded)
            # the call it was taken in had begun
            and (type(epochs) is not int or recorded[-1][0] <= epochs)):
        return [(begins, ends) for begins, ends in recorded]
    raise CorruptCheckpointError(
        f"{os.path.join(path, MANIFEST_NAME)} has position['fit_calls'] {recorded!r}, not a "
        "list of [first epoch, last epoch] of each fit call")


# ---------------------------------------------------------------- checksums

#: threads that check the files of a checkpoint at once (xxhash lets go of
#: the GIL): a resume waits for the checksum of its largest file, not for
#: those of all its files one after the other (``benchmarks/ab_check_threads.py``)
CHECK_THREADS = min(2, os.cpu_count() or 1)
#: the algorithm of the checksums in a manifest (``benchmarks/bench_checksum.py``:
#: the fastest of those measured; a checksum finds damage, not tampering)
CHECKSUM_ALGORITHM = 'xxh3_64'
_CHUNK_BYTES = 1 << 22


def checksum_stream(stream: BinaryIO) -> str:
    """The checksum of what is left to read of the binary ``stream``, as a
    manifest records it: ``"xxh3_64:<16 hex digits>"``."""
    hasher = xxhash.xxh3_64()
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    # one buffer, filled again: no new bytes object for every chunk
    while size := stream.readinto(buffer):
        hasher.update(view[:size])
    return f'{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}'


def checksum_file(path: str | os.PathLike[str]) -> str:
    """The checksum of the file ``path`` (:func:`checksum_stream`)."""
    with open(path, 'rb', buffering=0) as stream:
        return checksum_stream(stream)
