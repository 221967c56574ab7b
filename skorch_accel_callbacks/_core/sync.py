"""Process synchronisation: the only module that talks across processes.

Every function takes a skorch net. A net without an ``accelerator`` attribute
(a plain ``NeuralNet``), or with an accelerator that runs a single process, is
single-process: barriers return at once, broadcasts return their input and
nothing is sent anywhere. Built on accelerate's collectives, so the same code
serves gloo on CPU and NCCL on GPUs.

On gloo, the objects travel in tensors that this module holds until gloo is
done with them (see :func:`_released`): a process that exits right after
training then cannot abort at interpreter exit.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from accelerate.utils import broadcast_object_list, gather_object, recursively_apply

from skorch_accel_callbacks._core import accelerate_io
from skorch_accel_callbacks.errors import RankError

if TYPE_CHECKING:
    from accelerate import Accelerator
    from skorch import NeuralNet

__all__ = [
    'NodeGroup',
    'Vote',
    'agree',
    'barrier',
    'broadcast',
    'exchange_flags',
    'gather',
    'gather_for_metrics',
    'gather_pass',
    'is_distributed',
    'is_local_main_process',
    'is_main_process',
    'num_processes',
    'process_index',
    'run_on_main',
]


def _accelerator(net: NeuralNet) -> Accelerator | None:
    return getattr(net, 'accelerator', None)


def num_processes(net: NeuralNet) -> int:
    """Number of processes that train ``net`` (1 without accelerate)."""
    accelerator = _accelerator(net)
    return 1 if accelerator is None else accelerator.num_processes


def process_index(net: NeuralNet) -> int:
    """Global rank of this process (0 without accelerate)."""
    accelerator = _accelerator(net)
    return 0 if accelerator is None else accelerator.process_index


def is_distributed(net: NeuralNet) -> bool:
    return num_processes(net) > 1


def is_main_process(net: NeuralNet) -> bool:
    """Whether this is the global main process (rank 0)."""
    accelerator = _accelerator(net)
    return True if accelerator is None else accelerator.is_main_process


def is_local_main_process(net: NeuralNet) -> bool:
    """Whether this is the main process of its node."""
    accelerator = _accelerator(net)
    return True if accelerator is None else accelerator.is_local_main_process


def barrier(net: NeuralNet) -> None:
    """Wait until every process reaches this point."""
    if is_distributed(net):
        _accelerator(net).wait_for_everyone()


def broadcast(net: NeuralNet, value: Any) -> Any:
    """Return the main process's ``value`` on every process.

    ``value`` must be picklable and should be small: a decision, a path, an
    error message.
    """
    if not is_distributed(net):
        return value
    if _on_gloo():
        return _gloo_broadcast(value)
    return broadcast_object_list([value], from_process=0)[0]


def gather(net: NeuralNet, value: Any) -> list[Any]:
    """Return the list of every process's ``value``, indexed by rank."""
    if not is_distributed(net):
        return [value]
    if _on_gloo():
        return _gloo_gather(value)
    return gather_object([value])


def exchange_flags(net: NeuralNet, flags: Sequence[int]) -> list[list[int]]:
    """Every process's ``flags`` (small ints, as many on every process),
    indexed by rank, in one collective.

    One collective, not the two of :func:`gather`: a ``KeyboardInterrupt``
    that lands on a process right before or after it cannot leave the
    others inside half of an exchange. In one process nothing is sent.
    """
    flags = [int(flag) for flag in flags]
    if not is_distributed(net):
        return [flags]
    mine = torch.tensor(flags, dtype=torch.int64)
    if _on_gloo():
        gathered = _gloo_gather_tensor(mine)
    else:
        accelerator = _accelerator(net)
        gathered = accelerator.gather(mine.to(accelerator.device)).cpu()
    return gathered.view(num_processes(net), len(flags)).tolist()


def gather_for_metrics(net: NeuralNet, data: Any) -> Any:
    """``accelerator.gather_for_metrics(data)``: the outputs of a batch of
    evaluation on every process, concatenated along the first dimension,
    less the rows that accelerate repeated to fill up the last batch.

    ``data`` is a tensor or a nested list, tuple or dict of tensors (any
    other object is gathered as a list, as accelerate does). On gloo the
    gathered tensors are held until gloo let go of them (see
    :func:`_released`); accelerate's own gather leaves them to gloo's worker
    thread, and a script whose last collective is an evaluation then aborts
    at exit now and then.
    """
    accelerator = _accelerator(net)
    if not (is_distributed(net) and _on_gloo()):
        return accelerator.gather_for_metrics(data)
    try:
        recursively_apply(lambda tensor: tensor, data, error_on_other_type=True)
        only_tensors = True
    except TypeError:
        only_tensors = False
    if only_tensors:
        gathered = recursively_apply(_gloo_gather_tensor, data, error_on_other_type=True)
    else:
        gathered = [item for part in _gloo_gather(data) for item in part]
    rows = accelerate_io.rows_of_data_in_last_batch(accelerator)
    if rows is None:
        return gathered
    if only_tensors:
        return recursively_apply(lambda tensor: tensor[:rows], gathered)
    return gathered[:rows]


def gather_pass(net: NeuralNet, batches: Sequence[Any], rows: int | None) -> list[Any]:
    """Every process's ``batches`` of one pass over a sharded loader, in the
    order of the data, on every process: what :func:`gather_for_metrics`
    of each batch in turn would have given, in one exchange at the end of
    the pass (the processes may have run different numbers of batches, as
    with accelerate's ``even_batches=False``, where an exchange at each
    batch would pair different batches).

    accelerate hands batch ``i`` of the pass to process ``i % n`` (with
    ``split_batches``, part ``r`` of each batch to process ``r``): the
    batches are interleaved back in that order. ``rows``, the length of the
    data set (None if it has none), drops the rows that accelerate repeated
    at the end to fill up the last batches. Tensors come back on the CPU.
    """
    if not is_distributed(net):
        return list(batches)
    on_cpu = [recursively_apply(lambda tensor: tensor.detach().cpu(), batch,
                                error_on_other_type=False) for batch in batches]
    parts = gather(net, on_cpu)
    ordered = [part[i] for i in range(max(len(part) for part in parts))
               for part in parts if i < len(part)]
    if rows is None:
        return ordered
    kept, left = [], rows
    for batch in ordered:
        size = _batch_rows(batch)
        if left <= 0:
            break
        kept.append(batch if size <= left else recursively_apply(
            lambda tensor, end=left: tensor[:end], batch, error_on_other_type=False))
        left -= size
    return kept


def _batch_rows(batch: Any) -> int:
    """The number of rows of a batch: the length of its first tensor."""
    found = []
    recursively_apply(lambda tensor: found.append(len(tensor)) or tensor, batch,
                      error_on_other_type=False)
    return found[0] if found else 0


# gloo lets go of a collective's tensors a moment after the collective
# returns; this long at most is waited for it
_RELEASE_TIMEOUT = 10.0


def _on_gloo() -> bool:
    return dist.is_initialized() and dist.get_backend() == 'gloo'


def _released(tensors: Sequence[torch.Tensor]) -> None:
    """Wait until gloo's worker threads hold none of ``tensors`` any more.

    A gloo collective's work, which holds its tensors, is freed by a worker
    thread a moment after the caller got the result. If Python had dropped
    the tensors first (as torch's ``all_gather_object`` and
    ``broadcast_object_list`` do when they return), that thread must take the
    GIL to free their Python objects; when the interpreter is exiting by
    then, Python ends the thread inside a noexcept destructor and the process
    aborts: "terminate called without an active exception", SIGABRT
    (pytorch/pytorch#190489). Training that ends with this module's last
    exchange and a script that ends with training hit it at random. Holding
    the tensors until gloo let go keeps their freeing on this thread.
    """
    deadline = time.monotonic() + _RELEASE_TIMEOUT
    while (any(tensor._use_count() > 1 for tensor in tensors)
           and time.monotonic() < deadline):
        time.sleep(0.0002)


def _to_bytes_tensor(value: Any) -> torch.Tensor:
    # a copy: a tensor on the pickle's own buffer frees it through Python
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).clone()


def _gloo_gather(value: Any, group: Any = None) -> list[Any]:
    mine = _to_bytes_tensor(value)
    size = torch.tensor([mine.numel()], dtype=torch.long)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    _released([size, *sizes])
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:mine.numel()] = mine
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    _released([padded, *parts])
    return [pickle.loads(part[:int(n)].numpy().tobytes())
            for part, n in zip(parts, sizes, strict=True)]


def _gloo_gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    # a copy that nothing else holds, so that its count of users tells when
    # gloo let go of it; a 0-d tensor is gathered as 1-d, as by accelerate
    mine = (tensor[None] if tensor.ndim == 0 else tensor).clone(
        memory_format=torch.contiguous_format)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    _released([mine, *parts])
    return torch.cat(parts)


def _gloo_broadcast(value: Any) -> Any:
    data = _to_bytes_tensor(value) if dist.get_rank() == 0 else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.long)
    dist.broadcast(size, src=0)
    _released([size])
    if data is None:
        data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    _released([data])
    return pickle.loads(data.numpy().tobytes())


class NodeGroup:
    """The main processes of the nodes, talking among themselves from a
    background thread (an upload) while training goes on.

    Its own gloo process group, as torch's ``async_save`` takes one: the
    collectives of the training's group run on the main thread, and two
    threads must never share a group. Every process of the job creates it
    (:meth:`of_node_mains`), in the same order; only the nodes' main
    processes :meth:`exchange`. Its collectives wait as long as torch's
    default timeout of a process group; a node whose process died fails
    them at once (its connections close).

    Parameters
    ----------
    ranks : list of int
      The global ranks of the nodes' main processes, node 0 first.
    group : ProcessGroup or None
      Their process group; None on the other processes.
    """

    def __init__(self, ranks: list[int], group: Any) -> None:
        self.ranks = ranks
        self.group = group

    @classmethod
    def of_node_mains(cls, net: NeuralNet) -> NodeGroup:
        """The group of the main processes of the nodes; on every process."""
        local_mains = gather(net, is_local_main_process(net))
        ranks = [rank for rank, local_main in enumerate(local_mains) if local_main]
        group = dist.new_group(ranks, backend='gloo')
        return cls(ranks, group if process_index(net) in ranks else None)

    @property
    def node(self) -> int:
        """This node's index among the nodes (0 for rank 0's)."""
        return dist.get_rank(self.group)

    def exchange(self, value: Any) -> list[Any]:
        """Every node main's ``value``, node 0's first; on the node mains only."""
        return _gloo_gather(value, self.group)

    def __getstate__(self) -> dict[str, Any]:
        # a process group belongs to this process
        return dict(self.__dict__, group=None)


class Vote:
    """Flags that any process may raise, counted on every process without
    making training wait for a collective.

    :meth:`post` sends this process's flags in a non-blocking all-reduce
    (maximum); :meth:`count` returns the combined flags of the vote posted
    before, waiting for it if it is not done (after a batch of training it
    is). Every process must post and count at the same points, so that all
    see the same result at the same batch. In one process no collective
    runs: :meth:`count` returns the flags posted. :meth:`close` when done.
    """

    def __init__(self, net: NeuralNet) -> None:
        self._distributed = is_distributed(net)
        accelerator = _accelerator(net)
        self._gloo = _on_gloo()
        # NCCL reduces tensors on the device, gloo on the CPU
        self._device = (accelerator.device if accelerator is not None and not self._gloo
                        else torch.device('cpu'))
        self._pending = None
        # counted votes' tensors that gloo may still hold (see _released)
        self._retired = []

    def post(self, flags: Iterable[int | bool]) -> None:
        """Send this process's ``flags`` (ints >= 0; booleans count as 0/1)."""
        flags = [int(flag) for flag in flags]
        if not self._distributed:
            self._pending = flags
            return
        tensor = torch.tensor(flags, dtype=torch.int32, device=self._device)
        self._pending = (tensor, dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True))

    def count(self) -> list[int] | None:
        """The combined flags (the maximum of each over the processes) of the
        last vote posted, ``None`` if none is; that vote is then done."""
        pending, self._pending = self._pending, None
        if pending is None or not self._distributed:
            return pending
        tensor, work = pending
        del pending
        work.wait()
        # the work holds the tensor too
        del work
        result = tensor.tolist()
        if self._gloo:
            # kept until gloo let go, without waiting for it at every batch
            self._retired = [t for t in self._retired if t._use_count() > 1]
            self._retired.append(tensor)
        return result

    def close(self) -> None:
        """Let go of the votes: wait until gloo let go of their tensors
        (before the interpreter may exit).

        A vote still under way is left after a while: it is one that a
        failed fit posted, which another process may never post.
        """
        pending, self._pending = self._pending, None
        if pending is not None and self._distributed:
            tensor, work = pending
            del pending
            try:
                work.wait(timeout=timedelta(seconds=_RELEASE_TIMEOUT))
            except RuntimeError:
                pass
            del work
            self._retired.append(tensor)
        if self._gloo:
            _released(self._retired)
        self._retired = []

    def __getstate__(self) -> dict[str, Any]:
        # a vote in flight belongs to this process's process group
        return dict(self.__dict__, _pending=None, _retired=[])


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_on_main(net: NeuralNet, fn: Callable[[], Any], what: str) -> Any:
    """Call ``fn()`` on the main process and return its result on every rank.

    If ``fn`` raises on the main process, the main process re-raises it and
    every other process raises :class:`RankError` naming rank 0 and ``what``;
    no process is left waiting.
    """
    result, error = None, None
    if is_main_process(net):
        try:
            result = fn()
        except Exception as exc:  # pylint: disable=broad-except
            error = exc
    failed, payload = broadcast(
        net, (True, _describe(error)) if error is not None else (False, result))
    if error is not None:
        raise error
    if failed:
        raise RankError(f"{what} failed on rank 0: {payload}")
    return payload


@contextmanager
def agree(
        net: NeuralNet,
        what: str,
        ignore_if_all_raise: type[Exception] | tuple[type[Exception], ...] = (),
) -> Iterator[None]:
    """Run the block on every process; if it raises anywhere, raise everywhere.

    The failing process re-raises its own exception, with a note naming
    ``what`` and its rank; the others raise :class:`RankError` naming the
    failing rank(s) and ``what``. The exchange at the end is also a barrier:
    no process leaves before all finished the block.

    An exception of a type in ``ignore_if_all_raise`` that every process
    raised is swallowed on all of them (a checkpoint that no rank finds yet);
    raised on some ranks only, it counts as a failure like any other.
    """
    error = None
    try:
        yield
    except Exception as exc:  # pylint: disable=broad-except
        error = exc
    tolerated = isinstance(error, ignore_if_all_raise) if ignore_if_all_raise else False
    outcomes = gather(net, (tolerated, None if error is None else _describe(error)))
    if all(ok for ok, _ in outcomes):
        return
    if error is not None:
        # the error of a writer (torch, safetensors) rarely names its file
        error.add_note(f"while {what} (rank {process_index(net)})")
        raise error
    failures = [
        f"rank {rank}: {message}" for rank, (_, message) in enumerate(outcomes)
        if message is not None
    ]
    if failures:
        raise RankError(f"{what} failed on " + "; ".join(failures))
