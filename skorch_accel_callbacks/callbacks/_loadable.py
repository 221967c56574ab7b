"""What a checkpoint callback with a ``dirname`` reads: its checkpoints as
skorch's ``load_params(checkpoint=...)`` reads a ``Checkpoint``'s, and a
checkpoint's files as the arguments of ``load_params``.
"""

from __future__ import annotations

import os
from typing import Any

from skorch_accel_callbacks.engine import loadable, model_files
from skorch_accel_callbacks.format import frozen_parts_of, plain_history_name, read_manifest
from skorch_accel_callbacks.storage import CheckpointStorage

__all__ = ['LoadableCheckpoint', 'checkpoint_files', 'f_argument']


def f_argument(module_name: str) -> str:
    """The argument of skorch's ``load_params`` for a module: ``f_params``
    for ``module``, ``f_<name>`` for the others (``f_criterion``)."""
    return 'f_params' if module_name == 'module' else f'f_{module_name}'


def checkpoint_files(path: str | os.PathLike) -> dict[str, tuple[str, ...]]:
    """The files of checkpoint ``path`` that hold each argument of skorch's
    ``load_params``: ``{'f_params': (<path>/model.safetensors,), ...,
    'f_history': (<path>/history.json,)}``; a model whose frozen parameters
    lie in a file of their own has both, ``(<path>/model.safetensors,
    <path>/model_frozen.safetensors)``.

    Raises :class:`CorruptCheckpointError` naming the file if the checkpoint
    is not complete.
    """
    saved = read_manifest(path)
    parts = frozen_parts_of(saved)
    files = {f_argument(name): tuple(os.path.join(path, rel)
                                     for rel in (file, parts.get(file)) if rel is not None)
             for name, file in model_files(saved, path)}
    files['f_history'] = (os.path.join(path, plain_history_name(saved)),)
    return files



class LoadableCheckpoint:
    """Mixin of a checkpoint callback with a ``dirname``: its checkpoints
    read as skorch's ``load_params(checkpoint=...)`` reads a ``Checkpoint``'s.

    Reading needs no lock, nor ``initialize()``: a script that only loads a
    checkpoint creates the callback and reads.
    """

    dirname: str

    def _reader(self) -> CheckpointStorage:
        """The storage the checkpoints are read from (the callback's own
        once initialized, else a new one): the class's to say."""
        raise NotImplementedError

    def committed(self) -> list[str]:
        """Names of the committed checkpoint folders, oldest commit first."""
        return self._reader().committed()

    def find(self, which: str = 'latest') -> str | None:
        """Path of the checkpoint to resume from, or None; see
        ``CheckpointStorage.find``."""
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
        return self._checkpoint_files('latest')['f_history'][0]

    def _checkpoint_files(self, which: str) -> dict[str, tuple[str, ...]]:
        """:func:`checkpoint_files` of checkpoint ``which`` of ``dirname``,
        downloaded first from a store."""
        found = self._reader().find_checkpoint(which)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {self.dirname}")
        return checkpoint_files(found.path)

    def get_formatted_files(self, net: Any, which: str = 'latest') -> dict[str, str]:
        """The files of a checkpoint as arguments of skorch's ``load_params``.

        ``net.load_params(checkpoint=cp)`` calls it: it loads the model(s)
        and the history of the newest complete checkpoint into any net,
        with or without accelerate, in one process or many (not the
        optimizer nor the rest of the training state: resuming is
        :class:`AccelerateLoadInitState`'s). Where the checkpoint holds
        every rank's own history, rank 0's is loaded; the module buffers
        are those of accelerate's model files (for every rank's own under
        FSDP2, rank 0's, ``export()`` the checkpoint).

        The models come as ``load_params`` reads them without
        ``use_safetensors``: the safetensors files themselves, which
        ``torch.load`` reads from torch 2.13 on (``use_safetensors=True``
        reads them too), and with an older torch their tensors in an
        in-memory file of torch's format (which ``use_safetensors=True``
        would not read).
        A model whose frozen parameters lie in a file of their own
        (``AccelerateCheckpoint(reuse_frozen=True)``) comes with them, both
        files read into such an in-memory file.
        A model that FSDP2 saved sharded is merged in this process (as
        ``export()`` merges it) into such an in-memory file, in one process
        (in a job of several, ``export()`` it first and load the exported
        files).

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
        >>> import numpy as np
        >>> import torch
        >>> from accelerate import Accelerator
        >>> from skorch import NeuralNetClassifier
        >>> from skorch.hf import AccelerateMixin
        >>> from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateFixesMixin
        >>> class AcceleratedNet(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
        ...     pass
        >>> X = np.random.randn(64, 4).astype(np.float32)
        >>> y = (X[:, 0] > 0).astype(np.int64)
        >>> model = dict(module=torch.nn.Linear, module__in_features=4,
        ...              module__out_features=2, criterion=torch.nn.CrossEntropyLoss)
        >>> cp = AccelerateCheckpoint(dirname='run1', monitor='valid_loss_best', keep_best=1)
        >>> _ = AcceleratedNet(**model, accelerator=Accelerator(cpu=True), max_epochs=2,
        ...                    callbacks=[cp]).fit(X, y)  # doctest: +ELLIPSIS
          epoch    train_loss...
        >>> sorted(cp.get_formatted_files(None, which='best'))
        ['f_history', 'f_params']

        Load the best checkpoint's model and history into a plain net (the
        newest: ``load_params(checkpoint=cp)``):

        >>> net = NeuralNetClassifier(**model).initialize()
        >>> net.load_params(**cp.get_formatted_files(net, which='best'))

        """
        return {key: loadable(files)
                for key, files in self._checkpoint_files(which).items()}
