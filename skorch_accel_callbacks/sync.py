"""Process synchronisation: the only module that talks across processes.

Every function takes a skorch net. A net without an ``accelerator`` attribute
(a plain ``NeuralNet``), or with an accelerator that runs a single process, is
single-process: barriers return at once, broadcasts return their input and
nothing is sent anywhere. Built on accelerate's collectives, so the same code
serves gloo on CPU and NCCL on GPUs.
"""

from contextlib import contextmanager

from accelerate.utils import broadcast_object_list, gather_object

__all__ = [
    'RankError',
    'agree',
    'barrier',
    'broadcast',
    'gather',
    'is_distributed',
    'is_local_main_process',
    'is_main_process',
    'num_processes',
    'process_index',
    'run_on_main',
]


class RankError(RuntimeError):
    """A step failed on another process.

    Raised on the processes where the step succeeded, so that every rank
    leaves the step with an exception instead of waiting in the next
    collective until the process-group timeout.
    """


def _accelerator(net):
    return getattr(net, 'accelerator', None)


def num_processes(net):
    """Number of processes that train ``net`` (1 without accelerate)."""
    accelerator = _accelerator(net)
    return 1 if accelerator is None else accelerator.num_processes


def process_index(net):
    """Global rank of this process (0 without accelerate)."""
    accelerator = _accelerator(net)
    return 0 if accelerator is None else accelerator.process_index


def is_distributed(net):
    return num_processes(net) > 1


def is_main_process(net):
    """Whether this is the global main process (rank 0)."""
    accelerator = _accelerator(net)
    return True if accelerator is None else accelerator.is_main_process


def is_local_main_process(net):
    """Whether this is the main process of its node."""
    accelerator = _accelerator(net)
    return True if accelerator is None else accelerator.is_local_main_process


def barrier(net):
    """Wait until every process reaches this point."""
    if is_distributed(net):
        _accelerator(net).wait_for_everyone()


def broadcast(net, value):
    """Return the main process's ``value`` on every process.

    ``value`` must be picklable and should be small: a decision, a path, an
    error message.
    """
    if not is_distributed(net):
        return value
    return broadcast_object_list([value], from_process=0)[0]


def gather(net, value):
    """Return the list of every process's ``value``, indexed by rank."""
    if not is_distributed(net):
        return [value]
    return gather_object([value])


def _describe(exc):
    return f"{type(exc).__name__}: {exc}"


def run_on_main(net, fn, what):
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
def agree(net, what, ignore_if_all_raise=()):
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
