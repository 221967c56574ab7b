"""AccelerateLoadInitState: resume a run from an AccelerateCheckpoint."""

import os
import warnings

from skorch.callbacks import Callback
from skorch.utils import noop

from skorch_accel_callbacks import (
    accelerate_io,
    compat,
    epoch_position,
    format,
    sync,
    training_state,
)
from skorch_accel_callbacks.base import (
    FolderStateCallback,
    Resumed,
    check_sink,
    move_callback,
    processes,
    say,
)
from skorch_accel_callbacks.checkpoint import AccelerateCheckpoint
from skorch_accel_callbacks.errors import CheckpointError, CorruptCheckpointError
from skorch_accel_callbacks.folder import CheckpointFolder, is_committer
from skorch_accel_callbacks.readers import first_unloadable
from skorch_accel_callbacks.wrapping import net_optimizers, own_registries

__all__ = ['AccelerateLoadInitState']

WORLD_SIZE_CHANGES = ('raise', 'reseed')


def _checkpoint_files(folder):
    return [os.path.join(folder, name) for name in sorted(os.listdir(folder))
            if name.endswith(('.bin', '.pkl', '.pt', '.safetensors'))]


def _read_own(folder, names, load):
    """``load(folder)`` for this package's own files ``names``; an error names
    the file (JSON and safetensors readers do not always say which)."""
    try:
        return load(folder)
    except Exception as exc:  # pylint: disable=broad-except
        names = (names,) if isinstance(names, str) else names
        files = [os.path.join(folder, name) for name in names]
        at_fault = first_unloadable(files) if len(files) > 1 else None
        raise CorruptCheckpointError(
            f"{at_fault[0] if at_fault else ' or '.join(files)} cannot be loaded: "
            f"{type(exc).__name__}: {exc}") from exc


class AccelerateLoadInitState(FolderStateCallback, Callback):
    """Resume training from the checkpoints of an :class:`AccelerateCheckpoint`.

    When training begins, every rank loads the checkpoint with
    ``accelerator.load_state`` (models, optimizers, grad scaler, step
    counter), and the net gets back its history. When the first epoch
    begins (the training loader is prepared by then), each rank gets back its
    random state and its loader's shuffling state, and the callbacks their
    state; this callback moves itself before the net's other callbacks for
    that. ``fit`` then trains only the epochs that are left to reach
    ``max_epochs`` in total, and nothing at all if a callback had stopped
    the run (``EarlyStopping``): when an epoch would begin with none left,
    this callback ends the fit as skorch's callbacks do (a
    ``KeyboardInterrupt`` that ``fit`` catches), before any other callback
    sees that epoch. The net's parameters, ``max_epochs`` among them, are
    never changed. A later ``partial_fit`` (or ``fit`` with
    ``warm_start=True``) continues the training without loading again, and
    trains as many epochs as skorch would.

    A checkpoint taken inside an epoch (``every_n_steps``,
    ``every_n_seconds``, a signal) continues that epoch: when it begins,
    each rank gets back the random states the epoch began with, so that the
    loader draws the same order, and the batches already trained are
    skipped by index (no row of them is loaded); when its first batch
    begins, the callbacks get back their state and each rank the random
    states of the batch the checkpoint was taken at. A callback that acts
    on every batch without ``state_dict()``/``load_state_dict()`` (and is
    not one of skorch's whose state a checkpoint holds) is named in a
    warning: only its fitted attributes come back.

    Without a checkpoint, training starts fresh. A checkpoint from another
    model (parameter names or shapes) or in a newer format raises
    :class:`CheckpointError` naming what differs, before any training step;
    a damaged one raises (or, for ``resume='latest'``, is skipped with a
    warning) naming the file. So does one trained with other
    hyper-parameters (see ``check_params``), and one taken inside an epoch
    when what its position there depends on changed: the training loader's
    batch size, gradient accumulation, shuffling or the train split (when
    training begins) or the number of training rows (when the first epoch
    begins, once the split is made; still before any training step). From
    a checkpoint of an epoch's end, a new batch size resumes fine.

    A checkpoint written by another number of processes raises too, unless
    ``on_world_size_change='reseed'``: then the model, optimizers, LR
    schedulers, grad scaler, history and callback states load exactly (under
    DDP they are the same on every rank), and each rank's random state and
    the loaders' shuffling state are derived from the saved rank 0's and the
    new number of processes. Two resumes of a checkpoint on the same number
    of processes are bit-identical to each other, but not to the
    uninterrupted run: each step now trains on another number of batches,
    drawn in another order. A warning says so.

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

    check_data : bool (default=True)
      Refuse a checkpoint trained on other data than this ``fit``'s (its
      length, shapes, dtypes or a sample of its rows differ): resuming it
      would silently continue another training, e.g. another fold of a
      cross-validation that shares the folder. ``False`` resumes anyway.

    on_world_size_change : str (default='raise')
      What to do with a checkpoint written by another number of processes:
      ``'raise'`` a :class:`CheckpointError` (a bit-exact resume needs every
      saved rank), or ``'reseed'``: resume it with random states derived
      for the new ranks (see above), e.g. when a cluster gives back 4 GPUs
      of the 8 a preempted job had.

    check_params : bool or tuple of str (default=True)
      Refuse a checkpoint trained with other values of the net's parameters
      that change training (``get_params()`` without ``callbacks``,
      ``max_epochs``, ``verbose``, ``warm_start``, ``accelerator``,
      ``device``, ``batch_size``, the validation loader's and others that
      decide only how long, how verbosely or how fast training runs),
      naming each: in a hyper-parameter search every fit needs its own
      folder. A tuple of names, e.g. ``('lr',)``, lets those differ, and
      the new values take effect (the optimizers' settings of ``lr`` and
      ``optimizer__*`` replace the checkpoint's); ``False`` lets any differ.
      Checkpoints of versions before 0.3 recorded no parameters.

    Attributes
    ----------
    did_load_ : bool
      Whether this callback has looked for a checkpoint (once per
      ``initialize``).

    loaded_from_ : str or None
      Path of the checkpoint the net was resumed from.

    resumed_ : Resumed or None
      What the net was resumed from (path, name, optimizer steps, batches
      into its epoch, the epochs after which the resumed fit ends); the
      checkpoint callback of the folder continues counting from it.

    Raises
    ------
    TypeError, ValueError
      At ``initialize``: ``checkpoint`` is not an
      :class:`AccelerateCheckpoint`, ``resume``, ``sink``, ``check_data``,
      ``on_world_size_change`` or ``check_params`` of the wrong type or value.
      When training begins: accelerate's FSDP, DeepSpeed, Megatron-LM or
      XLA back-end (``ValueError`` naming it).
    CheckpointError
      When training begins: the checkpoint cannot be resumed by this run
      (another number of processes with ``on_world_size_change='raise'``,
      another model, other data, other hyper-parameters, a newer format, a
      change that moves the position inside an epoch), or no complete
      checkpoint is left. A changed number of training rows inside an epoch
      raises when the first epoch begins.
    CorruptCheckpointError
      When training begins: a named checkpoint, or a file of the chosen
      one, is damaged; the message names the file.

    Examples
    --------
    >>> cp = AccelerateCheckpoint(dirname='run1')
    >>> net = AcceleratedNet(
    ...     MyModule, accelerator=Accelerator(), max_epochs=20,
    ...     callbacks=[cp, AccelerateLoadInitState(cp)],
    ... )
    >>> net.fit(X, y)  # after a crash: trains only the epochs not yet done

    A job that may come back on another number of GPUs:

    >>> load = AccelerateLoadInitState(cp, on_world_size_change='reseed')

    Going on with a larger learning rate on purpose:

    >>> load = AccelerateLoadInitState(cp, check_params=('lr',))

    """

    def __init__(self, checkpoint, resume='latest', sink=noop, check_data=True,
                 on_world_size_change='raise', check_params=True):
        self.checkpoint = checkpoint
        self.resume = resume
        self.sink = sink
        self.check_data = check_data
        self.on_world_size_change = on_world_size_change
        self.check_params = check_params

    def initialize(self):
        owner = type(self).__name__
        if not isinstance(self.checkpoint, AccelerateCheckpoint):
            raise TypeError(
                f"{owner} needs an AccelerateCheckpoint, got {self.checkpoint!r}")
        if not isinstance(self.resume, (str, os.PathLike)) or not str(self.resume):
            raise ValueError(
                f"{owner}: resume must be 'latest', 'best' or a folder, got {self.resume!r}")
        check_sink(self.sink, owner)
        if not isinstance(self.check_data, bool):
            raise ValueError(
                f"{owner}: check_data must be True or False, got {self.check_data!r}")
        if self.on_world_size_change not in WORLD_SIZE_CHANGES:
            raise ValueError(
                f"{owner}: on_world_size_change must be one of {WORLD_SIZE_CHANGES}, "
                f"got {self.on_world_size_change!r}")
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
        self._pending = None
        self._inside = None
        self._rng_at_batch = True
        self._undo_skip = None
        self._skipped = 0
        self._folder = None
        self._saved_manifest = None
        return self

    def __getstate__(self):
        return dict(self.__dict__, _undo_skip=None)

    def _checkpoint_folder(self, net):
        """The folder object of the checkpoint callback that trains with
        this net: ``checkpoint`` itself, or the callback of the net with
        the same folder (a clone of the net holds a copy of ``checkpoint``
        here and another in its callbacks); else one of its own."""
        wanted = os.path.realpath(self.checkpoint.dirname)
        for _, callback in net.callbacks_:
            if (isinstance(callback, AccelerateCheckpoint)
                    and getattr(callback, 'folder_', None) is not None
                    and os.path.realpath(callback.dirname) == wanted):
                return callback.folder_
        return CheckpointFolder(self.checkpoint.dirname)

    # pylint: disable=arguments-differ
    def on_train_begin(self, net, X=None, y=None, **kwargs):
        self._last_epoch = None
        accelerator = getattr(net, 'accelerator', None)
        if accelerator is not None:
            # before the checkpoint's model layout is compared, which would
            # blame the modules of a back-end that shards or wraps them itself
            accelerate_io.check_plain_state(accelerator, type(self).__name__)
        move_callback(net, self, 'first')
        self._folder = self._checkpoint_folder(net)
        # a job refused by the lock must not have read another job's checkpoint
        self._folder.claim(net)
        if self.did_load_:
            return
        self.did_load_ = True
        path = self._resolve(net)
        if path is None:
            say(net, self.sink, f"No checkpoint in {self.checkpoint.dirname}; "
                                "training from scratch.")
            return

        rank = sync.process_index(net)
        reseed = self.on_world_size_change == 'reseed'
        with sync.agree(net, f"loading checkpoint {path}"), own_registries(net):
            saved = format.read(path)
            changed = compat.check_world_size(net, saved, path, reseed)
            compat.check_compatible(net, saved, path)
            if self.check_data:
                compat.check_same_data(saved, training_state.data_fingerprint(X, y), path)
            changed_params = compat.check_same_params(net, saved, path, self.check_params)
            # the number of training rows is checked when the first epoch begins
            compat.check_epoch_settings(net, saved, path)
            self._saved_manifest = saved
            fresh_settings = training_state.optimizer_hyperparameters(net_optimizers(net))
            # on another number of processes the new ranks' random states
            # derive from rank 0's: the other saved ranks' files are not read
            reads_own_rank = not changed or rank == 0
            if reads_own_rank:
                compat.check_rank_files(path, saved, rank)
            try:
                accelerate_io.load_state(net.accelerator, path)
            except Exception as exc:
                at_fault = first_unloadable(_checkpoint_files(path))
                raise CheckpointError(
                    f"{at_fault[0] if at_fault else path} could not be loaded: "
                    f"{type(exc).__name__}: {exc}") from exc
            rng = training_state.capture_rng()
            hyperparameters = training_state.optimizer_hyperparameters(net_optimizers(net))
            # the new values of parameters allowed to change take effect
            training_state.keep_new_optimizer_settings(
                net, changed_params, fresh_settings, hyperparameters)
            history = _read_own(path, format.HISTORY_NAME,
                                training_state.load_history)
            callbacks = _read_own(
                path, (format.CALLBACKS_NAME, format.CALLBACK_TENSORS_NAME),
                training_state.load_callback_states)
            rank_state = None
            if reads_own_rank:
                rank_state = _read_own(
                    path, format.rank_state_name(rank),
                    lambda folder: training_state.load_rank_state(folder, rank))
            inside = None
            if format.batches_into_epoch(saved) and not changed:
                inside = _read_own(
                    path, (format.position_name(rank), *format.epoch_caches_names(rank)),
                    lambda folder: (*epoch_position.load_position(folder, rank),
                                    training_state.load_epoch_caches(folder, rank)))
            elif format.batches_into_epoch(saved) and reads_own_rank:
                inside = _read_own(path, format.position_name(rank),
                                   lambda folder: epoch_position.load_position(folder, rank))
        # the random states of the batch the checkpoint was taken at, given
        # back when training goes on inside its epoch
        self._rng_at_batch = True
        if changed:
            rng, rank_state, inside = self._reseed(net, saved, path, rng, rank_state, inside)
            path_said = (f"{path} (written by {processes(saved['world_size'])}, "
                         "random states derived anew)")
        else:
            path_said = path

        net.history = history
        self._pending = (rng, rank_state, callbacks, hyperparameters)
        self._inside = inside
        self.loaded_from_ = path
        # the history's last row is the epoch under way, if any
        done = len(history) - (1 if inside else 0)
        stopped = format.stopped_early(saved)
        self._last_epoch = done if stopped else max(done, net.max_epochs)
        left = self._last_epoch - done
        self.resumed_ = self._record(net, saved, path)
        where = (f"at batch {inside[0]} of epoch {done + 1}" if inside
                 else f"after epoch {done}")
        say(net, self.sink,
            f"Resumed from {path_said} {where}; "
            + ("a callback had stopped training." if stopped
               else f"training {left} more epoch(s)." if left
               else "max_epochs had been reached."))

    def _record(self, net, saved, path):
        position = saved.get('position')
        if position is None:  # format 2 recorded no steps: count them
            position = {'step': training_state.optimizer_steps(
                net.history, accelerate_io.accumulation_steps(net.accelerator)), 'batches': 0}
        return Resumed(
            dirname=os.path.realpath(self.checkpoint.dirname), path=path,
            name=CheckpointFolder.name_of(path), step=position['step'],
            # on another number of processes, the batches this run skips
            batches=self._inside[0] if self._inside else 0,
            last_epoch=self._last_epoch)

    def _reseed(self, net, saved, path, rng, rank_state, inside):
        """This rank's random state, loader state and place in the epoch in a
        run on another number of processes than ``path`` was written by:
        derived from the saved rank 0's and the new number of processes, so
        that every resume of ``path`` on that many processes draws the same
        numbers. ``inside``: rank 0's ``(batches, EpochStart)`` of a
        checkpoint taken inside an epoch (on rank 0), else None."""
        world_size = sync.num_processes(net)
        origin, iteration, step, position = sync.broadcast(net, (
            training_state.reseed_origin(rng, rank_state),
            rank_state['loader_iteration'],
            accelerate_io.accumulation_step(net.accelerator),
            None if inside is None else (inside[0], inside[1].iteration),
        ) if rank_state is not None else None)
        accelerate_io.set_accumulation_step(net.accelerator, step)
        rng = training_state.derived_rng(origin, world_size, sync.process_index(net))
        rank_state = training_state.derived_rank_state(origin, world_size, iteration)
        message = (
            f"{path} was written by {processes(saved['world_size'])}, this run has "
            f"{world_size}: the model, optimizer, schedulers, history and callbacks "
            "are resumed exactly, but every rank's random state and data order are "
            "derived anew (on_world_size_change='reseed') and a step now "
            f"averages the batches of {world_size} process(es): the run goes on "
            "statistically, not bitwise, as the uninterrupted one would have")
        if position is not None:
            batches, start_iteration = position
            # as many rows of the epoch as the saved run had trained, in the
            # new order: some rows of the epoch are trained twice, others not
            skipped = batches * saved['world_size'] // world_size
            message += (
                f". It was taken inside an epoch, after {batches} batches on each of "
                f"{processes(saved['world_size'])}: each process skips {skipped} "
                "batches of that epoch in the new order, and scores collected on the "
                "epoch's training batches (EpochScoring on_train) cover the rest only")
            start = epoch_position.EpochStart(
                rng, rank_state['generator'], start_iteration)
            inside = (skipped, start, {})
            # the epoch's draws go on from its new start
            self._rng_at_batch = False
        if sync.is_main_process(net):
            warnings.warn(message, UserWarning, stacklevel=3)
        return rng, rank_state, inside

    def on_epoch_begin(self, net, dataset_train=None, **kwargs):
        # skorch began an epoch that the resumed run does not have
        ends = self._last_epoch is not None and sum(
            'train_loss' in row for row in net.history[:-1]) >= self._last_epoch
        if ends:
            net.history.pop()
        if self._pending is not None:
            loader = training_state.find_train_loader(net, dataset_train)
            if self._inside is not None and not ends:
                self._continue_epoch(net, loader)
                return
            rng, rank_state = self._restore_callbacks(net)
            training_state.apply_rank_state(loader, rank_state)
            # preparing the training loader drew from the global generator to
            # seed the sampler; the uninterrupted run had not drawn at this
            # point (nor, when this fit ends here, at its end)
            training_state.restore_rng(rng)
        if ends:
            raise KeyboardInterrupt

    def _continue_epoch(self, net, loader):
        """Set the epoch that a checkpoint taken inside it was taken in up to
        go on after its trained batches."""
        batches, start, _ = self._inside
        if not epoch_position.can_skip(loader):
            raise CheckpointError(
                f"{self.loaded_from_} was taken inside an epoch, but this run's training "
                "data cannot skip batches by index (an IterableDataset)")
        # the train split is made by now, before the epoch's first step
        compat.check_train_rows(self._saved_manifest, len(loader.dataset),
                                self.loaded_from_)
        # on another number of processes the share of an epoch changed; at
        # least one batch is left, which the resume begins at
        batches = min(batches, max(len(loader) - 1, 0))
        unknown = training_state.unknown_batch_state(net)
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
        start.restore(loader)
        self._undo_skip = accelerate_io.skip_first_batches_once(loader, batches)
        self._skipped = batches

    def on_batch_begin(self, net, training=False, **kwargs):
        if self._inside is None or not training:
            return
        _, _, caches = self._inside
        self._inside = None
        # the pass over the loader has begun: it keeps its skip
        self._undo_skip()
        self._undo_skip = None
        # after every callback's on_epoch_begin, which resets their scratch space
        rng, _ = self._restore_callbacks(net)
        training_state.apply_epoch_caches(net, caches, device=net.accelerator.device)
        if self._rng_at_batch:
            training_state.restore_rng(rng)

    def on_epoch_end(self, net, **kwargs):
        if self._skipped:
            # skorch counted the batches of this fit only
            net.history.record('train_batch_count',
                               self._skipped + net.history[-1]['train_batch_count'])
            self._skipped = 0

    def _restore_callbacks(self, net):
        """Give the callbacks and optimizer settings their saved state, once.

        Done after every callback's on_train_begin, which may reset state
        (EarlyStopping) or build and step a new LR scheduler.
        """
        rng, rank_state, callbacks, hyperparameters = self._pending
        self._pending = None
        training_state.apply_callback_states(net, callbacks)
        training_state.restore_optimizer_hyperparameters(net_optimizers(net), hyperparameters)
        return rng, rank_state

    def on_train_end(self, net, **kwargs):
        try:
            if self._undo_skip is not None:
                self._undo_skip()
                self._undo_skip = None
            if self._pending is not None:
                # a finished run trained no epoch; end with the state it was saved with
                self._restore_callbacks(net)
            self._last_epoch = None
        finally:
            # the checkpoint callback releases a folder it shares, when its
            # training ends (it runs after this one)
            if self._folder is not None and not any(
                    getattr(cb, 'folder_', None) is self._folder for _, cb in net.callbacks_):
                self._folder.release()
            self._folder = None

    def _resolve(self, net):
        """The folder to resume from, the same checkpoint on every rank."""
        committer = is_committer(net)
        found = None
        with sync.agree(net, f"finding a checkpoint in {self.checkpoint.dirname}"):
            if committer:
                found = self._folder.find(self.resume)
        name = None if found is None else CheckpointFolder.name_of(found)
        chosen = sync.broadcast(net, name)
        with sync.agree(net, "choosing the checkpoint to resume from"):
            if committer and name != chosen:
                raise CheckpointError(
                    f"rank {sync.process_index(net)} would resume from {found}, but "
                    f"rank 0 from {chosen}: the nodes' checkpoint folders differ")
        if chosen is None:
            return None
        if self.resume in ('latest', 'best'):
            return self._folder.path(chosen)
        return os.fspath(self.resume)
