"""Which Pythons can hang a loader's worker at its fork (CPython gh-112275)
and which loaders of a net fork their workers: the parts of the warning
that ``AccelerateCheckpoint`` gives when training begins in several
processes (``state/_worker_start.py``). The warning itself, given on rank 0
only, is checked in 2 processes by ``test_data_pipeline.py``.
"""

import multiprocessing
import subprocess
import sys
import warnings

import pytest

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint
from skorch_accel_callbacks.state._worker_start import (
    forking_loaders,
    python_can_hang_at_fork,
    start_method,
)


@pytest.mark.parametrize(('version', 'hangs'), [
    ((3, 11, 0, 'final', 0), True),
    ((3, 11, 7, 'final', 0), True),
    ((3, 11, 9, 'final', 0), True),
    # gh-112275's fix: the thread-list lock reset before other threads'
    # states are deleted in the child
    ((3, 11, 10, 'final', 0), False),
    ((3, 11, 14, 'final', 0), False),
    # reset first since 3.12.0
    ((3, 12, 0, 'final', 0), False),
    ((3, 12, 1, 'final', 0), False),
    ((3, 13, 0, 'final', 0), False),
    ((3, 14, 0, 'final', 0), False),
])
def test_the_pythons_that_can_hang_at_a_fork(version, hangs):
    assert python_can_hang_at_fork(version) is hangs


def test_the_start_method_of_each_way_of_naming_it():
    assert start_method('forkserver') == 'forkserver'
    assert start_method(multiprocessing.get_context('spawn')) == 'spawn'
    assert start_method(multiprocessing.get_context('fork')) == 'fork'
    assert start_method(None) == (multiprocessing.get_start_method(allow_none=True)
                                  or multiprocessing.get_all_start_methods()[0])


def test_the_default_start_method_is_read_without_fixing_it():
    """A user may still call ``multiprocessing.set_start_method`` after the
    check: reading the default must not choose it for the process."""
    code = ("import multiprocessing\n"
            "from skorch_accel_callbacks.state._worker_start import start_method\n"
            "print(start_method(None))\n"
            "assert multiprocessing.get_start_method(allow_none=True) is None\n"
            "multiprocessing.set_start_method('spawn')\n")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == multiprocessing.get_all_start_methods()[0]


# Linux's default before Python 3.14; forkserver from 3.14 on
DEFAULT_FORKS = start_method(None) == 'fork'


@pytest.mark.parametrize(('params', 'expected'), [
    ({}, []),
    ({'iterator_train__num_workers': 2},
     ['iterator_train (2 workers, at every epoch)'] if DEFAULT_FORKS else []),
    ({'iterator_train__num_workers': 2, 'iterator_train__persistent_workers': True},
     ['iterator_train (2 workers, once a fit)'] if DEFAULT_FORKS else []),
    ({'iterator_train__num_workers': 2,
      'iterator_train__multiprocessing_context': 'forkserver'}, []),
    ({'iterator_train__num_workers': 2,
      'iterator_train__multiprocessing_context': multiprocessing.get_context('spawn')}, []),
    ({'iterator_train__num_workers': 2, 'iterator_train__multiprocessing_context': 'fork',
      'iterator_valid__num_workers': 1,
      'iterator_valid__multiprocessing_context': multiprocessing.get_context('fork')},
     ['iterator_train (2 workers, at every epoch)', 'iterator_valid (1 worker, at every epoch)']),
])
def test_the_loaders_that_fork_their_workers(params, expected):
    assert forking_loaders(make_net(make_accelerator(), **params)) == expected


def test_one_process_is_not_warned_of(tmp_path):
    """No other rank waits on a hung one, and no process group's threads
    call into Python: nothing to warn of, whatever the Python."""
    net = make_net(make_accelerator(), max_epochs=1, iterator_train__num_workers=2,
                   callbacks=[AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))])
    X, y = make_data(n=96)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter('always')
        net.fit(X, y)
    assert [str(w.message) for w in shown if 'gh-112275' in str(w.message)] == []
