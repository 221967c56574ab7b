"""The one use of torch's internals: ``torch.save``'s archive, written
without the CRC-32 of its records, for the optimizer files of a checkpoint
(:func:`save_without_crc` says why); ``tests/format/test_torch_archive.py``
checks on every release of the test matrix that ``torch.load`` reads what
it writes.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

__all__ = ['save_without_crc']


def save_without_crc(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``, except that the zip records' CRC-32 fields
    are 0: the file ``torch.serialization.set_crc32_options(False)`` makes,
    which ``torch.load`` reads. Computing the CRCs took half the time of
    writing an optimizer file into the page cache (benchmarks/RESULTS.rst);
    the manifest's checksum of the file is what a resume checks. That switch
    is process-wide, and another thread's ``torch.save`` would lose its CRCs
    too: the writer is made here, for this file alone.

    Raises ``OSError`` (a full disk: ``ENOSPC``, naming the file) where
    ``torch.save`` raises torch's own error, or aborts the process: its
    archive writer that failed to write finishes the archive again when it
    is destroyed, and terminates the process when that fails too.
    """
    alignment = torch.serialization._get_storage_alignment()
    try:
        with open(path, 'wb') as stream:
            _write_archive(obj, stream, alignment)
    except OSError as error:
        # the last of the buffer, written at close, names no file
        raise OSError(error.errno, error.strerror, path) from error


def _write_archive(obj: Any, stream: Any, alignment: int) -> None:
    """torch's archive of ``obj`` written into the open file ``stream``."""
    sink = _ArchiveSink(stream)
    writer = torch._C.PyTorchFileWriter(sink, False, alignment)
    try:
        torch.serialization._save(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL,
                                  _disable_byteorder_record=False)
        writer.write_end_of_file()
    finally:
        # destroyed while its file is open: one that failed finishes its
        # archive into the sink here, not later into a closed file
        del writer
    if sink.error is not None:
        raise sink.error


class _ArchiveSink:
    """The file torch's archive writer writes into: every byte written (a
    short write goes on), and after the first error nothing more, each write
    answered as done, so that torch's writer never fails (see
    :func:`save_without_crc`); ``error`` is that first error. The
    file is buffered, as torch's own file is: the crash-point suite's plan
    of a save (its write calls) stays what it was."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast('B')
        if self.error is None:
            try:
                done = 0
                while done < len(view):
                    done += self.stream.write(view[done:])
            except OSError as error:
                self.error = error
        return len(view)
