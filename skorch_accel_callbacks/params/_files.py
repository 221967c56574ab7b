"""The files of a :class:`~skorch_accel_callbacks.ParamsCheckpoint` save.

A save writes each file (params, optimizer, history, pickle, ...) under a
temporary name next to its final one and moves all of them into place
together, through :class:`~skorch_accel_callbacks.format.StagedFiles` and
its journal (``<dirname>/.<fn_prefix>commit.json``). Before a checkpoint's
files are read or written again, the moves that a crash interrupted are
completed and the temporary files of killed saves of those files are
removed; a save in flight of another job (same folder, other ``fn_prefix``,
or the holder of the lock) is left alone.

A save skips the files of objects that have no state to save (no
``state_dict``, e.g. a criterion that is a plain function): they are
neither saved nor loaded.

The file names are skorch's: ``dirname``, ``fn_prefix`` and the ``f_*``
arguments (name -> value, a value of ``str`` may be a format template such as
``'params_{last_epoch[epoch]}.pt'``).
"""

import os
import re
import string
from collections.abc import Callable, Mapping
from typing import Any

from skorch_accel_callbacks._core import skorch_io
from skorch_accel_callbacks._core.wrapping import check_plain, is_sharded
from skorch_accel_callbacks.errors import CorruptCheckpointError, FolderInUseError
from skorch_accel_callbacks.format import (
    TEMP_MARK,
    StagedFiles,
    atomic_path,
    finish_staged,
    remove_temp_files as remove_named_temp_files,
    unique_name,
)
from skorch_accel_callbacks.storage import PrefixLock

__all__ = [
    'check_folders',
    'check_sharding',
    'commit',
    'finish_interrupted_save',
    'journal_path',
    'not_saved_message',
    'remove_temp_files',
    'start_save',
    'state_attr',
    'stateless_files',
    'stateless_object',
    'write_file',
]

_MISSING = object()


def journal_path(dirname: str, fn_prefix: str) -> str:
    """Where a save lists its file moves while it makes them."""
    return os.path.join(dirname, f".{fn_prefix}commit.json")


def state_attr(f_key: str) -> str | None:
    """The attribute of the net whose ``state_dict`` the file ``f_key`` holds
    (``'f_params'`` -> ``'module_'``), None for the history and the pickle."""
    if f_key in ('f_history', 'f_pickle'):
        return None
    return 'module_' if f_key == 'f_params' else f_key[2:] + '_'


def stateless_object(net: Any, attr: str | None) -> Any:
    """The object ``net.<attr>`` if it has no state to save (no ``state_dict``:
    not a torch Module or Optimizer, e.g. a criterion that is a plain
    function), else None."""
    obj = getattr(net, attr, _MISSING) if attr is not None else _MISSING
    if obj is _MISSING or hasattr(obj, 'state_dict'):
        return None
    return obj


def stateless_files(net: Any, f_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``f_*`` arguments (name -> value) whose objects in ``net`` have no
    state to save: neither saved nor loaded."""
    return {key: val for key, val in sorted(f_kwargs.items())
            if val is not None and stateless_object(net, state_attr(key)) is not None}


def _describe_object(obj: Any) -> str:
    name = getattr(obj, '__qualname__', None)
    kind = type(obj).__name__
    return f"{name}, a {kind}" if name else f"a {kind}"


def not_saved_message(owner: str, net: Any, key: str, val: Any) -> str:
    """What ``owner`` warns about the file ``key=val`` of :func:`stateless_files`."""
    attr = state_attr(key)
    return (
        f"{owner}: {key}={val!r} is not saved (nor loaded): net.{attr} "
        f"({_describe_object(stateless_object(net, attr))}) has no state_dict, it is "
        f"not a torch Module or Optimizer; set {key}=None to not be told")


def _creation_error(folder: str) -> OSError | None:
    """Return the ``OSError`` that creating a file in ``folder`` raises, or None.

    An empty file is created and removed: ``os.access`` answers True for
    root even where nothing can be created (sysfs, some network mounts).
    """
    probe = unique_name(os.path.join(folder or '.', 'probe'), TEMP_MARK)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError as exc:
        return exc
    os.close(fd)
    os.remove(probe)
    return None


def check_folders(owner: str, dirname: str, fn_prefix: str,
                  f_kwargs: Mapping[str, Any]) -> None:
    """Raise ``OSError`` naming the ``f_*`` argument and ``owner`` if a file
    of the checkpoint could not be created in its folder."""
    checked = set()
    for key, val in sorted(f_kwargs.items()):
        if not isinstance(val, str):
            continue
        folder = os.path.dirname(os.path.join(dirname, fn_prefix + val))
        # a folder named by a format specifier is only known when saving
        if '{' in folder or folder in checked:
            continue
        checked.add(folder)
        error = _creation_error(folder)
        if error is not None:
            raise OSError(
                error.errno, f"{owner} cannot write "
                f"{key}={val!r}: {error.strerror} in folder",
                folder or '.') from error


def check_sharding(owner: str, net: Any, f_kwargs: Mapping[str, Any], load_best: bool) -> None:
    """Raise ``ValueError`` naming ``owner`` and its argument if the net's
    modules are sharded by FSDP2 and the checkpoint is to save an
    optimizer or the pickled net, or to load the best parameters: each needs
    what no rank holds (the full optimizer state, the plain module). The
    module's parameters are saved in full (gathered onto the main process)."""
    if not is_sharded(net):
        return
    into_new_net = "the saved parameters load into a new net"
    for key, val in sorted(f_kwargs.items()):
        if val is not None and key[2:] in skorch_io.optimizer_names(net):
            check_plain(net, f"{owner}: {key}={val!r} needs the optimizer state of a plain "
                        "module", f"set {key}=None; AccelerateCheckpoint and "
                        "AccelerateLoadInitState save and resume the optimizer sharded")
    if f_kwargs.get('f_pickle'):
        check_plain(net, f"{owner}: f_pickle={f_kwargs['f_pickle']!r} needs a plain module "
                    "to pickle", f"set f_pickle=None; {into_new_net}")
    if load_best:
        check_plain(net, f"{owner}: load_best=True needs a plain module to load into",
                    f"set load_best=False; {into_new_net}")


def _name_pattern(name: str) -> str:
    """A regex of the file names that the name template ``name``
    (``'params_{last_epoch[epoch]}.pt'``) stands for."""
    parts = []
    try:
        for literal, field, _, _ in string.Formatter().parse(name):
            parts.append(re.escape(literal))
            if field is not None:
                parts.append('.*')
    except ValueError:
        # not a valid template (saving it fails and says so): the name as is
        parts = [re.escape(name)]
    return ''.join(parts)


def remove_temp_files(dirname: str, fn_prefix: str, f_kwargs: Mapping[str, Any]) -> None:
    """Remove the temporary files that killed saves of the checkpoint's
    files left; those of other files (another ``fn_prefix``, another
    job's save in flight) are not touched."""
    patterns: dict[str, list[str]] = {}
    for val in f_kwargs.values():
        if not isinstance(val, str):
            continue
        folder, name = os.path.split(os.path.join(dirname, fn_prefix + val))
        # a folder named by a format specifier is not known here
        if '{' in folder:
            continue
        patterns.setdefault(folder, []).append(_name_pattern(name))
    for folder, names in patterns.items():
        remove_named_temp_files(folder, names)


def finish_interrupted_save(dirname: str, fn_prefix: str,
                            f_kwargs: Mapping[str, Any]) -> list[str]:
    """Complete the file moves of a save that a crash interrupted and remove
    the temporary files of killed saves; return the files moved into place.

    Nothing is done (and nothing returned) while another running job holds
    the lock of the checkpoint's files: the save in flight is that job's.
    A journal that cannot be read raises
    :class:`~skorch_accel_callbacks.CorruptCheckpointError` naming it.
    """
    if not os.path.isdir(dirname or '.'):
        return []
    try:
        lock = PrefixLock(dirname, fn_prefix).acquire()
    except FolderInUseError:
        return []
    try:
        finished = finish_staged(journal_path(dirname, fn_prefix))
        remove_temp_files(dirname, fn_prefix, f_kwargs)
    except ValueError as exc:
        raise CorruptCheckpointError(str(exc)) from exc
    finally:
        lock.release()
    return finished


def start_save(dirname: str, fn_prefix: str) -> StagedFiles:
    """The staged files of a new save, journaled in :func:`journal_path`."""
    return StagedFiles(journal_path(dirname, fn_prefix))


def write_file(f: Any, write: Callable[[Any], object], staged: StagedFiles | None,
               main: bool, every_rank: bool) -> None:
    """Write ``f`` with ``write(target)``; only the main process writes.

    On the main process (``main``) a path is written to a temporary file,
    staged to be moved into place with the save's other files (or, without
    ``staged``, moved at once); the other ranks call ``write`` with the
    final path when ``every_rank`` (a ``save_params`` that writes nothing
    but takes part in its collectives).
    """
    if main and isinstance(f, (str, os.PathLike)):
        if staged is not None:
            write(staged.temp_path(f))
        else:
            with atomic_path(f) as tmp:
                write(tmp)
    elif main or every_rank:
        write(f)


def commit(staged: StagedFiles, main: bool) -> None:
    """Move the files of a save into place, on the main process: the only
    one that wrote them."""
    if main:
        staged.commit()
