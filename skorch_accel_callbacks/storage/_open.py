"""The storage of a ``dirname``: a local folder or an fsspec store, as fsspec reads the URL."""

from __future__ import annotations

import os
from typing import Any

from fsspec.core import split_protocol

from skorch_accel_callbacks.storage._interface import CheckpointStorage
from skorch_accel_callbacks.storage._local import CheckpointFolder
from skorch_accel_callbacks.storage._remote import RemoteStorage

__all__ = ['TESTED_STORES', 'check_tested_store', 'is_remote', 'open_storage']

_LOCAL_PROTOCOLS = ('file', 'local')
#: the stores the tests run against (a local S3 server, a local GCS server,
#: fsspec's memory store), by URL scheme
TESTED_STORES = ('s3', 'gs', 'gcs', 'memory')


def is_remote(dirname: str | os.PathLike[str]) -> bool:
    """Whether ``dirname`` is the URL of a store other than the local
    filesystem, as fsspec parses it: ``s3://...``, ``s3+https://...``,
    ``simplecache::s3://...``, ``memory://...``; not a path, not ``file://...``.

    Raises
    ------
    ValueError
      ``dirname`` is a path that starts as a URL of a protocol fsspec knows
      but lacks its ``//`` (``s3:/bucket/run1``): a mistyped URL, not a
      folder to create.
    """
    dirname = os.fspath(dirname)
    protocol, _ = split_protocol(dirname)
    if protocol is None:
        _refuse_mistyped_url(dirname)
        return False
    return protocol.lower() not in _LOCAL_PROTOCOLS


def check_tested_store(dirname: str | os.PathLike[str], owner: str) -> None:
    """Refuse the URL of a store the package is not tested with, naming the
    tested ones, before training: an untested store (``ftp://``, ``http://``)
    would fail at the first save, deep in its fsspec package. A chained URL
    (``simplecache::s3://...``) counts by its last store, a scheme with a
    transport (``s3+https``) by its store.

    Raises
    ------
    ValueError
      ``dirname`` is the URL of an untested store, or a mistyped URL.
    """
    if not is_remote(dirname):
        return
    target = os.fspath(dirname).rsplit('::', 1)[-1]
    protocol = (split_protocol(target)[0] or '').lower().split('+')[0]
    if protocol not in TESTED_STORES:
        tested = ', '.join(f'{name}://' for name in TESTED_STORES)
        raise ValueError(
            f"{owner}: dirname={os.fspath(dirname)!r} is in a {protocol}:// store, which this "
            f"package is not tested with; the tested stores are {tested} and local folders "
            "(a path, or file://)")


def _refuse_mistyped_url(path: str) -> None:
    import fsspec
    head, colon, _ = path.partition(':')
    # one letter before the colon is a drive of Windows (C:/...)
    if colon and len(head) > 1 and head.lower() in fsspec.available_protocols():
        raise ValueError(
            f"{path!r} looks like a mistyped URL (a URL reads {head}://...), not a "
            f"folder: write the URL with two slashes, or ./{path} for a local folder "
            "of that name")


def open_storage(dirname: str | os.PathLike[str], local_dir: str | os.PathLike[str] | None = None,
                 storage_options: dict[str, Any] | None = None, *,
                 outage_seconds: float = 60.0, lease_seconds: float = 60.0,
                 ) -> CheckpointStorage:
    """The storage of the checkpoints of ``dirname``.

    A path or a ``file://`` URL is a local folder (:class:`CheckpointFolder`);
    any other fsspec URL (:func:`is_remote`: ``s3://bucket/run1``) an object
    store (:class:`RemoteStorage`), staged in ``local_dir`` (None: a folder
    of the system's temporary folder named after the URL), opened with the
    fsspec ``storage_options``, its requests sent again for up to
    ``outage_seconds`` and its lease lasting ``lease_seconds``.

    Raises
    ------
    ValueError
      ``dirname`` is a mistyped URL (:func:`is_remote`).
    """
    if is_remote(dirname):
        return RemoteStorage(os.fspath(dirname), local_dir, storage_options,
                             outage_seconds=outage_seconds, lease_seconds=lease_seconds)
    protocol, path = split_protocol(os.fspath(dirname))
    return CheckpointFolder(os.fspath(dirname) if protocol is None else path)
