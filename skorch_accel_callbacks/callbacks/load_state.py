"""AccelerateLoadInitState: resume a run from an AccelerateCheckpoint."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from skorch.callbacks import Callback, Checkpoint as SkorchCheckpoint, TrainEndCheckpoint

from skorch_accel_callbacks._core import accelerate_io, sync
from skorch_accel_callbacks._core.arguments import check_one_of, keyword_suggestions, suggestion
from skorch_accel_callbacks._core.base import FolderStateCallback, Resumed, move_callback
from skorch_accel_callbacks._core.messages import check_sink, processes, say
from skorch_accel_callbacks._core.wrapping import named_optimizers
from skorch_accel_callbacks.callbacks.checkpoint import AccelerateCheckpoint
from skorch_accel_callbacks.engine import (
    InsideEpoch,
    PageCacheFill,
    Restored,
    ResumeChecks,
    choose_checkpoint,
    fills_on_this_process,
    read_checkpoint,
)
from skorch_accel_callbacks.errors import CheckpointError
from skorch_accel_callbacks.format import fit_calls, is_checkpoint_name
from skorch_accel_callbacks.state import (
    ResumePlan,
    apply_callback_states,
    apply_epoch_caches,
    apply_loader_state,
    can_skip,
    changed_callback_settings,
    check_train_rows,
    epoch_end_advice,
    fetches_in_process,
    find_train_loader,
    install,
    keep_new_base_lrs,
    persistent_workers,
    restore_optimizer_hyperparameters,
    restore_rng,
    seed_draw_undone,
    unknown_batch_state,
)
from skorch_accel_callbacks.storage import CheckpointStorage

__all__ = ['AccelerateLoadInitState']

WORLD_SIZE_CHANGES = ('raise', 'reseed')
# what resume= names besides a checkpoint's name or folder
RESUME_POINTERS = ('latest', 'best')


@keyword_suggestions
class AccelerateLoadInitState(FolderStateCallback, Callback):
    """Resume training from the checkpoints of an :class:`AccelerateCheckpoint`.

    When training begins, every rank loads the checkpoint ``resume`` names
    (``accelerator.load_state``) and the net its history; when the first
    epoch begins, the random states, data order and callbacks' state come
    back, each rank's own (under skorch's ``AccelerateMixin`` each rank logs
    its own losses: a checkpoint stores every rank's history, callbacks'
    states and, under FSDP2, module buffers where they differ). ``fit``
    then trains only the epochs left to reach ``max_epochs`` (none once a
    callback such as ``EarlyStopping`` had stopped the run), bit for bit as
    the uninterrupted run; a checkpoint taken inside an epoch continues that
    epoch. The net's parameters are never changed. Without a checkpoint,
    training starts fresh.

    A script of several calls (``fit`` then ``partial_fit``, or ``fit``
    twice with ``warm_start=True``), run again, goes on in the call that
    was under way: calls are counted from the net's ``initialize``, and a
    checkpoint records the call it was taken in and where each call so far
    began and ends. The first call loads the newest checkpoint; if a later
    call of the same script took it (the first call's ``max_epochs`` is
    the one recorded), the calls before that one train nothing (their work
    is done: the net holds the checkpoint's parameters and history between
    them), and that call gets the random states, the callbacks' state and
    the position inside an epoch, and trains the epochs left of its own
    ``max_epochs`` (counted from the epoch it began at). A first call with
    another ``max_epochs``, or a checkpoint without that record, continues
    it itself, as a single ``fit`` does. A checkpoint this run cannot continue
    exactly (another model, number of processes, data, hyper-parameters) is
    refused before any training step. See the docs, section 'How the
    callbacks differ from skorch's'.

    From ``initialize`` until training begins (while the net builds its
    module), one process a node reads the files of the checkpoint that
    ``resume`` names into the page cache on a thread, what of them is not
    there yet, so that a relaunch on a machine whose page cache is cold
    checks and loads from memory; nothing is checked or applied before
    training begins.

    Parameters
    ----------
    checkpoint : AccelerateCheckpoint
      The checkpoint callback whose folder to resume from.

    resume : str or os.PathLike (default='latest')
      ``'latest'`` (the newest complete checkpoint), ``'best'`` (the newest
      the checkpoint's ``monitor`` marked best), a checkpoint's name
      (``'epoch-0003'``) or a checkpoint folder's path. A bare word that is
      none of these is refused at ``initialize`` (``'lastest'``).

    sink : callable (default=print)
      Where to say what was resumed, or that there was nothing to resume:
      on the main process only, and with ``print`` only when the net is
      verbose, as skorch's callbacks do; ``skorch.utils.noop`` says nothing.

    check_data : bool (default=True)
      Refuse a checkpoint trained on other data than this ``fit``'s (e.g.
      another fold in a shared folder); ``False`` resumes anyway.

    on_world_size_change : {'raise', 'reseed'} (default='raise')
      A checkpoint written by another number of processes: ``'raise'`` a
      :class:`CheckpointError`, or ``'reseed'``: resume it with random
      states derived for the new ranks (not bit-exact; a warning says so);
      where the saved ranks' histories and callbacks' states differed,
      every rank resumes saved rank 0's.

    check_params : bool or tuple of str (default=True)
      Refuse a checkpoint trained with other values of the net's parameters
      that change training (not ``max_epochs``, ``verbose``, ...) or of the
      settings of its callbacks (skorch's and this package's: their class
      by name, ``callbacks__<name>``, and their ``get_params``,
      ``callbacks__<name>__<param>``, without those that only decide where
      and how verbosely they speak, or where and when checkpoints are
      written), naming each; a skorch callback added or gone, and unnamed
      callbacks of one class listed in another order (skorch names them by
      position, ``EarlyStopping_1``...) are refused too. A tuple of names, e.g. ``('lr',)`` or
      ``('callbacks__lr_scheduler__gamma',)``, lets those differ and take
      effect (``'callbacks__<name>'``: every setting of that callback);
      ``False`` lets any differ. A new ``lr`` becomes the new base lr of a
      restored LR scheduler, which keeps its position; a callback setting's
      new value wins over the one in the callback's restored state.

    Attributes
    ----------
    did_load_ : bool
      Whether this callback has looked for a checkpoint (once per
      ``initialize``).

    loaded_from_ : str or None
      Path of the checkpoint the net was resumed from; its URL when it was
      read from an object store (through its staged copy).

    resumed_ : Resumed or None
      What the net was resumed from (path, name, optimizer steps, batches
      into its epoch, the epochs after which the call under way ends, the
      fit calls so far); a new one in each call up to the one that continues
      the checkpoint. The checkpoint callback of the folder counts on from it.

    Raises
    ------
    TypeError, ValueError
      At ``initialize``: an argument of the wrong type or value. When
      training begins: accelerate's FSDP1, DeepSpeed, Megatron-LM or XLA
      back-end (``ValueError`` naming it; FSDP2 is supported).
    CheckpointError
      When training begins (before any training step): the checkpoint
      cannot be resumed by this run (number of processes, model, data,
      hyper-parameters, a newer format, a change that moves the position
      inside an epoch; the message names what differs), or no complete
      checkpoint is left. A changed number of training rows inside an epoch
      raises when the first epoch begins.
    CorruptCheckpointError
      When training begins: a named checkpoint, or a file of the chosen
      one, is damaged; the message names the file.

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
    >>> def fit(max_epochs):
    ...     cp = AccelerateCheckpoint(dirname='run1')
    ...     net = AcceleratedNet(
    ...         torch.nn.Linear, module__in_features=4, module__out_features=2,
    ...         criterion=torch.nn.CrossEntropyLoss, accelerator=Accelerator(cpu=True),
    ...         max_epochs=max_epochs, callbacks=[cp, AccelerateLoadInitState(cp)])
    ...     return net.fit(X, y)
    >>> net = fit(max_epochs=1)  # doctest: +ELLIPSIS
    No checkpoint in run1; training from scratch.
      epoch    train_loss...
          1 ...

    After a crash, or to train for longer, the same fit again trains only
    the epochs not yet done:

    >>> net = fit(max_epochs=2)  # doctest: +ELLIPSIS
    Resumed from run1/epoch-0001 after epoch 1; training 1 more epoch(s).
      epoch    train_loss...
          2 ...
    >>> len(net.history)
    2

    A job that may come back on another number of GPUs:

    >>> cp = AccelerateCheckpoint(dirname='run1')
    >>> load = AccelerateLoadInitState(cp, on_world_size_change='reseed')

    Going on with a larger learning rate on purpose, or with another decay
    of a ``('lr_scheduler', LRScheduler(StepLR, step_size=1, gamma=...))``:

    >>> load = AccelerateLoadInitState(cp, check_params=('lr',))
    >>> load = AccelerateLoadInitState(cp, check_params=('callbacks__lr_scheduler__gamma',))

    """

    def __init__(
        self,
        checkpoint: AccelerateCheckpoint,
        *,
        resume: str | os.PathLike[str] = 'latest',
        sink: Callable[[str], object] = print,
        check_data: bool = True,
        on_world_size_change: str = 'raise',
        check_params: bool | tuple[str, ...] = True,
    ) -> None:
        self.checkpoint = checkpoint
        self.resume = resume
        self.sink = sink
        self.check_data = check_data
        self.on_world_size_change = on_world_size_change
        self.check_params = check_params

    def _check_resume(self, owner: str) -> None:
        """``resume`` is 'latest', 'best', a checkpoint's name or a path: a
        bare word that is none of them is a misspelling, refused now rather
        than looked for as a folder when training begins."""
        if not isinstance(self.resume, (str, os.PathLike)) or not str(self.resume):
            raise ValueError(f"{owner}: resume must be 'latest', 'best', a checkpoint's name "
                             f"or a folder, got {self.resume!r}")
        resume = os.fspath(self.resume)
        looks_like_a_path = (os.sep in resume or '://' in resume or resume.startswith('.')
                             or os.path.exists(resume))
        if resume in RESUME_POINTERS or is_checkpoint_name(resume) or looks_like_a_path:
            return
        raise ValueError(
            f"{owner}: resume={resume!r} is neither 'latest' nor 'best', no checkpoint's "
            f"name (epoch-NNNN, epoch-NNNN-step-SSSSSSSS) and no path"
            f"{suggestion(resume, RESUME_POINTERS)}; for a folder of that name in the "
            f"working directory, write './{resume}'")

    def initialize(self) -> AccelerateLoadInitState:
        owner = type(self).__name__
        if isinstance(self.checkpoint, (SkorchCheckpoint, TrainEndCheckpoint)):
            raise TypeError(
                f"{owner} resumes an AccelerateCheckpoint, got skorch's "
                f"{type(self.checkpoint).__name__}, which saves the parameters, optimizer "
                "and history only: use AccelerateCheckpoint(dirname=...) for an exact "
                "resume, or, for skorch's semantics (load those and train on), "
                "ParamsCheckpoint with LoadInitParams")
        if not isinstance(self.checkpoint, AccelerateCheckpoint):
            raise TypeError(
                f"{owner} needs an AccelerateCheckpoint, got {self.checkpoint!r}")
        self._check_resume(owner)
        check_sink(self.sink, owner)
        if not isinstance(self.check_data, bool):
            raise ValueError(
                f"{owner}: check_data must be True or False, got {self.check_data!r}")
        check_one_of(owner, 'on_world_size_change', self.on_world_size_change,
                     WORLD_SIZE_CHANGES)
        if not (isinstance(self.check_params, bool) or (
                isinstance(self.check_params, (tuple, list))
                and all(isinstance(name, str) for name in self.check_params))):
            raise ValueError(
                f"{owner}: check_params must be True, False or a tuple of parameter "
                f"names, got {self.check_params!r}")
        self.did_load_ = False
        self.loaded_from_ = None
        self.resumed_ = None
        # the epochs after which the fit that resumed ends; None in other fits
        self._last_epoch = None
        # the checkpoint read, until its callback states are applied
        self._pending: Restored | None = None
        # where inside its epoch it goes on, until the epoch's first batch
        self._inside: InsideEpoch | None = None
        self._undo_skip = None
        # a pass planned to go on inside its epoch, until its first batch
        self._armed = False
        # the plan gives the saved batch's random states back itself
        self._rng_by_pass = False
        self._skipped = 0
        self._storage: CheckpointStorage | None = None
        # the net's checkpoint callback this loader resumes (_net_checkpoint)
        self._followed: AccelerateCheckpoint | None = None
        # the fit/partial_fit call under way, counted from initialize
        self._call = -1
        # the calls the checkpoint read records: the last one continues it
        self._fit_calls: list[tuple[int, int]] = []
        self._stop_page_cache_fill()
        self._page_cache_fill = self._fill_page_cache()
        return self

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _undo_skip=None, _page_cache_fill=None)

    def _fill_page_cache(self) -> PageCacheFill | None:
        """The page cache filled, from now until training begins, with the
        files of the checkpoint the resume would check first, while the net
        initializes (:class:`~skorch_accel_callbacks.engine.PageCacheFill`;
        one process a node); None where that folder is known only once a
        fit begins (``{fit}``), is an object store's, or there is none."""
        if not fills_on_this_process():
            return None
        try:
            if self.checkpoint.per_fit_dirname:
                return None
            folder = self.checkpoint.open_storage().folder_to_check(self.resume)
        except (OSError, TypeError, ValueError):
            # a bad dirname: the checkpoint's initialize names it, which may
            # come after this one's; a folder that cannot be read: the resume
            return None
        return PageCacheFill(folder) if folder is not None and os.path.isdir(folder) else None

    def _stop_page_cache_fill(self) -> None:
        fill = getattr(self, '_page_cache_fill', None)
        if fill is not None:
            fill.stop()
        self._page_cache_fill = None

    def _net_checkpoint(self, net: Any) -> AccelerateCheckpoint:
        """The net's checkpoint callback that this loader resumes from:
        ``checkpoint`` itself, or, in a clone of the net (``sklearn.base.clone``
        copies ``checkpoint`` here and in the net's callbacks apart, and
        ``set_params(callbacks__<name>__dirname=...)`` changes the net's copy
        only), the net's copy. Raises :class:`CheckpointError` naming the
        folders if the net has none, or several and none equal to it."""
        owner = type(self).__name__
        own = [callback for _, callback in net.callbacks_
               if isinstance(callback, AccelerateCheckpoint)]
        if any(callback is self.checkpoint for callback in own):
            return self.checkpoint
        if len(own) == 1:
            return own[0]
        wanted = self.checkpoint.get_params(deep=False)
        equal = [callback for callback in own if callback.get_params(deep=False) == wanted]
        if len(equal) == 1:
            return equal[0]
        if not own:
            raise CheckpointError(
                f"{owner}'s checkpoint (dirname {self.checkpoint.dirname!r}) is not among "
                "the net's callbacks: the net would train on without saving where it "
                "resumes from. Add that AccelerateCheckpoint to the net's callbacks too "
                "(callbacks=[AccelerateLoadInitState(cp), cp]); to start a new training "
                "from another run's model, load its parameters instead (LoadInitParams, "
                "or export's files and net.load_params)")
        raise CheckpointError(
            f"{owner}'s checkpoint (dirname {self.checkpoint.dirname!r}) is none of the "
            "net's AccelerateCheckpoint callbacks (dirnames "
            f"{', '.join(repr(callback.dirname) for callback in own)}) and equals none of "
            "them: pass the one to resume from, AccelerateLoadInitState(cp) with cp one of "
            "the net's callbacks")

    def _checkpoint_storage(self, net: Any, X: Any, y: Any) -> CheckpointStorage:
        """The storage of the checkpoint callback this loader follows, for
        the fit that begins with ``X`` and ``y`` (its folder of this fit,
        with ``{fit}`` in its ``dirname``)."""
        return self._followed.folder_for_fit(net, X, y)

    # pylint: disable=arguments-differ
    def on_train_begin(self, net: Any, X: Any = None, y: Any = None, **kwargs: Any) -> None:
        # the resume reads the files itself from here on
        self._stop_page_cache_fill()
        self._call += 1
        self._last_epoch = None
        accelerator = getattr(net, 'accelerator', None)
        if accelerator is not None:
            # before the checkpoint's model layout is compared, which would
            # blame the modules of a back-end that shards or wraps them itself
            accelerate_io.check_plain_state(accelerator, type(self).__name__)
        move_callback(net, self, 'first')
        self._followed = self._net_checkpoint(net)
        self._storage = self._checkpoint_storage(net, X, y)
        # a job refused by the lock must not have read another job's checkpoint
        self._storage.claim(net)
        if not self.did_load_:
            self.did_load_ = True
            if not self._load(net, X, y):
                return
        if self._pending is not None and self._call < len(self._fit_calls):
            self._begin_call(net)
            if self._call == 0:
                say(net, self.sink, self._resumed_message(self._pending))

    def _load(self, net: Any, X: Any, y: Any) -> bool:
        """Read the checkpoint to resume from, if any: whether there was one."""
        chosen = choose_checkpoint(net, self._storage, self.resume, read_optimizers=True)
        if chosen is None:
            say(net, self.sink, f"No checkpoint in {self._followed.fit_dirname_}; "
                                "training from scratch.")
            return False
        restored = read_checkpoint(net, chosen, ResumeChecks(
            data=self.check_data, params=self.check_params,
            reseed=self.on_world_size_change == 'reseed', storage=self._storage), X, y)
        self._fit_calls = fit_calls(restored.manifest, restored.path)
        if self._fit_calls[0] != (0, net.max_epochs):
            # not the script that took it (its first call had another
            # max_epochs): this fit continues it, as a single fit does
            self._fit_calls = [(0, net.max_epochs)]
        net.history = restored.history
        self._pending, self._inside = restored, restored.inside
        self.loaded_from_ = self._named(restored.path)
        return True

    def _continues(self) -> bool:
        """Whether the call under way is the one the checkpoint read was
        taken in, and its state is not applied yet."""
        return self._pending is not None and self._call == len(self._fit_calls) - 1

    def _begin_call(self, net: Any) -> None:
        """Where the call under way ends, up to the call the checkpoint was
        taken in: a call before that one trains nothing (its work is done),
        that one the epochs left of its ``max_epochs``."""
        restored, call = self._pending, self._call
        done = restored.epochs_done
        if not self._continues():
            last = done
            calls = self._fit_calls[:call + 1]
        else:
            begins = self._fit_calls[call][0]
            last = done if restored.stopped_early else max(done, begins + net.max_epochs)
            if restored.inside is not None and last <= done:
                raise CheckpointError(
                    f"{self.loaded_from_} was taken inside epoch {done + 1}, which this "
                    f"fit call (it began at epoch {begins}, max_epochs={net.max_epochs}) "
                    "does not reach: it cannot go on inside that epoch; raise max_epochs "
                    f"to {done + 1 - begins} or more, or "
                    + epoch_end_advice(self._storage, restored.manifest))
            calls = [*self._fit_calls[:call], (begins, last)]
        self._last_epoch = last
        self.resumed_ = Resumed(
            dirname=os.path.realpath(self._followed.fit_dirname_), path=restored.path,
            name=CheckpointStorage.name_of(restored.path), step=restored.step,
            # on another number of processes, the batches this run skips
            batches=restored.inside.batches if restored.inside else 0,
            last_epoch=last, fit_calls=tuple(calls))

    def _named(self, path: str) -> str:
        """How the checkpoint read at ``path`` is named: its URL if it is
        a store's staged copy, else its path."""
        name = CheckpointStorage.name_of(path)
        return self._storage.url(name) if self._storage.path(name) == path else path

    def _resumed_message(self, restored: Restored) -> str:
        done = restored.epochs_done
        where = (f"at batch {restored.inside.batches} of epoch {done + 1}" if restored.inside
                 else f"after epoch {done}")
        source = self.loaded_from_
        if restored.reseeded_from is not None:
            source += (f" (written by {processes(restored.reseeded_from)}, "
                       "random states derived anew"
                       + (f", saved rank {restored.states_of_rank}'s history and callbacks"
                          if restored.states_of_rank is not None else '') + ")")
        taken_in = len(self._fit_calls) - 1
        if taken_in:
            return (f"Resumed from {source} {where}, taken in fit call {taken_in + 1} since "
                    f"initialize (a partial_fit or warm_start fit): the {taken_in} call(s) "
                    "before it train nothing, it goes on.")
        left = self._last_epoch - done
        return (f"Resumed from {source} {where}; "
                + ("a callback had stopped training." if restored.stopped_early
                   else f"training {left} more epoch(s)." if left
                   else "max_epochs had been reached."))

    def on_epoch_begin(self, net: Any, dataset_train: Any = None, **kwargs: Any) -> None:
        # skorch began an epoch that the resumed run does not have
        ends = self._last_epoch is not None and sum(
            'train_loss' in row for row in net.history[:-1]) >= self._last_epoch
        if ends:
            net.history.pop()
        if self._continues():
            loader = find_train_loader(net, dataset_train)
            # (a call that ends before the epoch it was taken in was refused)
            if self._inside is not None:
                self._continue_epoch(net, loader)
                return
            restored = self._restore_callbacks(net)
            apply_loader_state(loader, restored.rank_state)
            # preparing the training loader drew from the global generator to
            # seed the sampler; the uninterrupted run had not drawn at this
            # point (nor, when this fit ends here, at its end)
            restore_rng(restored.rng)
            if loader is not None and self._iterator_existed(loader, restored):
                install(loader).plan_resume(ResumePlan(
                    skip=0, undo_seed_draw=seed_draw_undone(loader)))
        if ends:
            raise KeyboardInterrupt

    def _iterator_existed(self, loader: Any, restored: Restored) -> bool:
        """Whether the checkpoint's run went on in this epoch with the
        iterator of persistent workers that its fit created at an earlier
        epoch (this run creates one now)."""
        begins = self._fit_calls[self._call][0]
        return persistent_workers(loader) and restored.epochs_done > begins

    def _continue_epoch(self, net: Any, loader: Any) -> None:
        """Set the epoch that a checkpoint taken inside it was taken in up to
        go on after its trained batches."""
        if not can_skip(loader):
            raise CheckpointError(
                f"{self.loaded_from_} was taken inside an epoch, but this run's training "
                "data cannot skip batches by index (an IterableDataset): resume it with "
                "a map-style data set, or "
                + epoch_end_advice(self._storage, self._pending.manifest))
        # the train split is made by now, before the epoch's first step
        check_train_rows(self._pending.manifest, len(loader.dataset),
                                  self.loaded_from_, self._storage)
        # on another number of processes the share of an epoch changed; at
        # least one batch is left, which the resume begins at
        batches = min(self._inside.batches, max(len(loader) - 1, 0))
        unknown = unknown_batch_state(net)
        if unknown and sync.is_main_process(net):
            warnings.warn(
                f"{self.loaded_from_} was taken inside an epoch; the callback(s) "
                f"{', '.join(map(repr, unknown))} act on every batch, and of their state "
                "only the fitted attributes (names ending in '_') come back, as the main "
                "process saved them: give them state_dict()/load_state_dict() methods to "
                "say what a checkpoint holds", UserWarning, stacklevel=2)
        # skorch began a new epoch; the checkpoint's last one goes on instead
        net.history.pop()
        # the loader draws the epoch's order again from these, skipping the
        # batches trained
        self._inside.start.restore(loader)
        self._skipped = batches
        self._armed = True
        rank_state = self._pending.rank_state or {}
        if rank_state.get('workers_drew'):
            # the workers read the trained batches again, and so make the
            # draws they had made for them (persistent workers that draw are
            # refused: no run of theirs has a checkpoint)
            self._undo_skip = accelerate_io.read_and_drop_first_batches_once(loader, batches)
            return
        # the fetches read ahead of training, then the next one, draw from
        # the states they drew from in the checkpoint's run
        states = ((*self._inside.read_ahead, self._pending.rng)
                  if self._inside.rng_at_batch and fetches_in_process(loader)
                  else ())
        self._rng_by_pass = bool(states)
        undo = (seed_draw_undone(loader)
                if self._iterator_existed(loader, self._pending) else None)
        install(loader).plan_resume(
            ResumePlan(skip=batches, states=states, undo_seed_draw=undo))

    def on_batch_begin(self, net: Any, training: bool = False, **kwargs: Any) -> None:
        # armed by _continue_epoch, in the call that continues the checkpoint
        if not self._armed or not training:
            return
        self._armed = False
        inside, self._inside = self._inside, None
        if self._undo_skip is not None:
            # the pass over the loader has begun: it keeps its skip
            self._undo_skip()
            self._undo_skip = None
        # after every callback's on_epoch_begin, which resets their scratch space
        restored = self._restore_callbacks(net)
        apply_epoch_caches(net.callbacks_, inside.caches, device=net.accelerator.device)
        if inside.rng_at_batch and not self._rng_by_pass:
            restore_rng(restored.rng)

    def on_epoch_end(self, net: Any, **kwargs: Any) -> None:
        if self._skipped:
            # skorch counted the batches of this fit only
            net.history.record('train_batch_count',
                               self._skipped + net.history[-1]['train_batch_count'])
            self._skipped = 0

    def _restore_callbacks(self, net: Any) -> Restored:
        """Give the callbacks and optimizer settings their saved state, once.

        Done after every callback's on_train_begin, which may reset state
        (EarlyStopping) or build and step a new LR scheduler.
        """
        restored, self._pending = self._pending, None
        # the settings check_params let differ take effect: in the callbacks'
        # states, and an optimizer's new lr as its schedulers' base
        apply_callback_states(
            net.callbacks_, restored.callbacks, changed_callback_settings(restored.changed_params))
        optimizers = named_optimizers(net)
        restore_optimizer_hyperparameters(optimizers.values(), restored.hyperparameters)
        keep_new_base_lrs(optimizers, [callback for _, callback in net.callbacks_],
                          restored.changed_params)
        return restored

    def on_train_end(self, net: Any, **kwargs: Any) -> None:
        try:
            if self._undo_skip is not None:
                self._undo_skip()
                self._undo_skip = None
            if self._continues():
                # a finished run trained no epoch; end with the state it was saved with
                self._restore_callbacks(net)
            self._last_epoch = None
        finally:
            # the checkpoint callback releases a storage it shares, when its
            # training ends (it runs after this one)
            if self._storage is not None and not any(
                    getattr(cb, 'folder_', None) is self._storage for _, cb in net.callbacks_):
                self._storage.release()
            self._storage = None
