"""Where the checkpoints of a folder live: the interface, and the storage of a path.

The writers (:mod:`~skorch_accel_callbacks.engine._writer`) and the callbacks use a
storage through :class:`CheckpointStorage` only, so that another kind of
storage (an object store) plugs in without a change to either. A storage
holds named checkpoints; one is written into a partial place
(:meth:`~CheckpointStorage.start`), becomes a checkpoint at once and
completely when committed (:meth:`~CheckpointStorage.commit`), and is read
back by name or by a pointer (``'latest'``, ``'best'``). A local folder is
a :class:`~skorch_accel_callbacks.storage._local.CheckpointFolder`; an object store
(any fsspec URL but ``file://``) a
:class:`~skorch_accel_callbacks.storage._remote.RemoteStorage`, staged in a local
folder and uploaded in the background.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

from skorch_accel_callbacks.storage._local import CheckpointFolder, Found
from skorch_accel_callbacks.storage._remote import RemoteStorage, is_remote

__all__ = ['CheckpointStorage', 'Found', 'open_storage']


@runtime_checkable
class CheckpointStorage(Protocol):
    """The checkpoints of one ``dirname``, as a writer and a resume use them."""

    dirname: str

    def claim(self, net: Any) -> None:
        """Take the storage for this job's training, on every rank."""

    def release(self) -> None:
        """End this job's claim."""

    def path(self, name: str) -> str:
        """Where the committed checkpoint ``name`` is read from."""

    def url(self, name: str) -> str:
        """Where the committed checkpoint ``name`` is kept, as messages name it."""

    def partial_path(self, name: str) -> str:
        """Where every rank writes the files of checkpoint ``name``."""

    def start(self, name: str) -> str:
        """An empty partial place for checkpoint ``name`` (the committer)."""

    def commit(self, name: str, content: dict, durable: bool, best: bool,
               started: float | None = None) -> dict:
        """Seal and commit checkpoint ``name``; return the manifest written."""

    def retire(self, keep_last: int, keep_best: int | None = None,
               keep: tuple[str | None, ...] | list[str | None] = ()) -> None:
        """Remove the checkpoints a retention policy does not keep."""

    def wait(self) -> str | None:
        """Wait for the storage's background work (removals, uploads) and
        raise what failed; return what to tell the user of it (how long an
        upload took), or None."""

    def committed(self) -> list[str]:
        """Names of the committed checkpoints, oldest first."""

    def find_checkpoint(self, which: str = 'latest') -> Found | None:
        """The checkpoint ``which`` names (``'latest'``, ``'best'``, a name or
        a path) with the manifest read there, or None."""

    def find(self, which: str = 'latest') -> str | None:
        """Path of the checkpoint ``which`` names, or None."""


def open_storage(dirname: str | os.PathLike, local_dir: str | os.PathLike | None = None,
                 storage_options: dict[str, Any] | None = None, *,
                 outage_seconds: float = 60.0, lease_seconds: float = 60.0,
                 ) -> CheckpointStorage:
    """The storage of the checkpoints of ``dirname``.

    A path or a ``file://`` URL is a local folder; any other fsspec URL
    (``s3://bucket/run1``) an object store, staged in ``local_dir`` (None:
    a folder of the system's temporary folder named after the URL), opened
    with the fsspec ``storage_options``, its requests sent again for up to
    ``outage_seconds`` and its lease lasting ``lease_seconds``
    (:class:`RemoteStorage`).
    """
    if is_remote(dirname):
        return RemoteStorage(os.fspath(dirname), local_dir, storage_options,
                             outage_seconds=outage_seconds, lease_seconds=lease_seconds)
    dirname = os.fspath(dirname)
    if dirname.lower().startswith('file://'):
        dirname = dirname[len('file://'):]
    return CheckpointFolder(dirname)
