"""What a resume needs beside ``accelerator.save_state``, one function per artefact.

- the skorch history (JSON);
- the state of the net's callbacks by name (JSON, tensors in safetensors,
  :mod:`~skorch_accel_callbacks.state._callback_states`);
- under FSDP2, the models' buffers (safetensors), which FSDP2 does not
  synchronise across ranks and its sharded checkpoint holds once;
- per rank: the training loader's shuffling generator and epoch counter
  (:func:`~skorch_accel_callbacks.state._rng_state.loader_state`), which
  accelerate creates when the loader is prepared and does not save, and the
  callbacks' scratch space of the epoch under way.

Under skorch's
``AccelerateMixin`` every rank logs its own losses, so the history, the
callbacks' states and the buffers exist per rank: :func:`encode_rank_states`
gives this rank's as bytes, the ranks compare their digests
(:func:`per_rank_items`), and :func:`write_rank_states` writes one copy of
what every rank holds alike (the files of before; the buffers then stay in
accelerate's checkpoint) and every rank's own of the rest. Nothing here is pickled, so
loading executes no code. The files are written into a checkpoint's partial
folder, which nobody reads before it is committed, and the commit flushes
every file of the folder to disk: so they are written plainly, without a
temporary name and a flush of their own each.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file
from skorch.history import History

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.format import (
    PER_RANK_ITEMS,
    buffers_name,
    callbacks_names,
    history_name,
    per_rank_files,
    rank_state_name,
)
from skorch_accel_callbacks.state._callback_states import encode_callback_states
from skorch_accel_callbacks.state._json_tensors import write_bytes
from skorch_accel_callbacks.state._rng_state import loader_state

if TYPE_CHECKING:
    from skorch import NeuralNet
    from torch.utils.data import DataLoader

__all__ = [
    'epoch_completed',
    'optimizer_steps',
    'find_train_loader',
    'RankStates',
    'encode_rank_states',
    'per_rank_items',
    'write_rank_states',
    'load_history',
    'load_buffers',
    'save_rank_state',
    'load_rank_state',
]


# ---------------------------------------------------------------- history

def epoch_completed(net: NeuralNet) -> bool:
    """Whether the last epoch of the history ran to its end (skorch records
    ``train_loss`` when an epoch's training batches are all done)."""
    return bool(net.history) and 'train_loss' in net.history[-1]


def optimizer_steps(history: Iterable[Mapping[str, Any]], accumulation_steps: int) -> int:
    """The optimizer steps of the complete epochs of ``history``, with a
    step every ``accumulation_steps`` batches and at each epoch's last."""
    return sum(math.ceil(row['train_batch_count'] / accumulation_steps)
               for row in history if 'train_batch_count' in row)


def _encode_history(net: NeuralNet) -> bytes:
    # as History.to_file writes it
    return json.dumps(net.history.to_list()).encode('utf-8')


def load_history(folder: str | os.PathLike, rank: int | None = None) -> History:
    """The history of ``folder``: the one that every rank shares (``rank``
    None), or rank ``rank``'s own."""
    return History.from_file(f"{folder}/{history_name(rank)}")


# ---------------------------------------------------------------- loader

def find_train_loader(net: NeuralNet, dataset_train: Any) -> DataLoader | None:
    """The loader that accelerate prepared for ``dataset_train``, if any."""
    accelerator = getattr(net, 'accelerator', None)
    if accelerator is None or dataset_train is None:
        return None
    for loader in reversed(accelerate_io.dataloaders(accelerator)):
        if getattr(loader, 'dataset', None) is dataset_train:
            return loader
    return None


def save_rank_state(folder: str | os.PathLike, rank: int, loader: DataLoader | None,
                    workers_drew: bool = False) -> None:
    """Save the shuffling state of this rank's training loader, and whether
    its worker processes drew random numbers in this fit.

    With more than one process accelerate gives the sampler a generator of
    its own, seeded when the loader is prepared; ``save_state`` writes no
    file for it with map-style data sets, nor for the generators of the
    loader and of a user's sampler.
    """
    state = loader_state(loader)
    tensors = {'generator': state['generator']} if 'generator' in state else {}
    tensors.update({f'generators.{path}': generator
                    for path, generator in state['generators'].items()})
    metadata = {'loader_iteration': str(state['loader_iteration']),
                'workers_drew': str(int(workers_drew))}
    # safetensors refuses an empty file
    tensors.setdefault('_', torch.zeros(0))
    save_file(tensors, f"{folder}/{rank_state_name(rank)}", metadata=metadata)


def load_rank_state(folder: str | os.PathLike, rank: int) -> dict[str, Any]:
    """What :func:`save_rank_state` saved: the loader state
    (:func:`~skorch_accel_callbacks.state._rng_state.loader_state`'s form)
    and ``'workers_drew'``."""
    path = f"{folder}/{rank_state_name(rank)}"
    with safe_open(path, framework='pt') as f:
        metadata = f.metadata() or {}
        state = {'loader_iteration': int(metadata.get('loader_iteration', 0)),
                 'workers_drew': bool(int(metadata.get('workers_drew', 0))),
                 'generators': {key.removeprefix('generators.'): f.get_tensor(key)
                                for key in f.keys() if key.startswith('generators.')}}
        if 'generator' in f.keys():
            state['generator'] = f.get_tensor('generator')
    return state


# ---------------------------------------------------------------- per rank

@dataclass(frozen=True)
class RankStates:
    """This rank's states that may differ between ranks, encoded."""

    #: item of :data:`~skorch_accel_callbacks.format._manifest.PER_RANK_ITEMS` -> the
    #: bytes of its files, in the order of their names
    #: (:func:`~skorch_accel_callbacks.format._manifest.per_rank_files`)
    files: dict[str, tuple[bytes, ...]]

    def digests(self) -> dict[str, str]:
        """Item -> a digest of its files' bytes, which the ranks compare."""
        digests = {}
        for item, parts in self.files.items():
            hasher = xxhash.xxh3_128()
            for part in parts:
                # the parts' lengths too: the same bytes split otherwise differ
                hasher.update(len(part).to_bytes(8, 'little'))
                hasher.update(part)
            digests[item] = hasher.hexdigest()
        return digests


def encode_rank_states(net: NeuralNet, warn: bool) -> RankStates:
    """This rank's history, callbacks' states and (under FSDP2) buffers,
    as the bytes that a checkpoint stores of them; ``warn`` of a
    callback's attribute that cannot be saved (on one rank: every rank
    leaves it out)."""
    files = {'history': (_encode_history(net),),
             'callbacks': encode_callback_states(net, warn=warn)}
    buffers = accelerate_io.fsdp2_buffers(net.accelerator)
    if buffers:
        files['buffers'] = (save(buffers),)
    return RankStates(files)


def per_rank_items(digests: Sequence[Mapping[str, str]]) -> list[str]:
    """The items whose copies differ between the ranks (``digests``: every
    rank's :meth:`RankStates.digests`, by rank), in the order of
    :data:`~skorch_accel_callbacks.format._manifest.PER_RANK_ITEMS`."""
    return [item for item in PER_RANK_ITEMS
            if item in digests[0] and len({each[item] for each in digests}) > 1]


def write_rank_states(folder: str | os.PathLike, states: RankStates, rank: int,
                      per_rank: Collection[str], shared: bool) -> None:
    """Write rank ``rank``'s own copy of the items ``per_rank``, and with
    ``shared`` (on the committing process) the one copy of each other item,
    under the names of before. Buffers that every rank holds alike are not
    written: accelerate's checkpoint holds them."""
    for item, parts in states.files.items():
        if item in per_rank:
            names = per_rank_files(item, rank)
        elif shared and item == 'history':
            names = (history_name(),)
        elif shared and item == 'callbacks':
            names = callbacks_names()
        else:
            continue
        for name, data in zip(names, parts, strict=True):
            write_bytes(f"{folder}/{name}", data)


def load_buffers(folder: str | os.PathLike, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s buffers, as :func:`encode_rank_states` saved them."""
    return load_file(f"{folder}/{buffers_name(rank)}")
