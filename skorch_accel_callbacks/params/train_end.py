"""skorch's ``TrainEndCheckpoint``, correct in every process.

:class:`TrainEndParamsCheckpoint` saves once, when training ends, through
a :class:`~skorch_accel_callbacks.ParamsCheckpoint`
(:mod:`~skorch_accel_callbacks.params.checkpoint`), and so saves as that one does.
"""

from collections.abc import Callable
from typing import Any, Self

from skorch.callbacks import TrainEndCheckpoint
from skorch.utils import noop

from skorch_accel_callbacks._core.base import InitParamsOnly
from skorch_accel_callbacks._core.messages import say
from skorch_accel_callbacks.params.checkpoint import File, ParamsCheckpoint, check_arguments

__all__ = ['TrainEndParamsCheckpoint']


class TrainEndParamsCheckpoint(InitParamsOnly, TrainEndCheckpoint):
    r"""Save the model at the end of training; correct in every process.

    A drop-in for :class:`skorch.callbacks.TrainEndCheckpoint` (default
    ``fn_prefix='train_end_'``, plus ``on_error``) that saves through a
    :class:`~skorch_accel_callbacks.ParamsCheckpoint`, stored as
    ``checkpoint_``, and so saves as that one does. See the docs, "How the
    callbacks differ from skorch's".

    Parameters
    ----------
    f_params, f_optimizer, f_criterion, f_history, f_pickle : file-like object, str, None
      As for :class:`~skorch_accel_callbacks.ParamsCheckpoint` (same defaults).

    fn_prefix : str (default='train_end\_')
      Prefix of every file name given as a string.

    dirname : str (default='')
      Folder of the files.

    use_safetensors : bool (default=False)
      Save tensors with ``safetensors`` instead of ``torch.save``.

    sink : callable (default=noop)
      Receives the messages, on the main process only.

    on_error : {'warn', 'raise'} (default='warn')
      What a failed save does, see :class:`~skorch_accel_callbacks.ParamsCheckpoint`.

    **kwargs
      ``f_<name>`` for a custom module ``net.<name>_``.

    Attributes
    ----------
    checkpoint_ : ParamsCheckpoint
      The checkpoint that saves at the end of training (as in skorch).

    Raises
    ------
    ValueError, TypeError, OSError, skorch_accel_callbacks.FolderInUseError
      As :class:`~skorch_accel_callbacks.ParamsCheckpoint`.

    Examples
    --------
    Save at the end of each run and continue from there on the next one:

    >>> import os
    >>> import numpy as np
    >>> import torch
    >>> from accelerate import Accelerator
    >>> from skorch import NeuralNetClassifier
    >>> from skorch.hf import AccelerateMixin
    >>> from skorch_accel_callbacks import (
    ...     AccelerateFixesMixin, LoadInitParams, TrainEndParamsCheckpoint)
    >>> class AcceleratedNet(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    ...     pass
    >>> X = np.random.randn(64, 4).astype(np.float32)
    >>> y = (X[:, 0] > 0).astype(np.int64)
    >>> def make_net(callbacks):
    ...     return AcceleratedNet(
    ...         torch.nn.Linear, module__in_features=4, module__out_features=2,
    ...         criterion=torch.nn.CrossEntropyLoss, accelerator=Accelerator(cpu=True),
    ...         max_epochs=2, callbacks=callbacks)
    >>> train_end_cp = TrainEndParamsCheckpoint(dirname='exp1')
    >>> load_state = LoadInitParams(train_end_cp)
    >>> net = make_net([train_end_cp, load_state]).fit(X, y)  # doctest: +ELLIPSIS
      epoch    train_loss...
    >>> sorted(os.listdir('exp1'))  # doctest: +NORMALIZE_WHITESPACE
    ['train_end_criterion.pt', 'train_end_history.json',
     'train_end_optimizer.pt', 'train_end_params.pt']

    """

    def __init__(
            self,
            f_params: File = 'params.pt',
            f_optimizer: File = 'optimizer.pt',
            f_criterion: File = 'criterion.pt',
            f_history: File = 'history.json',
            f_pickle: File = None,
            fn_prefix: str = 'train_end_',
            dirname: str = '',
            use_safetensors: bool = False,
            sink: Callable[[str], object] = noop,
            *,
            on_error: str = 'warn',
            **kwargs: File
    ) -> None:
        self.on_error = on_error
        super().__init__(
            f_params=f_params, f_optimizer=f_optimizer, f_criterion=f_criterion,
            f_history=f_history, f_pickle=f_pickle, fn_prefix=fn_prefix,
            dirname=dirname, use_safetensors=use_safetensors, sink=sink, **kwargs)

    def initialize(self) -> Self:
        check_arguments(self)
        if hasattr(self, 'checkpoint_'):
            self.checkpoint_.release_folder()
        self.checkpoint_ = ParamsCheckpoint(
            monitor=None,
            fn_prefix=self.fn_prefix,
            dirname=self.dirname,
            event_name=None,
            sink=self.sink,
            use_safetensors=self.use_safetensors,
            on_error=self.on_error,
            **self._f_kwargs()
        )
        self.checkpoint_.initialize()
        return self

    # pylint: disable=arguments-differ
    def on_train_begin(self, net: Any, X: Any = None, y: Any = None, **kwargs: Any) -> None:
        self.checkpoint_.on_train_begin(net, X=X, y=y, owner=type(self).__name__, **kwargs)

    def on_train_end(self, net: Any, **kwargs: Any) -> Self:
        try:
            self.checkpoint_.save_model(net)
            say(net, self.sink, "Final checkpoint triggered")
        finally:
            self.checkpoint_.release_folder()
        return self
