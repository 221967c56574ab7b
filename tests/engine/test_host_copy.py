"""The host copy of ``async_save`` (issue 31, item 2): cut into pieces that
the calling thread and a copy thread take from one queue; every byte of
every tensor arrives, whatever its dtype, layout or size, a tensor from
elsewhere is copied as before, and a failure returns only once no thread
copies any more."""

import threading
import time

import numpy as np
import pytest
import torch

from skorch_accel_callbacks.engine import _stager
from testutil import machine_lacks

CHUNK = _stager.COPY_CHUNK


def sources():
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(int(3.5 * CHUNK) // 4, generator=generator),  # several pieces
        torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        torch.randn(6, 4, generator=generator).t(),  # strided: copy_
        torch.tensor(3.0),  # Adam's step count: 0-dim
        torch.empty(0),
        torch.arange(CHUNK + 3, dtype=torch.uint8),
    ]


def test_every_tensor_arrives_whole():
    copies = [(torch.empty_like(t), t) for t in sources()]
    _stager.copy_all(copies)
    for buffer, tensor in copies:
        assert torch.equal(buffer, tensor)


def test_the_pieces_are_copied_at_once_by_the_calling_thread_and_a_copy_thread(monkeypatch):
    if _stager.COPY_THREADS < 2:
        machine_lacks("a second CPU: with one the pieces are copied on the calling thread")
    threads = []
    real = np.copyto
    # the first two pieces wait for each other: copied at the same time or never
    both_copying = threading.Barrier(2, timeout=10)

    def recorded(target, source):
        threads.append(threading.current_thread().name)
        if len(threads) <= 2:
            both_copying.wait()
        real(target, source)

    monkeypatch.setattr(_stager.np, 'copyto', recorded)
    tensor = torch.ones(3 * CHUNK // 4)
    buffer = torch.zeros_like(tensor)
    _stager.copy_all([(buffer, tensor)])
    assert torch.equal(buffer, tensor)
    assert len(threads) == 3  # each piece once
    first_two = threads[:2]
    assert threading.current_thread().name in first_two
    assert any(name.startswith('checkpoint-copy') for name in first_two)


def test_a_failure_on_the_calling_thread_waits_for_the_copy_threads(monkeypatch):
    """The copy raises only once no thread writes into the buffers."""
    if _stager.COPY_THREADS < 2:
        machine_lacks("a second CPU: with one the pieces are copied on the calling thread")
    real = np.copyto
    caller = threading.current_thread()
    copying = []

    def failing_here(target, source):
        if threading.current_thread() is caller:
            # raise while the copy thread is inside a piece (it waits until then)
            copying_now.wait(timeout=30)
            raise OSError("the caller's piece failed")
        copying.append('began')
        copying_now.set()
        time.sleep(0.2)
        real(target, source)
        copying.append('ended')

    copying_now = threading.Event()
    monkeypatch.setattr(_stager.np, 'copyto', failing_here)
    tensor = torch.ones(3 * CHUNK // 4)
    with pytest.raises(OSError, match="the caller's piece failed"):
        _stager.copy_all([(torch.zeros_like(tensor), tensor)])
    assert copying and copying[-1] == 'ended'


def test_a_failing_copy_raises():
    with pytest.raises(ValueError):
        _stager.copy_all([(torch.empty(2 * CHUNK // 4 + 1), torch.ones(2 * CHUNK // 4 + 2))])
