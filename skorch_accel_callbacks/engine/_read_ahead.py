"""The optimizers' files of a checkpoint, read while its files are checked.

Before a resume loads anything it checks every file of the checkpoint
(size and checksum: each file read once), and then the load reads the
model and optimizer files again. With Adam the optimizers' files are two
thirds of a checkpoint, and making their tensors is most of the load (a
fresh optimizer has no state: every byte goes into new memory). Their read
need not wait for the check: :class:`OptimizerReadAhead` reads them on a
thread of its own from the moment the folder to check is known, while the
check reads the same files, so that the disk is read about once and the two
reads share the cores. The states are handed to the load only for the
folder they were read from, after its check passed, and the load takes
them last, once the models and the other states are loaded (a read that
is not done when the check ends finishes while the models load): a
checkpoint the check refuses has its read dropped, and nothing is applied
before the check, as before. Where the read ahead failed (a file the check
will find damaged, a type that only accelerate's loader allows), the load
reads the files itself and reports what is wrong with them.

``benchmarks/bench_resume.py`` times the load with it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.format import MANIFEST_NAME, frozen_parts_of, read_json

__all__ = ['OptimizerReadAhead']


class OptimizerReadAhead:
    """Reads the optimizers' files of the prepared optimizers of
    ``accelerator`` from a checkpoint folder on a thread, as
    ``Accelerator.load_state`` reads them (with the frozen parts its
    manifest lists); one folder at a time.

    Under FSDP2 (whose optimizers accelerate loads through
    torch.distributed.checkpoint) it reads nothing.
    """

    def __init__(self, accelerator: Any) -> None:
        self._count = (0 if accelerate_io.is_fsdp2(accelerator)
                       else len(accelerate_io.optimizers(accelerator)))
        self._map_location = accelerate_io.optimizer_map_location(accelerator)
        self._reading: tuple[str, Future] | None = None

    def begin(self, folder: str | os.PathLike[str]) -> None:
        """Begin to read the optimizers' files of ``folder``; a read of
        another folder begun before is dropped."""
        self._reading = None
        if not self._count:
            return
        future: Future = Future()
        count, map_location = self._count, self._map_location

        def read() -> None:
            try:
                future.set_result(accelerate_io.read_optimizer_states(
                    folder, count, map_location, _frozen_parts(folder)))
            except Exception as exc:  # handed to take(), which falls back
                future.set_exception(exc)
            finally:
                if not future.done():  # take() must not wait for ever
                    future.set_exception(RuntimeError("the read ahead stopped"))

        # not a daemon: an interpreter that exits meanwhile lets the read end
        # instead of stopping it inside torch's reader
        threading.Thread(target=read, name='checkpoint-read-ahead').start()
        self._reading = (os.path.normpath(os.fspath(folder)), future)

    def reading(self, folder: str | os.PathLike[str]) -> bool:
        """Whether a read of ``folder`` was begun and not yet taken."""
        return (self._reading is not None
                and self._reading[0] == os.path.normpath(os.fspath(folder)))

    def take(self, folder: str | os.PathLike[str]) -> list[dict[str, Any]] | None:
        """The optimizers' states read from ``folder``, once read; None where
        no read of it was begun or the read failed (the load then reads the
        files itself)."""
        reading, self._reading = self._reading, None
        if reading is None or reading[0] != os.path.normpath(os.fspath(folder)):
            return None
        try:
            return reading[1].result()
        except Exception:  # the load's own read reports it, naming the file
            return None


def _frozen_parts(folder: str | os.PathLike[str]) -> dict[str, str]:
    """The frozen parts that the manifest of ``folder`` lists, its files
    unread (the check reads them); none where it has no manifest (no
    checkpoint: its check refuses it, and the read is dropped)."""
    path = os.path.join(folder, MANIFEST_NAME)
    return frozen_parts_of(read_json(path)) if os.path.exists(path) else {}
