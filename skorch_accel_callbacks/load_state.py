"""AccelerateLoadInitState: resume a run from an AccelerateCheckpoint."""

import os

from accelerate.utils import load as accelerate_load
from safetensors.torch import load_file
from skorch.callbacks import Callback
from skorch.utils import noop

from skorch_accel_callbacks import storage, sync, training_state
from skorch_accel_callbacks.callback_order import move_callback
from skorch_accel_callbacks.checkpoint import (
    CheckpointError, check_compatible, check_rank_files)

__all__ = ['AccelerateLoadInitState']


# the files accelerator.save_state writes, by how they are read
_TORCH_SUFFIXES = ('.bin', '.pkl', '.pt')


def _loads(file):
    """Read ``file`` as accelerate's load_state would, without executing code."""
    if file.endswith('.safetensors'):
        load_file(file)
    else:
        accelerate_load(file)  # torch.load with weights_only=True


def _file_at_fault(folder):
    """The first file of ``folder`` that does not load, or None.

    Only called after ``load_state`` failed, to name the file in the error:
    the files are read a second time on that path only.
    """
    for name in sorted(os.listdir(folder)):
        if not name.endswith(_TORCH_SUFFIXES + ('.safetensors',)):
            continue
        file = os.path.join(folder, name)
        try:
            _loads(file)
        except Exception:  # pylint: disable=broad-except
            return file
    return None


def _read_own(folder, names, load):
    """``load(folder)`` for this package's own files ``names``; an error names
    the file (JSON and safetensors readers do not always say which)."""
    try:
        return load(folder)
    except Exception as exc:  # pylint: disable=broad-except
        names = (names,) if isinstance(names, str) else names
        files = [os.path.join(folder, name) for name in names]
        if len(files) > 1:
            files = [file for file in files if not _readable(file)] or files
        raise storage.CorruptCheckpointError(
            f"{' or '.join(files)} cannot be loaded: {type(exc).__name__}: {exc}") from exc


def _readable(file):
    try:
        if file.endswith('.json'):
            storage.read_json(file)
        else:
            load_file(file)
        return True
    except Exception:  # pylint: disable=broad-except
        return False


class AccelerateLoadInitState(training_state.StateOnDisk, Callback):
    """Resume training from the checkpoints of an :class:`AccelerateCheckpoint`.

    When training begins, every rank loads the checkpoint with
    ``accelerator.load_state`` (models, optimizers, grad scaler, step
    counter), and the net gets back its history. When the first epoch
    begins (the training loader is prepared by then), each rank gets back its
    random state and its loader's shuffling state, and the callbacks their
    state; this callback moves itself before the net's other callbacks for
    that. ``fit`` then trains only the epochs that are left to reach
    ``max_epochs`` in total, and nothing at all if the checkpoint belongs to
    a run that had finished. skorch's ``fit`` reads the number of epochs to
    train from ``net.max_epochs``, so from this callback's ``on_train_begin``
    until the first epoch begins, ``net.max_epochs`` holds the epochs left;
    the other callbacks' ``on_train_begin`` see that number, every epoch
    sees the user's total.

    Without a checkpoint, training starts fresh. A checkpoint written by
    another number of processes, from another model (parameter names or
    shapes) or in a newer format raises :class:`CheckpointError` naming what
    differs, before any training step; a damaged one raises (or, for
    ``resume='latest'``, is skipped with a warning) naming the file.

    Parameters
    ----------
    checkpoint : AccelerateCheckpoint
      The checkpoint callback whose folder to resume from.

    resume : str (default='latest')
      ``'latest'`` (the newest complete checkpoint), ``'best'`` (the last one
      saved because of the checkpoint's ``monitor``) or the path of a
      checkpoint folder.

    sink : callable (default=noop)
      Where to say what was resumed (main process only), e.g. ``print``.

    Examples
    --------
    >>> cp = AccelerateCheckpoint(dirname='run1')
    >>> net = AcceleratedNet(
    ...     MyModule, accelerator=Accelerator(), max_epochs=20,
    ...     callbacks=[cp, AccelerateLoadInitState(cp)],
    ... )
    >>> net.fit(X, y)  # after a crash: trains only the epochs not yet done

    """

    def __init__(self, checkpoint, resume='latest', sink=noop):
        self.checkpoint = checkpoint
        self.resume = resume
        self.sink = sink

    def initialize(self):
        if not hasattr(self.checkpoint, 'find'):
            raise TypeError(
                "AccelerateLoadInitState needs an AccelerateCheckpoint, got "
                f"{type(self.checkpoint).__name__}")
        if not isinstance(self.resume, (str, os.PathLike)):
            raise ValueError(
                f"resume must be 'latest', 'best' or a folder, got {self.resume!r}")
        self.did_load_ = False
        self.loaded_from_ = None
        self.requested_epochs_ = None
        self._pending = None
        return self

    def on_train_begin(self, net, **kwargs):
        move_callback(net, self, 'first')
        # a job refused by the lock must not have read another job's checkpoint
        self.checkpoint.claim_folder(net)
        if self.did_load_:
            return
        self.did_load_ = True
        path = self._resolve(net)
        if path is None:
            self._sink(f"No checkpoint in {self.checkpoint.dirname}; training from scratch.", net)
            return

        rank = sync.process_index(net)
        with sync.agree(net, f"loading checkpoint {path}"):
            manifest = storage.read_manifest(path)
            check_compatible(net, manifest, path)
            check_rank_files(path, manifest, rank)
            try:
                net.accelerator.load_state(path)
            except Exception as exc:
                at_fault = _file_at_fault(path)
                raise CheckpointError(
                    f"{at_fault or path} could not be loaded: {type(exc).__name__}: {exc}"
                ) from exc
            rng = training_state.capture_rng()
            hyperparameters = training_state.optimizer_hyperparameters(
                net.accelerator._optimizers)
            history = _read_own(path, training_state.HISTORY_NAME,
                                training_state.load_history)
            callbacks = _read_own(
                path, (training_state.CALLBACKS_NAME, training_state.CALLBACK_TENSORS_NAME),
                training_state.load_callback_states)
            rank_state = _read_own(path, training_state.rank_state_name(rank),
                                   lambda folder: training_state.load_rank_state(folder, rank))

        net.history = history
        self._pending = (rng, rank_state, callbacks, hyperparameters)
        self.loaded_from_ = path
        self.checkpoint.resumed_from_ = os.path.basename(os.path.normpath(path))
        done = len(history)
        self.requested_epochs_ = net.max_epochs
        finished = manifest.get('finished') or done >= net.max_epochs
        net.max_epochs = 0 if finished else net.max_epochs - done
        self._sink(
            f"Resumed from {path} after epoch {done}; "
            + ("training had finished." if finished
               else f"training {net.max_epochs} more epoch(s)."), net)

    def on_epoch_begin(self, net, dataset_train=None, **kwargs):
        self._restore_max_epochs(net)
        if self._pending is None:
            return
        rng, rank_state = self._restore_callbacks(net)
        training_state.apply_rank_state(
            training_state.find_train_loader(net, dataset_train), rank_state)
        # preparing the training loader drew from the global generator to seed
        # the sampler; the uninterrupted run had not drawn at this point
        training_state.restore_rng(rng)

    def _restore_callbacks(self, net):
        """Give the callbacks and optimizer settings their saved state, once.

        Done after every callback's on_train_begin, which may reset state
        (EarlyStopping) or build and step a new LR scheduler.
        """
        rng, rank_state, callbacks, hyperparameters = self._pending
        self._pending = None
        training_state.apply_callback_states(net, callbacks)
        training_state.restore_optimizer_hyperparameters(
            net.accelerator._optimizers, hyperparameters)
        return rng, rank_state

    def on_train_end(self, net, **kwargs):
        if self._pending is not None:
            # a finished run trained no epoch; end with the state it was saved with
            self._restore_callbacks(net)
        self._restore_max_epochs(net)

    def _restore_max_epochs(self, net):
        """Give ``net.max_epochs`` back the number the user set.

        skorch's ``fit_loop`` has read the epochs left by the time the first
        epoch begins; from then on, and if that epoch raises, the net holds
        the user's total again.
        """
        if self.requested_epochs_ is not None:
            net.max_epochs = self.requested_epochs_
            self.requested_epochs_ = None

    def _resolve(self, net):
        """The folder to resume from, the same checkpoint on every rank."""
        committer = self.checkpoint.is_committer(net)
        found = None
        with sync.agree(net, f"finding a checkpoint in {self.checkpoint.dirname}"):
            if committer:
                found = self.checkpoint.find(self.resume)
        name = None if found is None else os.path.basename(os.path.normpath(found))
        chosen = sync.broadcast(net, name)
        with sync.agree(net, "choosing the checkpoint to resume from"):
            if committer and name != chosen:
                raise CheckpointError(
                    f"rank {sync.process_index(net)} would resume from {found}, but "
                    f"rank 0 from {chosen}: the nodes' checkpoint folders differ")
        if chosen is None:
            return None
        if self.resume in ('latest', 'best'):
            return os.path.join(self.checkpoint.dirname, chosen)
        return os.fspath(self.resume)

    def _sink(self, text, net):
        if sync.is_main_process(net) and (self.sink is not print or net.verbose):
            self.sink(text)
