"""Fixes for skorch's ``AccelerateMixin`` (measured on skorch 1.4.0 + accelerate 1.15)."""

import torch

from skorch_accel_callbacks import accelerate_io, sync
from skorch_accel_callbacks.wrapping import bare_modules, unwrapped

__all__ = ['AccelerateFixesMixin']


def _has_trainable_parameters(module):
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
    - ``accelerator._dataloaders`` keeps at most the latest training and the
      latest evaluation loader of the net, instead of growing by two per fit
      and one per predict and holding every data set alive.

    Examples
    --------
    >>> from skorch import NeuralNetClassifier
    >>> from skorch.hf import AccelerateMixin
    >>> from skorch_accel_callbacks import AccelerateFixesMixin
    >>> class AcceleratedNet(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    ...     pass

    """

    def initialize(self):
        self._wrapped_with_accelerator = False
        return super().initialize()

    def _initialize_accelerator(self):
        if self._wrapped_with_accelerator:
            return self
        all_criteria = self._criteria
        self._criteria = [
            name for name in all_criteria
            if self._place_or_keep_criterion(getattr(self, name + '_'))
        ]
        try:
            super()._initialize_accelerator()
        finally:
            self._criteria = all_criteria
        self._prune_accelerator_registries()
        return self

    def _place_or_keep_criterion(self, criterion):
        """Return whether ``criterion`` is to be prepared; if not, place it."""
        if not isinstance(criterion, torch.nn.Module):
            return False
        if _has_trainable_parameters(criterion):
            return True
        # buffers such as a class weight still have to be on the device
        if self.accelerator.device_placement:
            criterion.to(self.accelerator.device)
        return False

    def _prepared_objects(self):
        objects = list(bare_modules(self).values())
        for name in self._optimizers:
            objects.append(getattr(self, name + '_', None))
        return objects

    def _prune_accelerator_registries(self):
        """Drop this net's stale and duplicate entries from the registries."""
        current = {id(obj) for obj in self._prepared_objects()}
        previous = getattr(self, '_accelerator_registered', [])
        stale = {id(obj) for obj in previous} - current
        registered = []

        def keep(obj, seen):
            if id(obj) in stale or id(obj) in seen:
                return False
            if id(obj) in current:
                registered.append(obj)
            return True

        accelerate_io.prune_registries(self.accelerator, keep)
        self._accelerator_registered = registered

    def get_iterator(self, dataset, training=False):
        iterator = super().get_iterator(dataset, training=training)
        loaders = self.__dict__.setdefault('_accelerator_loaders', {})
        previous = loaders.get(training)
        if previous is not None and previous is not iterator:
            loaders_of_accelerator = accelerate_io.dataloaders(self.accelerator)
            loaders_of_accelerator[:] = [
                loader for loader in loaders_of_accelerator if loader is not previous]
        loaders[training] = iterator
        return iterator

    def on_train_begin(self, net, X=None, y=None, **kwargs):
        if self.initialized_ and not self._wrapped_with_accelerator:
            self._initialize_accelerator()
        return super().on_train_begin(net, X=X, y=y, **kwargs)

    def save_params(self, *args, **kwargs):
        with sync.agree(self, 'save_params'):
            with unwrapped(self):
                super().save_params(*args, **kwargs)

    def load_params(self, *args, **kwargs):
        with sync.agree(self, 'load_params'):
            if not self.initialized_:
                self.initialize()
            with unwrapped(self):
                super().load_params(*args, **kwargs)
