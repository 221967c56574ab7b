"""skorch's ``LoadInitState``, correct in every process.

:class:`LoadInitParams` loads the files of a
:class:`~skorch_accel_callbacks.ParamsCheckpoint` (or of any skorch
``Checkpoint``) into the net when training begins, on every rank, and names
the file at fault when one does not load.
"""

import os
from collections.abc import Iterator
from typing import Any, Self

from skorch.callbacks import Checkpoint, LoadInitState, TrainEndCheckpoint

from skorch_accel_callbacks._core import sync
from skorch_accel_callbacks._core.arguments import keyword_suggestions
from skorch_accel_callbacks._core.base import InitParamsOnly
from skorch_accel_callbacks._core.wrapping import check_plain, unwrapped
from skorch_accel_callbacks.errors import CorruptCheckpointError
from skorch_accel_callbacks.format import first_unloadable
from skorch_accel_callbacks.params.checkpoint import File, ParamsCheckpoint

__all__ = ['LoadInitParams']


@keyword_suggestions
class LoadInitParams(InitParamsOnly, LoadInitState):
    """Load a checkpoint into the net when training begins, on every rank.

    A drop-in for :class:`skorch.callbacks.LoadInitState`: as with skorch,
    nothing is loaded when the checkpoint's files do not exist yet. What it
    changes (every rank loads the same files, or every rank raises) is in
    the docs, "How the callbacks differ from skorch's".

    Parameters
    ----------
    checkpoint : skorch.callbacks.Checkpoint or skorch.callbacks.TrainEndCheckpoint
      Checkpoint to take the file names from, e.g. a
      :class:`~skorch_accel_callbacks.ParamsCheckpoint` or
      :class:`~skorch_accel_callbacks.TrainEndParamsCheckpoint`.

    use_safetensors : bool (default=False)
      Whether the files were saved with ``safetensors``.

    Attributes
    ----------
    did_load_ : bool
      Whether a checkpoint was looked for (once per ``initialize``).

    Raises
    ------
    TypeError
      At ``initialize``: ``checkpoint`` is not a skorch ``Checkpoint`` or
      ``TrainEndCheckpoint``.
    ValueError
      When training begins, if the net's module is sharded by FSDP2.
    CorruptCheckpointError
      When training begins: a file of the checkpoint does not load (the
      message names it), on every rank.
    skorch_accel_callbacks.RankError
      When training begins, on the ranks where loading succeeded, when it
      failed on another (or only some ranks found the files).

    Examples
    --------
    Run this several times; each run continues from the best checkpoint of
    the previous one:

    >>> import numpy as np
    >>> import torch
    >>> from accelerate import Accelerator
    >>> from skorch import NeuralNetClassifier
    >>> from skorch.hf import AccelerateMixin
    >>> from skorch_accel_callbacks import AccelerateFixesMixin, LoadInitParams, ParamsCheckpoint
    >>> class AcceleratedNet(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    ...     pass
    >>> X = np.random.randn(64, 4).astype(np.float32)
    >>> y = (X[:, 0] > 0).astype(np.int64)
    >>> def make_net(callbacks):
    ...     return AcceleratedNet(
    ...         torch.nn.Linear, module__in_features=4, module__out_features=2,
    ...         criterion=torch.nn.CrossEntropyLoss, accelerator=Accelerator(cpu=True),
    ...         max_epochs=2, callbacks=callbacks)
    >>> for run in range(2):
    ...     cp = ParamsCheckpoint(monitor='valid_loss_best', dirname='exp1')
    ...     net = make_net([cp, LoadInitParams(cp)]).fit(X, y)  # doctest: +ELLIPSIS
      epoch    train_loss...

    """

    def initialize(self) -> Self:
        if not isinstance(self.checkpoint, (Checkpoint, TrainEndCheckpoint)):
            raise TypeError(
                f"{type(self).__name__}: checkpoint must be a skorch Checkpoint or "
                f"TrainEndCheckpoint (such as a ParamsCheckpoint or "
                f"TrainEndParamsCheckpoint), got {self.checkpoint!r} of type "
                f"{type(self.checkpoint).__name__}")
        return super().initialize()

    # pylint: disable=arguments-differ
    def on_train_begin(self, net: Any, X: Any = None, y: Any = None, **kwargs: Any) -> None:
        if self.did_load_:
            return
        check_plain(net, f"{type(self).__name__} needs a plain module to load into",
                    "resume with AccelerateCheckpoint and AccelerateLoadInitState")
        self.did_load_ = True
        checkpoint = self.checkpoint
        if isinstance(checkpoint, TrainEndCheckpoint):
            checkpoint = checkpoint.checkpoint_
        if isinstance(checkpoint, ParamsCheckpoint):
            checkpoint.finish_interrupted_save(net)
        # as with skorch, no files yet (on every rank) means nothing to load
        with sync.agree(net, f"{type(self).__name__}: loading the checkpoint",
                        ignore_if_all_raise=FileNotFoundError):
            try:
                with unwrapped(net):
                    net.load_params(
                        checkpoint=checkpoint, use_safetensors=self.use_safetensors)
            except FileNotFoundError:
                raise
            except Exception as exc:  # pylint: disable=broad-except
                error = self._naming_the_file(net, checkpoint, exc)
                if error is exc:
                    raise
                raise error from exc

    def _naming_the_file(self, net: Any, checkpoint: Checkpoint,
                         exc: Exception) -> Exception:
        """The error of a failed load, as one that names the file at fault.

        skorch's errors (torch's weights-only unpickler, JSON, safetensors)
        do not say which file they were reading; each file is read again,
        on this error path only, to find it.
        """
        def files() -> Iterator[tuple[str, File]]:
            # the history first: the names of the others may depend on it
            if checkpoint.f_history is not None:
                yield 'f_history', checkpoint.f_history_
            for key, file in checkpoint.get_formatted_files(net).items():
                # load_params does not read the pickled net
                if key not in ('f_history', 'f_pickle'):
                    yield key, file

        for key, file in files():
            if not isinstance(file, (str, os.PathLike)):
                continue
            kind = ('json' if key == 'f_history'
                    else 'safetensors' if self.use_safetensors else 'torch')
            at_fault = first_unloadable([file], kind)
            if at_fault is not None:
                _, reason = at_fault
                return CorruptCheckpointError(
                    f"{file} cannot be loaded: {type(reason).__name__}: {reason}")
        return exc
