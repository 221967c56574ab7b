"""AccelerateCheckpoint: the whole training state, committed atomically."""

import functools
import os
import re
import warnings
from importlib.metadata import PackageNotFoundError, version

from accelerate.utils import load as accelerate_load
from skorch.callbacks import Callback
from skorch.utils import noop

from skorch_accel_callbacks import async_save as background, storage, sync, training_state
from skorch_accel_callbacks.callback_order import move_callback
from skorch_accel_callbacks.wrapping import bare_modules

__all__ = ['AccelerateCheckpoint', 'CheckpointError', 'FORMAT_VERSION']

FORMAT_VERSION = 1
_FOLDER_RE = re.compile(r'^epoch-(\d+)$')
_POINTERS = ('latest', 'best')


class CheckpointError(ValueError):
    """A checkpoint cannot be used by this run; the message says why."""


def _rng_name(rank):
    # accelerate's name for a rank's random states (checkpointing.py)
    return f'random_states_{rank}.pkl'


@functools.cache  # importlib.metadata reads files; versions do not change
def _package_versions():
    versions = {}
    for name in ('torch', 'accelerate', 'skorch', 'skorch-accel-callbacks'):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def model_layout(net):
    """Name, parameter names and shapes of each model, in accelerate's order.

    ``accelerator.save_state`` numbers its model files by the position of a
    model in ``accelerator._models``; the names make the order checkable.
    """
    by_id = {id(module): name for name, module in bare_modules(net).items()}
    layout = []
    for index, model in enumerate(net.accelerator._models):
        name = by_id.get(id(model))
        if name is None:
            raise CheckpointError(
                f"accelerator._models[{index}] ({type(model).__name__}) is not a "
                "module of this net: accelerator.save_state would save it too. It "
                "is left over from an earlier initialize() or belongs to another "
                "net; use AccelerateFixesMixin, which removes stale entries, or a "
                "fresh Accelerator")
        shapes = {key: list(value.shape) for key, value in model.state_dict().items()}
        layout.append([name, shapes])
    return layout


def _layout_differences(saved, current):
    saved_names = [name for name, _ in saved]
    current_names = [name for name, _ in current]
    if saved_names != current_names:
        return [f"models {saved_names} in the checkpoint, {current_names} in the net"]
    problems = []
    for (name, old), (_, new) in zip(saved, current):
        for key in sorted(set(old) | set(new)):
            if key not in new:
                problems.append(f"{name}: parameter {key!r} is in the checkpoint, not in the net")
            elif key not in old:
                problems.append(f"{name}: parameter {key!r} is in the net, not in the checkpoint")
            elif old[key] != new[key]:
                problems.append(
                    f"{name}: {key!r} has shape {tuple(old[key])} in the checkpoint, "
                    f"{tuple(new[key])} in the net")
    return problems


def check_compatible(net, manifest, path):
    """Raise :class:`CheckpointError` if ``net`` cannot resume from ``path``."""
    fmt = manifest.get('format_version')
    if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {fmt!r}; this version of "
            f"skorch-accel-callbacks reads format {FORMAT_VERSION} and older: upgrade it")
    world_size = sync.num_processes(net)
    if manifest.get('world_size') != world_size:
        raise CheckpointError(
            f"{path} was written by {manifest.get('world_size')} processes, this run "
            f"has {world_size}: every rank resumes its own random state and data "
            "order, so resume with the same number of processes")
    problems = _layout_differences(manifest.get('models', []), model_layout(net))
    if problems:
        raise CheckpointError(
            f"{path} was saved from another model: " + '; '.join(problems[:5])
            + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ''))
    n_optimizers = len(net.accelerator._optimizers)
    if manifest.get('optimizers') != n_optimizers:
        raise CheckpointError(
            f"{path} holds {manifest.get('optimizers')} optimizer(s), the net has "
            f"{n_optimizers}")


def check_rank_files(path, manifest, rank):
    """Check that this rank's own files are there and load without code."""
    for name in (_rng_name(rank), training_state.rank_state_name(rank)):
        if name not in manifest['files']:
            raise storage.CorruptCheckpointError(
                f"{os.path.join(path, name)} is missing: {path} has no state for rank {rank}")
    rng_file = os.path.join(path, _rng_name(rank))
    try:
        # accelerate's load_state silently skips random states it cannot read
        accelerate_load(rng_file)
    except Exception as exc:  # pylint: disable=broad-except
        raise storage.CorruptCheckpointError(
            f"{rng_file} cannot be loaded (weights_only): {type(exc).__name__}: {exc}"
        ) from exc


class AccelerateCheckpoint(training_state.StateOnDisk, Callback):
    """Checkpoint the whole training state with ``accelerator.save_state``.

    Saves everything a run needs to continue exactly where it stopped: the
    model(s), optimizer(s), LR schedulers prepared by accelerate, grad scaler
    and the random states of every rank (through ``accelerator.save_state``);
    the skorch history, the state of the net's callbacks (EarlyStopping,
    LRScheduler's scheduler, scoring, ...) and the shuffling state of the
    training loader of every rank (in files of its own, JSON and safetensors,
    never pickle). Use it with :class:`AccelerateLoadInitState` to resume.

    Each checkpoint is a folder ``<dirname>/epoch-NNNN``. Every rank writes
    into ``epoch-NNNN.partial``; when all are done, the main process writes a
    manifest (format version, world size, package versions, model layout,
    every file with its size), renames the folder into place, points
    ``latest.json`` (and ``best.json``) at it, and only then removes old
    checkpoints. A crash at any moment leaves the previous checkpoint intact
    and a ``.partial`` folder that resuming ignores.

    One job at a time uses a folder: from the start of training to its end
    the committing process holds a lock on ``<dirname>/.lock``, and a second
    job on the same folder fails when training begins, naming the holder's
    pid and host. The lock ends with the holder's process, also when it is
    killed. (After ``fit`` raised, the callback keeps the lock until it
    trains again or is garbage-collected.)

    The decision to save is taken on the main process and broadcast, so all
    ranks agree even when their metrics differ. A save that fails raises on
    every rank: a run that believes it is protected but is not is the worst
    outcome. This callback runs after the net's other callbacks (it moves
    itself there when training begins) so that it saves their end-of-epoch
    state. When training ends (``max_epochs`` reached, or stopped by a
    callback such as EarlyStopping) an unsaved last epoch is saved, marked
    finished: resuming a finished run trains nothing more.

    With ``ProjectConfiguration(save_on_each_node=True)`` the local main
    process of every node commits its own copy; give each node its own
    ``dirname`` (the filesystems are then not shared).

    Parameters
    ----------
    dirname : str (default='checkpoints')
      Folder that holds the checkpoints.

    monitor : str, callable or None (default=None)
      When to save. ``None`` saves at the end of every epoch (see
      ``every_n_epochs``). A string is a boolean column of the history, such
      as ``'valid_loss_best'``; a callable takes the net and returns a bool.
      Either is evaluated on the main process only. Checkpoints saved
      because of the monitor are also pointed at by ``best.json``.

    every_n_epochs : int (default=1)
      Save only at the end of every n-th epoch (counted from the start of
      training, over resumes).

    keep_last : int (default=2)
      How many of the most recent checkpoints to keep. The best checkpoint
      and the one this run resumed from are kept in addition.

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
      training, wait for it, and raise on every rank if it failed. Not for
      FSDP, DeepSpeed or Megatron-LM.

    Examples
    --------
    >>> from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
    >>> cp = AccelerateCheckpoint(dirname='run1')
    >>> net = AcceleratedNet(
    ...     MyModule, accelerator=Accelerator(),
    ...     callbacks=[cp, AccelerateLoadInitState(cp)],
    ... )
    >>> net.fit(X, y)  # killed? run the same command again to resume

    Let training go on while a checkpoint is written:

    >>> cp = AccelerateCheckpoint(dirname='run1', async_save=True)

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

    def initialize(self):
        if not isinstance(self.dirname, (str, os.PathLike)) or not str(self.dirname):
            raise ValueError(f"dirname must be a folder path, got {self.dirname!r}")
        for name in ('every_n_epochs', 'keep_last'):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ('durable', 'async_save'):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not (self.monitor is None or isinstance(self.monitor, str)
                or callable(self.monitor)):
            raise ValueError(
                f"monitor must be None, a history key or a callable, got {self.monitor!r}")
        self.last_saved_ = None
        self.resumed_from_ = None
        self._train_loader = None
        self._unlock()
        # storage.FolderLock on dirname while training: one job per folder
        self._lock = None
        self._saver = background.BackgroundSaver() if self.async_save else None
        # (folder, message) of the save in the background
        self._in_flight = None
        # threads removing retired checkpoints
        self._removals = []
        return self

    # ------------------------------------------------------------ hooks

    def on_train_begin(self, net, **kwargs):
        self._check_net(net)
        if self.async_save:
            background.check_supported(net.accelerator)
        move_callback(net, self, 'last')
        self.claim_folder(net)

    def claim_folder(self, net):
        """Create ``dirname`` and lock it for this job until training ends.

        Every rank calls it; it acts once per training, whichever of this
        callback and :class:`AccelerateLoadInitState` (which must hold the
        lock before it reads a checkpoint) calls it first.
        """
        if self._claimed:
            return
        with sync.agree(net, f"preparing checkpoint folder {self.dirname}"):
            if self.is_committer(net):
                self._prepare_folder()
        if self._save_on_each_node(net) and sync.is_distributed(net):
            self._check_folder_per_node(net)
        # after the check above, so that two nodes of one job sharing a folder
        # get its message, not the lock's "another running job"
        with sync.agree(net, f"locking checkpoint folder {self.dirname}"):
            if self.is_committer(net):
                self._lock_folder()
        self._claimed = True

    def _prepare_folder(self):
        if os.path.lexists(self.dirname) and not os.path.isdir(self.dirname):
            raise NotADirectoryError(
                f"checkpoint folder {self.dirname} is a file, not a folder")
        os.makedirs(self.dirname, exist_ok=True)
        if not os.access(self.dirname, os.W_OK | os.X_OK):
            raise PermissionError(f"checkpoint folder {self.dirname} is not writable")

    def _lock_folder(self):
        # held until training ends (or this process ends: the kernel frees it)
        if self._lock is None:
            self._lock = storage.FolderLock(self.dirname).acquire()
        # only the job that holds the lock may remove what a killed one left:
        # another job's partial folder is still being written
        storage.remove_leftovers(self.dirname)

    def _unlock(self):
        self._claimed = False
        if getattr(self, '_lock', None) is not None:
            self._lock.release()
            self._lock = None

    def __getstate__(self):
        # a lock belongs to this process; a copy (pickle, deepcopy) holds none
        state = self.__dict__.copy()
        if '_lock' in state:
            state['_lock'] = None
        return state

    def on_epoch_begin(self, net, dataset_train=None, **kwargs):
        self._train_loader = training_state.find_train_loader(net, dataset_train)

    def on_epoch_end(self, net, **kwargs):
        do_save = self._decide(net)
        if self.event_name is not None:
            net.history.record(self.event_name, do_save)
        if do_save:
            self.save_model(net, best=self.monitor is not None)

    def on_train_end(self, net, **kwargs):
        try:
            # interrupted inside an epoch: the last checkpoint stands
            if (net.history and 'train_loss' in net.history[-1]
                    and self.checkpoint_name(net) not in (self.last_saved_, self.resumed_from_)):
                self.save_model(net, finished=True)
            self.wait_for_saves(net)
            if self._saver is not None:
                self._saver.close()
        finally:
            self._unlock()

    def _check_folder_per_node(self, net):
        """With save_on_each_node, two nodes committing into one shared folder
        would race; each committer leaves a probe file and looks for others'."""
        rank = sync.process_index(net)
        committer = self.is_committer(net)
        probe = os.path.join(self.dirname, f'.node-probe-{rank}')
        with sync.agree(net, f"probing checkpoint folder {self.dirname}"):
            if committer:
                storage.write_json(probe, {'rank': rank})
        shared_with = []
        if committer:
            shared_with = [
                int(name.rsplit('-', 1)[1]) for name in os.listdir(self.dirname)
                if name.startswith('.node-probe-') and name != os.path.basename(probe)]
        seen = sync.gather(net, shared_with)
        with sync.agree(net, f"removing probe files in {self.dirname}"):
            if committer:
                storage.discard(probe)
        clashes = [(rank_, others) for rank_, others in enumerate(seen) if others]
        if clashes:
            rank_, others = clashes[0]
            raise CheckpointError(
                f"save_on_each_node=True, but rank {rank_} and rank(s) {others} "
                f"commit into the same folder {self.dirname}: give each node its own "
                "dirname, or set save_on_each_node=False on a shared filesystem")

    # ------------------------------------------------------------ policy

    def _decide(self, net):
        if len(net.history) % self.every_n_epochs != 0:
            return False
        if self.monitor is None:
            return True
        return bool(sync.run_on_main(
            net, lambda: bool(self._monitor_value(net)),
            f"evaluating checkpoint monitor {self.monitor!r}"))

    def _monitor_value(self, net):
        if callable(self.monitor):
            return self.monitor(net)
        try:
            return net.history[-1, self.monitor]
        except KeyError as exc:
            raise KeyError(
                f"checkpoint monitor {self.monitor!r} is not in the history of this "
                "epoch; make sure you have validation data if you monitor "
                "validation scores") from exc

    def checkpoint_name(self, net):
        return f"epoch-{len(net.history):04d}"

    def is_committer(self, net):
        """Whether this process commits checkpoint folders (one per folder)."""
        if self._save_on_each_node(net):
            return sync.is_local_main_process(net)
        return sync.is_main_process(net)

    @staticmethod
    def _save_on_each_node(net):
        return bool(net.accelerator.project_configuration.save_on_each_node)

    def _check_net(self, net):
        accelerator = getattr(net, 'accelerator', None)
        if accelerator is None:
            raise TypeError(
                "AccelerateCheckpoint needs a net with skorch's AccelerateMixin "
                "(an `accelerator` attribute); for a plain net use ParamsCheckpoint")
        if accelerator.project_configuration.automatic_checkpoint_naming:
            raise ValueError(
                "AccelerateCheckpoint names and retires its checkpoint folders itself; "
                "create the Accelerator without "
                "ProjectConfiguration(automatic_checkpoint_naming=True)")
        model_layout(net)

    # ------------------------------------------------------------ saving

    def save_model(self, net, best=False, finished=False):
        """Save a checkpoint of the whole training state on every rank.

        Every process must call it. Raises on every rank if any rank fails.
        With ``async_save``, it first waits for the previous save, and
        returns once the states are copied; the files are written and
        committed in the background.
        """
        self.wait_for_saves(net)
        name = self.checkpoint_name(net)
        final = os.path.join(self.dirname, name)
        partial = final + storage.PARTIAL_SUFFIX
        committer = self.is_committer(net)
        rank = sync.process_index(net)

        with sync.agree(net, f"preparing {partial}"):
            if committer:
                storage.fresh_folder(partial)
        snapshot = None
        with sync.agree(net, f"writing checkpoint {partial}"):
            if self.async_save:
                snapshot = self._saver.snapshot(
                    net.accelerator, partial, self.safe_serialization, writer=committer)
            else:
                net.accelerator.save_state(partial, safe_serialization=self.safe_serialization)
            training_state.save_rank_state(partial, rank, self._train_loader)
            if committer:
                training_state.save_history(partial, net)
                training_state.save_callback_states(partial, net)
        manifest = self._manifest(net, name, best, finished) if committer else None
        message = f"Saved checkpoint {final}" + (" (finished)" if finished else '')
        if self.async_save:
            # every other rank's files are complete: the others agreed above
            if committer:
                self._saver.start(
                    partial, snapshot, lambda: self._commit(partial, final, manifest, best))
            self._in_flight = (final, message)
            self.last_saved_ = name
            return
        with sync.agree(net, f"committing checkpoint {final}"):
            if committer:
                self._commit(partial, final, manifest, best)
        self.last_saved_ = name
        self._sink(message, net)

    def wait_for_saves(self, net):
        """Wait for the checkpoint written in the background, if any, and
        for the removal of retired checkpoints.

        Every process must call it. If writing or committing the checkpoint
        failed, raises on every rank: the committing one raises the error,
        the others :class:`~skorch_accel_callbacks.RankError`.
        """
        if self._in_flight is not None:
            final, message = self._in_flight
            self._in_flight = None
            with sync.agree(net, f"writing checkpoint {final} in the background"):
                self._saver.join()
            self._sink(message, net)
        # after the writer: with async_save, it starts them
        for thread in self._removals:
            thread.join()
        self._removals = []

    def _commit(self, partial, final, manifest, best):
        """Seal, rename and point at a written folder; retire old ones.

        Runs on the committing process, in the background with
        ``async_save``: it must not touch the net or run a collective.
        """
        name = manifest['name']
        storage.commit_folder(partial, final, manifest, durable=self.durable)
        storage.write_json(self._pointer('latest'), {'name': name})
        if best:
            storage.write_json(self._pointer('best'), {'name': name})
        self._retire_old(name)

    def _manifest(self, net, name, best, finished):
        return {
            'format_version': FORMAT_VERSION,
            'name': name,
            'epoch': len(net.history),
            'best': bool(best),
            'finished': bool(finished),
            'world_size': sync.num_processes(net),
            'save_on_each_node': self._save_on_each_node(net),
            'models': model_layout(net),
            'optimizers': len(net.accelerator._optimizers),
            'versions': _package_versions(),
        }

    def _pointer(self, which):
        return os.path.join(self.dirname, f'{which}.json')

    def _pointed(self, which):
        try:
            name = storage.read_json(self._pointer(which)).get('name')
        except (OSError, ValueError, AttributeError):
            return None
        return name if isinstance(name, str) and _FOLDER_RE.match(name) else None

    def committed(self):
        """Names of the committed checkpoint folders, oldest commit first."""
        if not os.path.isdir(self.dirname):
            return []
        found = []
        for name in os.listdir(self.dirname):
            path = os.path.join(self.dirname, name)
            if _FOLDER_RE.match(name) and os.path.isdir(path):
                manifest = os.path.join(path, storage.MANIFEST_NAME)
                stamp = os.path.getmtime(manifest) if os.path.exists(manifest) else 0.0
                found.append((stamp, name))
        return [name for _, name in sorted(found)]

    def _retire_old(self, newest):
        names = self.committed()
        keep = set(names[-self.keep_last:]) | {newest, self.resumed_from_}
        keep.add(self._pointed('best'))
        for name in names:
            if name in keep:
                continue
            # training need not wait for the files to be deleted
            try:
                thread = storage.discard_in_background(os.path.join(self.dirname, name))
            except OSError as exc:
                warnings.warn(f"could not remove old checkpoint "
                              f"{os.path.join(self.dirname, name)}: {exc}", UserWarning)
            else:
                if thread is not None:
                    self._removals.append(thread)

    # ------------------------------------------------------------ finding

    def find(self, which='latest'):
        """Path of the checkpoint to resume from, or None if there is none.

        ``which`` is ``'latest'``, ``'best'`` or the path of a checkpoint
        folder. For ``'latest'``, a folder that is not a complete checkpoint
        (a missing or damaged file) is skipped with a warning naming it, and
        the newest complete one is used. A checkpoint of a newer format
        raises :class:`CheckpointError`.
        """
        if which not in _POINTERS:
            storage.read_manifest(which)  # raises naming the file at fault
            return os.fspath(which)
        names = self.committed()
        if which == 'best':
            best = self._pointed('best')
            if best is None:
                if names:
                    raise CheckpointError(
                        f"no best checkpoint in {self.dirname}: only checkpoints saved "
                        "because of `monitor` are best ones")
                return None
            path = os.path.join(self.dirname, best)
            storage.read_manifest(path)
            return path
        latest = self._pointed('latest')
        candidates = ([latest] if latest else []) + [
            name for name in reversed(names) if name != latest]
        problems = []
        for name in candidates:
            path = os.path.join(self.dirname, name)
            try:
                manifest = storage.read_manifest(path)
            except storage.CorruptCheckpointError as exc:
                warnings.warn(f"skipping checkpoint {path}: {exc}", UserWarning)
                problems.append(str(exc))
                continue
            if manifest.get('format_version', 0) > FORMAT_VERSION:
                raise CheckpointError(
                    f"{path} has checkpoint format {manifest.get('format_version')}; "
                    f"this version reads format {FORMAT_VERSION} and older: upgrade "
                    "skorch-accel-callbacks")
            return path
        if problems:
            raise CheckpointError(
                f"{self.dirname} holds checkpoints but none is complete: "
                + '; '.join(problems))
        return None

    def _sink(self, text, net):
        if sync.is_main_process(net) and (self.sink is not print or net.verbose):
            self.sink(text)
