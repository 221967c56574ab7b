"""AccelerateCheckpoint: decide when to save the whole training state, and save it."""

import os
import signal
import time
import warnings
from typing import Any

from skorch.callbacks import Callback
from skorch.utils import noop

from skorch_accel_callbacks import (
    accelerate_io,
    compat,
    epoch_position,
    export,
    format,
    sync,
    training_state,
    triggers,
)
from skorch_accel_callbacks.background import BackgroundSaver
from skorch_accel_callbacks.base import (
    FolderStateCallback,
    check_sink,
    find_resumed,
    format_bytes,
    move_callback,
    say,
)
from skorch_accel_callbacks.errors import TrainingPreempted
from skorch_accel_callbacks.folder import CheckpointFolder, is_committer
from skorch_accel_callbacks.preemption import SignalWatch, check_signals
from skorch_accel_callbacks.wrapping import own_registries

__all__ = ['AccelerateCheckpoint']

# steps between two votes on signals and time: about this many seconds, and
# at most this many steps
_VOTE_SECONDS = 0.5
_MAX_VOTE_STEPS = 1000


class AccelerateCheckpoint(FolderStateCallback, Callback):
    """Checkpoint the whole training state with ``accelerator.save_state``.

    Saves everything a run needs to continue exactly where it stopped: the
    model(s), optimizer(s), LR schedulers prepared by accelerate, grad scaler
    and the random states of every rank (through ``accelerator.save_state``);
    the skorch history, the state of the net's callbacks (EarlyStopping,
    LRScheduler's scheduler, scoring, ...) and the shuffling state of the
    training loader of every rank (in files of its own, JSON and safetensors,
    never pickle). Use it with :class:`AccelerateLoadInitState` to resume.

    How it differs from skorch's ``Checkpoint`` (the README and the module
    docs refer here):

    - It saves the whole training state, not only parameters: a resumed run
      continues bit for bit as the uninterrupted one would have.
    - Each checkpoint is a folder ``<dirname>/epoch-NNNN``. Every rank writes
      into ``epoch-NNNN.partial``; when all are done, the committing process
      writes a manifest (format version, world size, package versions, model
      layout, every file with its size), renames the folder into place,
      points ``latest.json`` (and ``best.json``) at it, and only then
      removes old checkpoints. A crash at any moment leaves the previous
      checkpoint intact and a ``.partial`` folder that resuming ignores.
    - One job at a time uses a folder: from the start of training to its end
      the committing process holds a lock on ``<dirname>/.lock``; a second
      job on the same folder fails when training begins, naming the
      holder's pid and host. The lock ends with the holder's process, also
      when it is killed.
    - The decision to save is taken on the main process and broadcast, so
      all ranks agree even when their metrics differ. A save that fails
      raises on every rank: a run that believes it is protected but is not
      is the worst outcome.
    - It runs after the net's other callbacks (it moves itself there when
      training begins) so that it saves their end-of-epoch state.
    - It also saves inside an epoch, at an optimizer step (a batch whose
      gradients are applied): every ``every_n_steps`` steps, every
      ``every_n_seconds`` seconds, and on the signals ``save_on_signal``
      (SIGTERM by default), after which ``fit`` raises
      :class:`~skorch_accel_callbacks.TrainingPreempted` on every rank. Such
      a checkpoint, ``epoch-NNNN-step-SSSSSSSS`` (NNNN epochs done, at step
      SSSSSSSS), also holds where the epoch is; a resume skips the batches
      trained by index, without loading them, and goes on bit for bit.
      Deciding costs no collective at a batch: steps are counted on every
      rank, and time and signals are agreed on by a vote that every rank
      counts one step later, without waiting.
    - When training ends (``max_epochs`` reached, or stopped by a callback
      such as EarlyStopping) an unsaved last epoch is saved, marked
      finished: resuming a finished run trains nothing more.
    - With ``ProjectConfiguration(save_on_each_node=True)`` the local main
      process of every node commits its own copy; give each node its own
      ``dirname`` (the filesystems are then not shared).
    - Each save's message (to ``sink``) says its size and how long it took,
      with ``async_save`` also how long training waited; the manifest
      records when it was saved, its bytes and its duration.
    - ``net.load_params(checkpoint=cp)`` loads the model(s) of the newest
      complete checkpoint into any net, as with skorch's ``Checkpoint``
      (:meth:`get_formatted_files`); ``python -m skorch_accel_callbacks``
      lists, verifies and exports the checkpoints of a folder.
    - One process and DistributedDataParallel are supported: with
      accelerate's FSDP, DeepSpeed, Megatron-LM or XLA back-end, training
      fails when it begins, naming the back-end.

    Parameters
    ----------
    dirname : str (default='checkpoints')
      Folder that holds the checkpoints.

    monitor : str, callable or None (default=None)
      Which epochs are best. ``None`` saves at the end of every epoch (see
      ``every_n_epochs``). A string is a boolean column of the history, such
      as ``'valid_loss_best'``; a callable takes the net and returns a bool.
      Either is evaluated on the main process only. Without ``keep_best``
      an epoch is saved only when it is best; either way the newest best
      checkpoint is pointed at by ``best.json`` (``resume='best'``). Saves
      inside epochs do not ask the monitor.

    every_n_epochs : int (default=1)
      Save only at the end of every n-th epoch (counted from the start of
      training, over resumes).

    keep_last : int (default=2)
      How many of the most recent checkpoints to keep. The best checkpoint
      (see ``keep_best``) and the one this run resumed from are kept in
      addition.

    every_n_steps : int or None (default=None)
      Also save after every n-th optimizer step, counted from the start of
      training over resumes. With ``gradient_accumulation_steps=4`` a step
      is every 4th batch (and an epoch's last). A step due at an epoch's
      last batch is saved at the epoch's end, with its validation scores.
      Needs a map-style training data set (one that a resume can skip by
      index); an ``IterableDataset`` raises ``ValueError`` when the first
      epoch begins.

    every_n_seconds : float or None (default=None)
      Also save at the first optimizer step when this many seconds passed
      since the last save (measured on the main process). Same data-set
      requirement as ``every_n_steps``.

    save_on_signal : tuple of str or signal.Signals (default=('SIGTERM',))
      Signals that make every rank save at the next optimizer step and
      stop: ``fit`` then raises
      :class:`~skorch_accel_callbacks.TrainingPreempted`, so the job exits
      with a failure that a scheduler can requeue; the checkpoint is not
      marked finished. A signal that reaches one rank only is enough. The
      handlers are set from the first epoch's start to the end of training,
      in the main thread only, and the previous ones are put back afterwards
      (and called, where they were functions); a second such signal gets
      the previous handler's behaviour at once. Add ``'SIGUSR1'`` for SLURM's
      ``--signal=USR1@90``; ``()`` catches no signal.

    keep_best : int or None (default=None)
      With ``monitor``: ``None`` saves an epoch only when the monitor says
      so (as skorch's ``Checkpoint``); an int saves every epoch (see
      ``every_n_epochs``) for resuming, marks those the monitor approves
      as best, and keeps the ``keep_best`` newest best ones besides the
      ``keep_last`` newest: a crash after epochs that did not improve
      loses none of them.

    event_name : str or None (default='event_acp')
      History column that records whether a checkpoint was saved.

    sink : callable (default=noop)
      Where messages about saved checkpoints go (on the main process only),
      e.g. ``print``.

    safe_serialization : bool (default=True)
      Save models with safetensors (``accelerator.save_state`` argument).

    durable : bool (default=True)
      Flush every file of a checkpoint to disk (``fsync``) before it is
      committed, so that a power loss or a crash of the machine (not only of
      the process) cannot leave a committed checkpoint with missing data.
      ``False`` leaves the writing to the operating system: faster, and
      still safe against a killed process.

    async_save : bool (default=False)
      Write checkpoints in the background. Training waits only while the
      model and optimizer states are copied into host memory (buffers kept
      for the next save, about the size of the checkpoint); a thread on the
      committing process writes them and commits the folder as above, so a
      crash during the write leaves the previous checkpoint as ``latest``.
      At most one save is in flight: the next save, and the end of
      training, wait for it, and raise on every rank if it failed.

    Attributes
    ----------
    folder_ : CheckpointFolder
      The folder of checkpoints: :meth:`committed`, :meth:`find` read it.

    last_saved_ : str or None
      Name of the last checkpoint this callback saved (with ``async_save``,
      possibly still being written).

    resumed_from_ : str or None
      Name of the checkpoint the current training resumed from, set by
      :class:`AccelerateLoadInitState`; it is never retired by this run.

    global_step_ : int
      Optimizer steps taken since training began, over resumes.

    signals_ : tuple of signal.Signals
      The signals of ``save_on_signal``.

    Raises
    ------
    ValueError
      At ``initialize``: an argument of the wrong type or range.
    TypeError, ValueError
      When training begins: a net without an accelerator, an accelerator
      with ``automatic_checkpoint_naming`` or with the FSDP, DeepSpeed,
      Megatron-LM or XLA back-end.
    CheckpointError
      When training begins: the accelerator holds models that are not the
      net's; ``save_on_each_node`` committers that share one folder.
    skorch_accel_callbacks.lock.FolderInUseError
      When training begins: another running job holds the folder.
    ValueError
      When the first epoch begins: ``every_n_steps`` or ``every_n_seconds``
      with an ``IterableDataset``.
    OSError
      A save failed (on the rank that failed; the others raise
      :class:`~skorch_accel_callbacks.RankError`).
    TrainingPreempted
      After the checkpoint taken on one of ``save_on_signal`` is committed,
      on every rank.

    Examples
    --------
    >>> from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
    >>> cp = AccelerateCheckpoint(dirname='run1')
    >>> net = AcceleratedNet(
    ...     MyModule, accelerator=Accelerator(),
    ...     callbacks=[cp, AccelerateLoadInitState(cp)],
    ... )
    >>> net.fit(X, y)  # killed? run the same command again to resume

    Lose at most 500 steps to a crash and nothing to a preemption (SLURM's
    early warning included):

    >>> cp = AccelerateCheckpoint(dirname='run1', every_n_steps=500,
    ...                           save_on_signal=('SIGTERM', 'SIGUSR1'))

    Save every epoch for resuming, and keep the best 2 by validation loss:

    >>> cp = AccelerateCheckpoint(dirname='run1', monitor='valid_loss_best', keep_best=2)

    Let training go on while a checkpoint is written:

    >>> cp = AccelerateCheckpoint(dirname='run1', async_save=True)

    The model of the newest checkpoint, in a net without accelerate:

    >>> net = NeuralNetClassifier(MyModule).initialize()
    >>> net.load_params(checkpoint=AccelerateCheckpoint(dirname='run1'))

    """

    def __init__(
            self,
            dirname='checkpoints',
            monitor=None,
            every_n_epochs=1,
            keep_last=2,
            event_name='event_acp',
            sink=noop,
            safe_serialization=True,
            durable=True,
            async_save=False,
            every_n_steps=None,
            every_n_seconds=None,
            save_on_signal=('SIGTERM',),
            keep_best=None,
    ):
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

    def initialize(self):
        owner = type(self).__name__
        if not isinstance(self.dirname, (str, os.PathLike)) or not str(self.dirname):
            raise ValueError(f"{owner}: dirname must be a folder path, got {self.dirname!r}")
        for name in ('every_n_epochs', 'keep_last'):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{owner}: {name} must be an int >= 1, got {value!r}")
        for name in ('durable', 'async_save', 'safe_serialization'):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{owner}: {name} must be True or False, got {getattr(self, name)!r}")
        if not (self.event_name is None or isinstance(self.event_name, str)):
            raise ValueError(
                f"{owner}: event_name must be a string or None, got {self.event_name!r}")
        triggers.check_monitor(self.monitor, owner)
        triggers.check_interval(self.every_n_steps, 'every_n_steps', owner, int)
        triggers.check_interval(self.every_n_seconds, 'every_n_seconds', owner, float)
        triggers.check_interval(self.keep_best, 'keep_best', owner, int)
        if self.keep_best is not None and self.monitor is None:
            raise ValueError(f"{owner}: keep_best keeps the checkpoints that monitor "
                             "marks best; set monitor too")
        self.signals_ = check_signals(self.save_on_signal, owner)
        check_sink(self.sink, owner)
        self.close()
        self.folder_ = CheckpointFolder(self.dirname)
        self.last_saved_ = None
        self.global_step_ = 0
        self._watch = SignalWatch()
        self._vote = None
        # training batches of the epoch under way, and the random states it began with
        self._batches = 0
        self._epoch_start = None
        self._last_save = None
        # why to save at the end of this epoch (a step or time due at its last batch)
        self._deferred = None
        # the resume this callback counts from (a record of AccelerateLoadInitState)
        self._resumed = None
        # complete epochs after which the fit under way ends
        self._last_epoch = None
        self._fit_began = False
        self._saver = BackgroundSaver() if self.async_save else None
        # (folder, message) of the save in the background
        self._in_flight = None
        self._train_loader = None
        self._data = None
        self._epoch_end_seen = None
        return self

    @property
    def resumed_from_(self):
        return None if self._resumed is None else self._resumed.name

    def __getstate__(self):
        # a loader holds the training data; it is found again each epoch
        return dict(self.__dict__, _train_loader=None, _in_flight=None, _epoch_start=None)

    # ------------------------------------------------------------ hooks

    # pylint: disable=arguments-differ
    def on_train_begin(self, net, X=None, y=None, **kwargs):
        self._check_net(net)
        move_callback(net, self, 'last')
        self.folder_.claim(net)
        self._data = training_state.data_fingerprint(X, y)
        self._fit_began = False
        self._deferred = None
        self._last_save = time.monotonic()
        self._is_main = sync.is_main_process(net)
        if sync.is_distributed(net):
            # every rank needs to hear of a signal, SIGINT at least
            self._vote = sync.Vote(net)
            self._next_vote = 0
            self._vote_interval = 1
            self._voted_at = (0, self._last_save)

    def on_epoch_begin(self, net, dataset_train=None, **kwargs):
        self._train_loader = training_state.find_train_loader(net, dataset_train)
        self._batches = 0
        if not self._fit_began:
            self._fit_began = True
            # the resume callback, which runs first, has loaded the checkpoint
            if not self._take_resumed(net):
                # a fresh start or a partial_fit: skorch trains max_epochs more
                self._last_epoch = len(net.history) - 1 + net.max_epochs
            # once every callback's on_train_begin went through: a fit that
            # fails before training leaves no handler behind
            self._watch.install(type(self).__name__, *self._watched_signals(net))
        if self.every_n_steps or self.every_n_seconds or self._watch.stop_signals:
            if ((self.every_n_steps or self.every_n_seconds)
                    and not epoch_position.can_skip(self._train_loader)):
                raise ValueError(
                    f"{type(self).__name__}: every_n_steps and every_n_seconds save in the "
                    "middle of an epoch, which a resume skips by index: that needs a "
                    "map-style training data set (an IterableDataset cannot skip)")
            # after the resume callback gave back the epoch's starting state
            self._epoch_start = epoch_position.EpochStart.capture(self._train_loader)

    def on_batch_end(self, net, training=False, **kwargs):
        if not training:
            return
        self._batches += 1
        if not accelerate_io.gradients_applied(net.accelerator):
            return  # inside a gradient accumulation: no step to resume from
        self.global_step_ += 1
        reason = self._poll(net)
        if reason is None:
            return
        if accelerate_io.at_end_of_loader(self._train_loader):
            # the epoch's end saves it, with its validation scores
            self._deferred = reason
            return
        if isinstance(reason, str) or epoch_position.can_skip(self._train_loader):
            path = self.save_model(net)
        else:
            path = None  # a signal inside an epoch of an IterableDataset
        if not isinstance(reason, str):
            # training ends inside this pass over the loader
            accelerate_io.leave_loader(self._train_loader)
            self._stop(net, reason, path)

    def on_epoch_end(self, net, **kwargs):
        # an epoch whose end this hook did not see was ended before it by a
        # KeyboardInterrupt: a callback's decision (EarlyStopping) or a Ctrl-C
        self._epoch_end_seen = len(net.history)
        deferred, self._deferred = self._deferred, None
        received = self._signal_at_epoch_end(net)
        if received is None and isinstance(deferred, signal.Signals):
            received = deferred
        decided, best = self._decide(net)
        # the fit ends after this epoch: its checkpoint says training finished
        last = len(net.history) >= self._last_epoch
        do_save = decided or last or deferred is not None or received is not None
        if self.event_name is not None:
            net.history.record(self.event_name, do_save)
        if do_save:
            path = self.save_model(net, best=best, finished=last)
            if received is not None:
                self._stop(net, received, path)

    def on_train_end(self, net, **kwargs):
        try:
            # a fit that the resume callback ended before its first epoch
            self._take_resumed(net)
            if (training_state.epoch_completed(net)
                    and self.checkpoint_name(net) not in (self.last_saved_, self.resumed_from_)):
                self._save_at_train_end(net)
            self.wait_for_saves(net)
            received = self._signal_at_train_end(net)
            if received is not None:
                saved = self.last_saved_ or self.resumed_from_
                self._stop(net, received, saved and self.folder_.path(saved))
        finally:
            self.close()

    def _save_at_train_end(self, net):
        """Save the epoch that training ended in, unless its end was cut
        short by an interruption that was no callback's decision."""
        # this callback's own end of the epoch went through, but for its
        # save (a KeyboardInterrupt in the save): the epoch's state is whole
        seen = self._epoch_end_seen == len(net.history)
        stopped_early = not seen and sync.broadcast(
            net, self._watch.interrupted is None and triggers.stopped_by_callback(net))
        if seen or stopped_early:
            ends = self._last_epoch is not None and len(net.history) >= self._last_epoch
            self.save_model(net, finished=stopped_early or ends, stopped_early=stopped_early)
            return
        # a Ctrl-C in another callback's end of the epoch: some of them saw
        # the epoch end, some not; resuming the last checkpoint replays it
        last = self.last_saved_ or self.resumed_from_
        say(net, self.sink,
            f"Training was interrupted (KeyboardInterrupt) in the end of epoch "
            f"{len(net.history)}, which is not saved: "
            + (f"{self.folder_.path(last)} stands" if last else "no checkpoint was taken")
            + "; run the same command again to resume")

    def _take_resumed(self, net):
        """Count on from the checkpoint that this fit resumed from, if it did
        (not a fit that continues training without loading, such as
        ``partial_fit``); return whether it did."""
        record = find_resumed(net, self.dirname)
        if record is None or record is self._resumed:
            return False
        self._resumed = record
        self.global_step_, self._batches = record.step, record.batches
        self._last_epoch = record.last_epoch
        return True

    def _watched_signals(self, net):
        """``(signals that save and stop, signals only noted)``: a Ctrl-C
        (SIGINT) stops every rank as a preemption does when there are
        several (one rank's KeyboardInterrupt would leave the others waiting
        in a collective), and in one process ends ``fit`` as skorch's does,
        noted so that it is not taken for a callback's decision."""
        stop = tuple(self.signals_)
        if signal.SIGINT in stop:
            return stop, ()
        if sync.is_distributed(net):
            return stop + (signal.SIGINT,), ()
        return stop, (signal.SIGINT,)

    def close(self):
        """Wait for this process's background work, free the save buffers
        and release the folder.

        Called when training ends and by ``initialize`` (a new ``fit`` after
        one that raised while a save was written in the background). A
        background save that failed and was not reported on every rank by
        :meth:`wait_for_saves` is reported here with a warning.
        """
        saver = getattr(self, '_saver', None)
        folder = getattr(self, 'folder_', None)
        watch = getattr(self, '_watch', None)
        if watch is not None:
            watch.uninstall()
        vote, self._vote = getattr(self, '_vote', None), None
        try:
            if vote is not None:
                vote.close()
            if saver is not None:
                try:
                    saver.close()
                except Exception as exc:  # pylint: disable=broad-except
                    warnings.warn(
                        f"{type(self).__name__}: the checkpoint written in the background "
                        f"failed: {type(exc).__name__}: {exc}", UserWarning)
        finally:
            if folder is not None:
                folder.wait_for_removals()
                folder.release()

    # ------------------------------------------------------------ policy

    def _decide(self, net):
        """``(save, best)`` at the end of this epoch."""
        if not triggers.epoch_due(net, self.every_n_epochs):
            return False, False
        if self.monitor is None:
            return True, False
        best = sync.run_on_main(
            net, lambda: triggers.monitor_says(net, self.monitor, type(self).__name__),
            f"evaluating checkpoint monitor {self.monitor!r}")
        # with keep_best the monitor marks the best, and every epoch is saved
        return best or self.keep_best is not None, best

    def _poll(self, net):
        """Why to save after the optimizer step just taken: ``'step'``,
        ``'time'``, a signal (``signal.Signals``), or None.

        The step count is the same on every rank; the time is measured on
        the main process and a signal may reach one rank only, so those two
        go through a vote (:meth:`_vote_now`).
        """
        if self._vote is not None:
            flags = self._vote_now()
        else:
            received = self._watch.received
            flags = (int(received) if received else 0,
                     self.every_n_seconds is not None and triggers.time_due(
                         time.monotonic() - self._last_save, self.every_n_seconds))
        if flags[0]:
            return signal.Signals(flags[0])
        if triggers.step_due(self.global_step_, self.every_n_steps):
            return 'step'
        return 'time' if flags[1] else None

    def _vote_now(self):
        """``(signal number, time due)`` that the ranks agreed on at this step.

        A vote is posted without waiting and counted when the next one is
        posted, a number of steps later that the votes themselves agree on:
        the main process proposes as many steps as take about
        ``_VOTE_SECONDS`` (or half of ``every_n_seconds``, if shorter), so
        that posting one (a few hundred microseconds on gloo) costs well
        under 1% of training, and a signal is seen within about two such
        intervals.
        """
        if self.global_step_ < self._next_vote:
            return 0, False
        now = time.monotonic()
        proposed = 0
        if self._is_main:
            steps = self.global_step_ - self._voted_at[0]
            seconds = max(now - self._voted_at[1], 1e-9)
            # a short every_n_seconds needs votes as often as its half
            wanted = (_VOTE_SECONDS if self.every_n_seconds is None
                      else min(_VOTE_SECONDS, self.every_n_seconds / 2))
            proposed = max(1, min(_MAX_VOTE_STEPS, round(wanted * steps / seconds)))
        self._voted_at = (self.global_step_, now)
        received = self._watch.received
        time_is_due = self._is_main and self.every_n_seconds is not None and triggers.time_due(
            now - self._last_save, self.every_n_seconds)
        # none under way at an epoch's first vote: the interval agreed before
        counted = self._vote.count() or [0, 0, self._vote_interval]
        self._vote.post([int(received) if received else 0, time_is_due, proposed])
        self._vote_interval = counted[2]
        self._next_vote = self.global_step_ + counted[2]
        return counted[0], bool(counted[1])

    def _signal_at_epoch_end(self, net):
        """The signal any rank got by the end of this epoch, or None; every
        rank counts the vote under way and one more (the epoch end waits for
        collectives anyway)."""
        received = int(self._watch.received or 0)
        if self._vote is not None:
            counted = self._vote.count() or [0, 0, 1]
            self._vote.post([received, 0, 0])
            received = max(received, counted[0], self._vote.count()[0])
            # the next epoch votes at its first step
            self._next_vote = self.global_step_ + 1
        return signal.Signals(received) if received else None

    def _signal_at_train_end(self, net):
        """The signal any rank got that training did not stop for (it came
        during the end of training), or None; every rank counts the vote
        under way and what every rank got since."""
        received = int(self._watch.received or 0)
        if self._vote is not None:
            counted = self._vote.count()
            received = max(sync.gather(net, max(received, counted[0] if counted else 0)))
        return signal.Signals(received) if received else None

    def _stop(self, net, received, path):
        """End training on every rank after the checkpoint ``path`` of a
        signal is committed."""
        try:
            self.wait_for_saves(net)
        finally:
            self.close()
        say(net, self.sink, f"Stopping on {received.name}"
            + (f": resume from {path}" if path else ": no checkpoint could be taken "
               "inside the epoch of an IterableDataset"))
        raise TrainingPreempted(received, path)

    def checkpoint_name(self, net: Any) -> str:
        """The folder name of a checkpoint of the net as it is now:
        ``epoch-NNNN`` after ``NNNN`` epochs, ``epoch-NNNN-step-SSSSSSSS``
        at optimizer step ``SSSSSSSS`` of the epoch after (names sort in
        training order)."""
        if not net.history or training_state.epoch_completed(net):
            return format.checkpoint_name(len(net.history))
        return format.checkpoint_name(len(net.history) - 1, self.global_step_)

    def is_committer(self, net):
        """Whether this process commits checkpoint folders (one per folder)."""
        return is_committer(net)

    def _check_net(self, net):
        accelerator = getattr(net, 'accelerator', None)
        if accelerator is None:
            raise TypeError(
                "AccelerateCheckpoint needs a net with skorch's AccelerateMixin "
                "(an `accelerator` attribute); for a plain net use ParamsCheckpoint")
        if accelerate_io.uses_automatic_naming(accelerator):
            raise ValueError(
                "AccelerateCheckpoint names and retires its checkpoint folders itself; "
                "create the Accelerator without "
                "ProjectConfiguration(automatic_checkpoint_naming=True)")
        # before the model layout, which would blame the modules of a back-end
        # that shards or wraps them itself
        accelerate_io.check_plain_state(
            accelerator,
            'AccelerateCheckpoint' + ('(async_save=True)' if self.async_save else ''))
        with own_registries(net):
            compat.model_layout(net)

    # ------------------------------------------------------------ reading

    def _reader(self):
        # reading needs no lock, nor initialize(): a script that only loads
        # a checkpoint creates the callback and reads
        folder = getattr(self, 'folder_', None)
        return folder if folder is not None else CheckpointFolder(self.dirname)

    def committed(self):
        """Names of the committed checkpoint folders, oldest commit first."""
        return self._reader().committed()

    def find(self, which='latest'):
        """Path of the checkpoint to resume from, or None; see
        :meth:`CheckpointFolder.find`."""
        return self._reader().find(which)

    # ------------------------------------------------------------ skorch's load_params

    @property
    def f_history(self):
        """The history's file in a checkpoint; skorch's ``load_params``
        reads the history of a checkpoint when this is not None."""
        return format.HISTORY_NAME

    @property
    def f_history_(self):
        """Path of the history of the newest complete checkpoint."""
        return self.get_formatted_files(None)['f_history']

    def get_formatted_files(self, net, which='latest'):
        """The files of a checkpoint as arguments of skorch's ``load_params``.

        ``net.load_params(checkpoint=cp)`` calls it, so it loads the
        model(s) and the history of the newest complete checkpoint into any
        net: a plain skorch net without accelerate, an accelerated net,
        wrapped or not, in one process or many. It loads neither the
        optimizer nor the rest of the training state (resuming is
        :class:`AccelerateLoadInitState`'s). The model files are
        safetensors (unless ``safe_serialization=False``): torch 2.13 reads
        them with ``torch.load``; with an older torch, pass
        ``use_safetensors=True`` to ``load_params``.

        Parameters
        ----------
        net : skorch.NeuralNet or None
          Unused; skorch passes the net.

        which : str (default='latest')
          ``'latest'`` (the newest complete checkpoint), ``'best'``, the name
          of a checkpoint (``'epoch-0003'``) or the path of a checkpoint
          folder.

        Returns
        -------
        files : dict
          ``f_params`` (the module ``module``), ``f_<name>`` for every other
          module or criterion the checkpoint holds (those with trainable
          parameters, such as ``f_criterion``), ``f_history``.

        Raises
        ------
        FileNotFoundError
          There is no checkpoint (of that name) in ``dirname``.
        CheckpointError
          ``which='best'`` and no checkpoint of ``dirname`` was saved as the
          best (``monitor`` marks those); or the checkpoint chosen is of a
          newer format.
        CorruptCheckpointError
          The checkpoint chosen is damaged (the message names the file).

        Examples
        --------
        >>> cp = AccelerateCheckpoint(dirname='run1')
        >>> net = NeuralNetClassifier(MyModule).initialize()
        >>> net.load_params(checkpoint=cp)  # the newest checkpoint
        >>> net.load_params(**cp.get_formatted_files(net, which='best'))

        """
        return export.checkpoint_files(export.find_checkpoint(self.dirname, which))

    # ------------------------------------------------------------ saving

    def save_model(self, net, best=False, finished=False, stopped_early=False):
        """Save a checkpoint of the whole training state on every rank.

        Every process must call it. Raises on every rank if any rank fails.
        With ``async_save``, it first waits for the previous save, and
        returns once the states are copied; the files are written and
        committed in the background. ``best`` points ``best.json`` at it;
        ``finished`` marks the end of training (``max_epochs`` reached or,
        with ``stopped_early``, stopped by a callback: resuming such a
        checkpoint trains nothing). Called inside an epoch (after a training
        batch), the checkpoint also holds where in the epoch training is.
        Returns the checkpoint's path.
        """
        entered = time.monotonic()
        self.wait_for_saves(net)
        started = time.monotonic()
        name = self.checkpoint_name(net)
        folder = self.folder_
        committer = self.is_committer(net)
        partial = folder.partial_path(name)

        with sync.agree(net, f"preparing {partial}"):
            if committer:
                folder.start(name)
        snapshot, sealed = None, None
        with sync.agree(net, f"writing checkpoint {partial}"), own_registries(net):
            if self.async_save:
                snapshot = self._saver.snapshot(
                    net.accelerator, partial, self.safe_serialization, writer=committer)
            else:
                accelerate_io.save_state(net.accelerator, partial, self.safe_serialization)
            rank = sync.process_index(net)
            training_state.save_rank_state(partial, rank, self._train_loader)
            inside_epoch = not training_state.epoch_completed(net)
            if inside_epoch:
                epoch_position.save_position(partial, rank, self._epoch_start, self._batches)
                training_state.save_epoch_caches(partial, rank, net)
            if committer:
                training_state.save_history(partial, net)
                training_state.save_callback_states(partial, net)
                position = {'step': self.global_step_,
                            'batches': self._batches if inside_epoch else 0}
                sealed = compat.build_manifest(net, name, best, finished, stopped_early,
                                               self._data, position, self._train_loader)
        written = {}

        def commit() -> None:
            written.update(folder.commit(name, sealed, durable=self.durable, best=best,
                                         started=started))
            folder.retire(self.keep_last, self.keep_best, keep=[self.resumed_from_])

        def message():
            # the committing process knows the size; only the main process,
            # a committer, says it
            text = f"Saved checkpoint {folder.path(name)}" + (" (finished)" if finished else '')
            if written:
                text += (f": {format_bytes(written['bytes'])} in "
                         f"{written['save_seconds']:.2f} s")
                if 'blocked_seconds' in written:
                    text += f", training blocked {written['blocked_seconds']:.2f} s"
            return text

        if self.async_save:
            # every other rank's files are complete: the others agreed above
            if committer:
                # training waited for the previous save too
                sealed['blocked_seconds'] = round(time.monotonic() - entered, 3)
                self._saver.start(partial, snapshot, commit)
            self._in_flight = (folder.path(name), message)
        else:
            with sync.agree(net, f"committing checkpoint {folder.path(name)}"):
                if committer:
                    commit()
            say(net, self.sink, message())
        self.last_saved_ = name
        self._last_save = time.monotonic()
        return folder.path(name)

    def wait_for_saves(self, net):
        """Wait for the checkpoint written in the background, if any, and
        for the removal of retired checkpoints.

        Every process must call it. If writing or committing the checkpoint
        failed, raises on every rank: the committing one raises the error,
        the others :class:`~skorch_accel_callbacks.RankError`.
        """
        if self._in_flight is not None:
            path, message = self._in_flight
            self._in_flight = None
            with sync.agree(net, f"writing checkpoint {path} in the background"):
                self._saver.join()
            say(net, self.sink, message())
        # after the writer: with async_save, it starts them
        self.folder_.wait_for_removals()

