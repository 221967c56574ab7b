"""One pass over the training loader: what its fetches drew from, and how a
resume goes on inside it.

A data set may draw random numbers as it reads a row (augmentation:
torchvision's transforms draw from torch's global generator). Where those
draws happen decides what a resume inside an epoch must give back:

- **in this process** (``num_workers=0``) the fetches draw from the global
  generators, interleaved with the model's own draws (dropout), and
  accelerate's loader reads one batch ahead of the one it hands out: when
  batch ``b`` is trained, batch ``b + 1`` is already read. :class:`PassControl`
  records the random states right before each fetch, a checkpoint keeps
  those of the batches read ahead of training (:meth:`PassControl.read_ahead`),
  and a resume gives them back right before the same fetches
  (:meth:`PassControl.plan_resume`), then the states of the saved batch
  before the fetch that followed it;
- **in worker processes** (``num_workers > 0``) each worker draws from its own
  generators, seeded from the loader's base seed when the pass began (or,
  with ``persistent_workers``, when the fit's first pass began). Skipping the
  trained batches by index would hand the rest to other workers, whose
  generators had not made the skipped batches' draws: so when the workers
  were seen to draw (:class:`WorkerDraws`), a resume reads the trained
  batches again through the workers and drops them (the cost of a pass over
  the data up to the checkpoint, without training); else it skips them by
  index. Persistent workers keep their generators from one epoch to the
  next, in processes a checkpoint cannot reach: a run whose persistent
  workers draw is refused at its first batch.

Both are installed on the loader that skorch builds for one ``fit``
(:func:`install`), and taken off when the fit ends (:func:`uninstall`).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.state import _rng_state as rng_state

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = [
    'PassControl',
    'ResumePlan',
    'WorkerDraws',
    'fetches_in_process',
    'install',
    'seed_draw_undone',
    'persistent_workers',
    'uninstall',
    'worker_draws',
]

# accelerate reads one batch ahead; a few more cover a loader of a user's
# that reads further ahead in this process
_RECORDED_AHEAD = 4


def fetches_in_process(loader: DataLoader) -> bool:
    """Whether ``loader`` reads its rows in this process (no workers)."""
    return accelerate_io.base_loader(loader).num_workers == 0


def persistent_workers(loader: DataLoader) -> bool:
    """Whether ``loader`` keeps its worker processes from one pass to the next."""
    base = accelerate_io.base_loader(loader)
    return base.num_workers > 0 and bool(base.persistent_workers)


@dataclass(frozen=True)
class ResumePlan:
    """How the next pass goes on from a checkpoint taken inside it."""

    #: batches of the pass that are left out, by index
    skip: int
    #: the random states to give this process before the fetches that
    #: follow, one each: the states recorded before the fetches the
    #: checkpoint's run had made ahead of training, then those it saved
    states: tuple[dict[str, Any], ...] = ()
    #: a generator and the state to give it back as the pass begins: the
    #: one that a new iterator drew the workers' base seed from, where the
    #: checkpoint's run went on with an iterator of persistent workers that
    #: drew none (see :func:`seed_draw_undone`)
    undo_seed_draw: tuple[torch.Generator, torch.Tensor] | None = None


class PassControl:
    """The batch sampler of a training loader, wrapped for one fit.

    It yields the batches of index lists of the sampler it wraps (``inner``)
    and, for each, first records the random states of this process when the
    loader reads in this process (the fetch that follows draws from them).
    A pass planned by :meth:`plan_resume` leaves out the trained batches and
    gives the planned states back; every later pass is the inner sampler's
    own, also in a persistent workers' iterator, which keeps the batch
    sampler it was created with.
    """

    def __init__(self, inner: Any, record: bool) -> None:
        self.inner = inner
        self.record = record
        self._plan: ResumePlan | None = None
        self._skipping = 0
        # (index in the pass, the random states before its fetch)
        self._recorded: deque[tuple[int, dict[str, Any]]] = deque(maxlen=_RECORDED_AHEAD)

    def __getattr__(self, name: str) -> Any:
        # batch_size, drop_last, sampler: what accelerate and torch ask of it
        if name == 'inner':
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner) - (self._plan.skip if self._plan else self._skipping)

    def plan_resume(self, plan: ResumePlan) -> None:
        """Make the next pass go on as ``plan`` says."""
        self._plan = plan

    def read_ahead(self, trained: int) -> list[dict[str, Any]]:
        """The random states recorded before the fetches of the batches after
        the first ``trained`` of this pass, which were read ahead of training."""
        return [state for index, state in self._recorded if index >= trained]

    def __iter__(self) -> Iterator[Any]:
        plan, self._plan = self._plan, None
        skip = plan.skip if plan else 0
        states = list(plan.states) if plan else []
        self._recorded.clear()
        self._skipping = skip
        if plan is not None and plan.undo_seed_draw is not None:
            # the iterator has drawn its base seed by now, the sampler not yet
            generator, state = plan.undo_seed_draw
            generator.set_state(state)
        try:
            for index, batch in enumerate(self.inner):
                if index < skip:
                    continue
                if states:
                    rng_state.restore_rng(states.pop(0))
                if self.record:
                    self._recorded.append((index, rng_state.capture_rng()))
                yield batch
            if states:
                # the pass ended before the fetch that the saved states
                # preceded: training goes on from them
                rng_state.restore_rng(states[-1])
        finally:
            self._skipping = 0


def seed_draw_undone(loader: DataLoader) -> tuple[torch.Generator, torch.Tensor]:
    """The generator that the next iterator of ``loader`` draws its workers'
    base seed from (the loader's ``generator``, else torch's global one),
    with its state now, for :attr:`ResumePlan.undo_seed_draw`.

    With ``persistent_workers`` a fit creates the loader's iterator, and
    draws that seed, at its first epoch only; a run resumed at a later epoch
    creates it then, and that draw would shift the sampler's order and the
    model's own draws (dropout) from there on.
    """
    generator = accelerate_io.base_loader(loader).generator or torch.default_generator
    return generator, generator.get_state()


def install(loader: DataLoader) -> PassControl:
    """The :class:`PassControl` of ``loader``, wrapped around its batch
    sampler the first time."""
    current = accelerate_io.batch_sampler(loader)
    if isinstance(current, PassControl):
        return current
    control = PassControl(current, record=fetches_in_process(loader))
    accelerate_io.set_batch_sampler(loader, control)
    return control


def uninstall(loader: DataLoader | None) -> None:
    """Give ``loader`` its own batch sampler and worker functions back."""
    if loader is None:
        return
    current = accelerate_io.batch_sampler(loader)
    if isinstance(current, PassControl):
        accelerate_io.set_batch_sampler(loader, current.inner)
    base = accelerate_io.base_loader(loader)
    if isinstance(base.collate_fn, _CollateAndLook):
        base.collate_fn = base.collate_fn.collate_fn
        base.worker_init_fn = base.worker_init_fn.worker_init_fn


# ---------------------------------------------------------------- workers

def _states() -> tuple[bytes, bytes, int, tuple]:
    """This process's global random states, compared cheaply."""
    _, key, pos, *_ = np.random.get_state()
    return (torch.get_rng_state().numpy().tobytes(), key.tobytes(), int(pos),
            random.getstate())


class _Baseline:
    """The random states a worker process had after its last look."""

    states: tuple | None = None


class _InitAndLook:
    """The loader's ``worker_init_fn``, then a look at the worker's states."""

    def __init__(self, worker_init_fn: Callable[[int], Any] | None) -> None:
        self.worker_init_fn = worker_init_fn

    def __call__(self, worker_id: int) -> None:
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)
        # seeded by torch and by the user's function: what draws from here on
        # is the data's
        _Baseline.states = _states()


class _CollateAndLook:
    """The loader's ``collate_fn``, then a look: whether this worker drew
    random numbers since its last look (reading the batch's rows, or
    collating them), into a flag that every worker shares with the
    training process."""

    def __init__(self, collate_fn: Callable[[Sequence[Any]], Any], flag: torch.Tensor) -> None:
        self.collate_fn = collate_fn
        self.flag = flag

    def __call__(self, rows: Sequence[Any]) -> Any:
        batch = self.collate_fn(rows)
        now = _states()
        if _Baseline.states is not None and now != _Baseline.states:
            self.flag.fill_(1)
        _Baseline.states = now
        return batch


class WorkerDraws:
    """Whether the worker processes of a training loader drew random numbers.

    The loader's ``worker_init_fn`` and ``collate_fn`` are wrapped (before
    its workers start) so that each worker compares its global random states
    (torch, numpy, Python) after every batch with those after the batch
    before, and raises a flag in shared memory when they changed.
    """

    def __init__(self, loader: DataLoader) -> None:
        base = accelerate_io.base_loader(loader)
        if isinstance(base.collate_fn, _CollateAndLook):
            self._flag = base.collate_fn.flag
            return
        self._flag = torch.zeros(1, dtype=torch.uint8).share_memory_()
        base.worker_init_fn = _InitAndLook(base.worker_init_fn)
        base.collate_fn = _CollateAndLook(base.collate_fn, self._flag)

    @property
    def drew(self) -> bool:
        return bool(self._flag.item())


def worker_draws(loader: DataLoader | None) -> WorkerDraws | None:
    """A :class:`WorkerDraws` for ``loader`` if it reads in workers."""
    if loader is None or fetches_in_process(loader):
        return None
    return WorkerDraws(loader)
