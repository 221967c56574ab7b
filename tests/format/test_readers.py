"""readers: the one table of files read without running code.

A torch file is read as accelerate's ``load_state`` reads it: the random
states accelerate saves (numpy's state among them) load; a pickle that would
run code does not.
"""

import pickle
import random

import numpy as np
import pytest
import torch

from skorch_accel_callbacks import CorruptCheckpointError
from skorch_accel_callbacks.format import (
    first_unloadable,
    kind_of,
    load_without_code,
    read_naming_fault,
)


def accelerate_rng_file(path):
    """A file of the form accelerate's save_state writes (random_states_N.pkl)."""
    torch.save({'step': 0, 'random_state': random.getstate(),
                'numpy_random_seed': np.random.get_state(),
                'torch_manual_seed': torch.get_rng_state()}, path)
    return path


def test_random_states_of_accelerate_load(tmp_path):
    file = accelerate_rng_file(tmp_path / 'random_states_0.pkl')
    assert load_without_code(file)['step'] == 0
    assert first_unloadable([file]) is None


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, 'w'))


@pytest.mark.parametrize('suffix', ['.bin', '.pkl', '.pt', '.pth'])
def test_every_torch_suffix_is_read_weights_only(tmp_path, suffix):
    file = tmp_path / f'evil{suffix}'
    file.write_bytes(pickle.dumps(Payload(tmp_path / 'pwned'), protocol=2))
    assert kind_of(file) == 'torch'
    assert first_unloadable([file])[0] == file
    assert not (tmp_path / 'pwned').exists()


def test_other_suffixes_are_not_read(tmp_path):
    assert kind_of(tmp_path / 'notes.txt') is None
    with pytest.raises(ValueError, match='notes.txt is not a file of a kind'):
        load_without_code(tmp_path / 'notes.txt')


def test_read_naming_fault_names_the_first_that_does_not_load(tmp_path):
    good = accelerate_rng_file(tmp_path / 'random_states_0.pkl')
    bad = tmp_path / 'optimizer.bin'
    bad.write_bytes(b'not a torch file')

    def read():
        raise KeyError('state')

    with pytest.raises(CorruptCheckpointError, match=f"^{bad} cannot be loaded: KeyError"):
        read_naming_fault([str(good), str(bad)], read)
    # all load: the fallback is named
    with pytest.raises(CorruptCheckpointError, match=f"^{tmp_path} cannot be loaded"):
        read_naming_fault([str(good)], read, fallback=str(tmp_path))
