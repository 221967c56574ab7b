"""A model that FSDP2 saved sharded, read back as one plain state dict.

Under FSDP2, accelerate's ``save_state`` with ``SHARDED_STATE_DICT`` writes
each model as a folder ``pytorch_model_fsdp_<i>/`` of
``torch.distributed.checkpoint``: a ``.metadata`` file (which piece of which
tensor lies where) and one ``__<rank>_0.distcp`` per rank;
``FULL_STATE_DICT`` writes one file ``pytorch_model_fsdp.bin``.
:func:`read_model` reads either, or any plain model file, into
``{name: tensor}`` in this one process, without a process group: a folder
through accelerate's ``merge_fsdp_weights``.

Nothing here runs code from a file. The library reads ``.metadata`` with a
plain ``pickle.load`` and any entry that is not a tensor with
``torch.load(weights_only=False)``: :func:`check_sharded_model` first reads
``.metadata`` with an unpickler that admits only the classes of that
metadata, refuses a folder with an entry other than a tensor, and checks
that every piece file it lists is there, whole. The pieces are read with
``torch.load(weights_only=True)``, the merged model as safetensors.
"""

from __future__ import annotations

import io
import os
import pickle
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import SAFE_WEIGHTS_NAME, merge_fsdp_weights
from safetensors.torch import load_file

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks._core.releases import torch_loads_safetensors
from skorch_accel_callbacks.errors import CorruptCheckpointError
from skorch_accel_callbacks.format import (
    DCP_METADATA_NAME,
    frozen_parts_of,
    kind_of,
    load_without_code,
    read_naming_fault,
)
from skorch_accel_callbacks.state import model_files as recorded_model_files

__all__ = ['check_sharded_model', 'is_sharded_model', 'loadable', 'model_files',
           'read_checkpoint_model', 'read_model', 'read_sharded_model']

_CHECKPOINT = 'torch.distributed.checkpoint'
# what a .metadata of torch 2.3 to 2.13 is made of, and nothing that runs code
_METADATA_CLASSES = {
    f'{_CHECKPOINT}.metadata': {
        'Metadata', 'MetadataIndex', 'ChunkStorageMetadata', 'TensorStorageMetadata',
        'BytesStorageMetadata', 'TensorProperties', 'StorageMeta', '_MEM_FORMAT_ENCODING'},
    f'{_CHECKPOINT}.filesystem': {'_StorageInfo'},
    'torch': {'Size'},
    'torch.serialization': {'_get_layout'},
    'collections': {'OrderedDict'},
    'pathlib': {'Path', 'PosixPath', 'WindowsPath', 'PurePosixPath', 'PureWindowsPath'},
}
# where Python 3.13 on defines pathlib's classes (a .metadata written there
# names them so), the same classes as pathlib's
_PATHLIB_OF_3_13 = 'pathlib._local'


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``.metadata`` file, refusing every class it does not hold."""

    def find_class(self, module: str, name: str) -> Any:
        if module == _PATHLIB_OF_3_13:
            module = 'pathlib'
        is_dtype = module == 'torch' and isinstance(getattr(torch, name, None), torch.dtype)
        if not is_dtype and name not in _METADATA_CLASSES.get(module, ()):
            raise pickle.UnpicklingError(
                f"{module}.{name} is not part of torch.distributed.checkpoint's metadata")
        return super().find_class(module, name)


def _fsdp_model_file(index: int, files: dict[str, Any]) -> str | None:
    """The listed folder (sharded) or file (full state dict) of the
    ``index``-th model of an FSDP checkpoint listing ``files``, or None."""
    sharded = accelerate_io.fsdp_model_file(index, sharded=True)
    full = accelerate_io.fsdp_model_file(index, sharded=False)
    if os.path.join(sharded, DCP_METADATA_NAME) in files:
        return sharded
    return full if full in files else None


def model_files(manifest: dict[str, Any], folder: str) -> list[tuple[str, str]]:
    """``(module name, file name)`` of each model of a checkpoint, as
    :func:`skorch_accel_callbacks.state.model_files`
    gives them, or for a checkpoint of FSDP accelerate's folder of a sharded
    model (``pytorch_model_fsdp_0``) or file of a full one
    (``pytorch_model_fsdp.bin``).

    Raises :class:`CorruptCheckpointError` naming the file if the manifest
    does not list a model's file.
    """
    files = manifest.get('files')
    models = manifest.get('models')
    if not (isinstance(files, dict) and isinstance(models, list)
            and any(accelerate_io.is_fsdp_model_path(name) for name in files)):
        return recorded_model_files(manifest, folder)
    if not all(isinstance(entry, list) and entry and isinstance(entry[0], str)
               for entry in models):
        return recorded_model_files(manifest, folder)  # which says which entry
    found = []
    for index, entry in enumerate(models):
        name = _fsdp_model_file(index, files)
        if name is None:
            missing = os.path.join(folder, accelerate_io.fsdp_model_file(index, sharded=True),
                                   DCP_METADATA_NAME)
            raise CorruptCheckpointError(
                f"{missing} is missing: the manifest lists model {entry[0]!r} but not its "
                "file")
        found.append((entry[0], name))
    return found


def is_sharded_model(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded model's folder rather than a model file."""
    return os.path.isdir(path)


def _read_metadata(path: str) -> Any:
    try:
        with open(path, 'rb') as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path} is missing: {os.path.dirname(path)} is not a sharded model "
            "(torch.distributed.checkpoint)") from None
    except Exception as exc:  # pylint: disable=broad-except
        raise CorruptCheckpointError(
            f"{path} cannot be loaded: {type(exc).__name__}: {exc}") from exc
    if type(metadata).__name__ != 'Metadata':
        raise CorruptCheckpointError(
            f"{path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint's "
            "Metadata")
    return metadata


def _piece_sizes(path: str, metadata: Any) -> dict[str, int]:
    """Piece file name -> the bytes ``metadata`` (of file ``path``) reads from it."""
    sizes: dict[str, int] = {}
    try:
        for info in metadata.storage_data.values():
            name = info.relative_path
            if not isinstance(name, str) or os.path.basename(name) != name \
                    or name in ('', os.curdir, os.pardir):
                raise CorruptCheckpointError(
                    f"{path} lists a piece {name!r} outside its folder")
            sizes[name] = max(sizes.get(name, 0), int(info.offset) + int(info.length))
        entries = metadata.state_dict_metadata.items()
    except AttributeError as exc:
        raise CorruptCheckpointError(f"{path} is not a complete metadata: {exc}") from exc
    for key, entry in entries:
        if type(entry).__name__ != 'TensorStorageMetadata':
            raise CorruptCheckpointError(
                f"{path}: {key!r} is not a tensor, and cannot be read without running code")
    return sizes


def check_sharded_model(folder: str | os.PathLike) -> None:
    """Raise :class:`CorruptCheckpointError` naming the file at fault unless
    ``folder`` is a sharded model whose ``.metadata`` loads without running
    code, lists tensors only, and whose piece files are all there, each at
    least as long as the metadata says."""
    folder = os.fspath(folder)
    path = os.path.join(folder, DCP_METADATA_NAME)
    for name, size in sorted(_piece_sizes(path, _read_metadata(path)).items()):
        piece = os.path.join(folder, name)
        try:
            actual = os.path.getsize(piece)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{piece} is missing: {path} lists it") from None
        if actual < size:
            raise CorruptCheckpointError(
                f"{piece} is cut short: {actual} bytes, {path} reads {size} from it")


def read_sharded_model(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full state dict of the sharded model in ``folder``, on the CPU.

    Runs in one process (a process of a job of several would merge only on
    the main one): in a job, read the exported files instead (:func:`export
    <skorch_accel_callbacks.tools.export.export>`). accelerate's
    ``merge_fsdp_weights`` makes the process's ``PartialState`` if it has
    none yet (the CPU's, or the first GPU's where there is one).

    Raises
    ------
    CorruptCheckpointError
      ``.metadata`` or a piece is missing, damaged or cut short (the message
      names it), or the model holds an entry other than a tensor.
    RuntimeError
      This process is one of a job of several.
    """
    folder = os.fspath(folder)
    check_sharded_model(folder)
    processes = PartialState().num_processes
    if processes > 1:
        raise RuntimeError(
            f"{folder} is a sharded model, merged in one process: this is one of "
            f"{processes}; export it first (python -m skorch_accel_callbacks export) and "
            "load the exported files")
    with tempfile.TemporaryDirectory() as merged:
        try:
            merge_fsdp_weights(folder, merged, safe_serialization=True)
            return load_file(os.path.join(merged, SAFE_WEIGHTS_NAME))
        except Exception as exc:  # pylint: disable=broad-except
            raise CorruptCheckpointError(
                f"{folder} cannot be merged: {type(exc).__name__}: {exc}") from exc


def read_model(path: str | os.PathLike) -> Any:
    """What the model file or sharded model folder ``path`` holds (a state
    dict), without running code; :class:`CorruptCheckpointError` names the
    file that does not load."""
    path = os.fspath(path)
    if is_sharded_model(path):
        return read_sharded_model(path)
    return read_naming_fault([path], lambda: load_without_code(path))


def read_checkpoint_model(folder: str | os.PathLike, manifest: dict[str, Any],
                          file: str) -> Any:
    """What the model file (or sharded model folder) ``file`` of checkpoint
    ``folder`` holds, with the frozen parameters of its part merged in
    where ``manifest`` lists one; :class:`CorruptCheckpointError` names the
    file that does not load, or a part that holds an entry of the model file."""
    state = read_model(os.path.join(folder, file))
    part = frozen_parts_of(manifest).get(file)
    if part is None:
        return state
    path = os.path.join(folder, part)
    frozen = read_model(path)
    if not (isinstance(state, dict) and isinstance(frozen, dict)):
        raise CorruptCheckpointError(f"{path} and its model file hold no two state dicts")
    twice = sorted(set(state) & set(frozen))
    if twice:
        raise CorruptCheckpointError(
            f"{path} holds {twice}, which its model file {os.path.join(folder, file)} holds too")
    return {**state, **frozen}


def loadable(files: Sequence[str]) -> str | io.BytesIO:
    """The model ``files`` as skorch's ``load_params`` takes them (by
    default, through ``torch.load``): one file as it is; a sharded model
    folder merged (:func:`read_sharded_model`), a model file and its frozen
    part merged, into an in-memory file of torch's format, and so a
    safetensors file where ``torch.load`` does not read one (torch older
    than 2.13), so that ``load_params(checkpoint=...)`` needs no
    ``use_safetensors`` on any supported torch."""
    path = files[0]
    if len(files) > 1:
        state = {}
        for file in files:
            state.update(read_model(file))
    elif is_sharded_model(path):
        state = read_sharded_model(path)
    elif kind_of(os.path.basename(path)) == 'safetensors' and not torch_loads_safetensors():
        state = read_model(path)
    else:
        return path
    in_torch_format = io.BytesIO()
    torch.save(state, in_torch_format)
    in_torch_format.seek(0)
    return in_torch_format
