"""AccelerateCheckpoint: decide when to save the whole training state."""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from skorch.callbacks import Callback, LoadInitState
from skorch.hf import AccelerateMixin
from skorch.utils import noop

from skorch_accel_callbacks._core import accelerate_io, base, messages, releases, skorch_io, sync
from skorch_accel_callbacks._core.arguments import keyword_suggestions
from skorch_accel_callbacks._core.base import FolderStateCallback
from skorch_accel_callbacks._core.wrapping import bare_modules, own_registries
from skorch_accel_callbacks.callbacks import _triggers as triggers
from skorch_accel_callbacks.callbacks._loadable import LoadableCheckpoint
from skorch_accel_callbacks.callbacks._preemption import check_signals
from skorch_accel_callbacks.callbacks.mixin import AccelerateFixesMixin
from skorch_accel_callbacks.engine import (
    BackgroundWriter,
    Retention,
    SaveRequest,
    SyncWriter,
    load_best_models,
)
from skorch_accel_callbacks.errors import CheckpointError, TrainingPreempted
from skorch_accel_callbacks.format import checkpoint_name
from skorch_accel_callbacks.state import (
    EpochStart,
    PassControl,
    WorkerDraws,
    can_skip,
    check_can_skip,
    data_fingerprint,
    epoch_completed,
    find_train_loader,
    fit_id,
    install,
    model_layout,
    persistent_workers,
    uninstall,
    warn_forked_workers_can_hang,
    warn_per_rank_buffers,
    worker_draws,
)
from skorch_accel_callbacks.storage import CheckpointStorage, check_tested_store, open_storage

if TYPE_CHECKING:
    from skorch import NeuralNet

__all__ = ['AccelerateCheckpoint', 'FIT_PLACEHOLDER']

#: in ``dirname``, stands for the folder of each fit (:meth:`AccelerateCheckpoint.folder_for_fit`)
FIT_PLACEHOLDER = '{fit}'


def _warn_without_fixes(net: Any, owner: str) -> None:
    """Warn about an accelerate net of skorch's without this package's
    ``AccelerateFixesMixin``, which the checkpoints rely on."""
    if isinstance(net, AccelerateMixin) and not isinstance(net, AccelerateFixesMixin):
        warnings.warn(
            f"{type(net).__name__} is a skorch AccelerateMixin net without "
            f"AccelerateFixesMixin, which {owner} relies on: without it each save_params or "
            "load_params prepares the module once more, a criterion without parameters is "
            "wrapped in DDP, and in several processes each rank decides on its own metrics "
            "(EarlyStopping, monitor). Put it first: class Net(AccelerateFixesMixin, "
            "AccelerateMixin, NeuralNetClassifier)", UserWarning, stacklevel=4)


def _check_checkpointable(net: NeuralNet, what: str, async_save: bool = False) -> None:
    """Raise naming ``what`` (and ``async_save``) if the accelerator of
    ``net`` cannot be checkpointed by ``AccelerateCheckpoint``: ``TypeError``
    without an accelerator, ``RuntimeError`` for an accelerate release that
    moved an internal the package uses, ``ValueError`` with
    ``automatic_checkpoint_naming`` (the callback names and retires its
    folders itself), a back-end it cannot save (``accelerate_io.check_plain_state``)
    or FSDP2 with compiled modules."""
    if async_save:
        what += '(async_save=True)'
    accelerator = getattr(net, 'accelerator', None)
    if accelerator is None:
        raise TypeError(
            f"{what} needs a net with skorch's AccelerateMixin "
            "(an `accelerator` attribute); for a plain net use ParamsCheckpoint")
    accelerate_io.check_internals(accelerator, what)
    if accelerate_io.uses_automatic_naming(accelerator):
        raise ValueError(
            f"{what} names and retires its checkpoint folders itself; "
            "create the Accelerator without "
            "ProjectConfiguration(automatic_checkpoint_naming=True)")
    accelerate_io.check_plain_state(accelerator, what, async_save)
    if accelerate_io.is_fsdp2(accelerator) and getattr(net, 'compile', False):
        raise ValueError(
            f"{what} does not checkpoint FSDP2 with compiled modules (compile=True): "
            "no resume of that combination has been shown exact; train with "
            "compile=False under FSDP2, or without FSDP2")


# skorch's Checkpoint's arguments for its files, which a checkpoint of the
# whole state does not have: what happens instead
_FILES_ADVICE = (
    "skorch's Checkpoint names its files; AccelerateCheckpoint saves the whole training "
    "state into <dirname>/epoch-NNNN under fixed names (the models as safetensors), which "
    "net.load_params(checkpoint=...) reads. Leave it out; for skorch's own files beside the "
    "checkpoints, add ParamsCheckpoint({arg}=...) to the callbacks (docs: From skorch's "
    "Checkpoint and LoadInitState)")
_SKORCH_FILE_ARGUMENTS = {
    arg: _FILES_ADVICE.format(arg=arg) for arg in (
        'f_params', 'f_optimizer', 'f_criterion', 'f_history', 'f_pickle', 'fn_prefix',
        'use_safetensors')}


@keyword_suggestions(advice=_SKORCH_FILE_ARGUMENTS)
class AccelerateCheckpoint(LoadableCheckpoint, FolderStateCallback, Callback):
    """Checkpoint the whole training state with ``accelerator.save_state``.

    Saves all a run needs to go on bit for bit (models, optimizers, random
    states and data order of every rank, history, callbacks' state) into
    ``<dirname>/epoch-NNNN``, committed once every rank wrote its part.
    Resume with :class:`AccelerateLoadInitState`. See the docs, section
    'How the callbacks differ from skorch's'.

    Parameters
    ----------
    dirname : str or os.PathLike (default='checkpoints')
      Folder of the checkpoints, or a store's URL (``s3://bucket/run1``); one job at a time.
      With ``{fit}`` in it (``'search/{fit}'``), each fit gets a folder of its own:
      ``{fit}`` becomes a digest of the net's recorded settings, its
      ``max_epochs`` and its training data, when the fit begins. The fits of a
      ``GridSearchCV`` or ``cross_validate`` then never resume each other's, and
      the same search relaunched resumes each of its own.

    monitor : str, callable or None (default=None)
      Which epochs are best: a boolean history column (``'valid_loss_best'``)
      or a callable of the net, on the main process. ``None`` saves every
      epoch; else, without ``keep_best``, only the best ones.

    every_n_epochs : int (default=1)
      Save at the end of every n-th epoch, counted over resumes.

    keep_last : int (default=2)
      How many of the newest checkpoints to keep, besides the best ones, the
      newest taken at an epoch's end and, while the fit that resumed from it
      runs, the one it resumed from.

    every_n_steps : int or None (default=None)
      Also save after every n-th optimizer step, counted over resumes; as
      ``every_n_seconds``, needs a map-style data set (no ``IterableDataset``).

    every_n_seconds : float or None (default=None)
      Also save at the first optimizer step this long after the last save.

    save_on_signal : tuple of str or signal.Signals (default=('SIGTERM',))
      On these signals every rank saves at the next optimizer step, then
      ``fit`` raises :class:`~skorch_accel_callbacks.TrainingPreempted`. Add
      ``'SIGUSR1'`` for SLURM's ``--signal=USR1@90``; ``()`` catches none.

    keep_best : int or None (default=None)
      With ``monitor``: save every epoch for resuming, and keep the
      ``keep_best`` newest best ones besides the ``keep_last`` newest.

    load_best : bool (default=False)
      When training ends, load the model(s) of the newest checkpoint that
      ``monitor`` marked best into the net, on every rank (FSDP2 too), as
      skorch's ``Checkpoint(load_best=True)`` loads its best parameters. The
      optimizers, the history and the random states stay the last epoch's;
      a fit that saved no best one keeps its last model, and ``sink`` says
      so. Needs ``monitor``.

    event_name : str or None (default='event_acp')
      History column that records whether a checkpoint was saved.

    sink : callable (default=noop)
      Where messages about saves go (main process only), e.g. ``print``.

    safe_serialization : bool (default=True)
      Save models with safetensors (``accelerator.save_state`` argument).

    durable : bool (default=True)
      ``fsync`` every file before the commit: safe against a machine crash.
      ``False`` is faster, and still safe against a killed process.

    async_save : bool (default=False)
      Write checkpoints in a background thread; training waits only while
      the states are copied to host memory. One save is in flight at a time.

    local_dir : str, os.PathLike or None (default=None)
      With a store's URL: where saves are staged (None: under the system's temp
      folder), uploaded one at a time; saves due meanwhile queue, a superseded
      one that retention would not keep is not uploaded (docs: object storage).

    storage_options : dict or None (default=None)
      With a store's URL: fsspec's options for its filesystem (endpoint, profile).
      For ``s3://``, each attempt of a request is bounded unless these say
      otherwise: a connection within 5 s, an answer within 10 s, one retry
      (``transfer.S3_CLIENT_DEFAULTS``).

    outage_seconds : float (default=60.0)
      With a store's URL: how long each request of an upload (its files, the
      lease, the manifest, the pointers, the removals) is sent again while
      the store fails or does not answer (warning at the first failure);
      then the upload fails with :class:`StoreUnavailableError`, raised at
      the next save or the end of training, with the checkpoint kept staged.
      A store that accepts connections and never answers fails a save within
      about ``outage_seconds`` + 30 s.

    lease_seconds : float (default=60.0)
      With an ``s3://`` URL: how long the folder's lease lasts after each
      renewal (every third of it). A job on another machine is refused the
      folder until the lease of a killed job expired, ``lease_seconds`` +
      10 s (clock skew) after its last renewal; a job restarted on the same
      machine (same boot, same PID namespace) takes it over at once.

    reuse_frozen : bool (default=True)
      Save the parameters that require no gradient (a frozen base:
      skorch's ``Freezer``, ``requires_grad_(False)``) of each model in a
      file of their own beside the model file, and the optimizer's state of
      them (a base trained before it was frozen: Adam's moments) in a file
      of their own beside the optimizer's (with safetensors, outside
      FSDP2), and while they are unchanged since the last save of this
      process, hard-link that save's files instead of writing them again.
      Unchanged means the same tensors with the same version counter, which
      every in-place change through the parameter moves (an optimizer
      step, ``load_params``, ``torch.nn.init``); a write through
      ``param.data`` or a NumPy view it cannot see: a run that changes
      frozen weights that way needs ``False``, which writes each model whole
      into its file at every save, as ``accelerator.save_state`` does.

    Attributes
    ----------
    folder_ : CheckpointStorage
      The folder of checkpoints: :meth:`committed`, :meth:`find` read it.

    writer_ : CheckpointWriter
      What writes the saves: a ``SyncWriter``, or with ``async_save`` a
      ``BackgroundWriter`` (the package's writer module).

    last_saved_ : str or None
      Name of the last checkpoint saved (maybe still being written).

    resumed_from_ : str or None
      Name of the checkpoint this training resumed from; not retired while
      the fit call that continues it runs.

    global_step_ : int
      Optimizer steps taken since training began, over resumes.

    signals_ : tuple of signal.Signals
      The signals of ``save_on_signal``.

    Warns
    -----
    UserWarning
      When created with an argument of skorch's ``Checkpoint`` for its
      files (``f_params``, ``f_optimizer``, ``f_criterion``, ``f_history``,
      ``f_pickle``, ``fn_prefix``, ``use_safetensors``), which it ignores:
      the warning says what it writes instead, and that ``ParamsCheckpoint``
      writes skorch's own files. When training begins, on the main process
      of several: on Python 3.11 before 3.11.10, loaders whose workers are
      forked (``num_workers > 0`` with the ``fork`` start method, Linux's
      default before Python 3.14), which can hang a rank (CPython
      gh-112275); the warning names the loaders and the ways out.

    Raises
    ------
    TypeError, ValueError
      At ``initialize``: an argument of the wrong type or range. When
      training begins: a net without an accelerator, or one with
      ``automatic_checkpoint_naming``, an FSDP1, DeepSpeed, Megatron-LM or XLA
      back-end, or FSDP2 with ``async_save``. When the first epoch begins:
      ``every_n_steps`` or ``every_n_seconds`` with an ``IterableDataset``.
    CheckpointError, FolderInUseError
      When training begins: models not the net's in the accelerator,
      ``save_on_each_node`` committers sharing one folder; another job's lock.
    OSError
      A save failed (on that rank; the others raise ``RankError``).
    TrainingPreempted
      On every rank, once the checkpoint at a ``save_on_signal`` is committed.

    Examples
    --------
    >>> import numpy as np
    >>> import torch
    >>> from accelerate import Accelerator
    >>> from skorch import NeuralNetClassifier
    >>> from skorch.hf import AccelerateMixin
    >>> from skorch_accel_callbacks import (
    ...     AccelerateCheckpoint, AccelerateFixesMixin, AccelerateLoadInitState)
    >>> class AcceleratedNet(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    ...     pass
    >>> X = np.random.randn(64, 4).astype(np.float32)
    >>> y = (X[:, 0] > 0).astype(np.int64)
    >>> def make_net(cp):
    ...     return AcceleratedNet(
    ...         torch.nn.Linear, module__in_features=4, module__out_features=2,
    ...         criterion=torch.nn.CrossEntropyLoss, accelerator=Accelerator(cpu=True),
    ...         max_epochs=2, callbacks=[cp, AccelerateLoadInitState(cp)])
    >>> cp = AccelerateCheckpoint(dirname='run1')
    >>> net = make_net(cp).fit(X, y)  # killed? run it again to resume  # doctest: +ELLIPSIS
    No checkpoint in run1; training from scratch.
      epoch    train_loss...
    >>> cp.committed()
    ['epoch-0001', 'epoch-0002']

    Lose at most 500 steps to a crash, none to a preemption (SLURM's too):

    >>> cp = AccelerateCheckpoint(dirname='run2', every_n_steps=500,
    ...                           save_on_signal=('SIGTERM', 'SIGUSR1'))

    Keep the best 2 by validation loss (a store's URL such as
    ``'s3://bucket/run3'`` works as a folder does); load the newest into a
    plain net:

    >>> cp = AccelerateCheckpoint(dirname='run3', monitor='valid_loss_best', keep_best=2)
    >>> net = make_net(cp).fit(X, y)  # doctest: +ELLIPSIS
    No checkpoint in run3; training from scratch.
      epoch    train_loss...
    >>> plain = NeuralNetClassifier(
    ...     torch.nn.Linear, module__in_features=4, module__out_features=2,
    ...     criterion=torch.nn.CrossEntropyLoss).initialize()
    >>> plain.load_params(checkpoint=cp)

    """

    def __init__(
        self,
        dirname: str | os.PathLike[str] = 'checkpoints',
        *,
        monitor: str | Callable[[NeuralNet], bool] | None = None,
        every_n_epochs: int = 1,
        keep_last: int = 2,
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        save_on_signal: tuple[str | signal.Signals, ...] = ('SIGTERM',),
        keep_best: int | None = None,
        load_best: bool = False,
        event_name: str | None = 'event_acp',
        sink: Callable[[str], object] = noop,
        safe_serialization: bool = True,
        durable: bool = True,
        async_save: bool = False,
        local_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        outage_seconds: float = 60.0,
        lease_seconds: float = 60.0,
        reuse_frozen: bool = True,
    ) -> None:
        self.dirname = dirname
        self.monitor = monitor
        self.every_n_epochs = every_n_epochs
        self.keep_last = keep_last
        self.event_name = event_name
        self.sink = sink
        self.safe_serialization = safe_serialization
        self.durable = durable
        self.async_save = async_save
        self.every_n_steps = every_n_steps
        self.every_n_seconds = every_n_seconds
        self.save_on_signal = save_on_signal
        self.keep_best = keep_best
        self.load_best = load_best
        self.local_dir = local_dir
        self.storage_options = storage_options
        self.outage_seconds = outage_seconds
        self.lease_seconds = lease_seconds
        self.reuse_frozen = reuse_frozen

    def initialize(self) -> AccelerateCheckpoint:
        releases.warn_if_untested()
        skorch_io.check_internals(type(self).__name__)
        self._check_arguments()
        self.signals_ = check_signals(self.save_on_signal, type(self).__name__)
        self.close()
        self.fit_dirname_ = None
        self.folder_: CheckpointStorage | None = None
        self.writer_ = None
        if not self.per_fit_dirname:
            self._open(os.fspath(self.dirname))
        self.last_saved_ = None
        self.global_step_ = 0
        self._poll = triggers.StepPoll(self.every_n_seconds)
        # training batches of the epoch under way, and the random states it began with
        self._batches = 0
        self._epoch_start = None
        # why to save at the end of this epoch (a step or time due at its last batch)
        self._deferred = None
        # the resume this callback counts from (a record of AccelerateLoadInitState)
        self._resumed = None
        # complete epochs after which the fit under way ends
        self._last_epoch = None
        # the fit/partial_fit calls since initialize, up to the one under
        # way: the complete epochs when each began, those after which it ends
        self._fit_calls: list[tuple[int, int]] = []
        # the checkpoint the call under way resumed from, kept by retention
        self._keep = None
        self._fit_began = False
        self._train_loader = None
        # this fit's watch over its training loader's passes and workers
        self._pass: PassControl | None = None
        self._worker_draws: WorkerDraws | None = None
        # the epoch whose first batch checked the workers
        self._workers_checked = None
        self._data = None
        self._epoch_end_seen = None
        # the warnings of per-rank buffers under FSDP2, of a net without
        # AccelerateFixesMixin and of workers whose fork can hang, once after
        # initialize
        self._buffers_warned = False
        self._setup_warned = False
        return self

    def _check_arguments(self) -> None:
        owner = type(self).__name__
        if not isinstance(self.dirname, (str, os.PathLike)) or not str(self.dirname):
            raise ValueError(f"{owner}: dirname must be a folder path, got {self.dirname!r}")
        check_tested_store(self.dirname, owner)
        if type(self.keep_last) is not int or self.keep_last < 1:
            raise ValueError(f"{owner}: keep_last must be an int >= 1, got {self.keep_last!r}")
        for name in ('durable', 'async_save', 'safe_serialization', 'reuse_frozen'):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{owner}: {name} must be True or False, got {getattr(self, name)!r}")
        if not (self.local_dir is None or isinstance(self.local_dir, (str, os.PathLike))):
            raise ValueError(f"{owner}: local_dir must be a folder or None, got {self.local_dir!r}")
        if not (self.storage_options is None or isinstance(self.storage_options, dict)):
            raise ValueError(f"{owner}: storage_options must be a dict or None, "
                             f"got {self.storage_options!r}")
        for name in ('outage_seconds', 'lease_seconds'):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{owner}: {name} must be a number of seconds > 0, "
                                 f"got {value!r}")
        if not (self.event_name is None or isinstance(self.event_name, str)):
            raise ValueError(
                f"{owner}: event_name must be a string or None, got {self.event_name!r}")
        triggers.check_triggers(owner, self.monitor, self.every_n_epochs, self.every_n_steps,
                                self.every_n_seconds, self.keep_best)
        if not isinstance(self.load_best, bool):
            raise ValueError(f"{owner}: load_best must be True or False, got {self.load_best!r}")
        if self.load_best and self.monitor is None:
            raise ValueError(
                f"{owner}: load_best=True loads the best checkpoint when training ends, and "
                "monitor (None) marks none best: give monitor, e.g. 'valid_loss_best'")
        messages.check_sink(self.sink, owner)

    @property
    def per_fit_dirname(self) -> bool:
        """Whether ``dirname`` names a folder per fit (holds ``{fit}``)."""
        return FIT_PLACEHOLDER in os.fspath(self.dirname)

    def open_storage(self) -> CheckpointStorage:
        """A new storage object of ``dirname`` (of the fit under way, with
        ``{fit}``; with a store's URL, staged in ``local_dir``, opened with
        ``storage_options``, as patient and with a lease as
        ``outage_seconds`` and ``lease_seconds`` say)."""
        dirname = getattr(self, 'fit_dirname_', None) or os.fspath(self.dirname)
        if FIT_PLACEHOLDER in dirname:
            raise ValueError(
                f"{type(self).__name__}(dirname={dirname!r}) names a folder per fit: which "
                "folder is known once a fit begins; read a fit's checkpoints through its "
                "fit_dirname_, or name the folder itself")
        return open_storage(dirname, self.local_dir, self.storage_options,
                            outage_seconds=self.outage_seconds,
                            lease_seconds=self.lease_seconds)

    def _open(self, dirname: str) -> None:
        """Open the storage of ``dirname`` and its writer."""
        self.fit_dirname_ = dirname
        self.folder_ = self.open_storage()
        writer = SyncWriter(self.folder_, Retention(self.keep_last, self.keep_best),
                            self.durable, self.safe_serialization, self.sink,
                            reuse_frozen=self.reuse_frozen)
        self.writer_ = BackgroundWriter(writer) if self.async_save else writer

    def folder_for_fit(self, net: Any, X: Any = None, y: Any = None) -> CheckpointStorage:
        """The storage of the fit that begins with ``X`` and ``y``: of
        ``dirname``, or with ``{fit}`` in it, of the folder of this fit's
        settings and data (the one of the fit before is released first)."""
        if self.per_fit_dirname:
            wanted = os.fspath(self.dirname).replace(
                FIT_PLACEHOLDER, fit_id(net, data_fingerprint(X, y)))
            if wanted != self.fit_dirname_:
                self.close()
                self._open(wanted)
        return self.folder_

    def _reader(self) -> CheckpointStorage:
        # reading needs no initialize(): a script that only loads creates the callback
        storage = getattr(self, 'folder_', None)
        return storage if storage is not None else self.open_storage()

    @property
    def resumed_from_(self) -> str | None:
        return None if self._resumed is None else self._resumed.name

    def __getstate__(self) -> dict:  # a loader holds the training data
        return dict(self.__dict__, _train_loader=None, _epoch_start=None, _pass=None,
                    _worker_draws=None)

    # ------------------------------------------------------------ hooks

    # pylint: disable=arguments-differ
    def on_train_begin(self, net: Any, X: Any = None, y: Any = None, **kwargs: Any) -> None:
        self.folder_for_fit(net, X, y)
        self._check_net(net)
        base.move_callback(net, self, 'last')
        self.folder_.claim(net)
        self._data = data_fingerprint(X, y)
        self._fit_calls.append((len(net.history), len(net.history) + net.max_epochs))
        self._keep = None
        self._fit_began = False
        self._deferred = None
        self._poll.begin(net)

    def on_epoch_begin(self, net: Any, dataset_train: Any = None, **kwargs: Any) -> None:
        self._train_loader = find_train_loader(net, dataset_train)
        self._batches = 0
        if not self._fit_began:
            self._fit_began = True
            # the resume callback, which runs first, has loaded the checkpoint
            if not self._take_resumed(net):
                # a fresh start or a partial_fit: skorch trains max_epochs more
                self._last_epoch = self._fit_calls[-1][1]
            # once every callback's on_train_begin went through: a fit that
            # fails before training leaves no handler behind
            self._poll.install(net, type(self).__name__, self.signals_)
        if self._train_loader is not None:
            # before the pass creates its iterator, which starts the workers
            self._worker_draws = worker_draws(self._train_loader)
        if self.every_n_steps or self.every_n_seconds or self._poll.stop_signals:
            if self.every_n_steps or self.every_n_seconds:
                check_can_skip(self._train_loader, type(self).__name__)
            if can_skip(self._train_loader):
                self._pass = install(self._train_loader)
            # after the resume callback gave back the epoch's starting state
            self._epoch_start = EpochStart.capture(self._train_loader)

    def on_batch_begin(self, net: Any, training: bool = False, **kwargs: Any) -> None:
        # the first training batch of each epoch, on every rank alike
        if training and self._workers_checked != len(net.history):
            self._workers_checked = len(net.history)
            self._check_workers(net)

    def _check_workers(self, net: Any) -> None:
        """Refuse, at the first batch of each epoch, persistent workers that
        draw random numbers: their generators go on from epoch to epoch in
        processes that no checkpoint reaches."""
        if not (self._worker_draws is not None
                and persistent_workers(self._train_loader)):
            return
        if any(sync.gather(net, self._worker_draws.drew)):
            raise CheckpointError(
                f"{type(self).__name__}: the training loader's worker processes draw "
                "random numbers (random augmentation in the data set's __getitem__ or "
                "in collate_fn), and persistent_workers=True keeps their generators "
                "from one epoch to the next in processes that a checkpoint cannot "
                "reach: a resume would train on other data than the uninterrupted run. "
                "Set iterator_train__persistent_workers=False: the workers are then "
                "started and seeded anew each epoch, from generators the checkpoint holds")

    def on_batch_end(self, net: Any, training: bool = False, **kwargs: Any) -> None:
        if not training:
            return
        self._batches += 1
        if not accelerate_io.gradients_applied(net.accelerator):
            return  # inside a gradient accumulation: no step to resume from
        self.global_step_ += 1
        reason = self._reason_at_step()
        if reason is None:
            return
        if accelerate_io.at_end_of_loader(self._train_loader):
            # the epoch's end saves it, with its validation scores
            self._deferred = reason
            return
        if isinstance(reason, str) or can_skip(self._train_loader):
            path = self.save_model(net)
        else:
            path = None  # a signal inside an epoch of an IterableDataset
        if not isinstance(reason, str):
            # training ends inside this pass over the loader
            accelerate_io.leave_loader(self._train_loader)
            self._stop(net, reason, path)

    def on_epoch_end(self, net: Any, **kwargs: Any) -> None:
        # an epoch whose end this hook did not see was ended before it by a
        # KeyboardInterrupt: a callback's decision (EarlyStopping) or a Ctrl-C
        self._epoch_end_seen = len(net.history)
        deferred, self._deferred = self._deferred, None
        received = self._poll.at_epoch_end(self.global_step_)
        if received is None and isinstance(deferred, signal.Signals):
            received = deferred
        decided, best = triggers.epoch_decision(
            net, self.every_n_epochs, self.monitor, self.keep_best, type(self).__name__)
        # the fit ends after this epoch: its checkpoint says training finished
        last = len(net.history) >= self._last_epoch
        do_save = decided or last or deferred is not None or received is not None
        if self.event_name is not None:
            net.history.record(self.event_name, do_save)
        if do_save:
            path = self.save_model(net, best=best, finished=last)
            if received is not None:
                self._stop(net, received, path)

    def on_train_end(self, net: Any, **kwargs: Any) -> None:
        try:
            # a fit that the resume callback ended before its first epoch
            self._take_resumed(net)
            if (epoch_completed(net)
                    and self.checkpoint_name(net) not in (self.last_saved_, self.resumed_from_)):
                self._save_at_train_end(net)
            self.wait_for_saves(net)
            received = self._poll.at_train_end(net)
            if received is None and self.load_best:
                self._load_best(net)
            if received is not None:
                saved = self.last_saved_ or self.resumed_from_
                self._stop(net, received, saved and self.folder_.url(saved))
        finally:
            uninstall(self._train_loader)
            self.close()

    def _load_best(self, net: Any) -> None:
        """``load_best``: the best checkpoint's model(s) into the net, as
        skorch's ``Checkpoint(load_best=True)`` loads its best parameters."""
        loaded = load_best_models(net, self.folder_)
        messages.say(net, self.sink,
                     f"Loaded the model(s) of the best checkpoint, {loaded}" if loaded else
                     f"load_best: no checkpoint in {self.folder_.dirname} is marked best "
                     f"(monitor={self.monitor!r} never chose one): the net keeps its last model")

    # ------------------------------------------------------------ policy

    def _reason_at_step(self) -> str | signal.Signals | None:
        """Why to save after the optimizer step just taken: a signal,
        ``'step'``, ``'time'``, or None."""
        received, time_due = self._poll.at_step(self.global_step_)
        if received is not None:
            return received
        if triggers.step_due(self.global_step_, self.every_n_steps):
            return 'step'
        return 'time' if time_due else None

    def _save_at_train_end(self, net: Any) -> None:
        """Save the epoch that training ended in, unless its end was cut
        short by an interruption that was no callback's decision."""
        # this callback's own end of the epoch went through, but for its
        # save (a KeyboardInterrupt in the save): the epoch's state is whole
        seen = self._epoch_end_seen == len(net.history)
        stopped_early = not seen and sync.broadcast(
            net, self._poll.interrupted is None and triggers.stopped_by_callback(net))
        if seen or stopped_early:
            ends = self._last_epoch is not None and len(net.history) >= self._last_epoch
            self.save_model(net, finished=stopped_early or ends, stopped_early=stopped_early)
            return
        # a Ctrl-C in another callback's end of the epoch: some of them saw
        # the epoch end, some not; resuming the last checkpoint replays it
        last = self.last_saved_ or self.resumed_from_
        messages.say(net, self.sink,
            f"Training was interrupted (KeyboardInterrupt) in the end of epoch "
            f"{len(net.history)}, which is not saved: "
            + (f"{self.folder_.url(last)} stands" if last else "no checkpoint was taken")
            + "; run the same command again to resume")

    def _take_resumed(self, net: Any) -> bool:
        """Count on from the checkpoint this fit resumed from, if it did (a
        ``partial_fit`` goes on without loading); return whether it did."""
        record = base.find_resumed(net, self.fit_dirname_)
        if record is None or record is self._resumed:
            return False
        self._resumed = record
        self.global_step_, self._batches = record.step, record.batches
        self._last_epoch = record.last_epoch
        # the resume counts the calls (one of them may have begun before
        # the checkpoint was loaded)
        self._fit_calls = list(record.fit_calls)
        self._keep = record.name
        return True

    def _stop(self, net: Any, received: signal.Signals, path: str | None) -> None:
        """End training on every rank once the signal's checkpoint is committed."""
        try:
            self.wait_for_saves(net)
        finally:
            self.close()
        messages.say(net, self.sink, f"Stopping on {received.name}"
            + (f": resume from {path}" if path else ": no checkpoint could be taken "
               "inside the epoch of an IterableDataset"))
        raise TrainingPreempted(received, path)

    def checkpoint_name(self, net: Any) -> str:
        """The name of a checkpoint of the net as it is now: ``epoch-NNNN``
        after NNNN epochs, ``epoch-NNNN-step-SSSSSSSS`` at step SSSSSSSS."""
        if not net.history or epoch_completed(net):
            return checkpoint_name(len(net.history))
        return checkpoint_name(len(net.history) - 1, self.global_step_)

    def _check_net(self, net: Any) -> None:
        # the back-end before the model layout, which would blame the
        # modules of a back-end that shards or wraps them itself
        _check_checkpointable(net, type(self).__name__, self.async_save)
        self._check_no_skorch_loader(net)
        if not self._setup_warned:
            self._setup_warned = True
            _warn_without_fixes(net, type(self).__name__)
            warn_forked_workers_can_hang(net, type(self).__name__)
        with own_registries(net):
            model_layout(net)
            if not self._buffers_warned:
                self._buffers_warned = True
                warn_per_rank_buffers(net.accelerator, bare_modules(net))

    def _check_no_skorch_loader(self, net: Any) -> None:
        """Refuse skorch's own ``LoadInitState`` on this checkpoint: it loads
        the parameters, optimizer and history only and trains on, without the
        random states, the data position or the callbacks' state."""
        for name, callback in net.callbacks_:
            if isinstance(callback, LoadInitState) and callback.checkpoint is self:
                raise CheckpointError(
                    f"skorch's LoadInitState ({name!r}) on {type(self).__name__}(dirname="
                    f"{self.dirname!r}) would load the parameters and history only and train "
                    "on without the random states, the data position or the callbacks' "
                    "state: the run would not go on as the interrupted one would have. Use "
                    "AccelerateLoadInitState(cp) in its place")

    # ------------------------------------------------------------ saving

    def save_model(self, net: Any, best: bool = False, finished: bool = False,
                   stopped_early: bool = False) -> str:
        """Save a checkpoint of the whole training state on every rank (each
        must call it; any rank's failure raises on all); return its path.

        ``best`` points ``best.json`` at it; ``finished`` marks the end of
        training (with ``stopped_early``: stopped by a callback), after which
        a resume trains nothing. With ``async_save`` it returns once the
        states are copied.
        """
        requested_at = time.monotonic()
        # the save before, and of a store's uploads only those that fill its queue
        report = self.writer_.wait(net, before_save=True)
        if report is not None:
            messages.say(net, self.sink, report.message())
        name = self.checkpoint_name(net)
        inside_epoch = not epoch_completed(net)
        report = self.writer_.save(net, SaveRequest(
            name=name, step=self.global_step_,
            batches=self._batches if inside_epoch else 0,
            train_loader=self._train_loader, epoch_start=self._epoch_start,
            read_ahead=tuple(self._pass.read_ahead(self._batches))
            if inside_epoch and self._pass is not None else (),
            workers_drew=self._worker_draws is not None and self._worker_draws.drew,
            data=self._data, best=best, finished=finished, stopped_early=stopped_early,
            keep=(self._keep,), requested_at=requested_at,
            fit_calls=tuple(self._fit_calls)))
        if report is not None:
            messages.say(net, self.sink, report.message())
        self.last_saved_ = name
        self._poll.saved()
        return self.folder_.url(name)

    def wait_for_saves(self, net: Any) -> None:
        """Wait for the save in flight, the removal of retired checkpoints
        and, with a store, every upload queued, on every rank; a failed save
        raises on every rank (the others
        :class:`~skorch_accel_callbacks.RankError`)."""
        report = self.writer_.wait(net)
        if report is not None:
            messages.say(net, self.sink, report.message())

    def close(self) -> None:
        """Put the signal handlers back, wait for this process's background
        work and release the folder (when training ends, and at
        ``initialize``); a failed save not reported by :meth:`wait_for_saves`
        is reported here with a warning."""
        poll = getattr(self, '_poll', None)
        if poll is not None:
            poll.close()
        writer = getattr(self, 'writer_', None)
        storage = getattr(self, 'folder_', None)
        try:
            if writer is not None:
                writer.close()
        except Exception as exc:  # pylint: disable=broad-except
            warnings.warn(f"{type(self).__name__}: the checkpoint written in the background "
                          f"failed: {type(exc).__name__}: {exc}", UserWarning)
        finally:
            if storage is not None:
                storage.release()
