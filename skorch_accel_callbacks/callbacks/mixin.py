"""Fixes for skorch's ``AccelerateMixin`` (measured on skorch 1.4.0 + accelerate 1.15).

How such a net pickles is :mod:`~skorch_accel_callbacks.callbacks._pickling`'s."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any, Self

import torch
from skorch.callbacks import Callback, EpochScoring, LRScheduler
from skorch.hf import AccelerateMixin

from skorch_accel_callbacks._core import accelerate_io, skorch_io, sync
from skorch_accel_callbacks._core.wrapping import bare_modules, check_plain, gathered, unwrapped
from skorch_accel_callbacks.callbacks import _preemption as preemption
from skorch_accel_callbacks.callbacks._pickling import (
    MainProcessPrint as _MainProcessPrint,  # noqa: F401  pickles of 0.2.0 name it here
    bare_optimizers,
    picklable_state,
)
from skorch_accel_callbacks.errors import DivergedDecisionError, RankError

if TYPE_CHECKING:
    from skorch import NeuralNet
    from torch.utils.data import DataLoader

__all__ = ['AccelerateFixesMixin']

# what the mixins keep of a training, not arguments of the net: sklearn's
# clone passed them to a new net's __init__ as parameters (and refused a net
# left wrapped by an exception in fit: __init__ sets the first one to False)
_TRAINING_ATTRIBUTES = frozenset(
    {skorch_io.WRAPPED, '_accelerator_loaders', '_accelerator_registered',
     '_sigint_watch'})

# the hooks after which, with several processes, every rank says whether a
# callback stopped training: each runs once an epoch (a batch's hooks would
# cost a collective at every batch)
_AGREED_HOOKS = ('on_epoch_begin', 'on_epoch_end')

# what a process reports of a callback's hook
_WENT_ON, _STOPPED, _CTRL_C, _FAILED = 0, 1, 2, 3


def _verdict(outcomes: list[int]) -> str:
    """What every rank does after a hook whose outcome on each rank is in
    ``outcomes`` (by rank): ``'go'`` on, ``'stop'`` training (a
    KeyboardInterrupt on every rank: the callback stopped it on all, or a
    Ctrl-C reached one, which is meant for the whole job), ``'failed'`` or
    ``'diverged'`` (raise on every rank)."""
    if _FAILED in outcomes:
        return 'failed'
    if all(outcome == _WENT_ON for outcome in outcomes):
        return 'go'
    if _CTRL_C in outcomes or _WENT_ON not in outcomes:
        return 'stop'
    return 'diverged'


def _overrides(callback: Any, hook: str) -> bool:
    """Whether ``callback``'s ``hook`` is more than skorch's no-op."""
    return getattr(type(callback), hook, None) is not getattr(Callback, hook)


def _has_trainable_parameters(module: torch.nn.Module) -> bool:
    return any(param.requires_grad for param in module.parameters())


class AccelerateFixesMixin:
    """Put this mixin before skorch's ``AccelerateMixin`` to fix its
    multi-process pitfalls.

    - ``save_params``/``load_params`` unwrap with
      :func:`~skorch_accel_callbacks.unwrapped` and keep the same wrappers,
      instead of calling ``accelerator.prepare`` again (a collective that
      rebuilds DDP and registers the module once more, so that every later
      ``accelerator.save_state`` writes one more model file). A failure on
      one rank raises on every rank.
    - A second ``initialize()`` (or ``initialize()`` followed by ``fit()``)
      prepares the new module and optimizer. skorch never resets
      ``_wrapped_with_accelerator``, so the new objects stayed unprepared and
      the ranks trained without DDP, their weights silently diverging.
      Objects of the earlier initialization are removed from the
      accelerator's registries.
    - A warm-start ``partial_fit`` after ``unwrap_after_train=True`` wraps the
      module again before training instead of training the bare module.
    - Criteria without trainable parameters (``NLLLoss``, ``CrossEntropyLoss``)
      are moved to the device but not prepared: DDP refuses modules without
      trainable parameters ("DistributedDataParallel is not needed when a
      module doesn't have any parameter that requires a gradient").
    - Under FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``) the
      module and its optimizer are prepared in one call, as
      ``fully_shard`` needs (skorch prepared them one at a time, which
      accelerate refuses); a criterion without trainable parameters is
      placed, not prepared. The net must have one module and one optimizer
      (anything else is refused at ``initialize``). Unwrapping after
      training leaves the module sharded (``fully_shard`` changed the
      module itself), so ``partial_fit`` goes on training it. ``predict``
      must run on every process: the forward gathers the parameters.
    - ``accelerator._dataloaders`` keeps at most the latest training and the
      latest evaluation loader of the net, instead of growing by two per fit
      and one per predict and holding every data set alive.
    - The net pickles (and deep-copies) without its accelerator's process
      state: modules and optimizers unwrapped, the accelerator as its
      settings. Unpickled, it gets an accelerator of the process that
      unpickles it (see ``dump_net``): a net pickled in a job of several
      processes predicts and trains in one process on its own, and one
      pickled while wrapped in DDP loads where no process group exists. The
      modules are prepared again when training begins. Its ``device``
      stays None (skorch set it to the CPU, which ``AccelerateMixin``
      refuses in ``fit``), and its tensors are loaded onto the accelerator's
      device.
    - ``sklearn.base.clone`` works after any ``fit``, also one that raised
      (:class:`~skorch_accel_callbacks.TrainingPreempted`, another
      exception) and left the modules wrapped: the mixins' training state
      is not among the net's parameters. A ``fit`` that raised leaves the
      pass over its loaders, which accelerate's gradient state otherwise
      keeps as a weak reference that no pickle can hold.
    - The outputs of ``predict``, ``predict_proba`` and ``forward`` are
      gathered by this package's ``gather_for_metrics``,
      as by ``accelerator.gather_for_metrics``, holding the tensors on gloo
      until gloo let go of them: a script whose last collective is a
      prediction exits cleanly, instead of aborting now and then at exit
      (pytorch/pytorch#190489).

    - With several processes, the epoch's metrics are those of every rank
      (``reduce_metrics``), and a callback that stops training on some
      ranks only raises :class:`~skorch_accel_callbacks.DivergedDecisionError`
      on every rank instead of leaving the others waiting in a collective
      until the process group's timeout (see below).

    Parameters
    ----------
    reduce_metrics : bool (default=True)
      With several processes, at the end of each epoch (before any
      callback's ``on_epoch_end``), make the epoch's batch rows of the
      history every rank's, rank 0's first, on every rank, as Lightning's
      ``sync_dist=True`` does for its logged values: ``train_loss`` and
      ``valid_loss`` (skorch's ``PassthroughScoring``: the mean of the
      batch losses weighted by the batch sizes) and every ``BatchScoring``
      are then over all ranks' batches, bit for bit the same on every
      rank, and ``EarlyStopping``, ``LRScheduler(ReduceLROnPlateau)`` and
      a checkpoint's ``monitor`` decide the same everywhere. Each caching
      ``EpochScoring`` (``valid_acc``) gets every rank's predictions and
      targets, in the order of the data and without the rows that
      accelerate repeats to fill up the last batches: it scores the whole
      validation data (or training data, ``on_train=True``), as it does
      without caching (``predict`` gathers). One exchange of the batch
      rows (and one of each pass's cached predictions) at the end of the
      epoch, none at a batch, so that ranks with different numbers of
      batches (accelerate's ``even_batches=False``) exchange the same
      way. What is not reduced:
      ``train_batch_count``/``valid_batch_count`` stay this rank's counts
      (the optimizer steps are counted from them); a loss of a batch that
      accelerate filled up with repeated rows counts them, as the rank's
      own loss did; an epoch-level value that a callback computes from
      its own state (a user's callback, a clock) is its own. With
      ``False``, every rank records its own losses, as skorch does. In one
      process nothing changes and nothing is exchanged. A change between
      the launches of a resumed training is refused by
      :class:`~skorch_accel_callbacks.AccelerateLoadInitState` (it changes
      what the callbacks decide).

    Notes
    -----
    With several processes, after each callback's ``on_epoch_begin`` and
    ``on_epoch_end`` (those that a callback overrides), every rank says in
    one small collective whether the callback stopped training (skorch's
    ``KeyboardInterrupt``), failed or went on. All went on: training goes
    on. All stopped: they stop, as in skorch. Some stopped and some not:
    :class:`~skorch_accel_callbacks.DivergedDecisionError` on every rank,
    naming the callback, the epoch and the ranks. One failed: it raises
    its error, the others :class:`~skorch_accel_callbacks.RankError`. A
    Ctrl-C that reached a rank in such a hook (noted by a signal handler
    that still raises ``KeyboardInterrupt``) stops every rank, as a
    Ctrl-C of the job is meant to; an ``AccelerateCheckpoint`` turns a
    Ctrl-C into a save and a stop on every rank anyway. Decisions in a
    batch's hooks are not compared (that would be a collective at every
    batch): such a callback must decide the same on every rank.

    Examples
    --------
    >>> from skorch import NeuralNetClassifier
    >>> from skorch.hf import AccelerateMixin
    >>> from skorch_accel_callbacks import AccelerateFixesMixin
    >>> class AcceleratedNet(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    ...     pass

    Every rank then records the losses of all ranks and EarlyStopping
    stops them at the same epoch; ``reduce_metrics=False`` records each
    rank's own, as skorch does:

    >>> import torch
    >>> from accelerate import Accelerator, PartialState
    >>> from skorch.callbacks import EarlyStopping
    >>> net = AcceleratedNet(torch.nn.Linear, module__in_features=4,
    ...                      module__out_features=2, criterion=torch.nn.CrossEntropyLoss,
    ...                      accelerator=Accelerator(cpu=True), max_epochs=20,
    ...                      callbacks=[EarlyStopping(patience=3)])
    >>> net.reduce_metrics
    True
    >>> net.set_params(reduce_metrics=False).get_params()['reduce_metrics']
    False

    """

    def __init__(self, *args: Any, reduce_metrics: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reduce_metrics = reduce_metrics

    def initialize(self) -> Self:
        skorch_io.check_internals(type(self).__name__)
        accelerate_io.check_internals(self.accelerator, type(self).__name__)
        skorch_io.set_wrapped(self, False)
        return super().initialize()

    def _validate_params(self) -> None:
        super()._validate_params()
        if not isinstance(self.reduce_metrics, bool):
            raise ValueError(f"reduce_metrics must be True or False, got {self.reduce_metrics!r}")

    def __getstate__(self) -> dict[str, Any]:
        with unwrapped(self), bare_optimizers(self):
            state = super().__getstate__()
        # the loaders hold the data sets; the registry the accelerator's objects
        state.pop('_accelerator_loaders', None)
        state.pop('_accelerator_registered', None)
        state.pop('_sigint_watch', None)
        return picklable_state(state)

    def __setstate__(self, state: dict[str, Any]) -> None:
        device = state['device']
        accelerator = state.get('accelerator')
        if device is None and getattr(accelerator, 'device_placement', False):
            # skorch loads the tensors onto state['device'] and makes a None
            # the CPU, which AccelerateMixin then refuses in fit; torch maps
            # no storage to an indexed CPU such as accelerate's 'cpu:0'
            placed = accelerator.device
            state['device'] = 'cpu' if placed.type == 'cpu' else placed
        # a net pickled before the parameter existed
        state.setdefault('reduce_metrics', True)
        super().__setstate__(state)
        self.device = device

    def _get_param_names(self) -> list[str]:
        return [name for name in super()._get_param_names()
                if name not in _TRAINING_ATTRIBUTES]

    def evaluation_step(self, batch: Any, training: bool = False) -> Any:
        # AccelerateMixin's, with the gather of sync
        output = super(AccelerateMixin, self).evaluation_step(batch, training=training)
        return sync.gather_for_metrics(self, output)

    def _initialize_accelerator(self) -> Self:
        if skorch_io.is_wrapped(self):
            return self
        if accelerate_io.is_fsdp2(self.accelerator):
            self._prepare_for_fsdp2()
        else:
            trained = [name for name in skorch_io.criterion_names(self)
                       if self._place_or_keep_criterion(getattr(self, name + '_'))]
            with skorch_io.criteria_limited_to(self, trained):
                super()._initialize_accelerator()
        self._prune_accelerator_registries()
        return self

    def _prepare_for_fsdp2(self) -> None:
        """Prepare the one module and its optimizer in one call, as FSDP2
        needs (``fully_shard`` replaces the parameters the optimizer holds);
        skorch prepares them one at a time, which accelerate refuses."""
        modules = [name for name in skorch_io.module_names(self)
                   if isinstance(getattr(self, name + '_'), torch.nn.Module)]
        optimizers = [name for name in skorch_io.optimizer_names(self)
                      if isinstance(getattr(self, name + '_'), torch.optim.Optimizer)]
        trained_criteria = [name for name in skorch_io.criterion_names(self)
                            if self._place_or_keep_criterion(getattr(self, name + '_'))]
        if len(modules) != 1 or len(optimizers) != 1 or trained_criteria:
            raise ValueError(
                "under FSDP2 the net must have exactly one module with trainable "
                "parameters and one optimizer (accelerate shards one model per "
                f"Accelerator.prepare); this net has the modules {modules}, the "
                f"optimizers {optimizers} and the criteria with trainable parameters "
                f"{trained_criteria}")
        [module], [optimizer] = modules, optimizers
        prepared = self.accelerator.prepare(
            getattr(self, module + '_'), getattr(self, optimizer + '_'))
        setattr(self, module + '_', prepared[0])
        setattr(self, optimizer + '_', prepared[1])
        for _, callback in self.callbacks_:
            if isinstance(callback, LRScheduler):
                callback.policy_ = self.accelerator.prepare(callback.policy_)
        skorch_io.set_wrapped(self, True)

    def _unwrap_accelerator(self) -> None:
        # fully_shard turns the module itself into the sharded one: nothing
        # wraps it, and preparing it again would shard it once more
        if not accelerate_io.is_fsdp2(self.accelerator):
            super()._unwrap_accelerator()

    def _place_or_keep_criterion(self, criterion: Any) -> bool:
        """Return whether ``criterion`` is to be prepared; if not, place it."""
        if not isinstance(criterion, torch.nn.Module):
            return False
        if _has_trainable_parameters(criterion):
            return True
        # buffers such as a class weight still have to be on the device
        if self.accelerator.device_placement:
            criterion.to(self.accelerator.device)
        return False

    def _prepared_objects(self) -> list[Any]:
        objects = list(bare_modules(self).values())
        for name in skorch_io.optimizer_names(self):
            objects.append(getattr(self, name + '_', None))
        return objects

    def _prune_accelerator_registries(self) -> None:
        """Drop this net's stale and duplicate entries from the registries."""
        current = {id(obj) for obj in self._prepared_objects()}
        previous = getattr(self, '_accelerator_registered', [])
        stale = {id(obj) for obj in previous} - current
        registered = []

        def keep(obj: Any, seen: set[int]) -> bool:
            if id(obj) in stale or id(obj) in seen:
                return False
            if id(obj) in current:
                registered.append(obj)
            return True

        accelerate_io.prune_registries(self.accelerator, keep)
        self._accelerator_registered = registered

    def get_iterator(self, dataset: Any, training: bool = False) -> DataLoader:
        iterator = super().get_iterator(dataset, training=training)
        loaders = self.__dict__.setdefault('_accelerator_loaders', {})
        previous = loaders.get(training)
        if previous is not None and previous is not iterator:
            loaders_of_accelerator = accelerate_io.dataloaders(self.accelerator)
            loaders_of_accelerator[:] = [
                loader for loader in loaders_of_accelerator if loader is not previous]
        loaders[training] = iterator
        return iterator

    def fit_loop(self, *args: Any, **kwargs: Any) -> Self:
        try:
            return super().fit_loop(*args, **kwargs)
        except BaseException:
            # accelerate's gradient state keeps a loader left inside its pass
            # as a weak reference, which no pickle of the net can hold
            for loader in self.__dict__.get('_accelerator_loaders', {}).values():
                accelerate_io.leave_loader(loader)
            raise

    def partial_fit(self, X: Any, y: Any = None, classes: Any = None, **fit_params: Any) -> Self:
        # with several processes a KeyboardInterrupt of a Ctrl-C is noted
        # (and still raised), so that it is not taken for a callback's
        # decision (see notify); an AccelerateCheckpoint's own watch, once
        # installed, replaces this one and turns a Ctrl-C into a stop on
        # every rank
        watch = preemption.SignalWatch()
        if sync.is_distributed(self):
            watch.install(type(self).__name__, (), (signal.SIGINT,))
        self._sigint_watch = watch
        try:
            return super().partial_fit(X, y, classes, **fit_params)
        finally:
            watch.uninstall()

    def notify(self, method_name: str, **cb_kwargs: Any) -> None:
        if method_name not in _AGREED_HOOKS or not sync.is_distributed(self):
            super().notify(method_name, **cb_kwargs)
            return
        getattr(self, method_name)(self, **cb_kwargs)
        for name, callback in self.callbacks_:
            if _overrides(callback, method_name):
                self._agreed_hook(name, callback, method_name, cb_kwargs)

    def _agreed_hook(self, name: str, callback: Any, hook: str, kwargs: dict[str, Any]) -> None:
        """Run ``callback``'s ``hook`` on this rank, then find out in one
        collective what it did on every rank: where it stopped training on
        some ranks only, or failed on some, every rank raises, instead of
        the ranks that went on waiting in their next collective."""
        outcome, error = _WENT_ON, None
        try:
            getattr(callback, hook)(self, **kwargs)
        except KeyboardInterrupt as exc:
            watch = self.__dict__.get('_sigint_watch')
            ctrl_c = watch is not None and watch.interrupted is not None
            outcome, error = (_CTRL_C if ctrl_c else _STOPPED), exc
        except Exception as exc:  # pylint: disable=broad-except
            outcome, error = _FAILED, exc
        outcomes = [flags[0] for flags in sync.exchange_flags(self, [outcome])]
        verdict = _verdict(outcomes)
        if verdict == 'go':
            return
        if verdict == 'stop':
            raise error if error is not None else KeyboardInterrupt
        if verdict == 'failed' and outcome == _FAILED:
            raise error
        described = f"{name!r} ({type(callback).__name__})"
        ranks = {kind: tuple(rank for rank, got in enumerate(outcomes) if got == kind)
                 for kind in (_WENT_ON, _STOPPED, _FAILED)}
        if verdict == 'failed':
            raise RankError(f"callback {described} failed in {hook} on rank(s) "
                                 f"{list(ranks[_FAILED])} (see their output)") from error
        raise DivergedDecisionError(described, hook, len(self.history), ranks[_STOPPED],
                                    ranks[_WENT_ON], self._advice_on_decisions()) from error

    def _advice_on_decisions(self) -> str:
        if not self.reduce_metrics:
            return ("Set reduce_metrics=True on the net (the default), so that every rank "
                    "records the epoch's train_loss and valid_loss over all ranks and "
                    "decides on them, or decide on the main process and send the decision "
                    "to every rank.")
        return ("The epoch's losses are already the same on every rank (reduce_metrics=True): "
                "the callback decides on something each rank computes on its own (a "
                "score of its own, a clock); decide on the main process and send the "
                "decision to every rank.")

    def on_epoch_end(self, net: NeuralNet, dataset_train: Any = None, dataset_valid: Any = None,
                     **kwargs: Any) -> None:
        # before any callback's end of the epoch (skorch's notify runs the
        # net's own hook first): the scores, and what decides on them, see
        # every rank's batches
        if self.reduce_metrics and sync.is_distributed(self):
            self._reduce_batch_rows()
            self._reduce_scoring_caches(dataset_train, dataset_valid)
        super().on_epoch_end(net, dataset_train=dataset_train, dataset_valid=dataset_valid,
                             **kwargs)

    def _reduce_batch_rows(self) -> None:
        """Make the epoch's batch rows every rank's, rank 0's first, on
        every rank: the averages over them (weighted by the batch sizes) of
        PassthroughScoring (train_loss, valid_loss) and BatchScoring are
        then the epoch's over all ranks, bit for bit the same on each."""
        row = self.history[-1]
        parts = sync.gather(self, row['batches'])
        row['batches'] = [batch for part in parts for batch in part]

    def _reduce_scoring_caches(self, dataset_train: Any, dataset_valid: Any) -> None:
        """Give each caching ``EpochScoring`` the predictions and targets of
        every rank's batches, in the order of the data and without the rows
        that accelerate repeated to fill up the last batches: it scores the
        whole pass, as it does without caching (``predict`` gathers)."""
        passes = {}
        for _, callback in self.callbacks_:
            if not (isinstance(callback, EpochScoring) and self._caches(callback)):
                continue
            # every caching EpochScoring of a pass holds the same batches
            if callback.on_train not in passes:
                dataset = dataset_train if callback.on_train else dataset_valid
                rows = len(dataset) if hasattr(dataset, '__len__') else None
                passes[callback.on_train] = (
                    sync.gather_pass(self, callback.y_preds_, rows),
                    sync.gather_pass(self, callback.y_trues_, rows))
            callback.y_preds_, callback.y_trues_ = map(list, passes[callback.on_train])

    def _caches(self, scoring: EpochScoring) -> bool:
        # skorch's rule: the net's use_caching overrides the callback's
        return scoring.use_caching if self.use_caching == 'auto' else self.use_caching

    def on_train_begin(self, net: NeuralNet, X: Any = None, y: Any = None, **kwargs: Any) -> None:
        if self.initialized_ and not skorch_io.is_wrapped(self):
            self._initialize_accelerator()
        return super().on_train_begin(net, X=X, y=y, **kwargs)

    def save_params(self, *args: Any, **kwargs: Any) -> None:
        with sync.agree(self, 'save_params'):
            # under FSDP2 the main process writes the full parameters,
            # which every rank gathers for it
            with unwrapped(self), gathered(self):
                super().save_params(*args, **kwargs)

    def load_params(self, *args: Any, **kwargs: Any) -> None:
        with sync.agree(self, 'load_params'):
            if not self.initialized_:
                self.initialize()
            check_plain(self, "load_params needs a plain module to load into",
                        "load the parameters into a net without FSDP2, or resume the "
                        "sharded training with AccelerateLoadInitState")
            with unwrapped(self):
                super().load_params(*args, **kwargs)
