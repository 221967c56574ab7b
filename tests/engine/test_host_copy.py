"""The host copy of ``async_save`` (issue 31, item 2): cut into pieces that
two threads take in turn; every byte of every tensor arrives, whatever its
dtype, layout or size, and a tensor from elsewhere is copied as before."""

import threading

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


def test_the_pieces_are_copied_on_the_copy_threads(monkeypatch):
    if _stager.COPY_THREADS < 2:
        machine_lacks("a second CPU: with one the pieces are copied on the calling thread")
    threads = []
    real = np.copyto

    def recorded(target, source):
        threads.append(threading.current_thread().name)
        real(target, source)

    monkeypatch.setattr(_stager.np, 'copyto', recorded)
    tensor = torch.ones(3 * CHUNK // 4)
    buffer = torch.zeros_like(tensor)
    _stager.copy_all([(buffer, tensor)])
    assert torch.equal(buffer, tensor)
    assert len(threads) == 3
    assert all(name.startswith('checkpoint-copy') for name in threads)


def test_a_failing_copy_raises():
    with pytest.raises(ValueError):
        _stager.copy_all([(torch.empty(2 * CHUNK // 4 + 1), torch.ones(2 * CHUNK // 4 + 2))])
