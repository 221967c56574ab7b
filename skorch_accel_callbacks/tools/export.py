"""A checkpoint's model(s) as plain skorch files, for inference without accelerate.

A checkpoint of :class:`~skorch_accel_callbacks.AccelerateCheckpoint` holds
accelerate's model files (``model.safetensors``, ``model_1.safetensors``, ...
in the order of the manifest's ``models``) beside the optimizer, random
states and the rest of a training state. :func:`export` writes the models
alone, under skorch's names (``params.safetensors`` for the module
``module``, ``<name>.safetensors`` for a module or criterion ``<name>``),
plus the history; :func:`checkpoint_files` names the files of a checkpoint
as the arguments of skorch's ``net.load_params``. Nothing here runs code
from a file: safetensors files are read as such, other tensor files with
``torch.load(weights_only=True)``. A checkpoint saved under FSDP2 holds
accelerate's ``pytorch_model_fsdp_0/`` (a sharded model, merged in this
process by :mod:`~skorch_accel_callbacks.engine._consolidate`) or
``pytorch_model_fsdp.bin`` (a full state dict) instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from typing import Any

import torch
from safetensors.torch import save_file

from skorch_accel_callbacks.callbacks import checkpoint_files, f_argument
from skorch_accel_callbacks.engine import model_files, read_checkpoint_model
from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.format import (
    HISTORY_NAME,
    MANIFEST_NAME,
    POINTERS,
    atomic_path,
    buffers_name,
    check_manifest,
    frozen_parts_of,
    is_checkpoint_name,
    load_without_code,
    per_rank_of,
    plain_history_name,
    read_json,
    read_naming_fault,
)
from skorch_accel_callbacks.storage import CheckpointStorage, Found, open_storage

__all__ = ['checkpoint_files', 'export', 'exported_name', 'f_argument', 'find_checkpoint',
           'find_exportable', 'open_source']


def exported_name(module_name: str) -> str:
    """The file :func:`export` writes for a module: skorch's default name
    (``params``, ``criterion``, ``<name>``) with ``.safetensors``."""
    return ('params' if module_name == 'module' else module_name) + '.safetensors'


def find_checkpoint(source: str | os.PathLike, which: str | os.PathLike = 'latest',
                    local_dir: str | os.PathLike | None = None,
                    storage_options: dict[str, Any] | None = None) -> str:
    """The path of one complete checkpoint, in a local folder.

    Parameters
    ----------
    source : str or path-like
      A folder of checkpoints (an ``AccelerateCheckpoint``'s ``dirname``),
      one checkpoint folder (``<dirname>/epoch-NNNN``), or the URL of either
      in a store (``s3://bucket/run1``, ``s3://bucket/run1/epoch-0003``).

    which : str (default='latest')
      For a folder of checkpoints: ``'latest'`` (the newest complete one),
      ``'best'``, the name of one of its checkpoints (``'epoch-0003'``) or
      the path of a checkpoint folder.

    local_dir : str, path-like or None (default=None)
      With a URL, the folder the checkpoint is downloaded into (None: as
      ``AccelerateCheckpoint``'s default staging folder).

    storage_options : dict or None (default=None)
      With a URL, the arguments of its fsspec filesystem.

    Raises
    ------
    FileNotFoundError
      No such folder (or bucket), no checkpoint in it, or no checkpoint of
      that name.
    ValueError
      ``source`` is one checkpoint and ``which`` asks to choose; ``source``
      is a mistyped URL.
    CorruptCheckpointError, CheckpointError
      The checkpoint chosen is not complete (the message names the file), or
      of a newer format.
    """
    storage, which = open_source(source, which, local_dir, storage_options)
    return _found(storage, which).path


def open_source(source: str | os.PathLike, which: str | os.PathLike = 'latest',
                local_dir: str | os.PathLike | None = None,
                storage_options: dict[str, Any] | None = None,
                ) -> tuple[CheckpointStorage, str]:
    """The storage of ``source`` and which of its checkpoints ``which``
    names: a checkpoint given as ``source`` (``DIR/epoch-0003``, a URL of
    one, a local folder with a manifest) stands for its folder's checkpoint
    of that name (its path, for a folder of another name).

    Raises :class:`FileNotFoundError` if there is no such folder (or
    bucket), :class:`ValueError` if ``source`` is one checkpoint and
    ``which`` asks to choose.
    """
    source, which = os.fspath(source), os.fspath(which)
    storage = open_storage(source, local_dir, storage_options)
    given = storage.dirname
    one = _one_checkpoint(given)
    if one is not None:
        if which != 'latest':
            raise ValueError(
                f"{source} is one checkpoint; which={which!r} chooses among the "
                "checkpoints of a folder: pass that folder")
        parent, _, name = given.rstrip('/').rpartition('/')
        storage = open_storage(parent or os.curdir, local_dir, storage_options)
        which = name if one else given
    if not storage.exists():
        raise FileNotFoundError(f"no such folder: {storage.dirname}")
    return storage, which


def _one_checkpoint(dirname: str) -> bool | None:
    """True if ``dirname`` is a checkpoint by its name, False if a local
    folder of another name holding a manifest, else None."""
    if is_checkpoint_name(dirname.rstrip('/').rpartition('/')[2]):
        return True
    return False if os.path.isfile(os.path.join(dirname, MANIFEST_NAME)) else None


def _found(storage: CheckpointStorage, which: str) -> Found:
    """The checkpoint ``which`` of ``storage`` names, in a local folder."""
    if not (which in POINTERS or is_checkpoint_name(which) or os.path.isdir(which)):
        raise FileNotFoundError(
            f"no checkpoint {which!r}: not 'latest', 'best', a checkpoint name "
            f"(epoch-NNNN) in {storage.dirname} or a checkpoint folder")
    found = storage.find_checkpoint(which)
    if found is None:
        raise FileNotFoundError(f"no checkpoint in {storage.dirname}")
    return found


def _exportable_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` if its model files and history
    are intact (listed, of their listed sizes and checksums): an incomplete checkpoint, of
    a missing or damaged optimizer or random-state file, cannot be resumed
    from, but its model can be exported; a warning names the files at fault.

    Raises the error of :func:`_manifest.read_manifest` if the manifest itself is at
    fault, and :class:`CorruptCheckpointError` naming the model file or
    history that is missing or damaged.
    """
    saved, problems = check_manifest(path)
    if saved is None:
        raise problems[0].error
    if not problems:
        return saved
    files = saved['files']
    history = plain_history_name(saved)
    needed = [file for _, file in model_files(saved, path)]
    needed += frozen_parts_of(saved).values()
    needed.append(history)
    if 'buffers' in per_rank_of(saved):
        needed.append(buffers_name(0))
    for problem in problems:
        # a sharded model's pieces lie in its folder
        if problem.file is not None and problem.file.split(os.sep)[0] in needed:
            raise problem.error
    sealed = os.path.join(path, MANIFEST_NAME)
    if history not in files:
        raise CorruptCheckpointError(f"{os.path.join(path, history)} is not listed in {sealed}")
    warnings.warn(f"{path} is not a complete checkpoint, it cannot be resumed from: "
                  + '; '.join(str(problem.error) for problem in problems)
                  + "; its model files and history are intact and are exported", UserWarning)
    return saved


def find_exportable(source: str | os.PathLike, which: str | os.PathLike = 'latest',
                    local_dir: str | os.PathLike | None = None,
                    storage_options: dict[str, Any] | None = None) -> str:
    """The path of the checkpoint :func:`export` exports: the one
    :func:`find_checkpoint` finds, except that a checkpoint whose model
    files and history are intact qualifies even if another of its files (an
    optimizer or random state) is missing or damaged, with a warning naming
    it; for ``'latest'``, the newest such checkpoint. A checkpoint in a
    store must be intact to be downloaded.

    Raises as :func:`find_checkpoint` does; :class:`CorruptCheckpointError`
    names the model file or history at fault.
    """
    storage, which = open_source(source, which, local_dir, storage_options)
    return _exported_checkpoint(storage, which)[0]


def _exported_checkpoint(storage: CheckpointStorage, which: str) -> tuple[str, dict[str, Any]]:
    """``(path, manifest)`` of :func:`find_exportable`."""
    if which == 'latest':
        newest = next(iter(storage.newest_first()), None)
        if newest is not None:
            try:
                return _exportable(storage, newest)
            except CheckpointError:
                pass  # find_checkpoint warns that it skips it, and finds an older one
    elif which in POINTERS or is_checkpoint_name(which):
        if which != 'best' or storage.pointed('best') is not None:
            return _exportable(storage, storage.named(which))
    elif os.path.isdir(which):
        return which, _exportable_manifest(which)
    found = _found(storage, which)
    return found.path, found.manifest


def _exportable(storage: CheckpointStorage, name: str) -> tuple[str, dict[str, Any]]:
    """``(path, manifest)`` of checkpoint ``name``: complete, or where its
    local folder is at hand, with intact model files and history."""
    try:
        found = storage.fetch(name)
    except CorruptCheckpointError:
        if not os.path.isdir(storage.path(name)):
            raise  # in a store, and not downloaded: nothing to look into
        return storage.path(name), _exportable_manifest(storage.path(name))
    return found.path, found.manifest


def _load_tensors(path: str, saved: dict[str, Any], file: str) -> dict[str, torch.Tensor]:
    """The state dict of the model file or sharded model folder ``file`` of
    checkpoint ``path`` (its frozen part merged in), without running code
    from it."""
    state = read_checkpoint_model(path, saved, file)
    if not (isinstance(state, dict)
            and all(isinstance(value, torch.Tensor) for value in state.values())):
        raise CorruptCheckpointError(f"{os.path.join(path, file)} holds no state dict of tensors")
    # safetensors stores no two names of one tensor (tied weights)
    return {key: value.detach().clone().contiguous() for key, value in state.items()}


def _take_rank_0_buffers(path: str, saved: dict[str, Any],
                         models: list[tuple[str, dict[str, torch.Tensor]]]) -> None:
    """Give ``models`` (name, state dict) of checkpoint ``path`` saved
    rank 0's buffers, where the ranks' differed (FSDP2 keeps them per rank,
    its sharded checkpoint holds one rank's), with a warning saying so."""
    if 'buffers' not in per_rank_of(saved):
        return
    file = os.path.join(path, buffers_name(0))
    buffers = read_naming_fault([file], lambda: load_without_code(file, 'safetensors'))
    for key, value in buffers.items():
        index, name = key.split('/', 1)
        models[int(index)][1][name] = value.clone()
    warnings.warn(
        f"{path}: the ranks' module buffers differed (FSDP2 keeps BatchNorm's running "
        f"statistics per rank): the model is exported with rank 0's ({file})",
        UserWarning, stacklevel=3)


def export(
        source: str | os.PathLike,
        *,
        out: str | os.PathLike,
        which: str | os.PathLike = 'latest',
        storage_options: dict[str, Any] | None = None,
) -> dict[str, str]:
    """Write the model(s) of a checkpoint into ``out`` as safetensors files
    that skorch's ``net.load_params`` reads, in any net: with or without
    accelerate, one process or many.

    ``<out>/params.safetensors`` holds the module ``module``,
    ``<out>/<name>.safetensors`` each other module or criterion the
    checkpoint holds (those with trainable parameters), and
    ``<out>/history.json`` the history. Where the checkpoint holds every
    rank's own history (each rank of skorch's ``AccelerateMixin`` logs its
    own losses) and, under FSDP2, every rank's own module buffers
    (BatchNorm's running statistics), rank 0's are written, the buffers
    with a warning naming rank 0. Each file is written atomically;
    files of an earlier export into ``out`` are replaced, the checkpoint
    is only read. A checkpoint whose model files and history are intact
    is exported even if another of its files (an optimizer or random state)
    is missing or damaged, with a warning naming it.
    A model that FSDP2 saved sharded is merged in this process, which must
    be one on its own (no job of several processes).

    Parameters
    ----------
    source : str or path-like
      A folder of checkpoints or one checkpoint folder (a folder that holds
      a ``manifest.json``), or the URL of checkpoints in an object store
      (``s3://bucket/run1``): the checkpoint is downloaded into a temporary
      folder, checked (every file of it must be intact), exported and removed.

    out : str or path-like
      The folder to write into; it is created if needed, and must not be a
      file.

    which : str (default='latest')
      Which checkpoint of a folder of checkpoints: ``'latest'``,
      ``'best'``, a checkpoint name or a checkpoint folder.

    storage_options : dict or None (default=None)
      With a URL, the arguments of its fsspec filesystem (as
      ``AccelerateCheckpoint``'s).

    Returns
    -------
    files : dict
      The files written, as arguments of ``load_params``: ``{'f_params':
      '<out>/params.safetensors', 'f_history': '<out>/history.json'}``.

    Raises
    ------
    FileNotFoundError
      No such folder, or no checkpoint in it (of that name).
    FileExistsError
      ``out`` is a file (or anything but a folder).
    ValueError
      ``out`` is inside the checkpoint.
    CheckpointError
      ``which='best'`` and the folder has checkpoints but no best one; the
      checkpoint is of a newer format.
    CorruptCheckpointError
      A model file or the history of the checkpoint is missing, of another
      size or does not load; the message names it.
    RuntimeError
      A model is sharded and this process is one of a job of several.

    Examples
    --------
    A checkpoint of two epochs, exported and loaded into a plain net (a
    store's URL, ``export('s3://bucket/run1', out='model', which='best')``,
    works as a folder does):

    >>> import numpy as np
    >>> import torch
    >>> from accelerate import Accelerator
    >>> from skorch import NeuralNetClassifier
    >>> from skorch.hf import AccelerateMixin
    >>> from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateFixesMixin
    >>> from skorch_accel_callbacks.tools.export import export
    >>> class AcceleratedNet(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    ...     pass
    >>> X = np.random.randn(64, 4).astype(np.float32)
    >>> y = (X[:, 0] > 0).astype(np.int64)
    >>> model = dict(module=torch.nn.Linear, module__in_features=4,
    ...              module__out_features=2, criterion=torch.nn.CrossEntropyLoss)
    >>> _ = AcceleratedNet(**model, accelerator=Accelerator(cpu=True), max_epochs=2,
    ...                    callbacks=[AccelerateCheckpoint(dirname='checkpoints')],
    ...                    ).fit(X, y)  # doctest: +ELLIPSIS
      epoch    train_loss...
    >>> files = export('checkpoints', out='model')  # the newest checkpoint
    >>> files
    {'f_params': 'model/params.safetensors', 'f_history': 'model/history.json'}
    >>> net = NeuralNetClassifier(**model).initialize()
    >>> net.load_params(**files, use_safetensors=True)

    """
    out = os.fspath(out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise FileExistsError(f"{out} exists and is not a folder: export into a new "
                              "folder, or one an earlier export wrote")
    # a checkpoint of a store is downloaded here, exported and removed
    with tempfile.TemporaryDirectory(prefix='skorch-accel-export-') as staging:
        storage, which = open_source(source, which, staging, storage_options)
        return _export(*_exported_checkpoint(storage, which), out)


def _export(path: str, saved: dict[str, Any], out: str) -> dict[str, str]:
    """Write the models and history of checkpoint ``path`` (of manifest
    ``saved``) into ``out``; see :func:`export`."""
    inside = os.path.relpath(os.path.realpath(out), os.path.realpath(path))
    if not (inside == os.pardir or inside.startswith(os.pardir + os.sep)):
        raise ValueError(f"{out} is inside the checkpoint {path}: export into another folder")
    history = os.path.join(path, plain_history_name(saved))
    try:
        read_json(history)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{history} cannot be loaded: {exc}") from exc
    # every file is read before one is written: a damaged checkpoint
    # leaves ``out`` as it was
    models = [(name, _load_tensors(path, saved, file))
              for name, file in model_files(saved, path)]
    _take_rank_0_buffers(path, saved, models)
    os.makedirs(out, exist_ok=True)
    written = {}
    for name, tensors in models:
        target = os.path.join(out, exported_name(name))
        with atomic_path(target) as tmp:
            save_file(tensors, tmp, metadata={
                'format': 'pt', 'module': name, 'checkpoint': os.path.basename(path),
                'epoch': str(saved.get('epoch'))})
        written[f_argument(name)] = target
    target = os.path.join(out, HISTORY_NAME)
    with atomic_path(target) as tmp:
        shutil.copyfile(history, tmp)
    written['f_history'] = target
    return written
