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
process by :mod:`~skorch_accel_callbacks.tools._consolidate`) or
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

from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.format import _manifest
from skorch_accel_callbacks.format._atomic import atomic_path, read_json
from skorch_accel_callbacks.format._manifest import POINTERS, is_checkpoint_name
from skorch_accel_callbacks.format._readers import load_without_code, read_naming_fault
from skorch_accel_callbacks.storage._interface import CheckpointStorage, open_storage
from skorch_accel_callbacks.storage._local import CheckpointFolder, Found
from skorch_accel_callbacks.storage._remote import RemoteStorage, is_remote
from skorch_accel_callbacks.tools import _consolidate as consolidate

__all__ = ['LoadableCheckpoint', 'checkpoint_files', 'export', 'exported_name', 'f_argument',
           'fetch_checkpoint', 'find_checkpoint', 'find_exportable']


def f_argument(module_name: str) -> str:
    """The argument of skorch's ``load_params`` for a module: ``f_params``
    for ``module``, ``f_<name>`` for the others (``f_criterion``)."""
    return 'f_params' if module_name == 'module' else f'f_{module_name}'


def exported_name(module_name: str) -> str:
    """The file :func:`export` writes for a module: skorch's default name
    (``params``, ``criterion``, ``<name>``) with ``.safetensors``."""
    return ('params' if module_name == 'module' else module_name) + '.safetensors'


def find_checkpoint(source: str | os.PathLike, which: str | os.PathLike = 'latest') -> str:
    """The path of one complete checkpoint.

    Parameters
    ----------
    source : str or path-like
      A folder of checkpoints (an ``AccelerateCheckpoint``'s ``dirname``),
      or one checkpoint folder (``<dirname>/epoch-NNNN``).

    which : str (default='latest')
      For a folder of checkpoints: ``'latest'`` (the newest complete one),
      ``'best'``, the name of one of its checkpoints (``'epoch-0003'``) or
      the path of a checkpoint folder.

    Raises
    ------
    FileNotFoundError
      No such folder, no checkpoint in it, or no checkpoint of that name.
    ValueError
      ``source`` is one checkpoint and ``which`` asks to choose.
    CorruptCheckpointError, CheckpointError
      The checkpoint chosen is not complete (the message names the file), or
      of a newer format.
    """
    return _found(source, which).path


def _found(source: str | os.PathLike, which: str | os.PathLike) -> Found:
    """The checkpoint :func:`find_checkpoint` finds, with its manifest."""
    source = os.fspath(source)
    if not os.path.isdir(source):
        raise FileNotFoundError(f"no such folder: {source}")
    if _is_one_checkpoint(source):
        if which != 'latest':
            raise ValueError(
                f"{source} is one checkpoint; which={which!r} chooses among the "
                "checkpoints of a folder: pass that folder")
        return Found(source, _manifest.read(source))
    which = os.fspath(which)
    if not (which in POINTERS or is_checkpoint_name(which) or os.path.isdir(which)):
        raise FileNotFoundError(
            f"no checkpoint {which!r}: not 'latest', 'best', a checkpoint name "
            f"(epoch-NNNN) in {source} or a checkpoint folder")
    found = CheckpointFolder(source).find_checkpoint(which)
    if found is None:
        raise FileNotFoundError(f"no checkpoint in {source}")
    return found


def fetch_checkpoint(url: str, which: str | os.PathLike, local_dir: str | os.PathLike,
                     storage_options: dict[str, Any] | None = None) -> Found:
    """Checkpoint ``which`` (``'latest'``, ``'best'`` or a name) of the
    store at ``url``, downloaded into ``local_dir`` and checked there.

    Raises
    ------
    FileNotFoundError
      The store holds no checkpoint (of that name).
    CheckpointError, CorruptCheckpointError
      As :meth:`RemoteStorage.find_checkpoint`: the URL cannot be opened, no
      checkpoint is the best one, the checkpoint named is damaged.
    """
    found = RemoteStorage(url, local_dir, storage_options).find_checkpoint(which)
    if found is None:
        raise FileNotFoundError(f"no checkpoint in {url}")
    return found


def checkpoint_files(path: str | os.PathLike) -> dict[str, str]:
    """The files of checkpoint ``path`` as arguments of skorch's
    ``load_params``: ``{'f_params': <path>/model.safetensors, ...,
    'f_history': <path>/history.json}``.

    Raises :class:`CorruptCheckpointError` naming the file if the checkpoint
    is not complete.
    """
    saved = _manifest.read(path)
    files = {f_argument(name): os.path.join(path, file)
             for name, file in consolidate.model_files(saved, path)}
    files['f_history'] = os.path.join(path, _manifest.plain_history_name(saved))
    return files


def _exportable_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` if its model files and history
    are intact (listed, of their listed sizes and checksums): an incomplete checkpoint, of
    a missing or damaged optimizer or random-state file, cannot be resumed
    from, but its model can be exported; a warning names the files at fault.

    Raises the error of :func:`_manifest.read` if the manifest itself is at
    fault, and :class:`CorruptCheckpointError` naming the model file or
    history that is missing or damaged.
    """
    saved, problems = _manifest.check(path)
    if saved is None:
        raise problems[0].error
    if not problems:
        return saved
    files = saved['files']
    history = _manifest.plain_history_name(saved)
    needed = [file for _, file in consolidate.model_files(saved, path)]
    needed.append(history)
    if 'buffers' in _manifest.per_rank(saved):
        needed.append(_manifest.buffers_name(0))
    for problem in problems:
        # a sharded model's pieces lie in its folder
        if problem.file is not None and problem.file.split(os.sep)[0] in needed:
            raise problem.error
    sealed = os.path.join(path, _manifest.MANIFEST_NAME)
    if history not in files:
        raise CorruptCheckpointError(f"{os.path.join(path, history)} is not listed in {sealed}")
    warnings.warn(f"{path} is not a complete checkpoint, it cannot be resumed from: "
                  + '; '.join(str(problem.error) for problem in problems)
                  + "; its model files and history are intact and are exported", UserWarning)
    return saved


def find_exportable(source: str | os.PathLike, which: str | os.PathLike = 'latest') -> str:
    """The path of the checkpoint :func:`export` exports: the one
    :func:`find_checkpoint` finds, except that a checkpoint whose model
    files and history are intact qualifies even if another of its files (an
    optimizer or random state) is missing or damaged, with a warning naming
    it; for ``'latest'``, the newest such checkpoint.

    Raises as :func:`find_checkpoint` does; :class:`CorruptCheckpointError`
    names the model file or history at fault.
    """
    return _exported_checkpoint(source, which)[0]


def _exported_checkpoint(
        source: str | os.PathLike, which: str | os.PathLike,
) -> tuple[str, dict[str, Any]]:
    """``(path, manifest)`` of :func:`find_exportable`."""
    source = os.fspath(source)
    one = _is_one_checkpoint(source)
    if which == 'latest' and not one and os.path.isdir(source):
        folder = CheckpointFolder(source)
        newest = next(iter(folder.newest_first()), None)
        if newest is not None:
            try:
                return folder.path(newest), _exportable_manifest(folder.path(newest))
            except CheckpointError:
                pass  # find_checkpoint warns that it skips it, and finds an older one
    try:
        found = _found(source, which)
    except CorruptCheckpointError:
        if which == 'latest' and not one:
            raise
        # the checkpoint named (one, best.json's, by name or path) is incomplete
        path = source if one else CheckpointFolder(source).named(which)
        return path, _exportable_manifest(path)
    return found.path, found.manifest


def _is_one_checkpoint(source: str | os.PathLike) -> bool:
    return (is_checkpoint_name(os.path.basename(os.path.normpath(source)))
            or os.path.isfile(os.path.join(source, _manifest.MANIFEST_NAME)))


def _load_tensors(file: str) -> dict[str, torch.Tensor]:
    """A state dict from a model file or sharded model folder, without
    running code from it."""
    state = consolidate.read_model(file)
    if not (isinstance(state, dict)
            and all(isinstance(value, torch.Tensor) for value in state.values())):
        raise CorruptCheckpointError(f"{file} holds no state dict of tensors")
    # safetensors stores no two names of one tensor (tied weights)
    return {key: value.detach().clone().contiguous() for key, value in state.items()}


def _take_rank_0_buffers(path: str, saved: dict[str, Any],
                         models: list[tuple[str, dict[str, torch.Tensor]]]) -> None:
    """Give ``models`` (name, state dict) of checkpoint ``path`` saved
    rank 0's buffers, where the ranks' differed (FSDP2 keeps them per rank,
    its sharded checkpoint holds one rank's), with a warning saying so."""
    if 'buffers' not in _manifest.per_rank(saved):
        return
    file = os.path.join(path, _manifest.buffers_name(0))
    buffers = read_naming_fault([file], lambda: load_without_code(file, 'safetensors'))
    for key, value in buffers.items():
        index, name = key.split('/', 1)
        models[int(index)][1][name] = value.clone()
    warnings.warn(
        f"{path}: the ranks' module buffers differed (FSDP2 keeps BatchNorm's running "
        f"statistics per rank): the model is exported with rank 0's ({file})",
        UserWarning, stacklevel=3)


def export(
        source: str | os.PathLike, out: str | os.PathLike, which: str | os.PathLike = 'latest',
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
    is missing or damaged, with a warning naming it (:func:`find_exportable`).
    A model that FSDP2 saved sharded is merged in this process, which must
    be one on its own (no job of several processes).

    Parameters
    ----------
    source : str or path-like
      A folder of checkpoints or one checkpoint folder (see
      :func:`find_checkpoint`), or the URL of checkpoints in an object store
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
    >>> from skorch_accel_callbacks.tools.export import export
    >>> files = export('checkpoints', 'model')  # the newest checkpoint
    >>> files
    {'f_params': 'model/params.safetensors', 'f_history': 'model/history.json'}
    >>> net = NeuralNetClassifier(MyModule).initialize()
    >>> net.load_params(**files, use_safetensors=True)
    >>> export('s3://bucket/run1', 'model', which='best')

    """
    out = os.fspath(out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise FileExistsError(f"{out} exists and is not a folder: export into a new "
                              "folder, or one an earlier export wrote")
    if is_remote(source):
        with tempfile.TemporaryDirectory(prefix='skorch-accel-export-') as staging:
            found = fetch_checkpoint(os.fspath(source), which, staging, storage_options)
            return export(found.path, out)
    path, saved = _exported_checkpoint(source, which)
    inside = os.path.relpath(os.path.realpath(out), os.path.realpath(path))
    if not (inside == os.pardir or inside.startswith(os.pardir + os.sep)):
        raise ValueError(f"{out} is inside the checkpoint {path}: export into another folder")
    history = os.path.join(path, _manifest.plain_history_name(saved))
    try:
        read_json(history)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{history} cannot be loaded: {exc}") from exc
    # every file is read before one is written: a damaged checkpoint
    # leaves ``out`` as it was
    models = [(name, _load_tensors(os.path.join(path, file)))
              for name, file in consolidate.model_files(saved, path)]
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
    target = os.path.join(out, _manifest.HISTORY_NAME)
    with atomic_path(target) as tmp:
        shutil.copyfile(history, tmp)
    written['f_history'] = target
    return written


class LoadableCheckpoint:
    """Mixin of a checkpoint callback with a ``dirname``: its checkpoints
    read as skorch's ``load_params(checkpoint=...)`` reads a ``Checkpoint``'s.

    Reading needs no lock, nor ``initialize()``: a script that only loads a
    checkpoint creates the callback and reads.
    """

    def _reader(self) -> CheckpointStorage:
        storage = getattr(self, 'folder_', None)
        return storage if storage is not None else self.open_storage()

    def open_storage(self) -> CheckpointStorage:
        """A new storage object of ``dirname`` (with a store's URL, staged in
        ``local_dir`` and opened with ``storage_options``)."""
        return open_storage(self.dirname, getattr(self, 'local_dir', None),
                            getattr(self, 'storage_options', None))

    def committed(self) -> list[str]:
        """Names of the committed checkpoint folders, oldest commit first."""
        return self._reader().committed()

    def find(self, which: str = 'latest') -> str | None:
        """Path of the checkpoint to resume from, or None; see
        ``CheckpointFolder.find``."""
        return self._reader().find(which)

    @property
    def f_history(self) -> None:
        """None: skorch's ``load_params`` then takes the history's file from
        :meth:`get_formatted_files`, with the models', so that the
        checkpoint is found (and a damaged newer one skipped, with a
        warning) once, and both come from the same one."""
        return None

    @property
    def f_history_(self) -> str:
        """Path of the history of the newest complete checkpoint."""
        return self._checkpoint_files('latest')['f_history']

    def _checkpoint_files(self, which: str) -> dict[str, str]:
        """:func:`checkpoint_files` of checkpoint ``which`` of ``dirname``,
        downloaded first from a store."""
        if is_remote(self.dirname):
            found = self._reader().find_checkpoint(which)
            if found is None:
                raise FileNotFoundError(f"no checkpoint in {self.dirname}")
            return checkpoint_files(found.path)
        return checkpoint_files(find_checkpoint(self.dirname, which))

    def get_formatted_files(self, net: Any, which: str = 'latest') -> dict[str, str]:
        """The files of a checkpoint as arguments of skorch's ``load_params``.

        ``net.load_params(checkpoint=cp)`` calls it: it loads the model(s)
        and the history of the newest complete checkpoint into any net,
        with or without accelerate, in one process or many (not the
        optimizer nor the rest of the training state: resuming is
        :class:`AccelerateLoadInitState`'s). Where the checkpoint holds
        every rank's own history, rank 0's is loaded; the module buffers
        are those of accelerate's model files (for every rank's own under
        FSDP2, rank 0's, ``export()`` the checkpoint). With a torch older than 2.13,
        pass ``use_safetensors=True`` to ``load_params``.

        A model that FSDP2 saved sharded is merged in this process
        (as ``export()`` merges it) and comes as an
        in-memory file of torch's format: load it without
        ``use_safetensors=True``, in one process (in a job of several,
        ``export()`` it first and load the exported files).

        Parameters
        ----------
        net : skorch.NeuralNet or None
          Unused; skorch passes the net.

        which : str (default='latest')
          ``'latest'``, ``'best'``, the name of a checkpoint
          (``'epoch-0003'``) or the path of a checkpoint folder.

        Returns
        -------
        files : dict
          ``f_params`` (the module ``module``), ``f_<name>`` for every other
          module or criterion with trainable parameters, ``f_history``.

        Raises
        ------
        FileNotFoundError
          There is no checkpoint (of that name) in ``dirname``.
        CheckpointError
          ``which='best'`` and no checkpoint is marked best; or the
          checkpoint is of a newer format.
        CorruptCheckpointError
          The checkpoint chosen is damaged (the message names the file).
        RuntimeError
          A model is sharded and this process is one of a job of several.

        Examples
        --------
        >>> net = NeuralNetClassifier(MyModule).initialize()
        >>> net.load_params(checkpoint=AccelerateCheckpoint(dirname='run1'))
        >>> net.load_params(**cp.get_formatted_files(net, which='best'))

        """
        return {key: consolidate.loadable(file)
                for key, file in self._checkpoint_files(which).items()}
