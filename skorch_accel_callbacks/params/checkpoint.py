"""skorch's ``Checkpoint``, correct in every process: :class:`ParamsCheckpoint`.

It decides on the main process whether to save, and writes the save; the
files of a save are handled in :mod:`~skorch_accel_callbacks.params._files`.
Its companions: :mod:`~skorch_accel_callbacks.params.train_end` and
:mod:`~skorch_accel_callbacks.params.load`.
"""

import os
import pickle
import warnings
from collections.abc import Callable
from typing import IO, Any, Self, TypeAlias

from skorch import NeuralNet
from skorch.callbacks import Checkpoint
from skorch.exceptions import SkorchException
from skorch.utils import _check_f_arguments, noop, open_file_like

from skorch_accel_callbacks._core import sync
from skorch_accel_callbacks._core.base import InitParamsOnly
from skorch_accel_callbacks._core.messages import check_sink, say
from skorch_accel_callbacks._core.wrapping import gathered, unwrapped
from skorch_accel_callbacks.callbacks import dump_net, monitor_says
from skorch_accel_callbacks.params import _files as params_files
from skorch_accel_callbacks.storage import PrefixLock

__all__ = ['ParamsCheckpoint']

ON_ERROR_CHOICES = ('warn', 'raise')

# what skorch's f_* arguments take
File: TypeAlias = str | os.PathLike | IO[Any] | None


def check_arguments(owner: Any) -> None:
    """Raise ``ValueError`` naming ``owner``'s class if its ``on_error``,
    ``sink`` or ``event_name`` is of the wrong kind."""
    if owner.on_error not in ON_ERROR_CHOICES:
        raise ValueError(
            f"{type(owner).__name__}: on_error must be one of "
            f"{ON_ERROR_CHOICES}, got {owner.on_error!r}")
    check_sink(owner.sink, type(owner).__name__)
    event_name = getattr(owner, 'event_name', None)
    if event_name is not None and not isinstance(event_name, str):
        raise ValueError(
            f"{type(owner).__name__}: event_name must be a str (the history "
            f"column) or None, got {event_name!r}")


class _SaveFailed(Exception):
    """Ends a save whose failure was already reported (``on_error='warn'``)."""


class _NullWriter:
    """A file-like sink for ``pickle.dump`` that keeps nothing."""

    def write(self, data: bytes) -> int:
        return len(data)


def _load_everywhere(net: Any, what: str, **kwargs: Any) -> None:
    """``net.load_params(**kwargs)`` on every rank (skorch's
    ``AccelerateMixin.load_params`` starts with a barrier), into the unwrapped
    modules: it then loads on this rank (with its temporary ``device='cpu'``
    for ``device=None``) instead of preparing the modules again."""
    with sync.agree(net, what):
        with unwrapped(net):
            net.load_params(**kwargs)


class ParamsCheckpoint(InitParamsOnly, Checkpoint):
    """Save the model when the monitored metric improved; correct in every
    process.

    A drop-in for :class:`skorch.callbacks.Checkpoint` (same arguments,
    defaults and file name format specifiers, plus ``on_error``);
    ``net.load_params(checkpoint=cp)`` accepts it. Use it in every process.
    What it changes (the main process decides and writes, a save's files
    replace the previous ones together, a lock on
    ``<dirname>/.<fn_prefix>lock`` while training) is in the docs, "How
    the callbacks differ from skorch's".

    Parameters
    ----------
    monitor : str, callable, None (default='valid_loss_best')
      History key or callable ``monitor(net)`` that says whether to save in
      this epoch; ``None`` saves every epoch. Evaluated on the main process.

    f_params : file-like object, str, None (default='params.pt')
      File for the module parameters; ``None`` to not save them. A string
      may contain format specifiers with ``net``, ``last_epoch`` and
      ``last_batch``, e.g. ``'params_{last_epoch[epoch]}.pt'``.

    f_optimizer : file-like object, str, None (default='optimizer.pt')
      File for the optimizer state; format specifiers as for ``f_params``.

    f_criterion : file-like object, str, None (default='criterion.pt')
      File for the criterion state; format specifiers as for ``f_params``.

    f_history : file-like object, str, None (default='history.json')
      File for the training history.

    f_pickle : file-like object, str, None (default=None)
      File for the whole pickled net, without its accelerator's processes
      (``dump_net``; see the docs' page on saving parameters);
      format specifiers as for ``f_params``.

    fn_prefix : str (default='')
      Prefix of every file name given as a string.

    dirname : str (default='')
      Folder of the files; created by ``initialize`` if missing.

    event_name : str, None (default='event_cp')
      History column that records whether a checkpoint was made; ``None``
      to not record it.

    sink : callable (default=noop)
      Receives the messages about checkpoints and failed saves, on the main
      process only. ``print`` is called only when the net is verbose.

    load_best : bool (default=False)
      Load the last checkpoint made by this callback once training ended,
      on every rank. Needs ``monitor`` other than ``None``.

    use_safetensors : bool (default=False)
      Save tensors with ``safetensors`` instead of ``torch.save``; the
      optimizer cannot be saved then (set ``f_optimizer=None``).

    on_error : {'warn', 'raise'} (default='warn')
      What a failed save does: ``'warn'`` sends the message to ``sink``,
      warns on every rank and goes on training; ``'raise'`` raises on every
      rank.

    **kwargs
      ``f_<name>`` for a custom module ``net.<name>_``.

    Attributes
    ----------
    f_history_ : str or None
      The formatted history file name (as in skorch).

    Raises
    ------
    ValueError
      At ``initialize``: ``on_error``, ``sink`` or ``event_name`` of the
      wrong kind. When training begins under FSDP2 (which saves the full
      parameters): ``f_optimizer``, ``f_pickle`` or ``load_best`` set.
    TypeError
      At ``initialize``: an argument that is not one (as in skorch:
      ``foobar=...``, did you mean ``f_foobar``?).
    OSError
      At ``initialize``: a folder to write into cannot be created or
      written. With ``on_error='raise'``, a failed save (on the rank that
      failed; the others raise :class:`~skorch_accel_callbacks.RankError`).
    pickle.PicklingError
      When training begins, if ``f_pickle`` is set and the net cannot be
      pickled.
    skorch_accel_callbacks.FolderInUseError
      When training begins: another running job (another process, or a
      net fitted in another thread) saves the same files.
    skorch.exceptions.SkorchException
      At the end of an epoch whose history lacks the ``monitor`` column,
      with skorch's message, on the main process.

    Examples
    --------
    Replace the import of skorch's ``Checkpoint``; nothing else changes:

    >>> import os
    >>> import numpy as np
    >>> import torch
    >>> from accelerate import Accelerator
    >>> from skorch import NeuralNetClassifier
    >>> from skorch.hf import AccelerateMixin
    >>> from skorch_accel_callbacks import AccelerateFixesMixin, ParamsCheckpoint
    >>> class AcceleratedNet(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    ...     pass
    >>> X = np.random.randn(64, 4).astype(np.float32)
    >>> y = (X[:, 0] > 0).astype(np.int64)
    >>> def make_net(callbacks):
    ...     return AcceleratedNet(
    ...         torch.nn.Linear, module__in_features=4, module__out_features=2,
    ...         criterion=torch.nn.CrossEntropyLoss, accelerator=Accelerator(cpu=True),
    ...         max_epochs=2, callbacks=callbacks)
    >>> cp = ParamsCheckpoint(dirname='run1', f_params='params_{last_epoch[epoch]}.pt')
    >>> net = make_net([cp]).fit(X, y)  # doctest: +ELLIPSIS
      epoch    train_loss...
    >>> sorted(name for name in os.listdir('run1') if name.startswith('params'))
    ['params_1.pt', 'params_2.pt']

    Raise instead of warning when a save fails, and load the best
    parameters after training:

    >>> cp = ParamsCheckpoint(dirname='run2', on_error='raise', load_best=True)
    >>> net = make_net([cp]).fit(X, y)  # doctest: +ELLIPSIS
      epoch    train_loss...

    """

    def __init__(
            self,
            monitor: str | Callable[[NeuralNet], bool] | None = 'valid_loss_best',
            f_params: File = 'params.pt',
            f_optimizer: File = 'optimizer.pt',
            f_criterion: File = 'criterion.pt',
            f_history: File = 'history.json',
            f_pickle: File = None,
            fn_prefix: str = '',
            dirname: str = '',
            event_name: str | None = 'event_cp',
            sink: Callable[[str], object] = noop,
            load_best: bool = False,
            use_safetensors: bool = False,
            *,
            on_error: str = 'warn',
            **kwargs: File
    ) -> None:
        self.on_error = on_error
        super().__init__(
            monitor=monitor, f_params=f_params, f_optimizer=f_optimizer,
            f_criterion=f_criterion, f_history=f_history, f_pickle=f_pickle,
            fn_prefix=fn_prefix, dirname=dirname, event_name=event_name,
            sink=sink, load_best=load_best, use_safetensors=use_safetensors,
            **kwargs)

    def initialize(self) -> Self:
        check_arguments(self)
        self.release_folder()
        try:
            super().initialize()
        except OSError as exc:
            raise OSError(
                exc.errno, f"{type(self).__name__} cannot create its folder "
                f"dirname={self.dirname!r}: {exc.strerror}", self.dirname) from exc
        # raise now if a file of this checkpoint could not be created
        params_files.check_folders(
            type(self).__name__, self.dirname, self.fn_prefix, self._f_kwargs())
        return self

    # the StagedFiles of the save in progress, on every rank; None between saves
    _staged = None
    # PrefixLock on this checkpoint's files while training, on the main process
    _lock = None

    def stateless_files(self, net: Any) -> dict[str, File]:
        """The ``f_*`` arguments (name -> value) whose objects in ``net`` have
        no state to save (no ``state_dict``): neither saved nor loaded."""
        return params_files.stateless_files(net, self._f_kwargs())

    def get_formatted_files(self, net: Any) -> dict[str, File]:
        """skorch's formatted file names, less those of :meth:`stateless_files`:
        the files that ``net.load_params(checkpoint=self)`` loads."""
        files = super().get_formatted_files(net)
        skipped = self.stateless_files(net)
        return {key: val for key, val in files.items() if key not in skipped}

    def __getstate__(self) -> dict[str, Any]:
        # a net pickled for f_pickle during a save must not carry that save,
        # nor the lock its training holds: a lock belongs to its process, and
        # a copy that believed it held one would train on without taking it
        return dict(self.__dict__, _staged=None, _lock=None)

    @property
    def journal_path(self) -> str:
        """Where a save lists its file moves while it makes them."""
        return params_files.journal_path(self.dirname, self.fn_prefix)

    def finish_interrupted_save(self, net: Any) -> None:
        """Complete the file moves of a save that a crash interrupted and
        remove the temporary files of killed saves; call it on every rank.

        Nothing is done while another running job holds the lock of these
        files (same ``dirname`` and ``fn_prefix``), and other prefixes' files
        are left alone. Training and ``LoadInitParams`` call it; call it
        yourself before ``net.load_params(checkpoint=cp)`` on files that a
        killed job may have left.
        """
        def finish() -> None:
            finished = params_files.finish_interrupted_save(
                self.dirname, self.fn_prefix, self._f_kwargs())
            if finished:
                say(net, self.sink, f"Completed the interrupted save of {', '.join(finished)}.")
        sync.run_on_main(net, finish, f"{type(self).__name__}: completing an interrupted "
                                      f"save ({self.journal_path})")

    def _lock_folder(self) -> None:
        # held until training ends (or this process ends: the kernel frees it)
        if self._lock is None:
            self._lock = PrefixLock(self.dirname, self.fn_prefix).acquire()

    def release_folder(self) -> None:
        """Release the lock of this checkpoint's files that training holds,
        removing its lock file (the kernel also releases it when the process
        ends)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # pylint: disable=arguments-differ
    def on_train_begin(self, net: Any, X: Any = None, y: Any = None, owner: str | None = None,
                       **kwargs: Any) -> None:
        """Lock this checkpoint's files, complete an interrupted save and
        check what will be saved.

        ``owner`` begins the warnings about files not saved
        (:meth:`stateless_files`): this class's name by default, that of the
        ``TrainEndParamsCheckpoint`` whose ``checkpoint_`` this is.
        """
        sync.run_on_main(net, self._lock_folder,
                         f"{type(self).__name__}: locking the files of fn_prefix="
                         f"{self.fn_prefix!r} in folder {self.dirname or '.'}")
        try:
            params_files.check_sharding(owner or type(self).__name__, net, self._f_kwargs(),
                                        self.load_best)
            self._warn_stateless(net, owner or type(self).__name__)
            self.finish_interrupted_save(net)
            if self.f_pickle:
                sync.run_on_main(
                    net, lambda: self._check_picklable(net),
                    f"{type(self).__name__}: pickling the net for f_pickle")
        except BaseException:
            # skorch calls no on_train_end after a failed on_train_begin
            self.release_folder()
            raise

    def _warn_stateless(self, net: Any, owner: str) -> None:
        for key, val in self.stateless_files(net).items():
            message = params_files.not_saved_message(owner, net, key, val)
            say(net, self.sink, message)
            warnings.warn(message, UserWarning, stacklevel=3)

    def _check_picklable(self, net: Any) -> None:
        with unwrapped(net):
            try:
                dump_net(net, _NullWriter())
            except Exception as exc:  # pylint: disable=broad-except
                raise pickle.PicklingError(
                    f"{type(self).__name__}: f_pickle={self.f_pickle!r} is set "
                    f"but the net cannot be pickled ({type(exc).__name__}: "
                    f"{exc}); set f_pickle=None or make the net picklable"
                ) from exc

    def on_epoch_end(self, net: Any, **kwargs: Any) -> None:
        do_checkpoint = sync.run_on_main(
            net, lambda: bool(self._monitor_says(net)),
            f"{type(self).__name__}: deciding whether to checkpoint")
        if self.event_name is not None:
            net.history.record(self.event_name, do_checkpoint)
        if do_checkpoint:
            self.save_model(net)
            say(net, self.sink, f"A checkpoint was triggered in epoch {len(net.history) + 1}.")

    def _monitor_says(self, net: Any) -> Any:
        """skorch's decision whether to checkpoint, from this rank's history."""
        if self.monitor is not None and not callable(self.monitor):
            try:
                net.history[-1, self.monitor]
            except KeyError as exc:
                # skorch's Checkpoint raises this text, which users and
                # skorch's own tests match: a drop-in keeps it
                raise SkorchException(
                    f"{exc.args[0]} Make sure you have validation data if you use "
                    f"validation scores for checkpointing. ({type(self).__name__}: "
                    f"monitor={self.monitor!r}; the history of this epoch has "
                    f"{sorted(net.history[-1])})") from None
        return monitor_says(net, self.monitor, type(self).__name__)

    def save_model(self, net: Any) -> None:
        """Save what the ``f_*`` arguments name (not the files of
        :meth:`stateless_files`); call it on every process.

        The main process writes each file under a temporary name, then moves
        all of them into place together (see the docs); the first file
        that fails ends the save and leaves the previous checkpoint as it was.
        """
        kwargs_module, kwargs_other = _check_f_arguments(
            self.__class__.__name__, **self._f_kwargs())
        kwargs_module = {attr: val for attr, val in kwargs_module.items()
                         if params_files.stateless_object(net, attr) is None}
        self._staged = params_files.start_save(self.dirname, self.fn_prefix)
        try:
            with unwrapped(net), gathered(net):
                self._write_files(net, kwargs_module, kwargs_other)
            self._agreed_save_step(
                net, "the checkpoint's files", self.journal_path,
                lambda: params_files.commit(self._staged, sync.is_main_process(net)))
        except _SaveFailed:
            pass
        finally:
            self._staged.abort()
            self._staged = None

    def _write_files(self, net: Any, kwargs_module: dict[str, File],
                     kwargs_other: dict[str, File]) -> None:
        for key, val in kwargs_module.items():
            if val is None:
                continue
            f = self._format_target(net, val, -1)
            key = key[:-1]  # remove trailing '_'
            self._save_params(f, net, 'f_' + key, key + " state")

        if kwargs_other.get('f_history') is not None:
            self._save_params(self.f_history_, net, "f_history", "history")

        f_pickle = kwargs_other.get('f_pickle')
        if f_pickle:
            self._save_pickle(self._format_target(net, f_pickle, -1), net)

    def _save_params(self, f: File, net: Any, f_name: str, log_name: str) -> None:
        # every rank calls save_params: skorch's AccelerateMixin and
        # AccelerateFixesMixin run collectives in it, and write on main only
        def write(target: File) -> None:
            net.save_params(**{f_name: target, 'use_safetensors': self.use_safetensors})
        self._save_file(net, f, log_name, write, every_rank=True)

    def _save_pickle(self, f: File, net: Any) -> None:
        def write(target: File) -> None:
            with open_file_like(target, 'wb') as file:
                dump_net(net, file)
        self._save_file(net, f, 'pickle', write, every_rank=False)

    def _save_file(self, net: Any, f: File, log_name: str, write: Callable[[File], object],
                   every_rank: bool) -> None:
        """Write ``f`` with ``write(target)`` as one agreed step, on the main process
        (:func:`~skorch_accel_callbacks.params._files.write_file`)."""
        def save() -> None:
            params_files.write_file(
                f, write, self._staged, main=sync.is_main_process(net), every_rank=every_rank)
        self._agreed_save_step(net, log_name, f, save)

    def _agreed_save_step(self, net: Any, log_name: str, f: File,
                          step: Callable[[], object]) -> None:
        """Run ``step()`` on every rank as one agreed block: any failure is
        known to every rank, and no rank leaves before the main process is
        done. A failure raises (``on_error='raise'``) or warns; inside
        :meth:`save_model` a warned failure also ends the save."""
        try:
            with sync.agree(net, f"{type(self).__name__}: saving {log_name} to {f}"):
                step()
        except Exception as exc:  # pylint: disable=broad-except
            message = f"Unable to save {log_name} to {f}, {type(exc).__name__}: {exc}"
            if self.on_error == 'raise':
                exc.add_note(f"{type(self).__name__} was saving {log_name} to {f}")
                raise
            say(net, self.sink, message)
            warnings.warn(message, UserWarning, stacklevel=3)
            if self._staged is not None:
                # the rest of the save would only be thrown away
                raise _SaveFailed() from exc

    def on_train_end(self, net: Any, **kwargs: Any) -> None:
        try:
            if self.load_best and self.monitor is not None:
                say(net, self.sink, "Loading best checkpoint after training.")
                _load_everywhere(
                    net, f"{type(self).__name__}: loading the best checkpoint",
                    checkpoint=self, use_safetensors=self.use_safetensors)
        finally:
            self.release_folder()

