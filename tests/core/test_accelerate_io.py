"""accelerate_io against accelerate itself: its save (in two steps, as
``async_save`` runs it too) writes the files ``Accelerator.save_state``
writes, with the same contents. An accelerate upgrade that changes
``save_state`` fails here."""

import filecmp
import os
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks._core import accelerate_io, torch_archive
from testutil import machine_lacks


class Counter:
    """A custom object registered for checkpointing."""

    def __init__(self):
        self.count = 3

    def state_dict(self):
        return {'count': self.count}

    def load_state_dict(self, state):
        self.count = state['count']


def files(folder):
    return sorted(os.listdir(folder))


@pytest.mark.parametrize('safe_serialization', [True, False])
def test_the_save_writes_what_save_state_writes(tmp_path, safe_serialization):
    accelerator = make_accelerator()
    accelerator.register_for_checkpointing(Counter())
    net = make_net(accelerator, max_epochs=1)
    net.fit(*make_data(n=96))
    scheduler = torch.optim.lr_scheduler.StepLR(net.optimizer_, step_size=1)
    accelerator.prepare(scheduler)

    whole, in_two = tmp_path / 'whole', tmp_path / 'in_two'
    accelerator.save_state(str(whole), safe_serialization=safe_serialization)
    accelerate_io.save_state(accelerator, str(in_two), safe_serialization)

    assert files(whole) == files(in_two)
    assert any(name.startswith('optimizer') for name in files(whole))
    assert any(name.startswith('scheduler') for name in files(whole))
    assert any(name.startswith('custom_checkpoint') for name in files(whole))
    for name in files(whole):
        a, b = whole / name, in_two / name
        if filecmp.cmp(a, b, shallow=False):
            continue
        # zip archives of torch.save can differ in their record headers only
        if name.endswith('.safetensors'):
            left, right = load_file(a), load_file(b)
        else:
            left = torch.load(a, weights_only=False)
            right = torch.load(b, weights_only=False)
        assert repr(left) == repr(right), name


@pytest.mark.parametrize('name', ['optimizer.bin', 'optimizer-ünïcode.bin'])
def test_optimizer_files_are_torch_archives_without_crc(tmp_path, name):
    """The optimizer file holds what ``torch.save`` would, read by
    ``torch.load(weights_only=True)``; its records carry no CRC-32 (the
    manifest's checksum guards the file), also under a non-ASCII name,
    which torch's file writer does not take."""
    net = make_net(make_accelerator(), max_epochs=1)
    net.fit(*make_data(n=96))
    state = net.optimizer_.state_dict()
    path = tmp_path / name
    torch_archive.save_without_crc(state, str(path))
    torch.save(state, tmp_path / 'reference.bin')
    loaded = torch.load(path, weights_only=True)
    assert repr(loaded) == repr(torch.load(tmp_path / 'reference.bin', weights_only=True))
    with zipfile.ZipFile(path) as archive:
        records = archive.infolist()
    assert records and {record.CRC for record in records} == {0}


def test_an_optimizer_file_that_cannot_be_written_raises_oserror_naming_it(tmp_path):
    """A full disk (``/dev/full`` answers every write with ENOSPC) gives the
    OSError that names the file, and the process lives on: torch's archive
    writer, failing, would abort it when destroyed."""
    if not os.path.exists('/dev/full'):
        machine_lacks('/dev/full (Linux)')
    state = {'state': {0: {'exp_avg': torch.randn(256, 256)}}, 'param_groups': []}
    with pytest.raises(OSError, match='No space left on device') as info:
        torch_archive.save_without_crc(state, '/dev/full')
    assert info.value.filename == '/dev/full'
    # the process is alive and writes the next file as usual
    torch_archive.save_without_crc(state, str(tmp_path / 'optimizer.bin'))
    assert torch.equal(torch.load(tmp_path / 'optimizer.bin', weights_only=True)[
        'state'][0]['exp_avg'], state['state'][0]['exp_avg'])


def test_fsdp_model_names_are_accelerates():
    """The names of an FSDP save's models come from accelerate's constant,
    in one place, as ``save_state`` numbers them."""
    from accelerate.utils.constants import FSDP_MODEL_NAME
    assert [accelerate_io.fsdp_model_file(i, sharded=True) for i in (0, 1)] == [
        f'{FSDP_MODEL_NAME}_0', f'{FSDP_MODEL_NAME}_1']
    assert [accelerate_io.fsdp_model_file(i, sharded=False) for i in (0, 1)] == [
        f'{FSDP_MODEL_NAME}.bin', f'{FSDP_MODEL_NAME}_1.bin']
    assert all(accelerate_io.is_fsdp_model_path(rel) for rel in (
        f'{FSDP_MODEL_NAME}_0/__0_0.distcp', f'{FSDP_MODEL_NAME}_1/.metadata',
        f'{FSDP_MODEL_NAME}.bin'))
    assert not any(accelerate_io.is_fsdp_model_path(rel) for rel in (
        'model.safetensors', 'optimizer_0/__0_0.distcp', f'{FSDP_MODEL_NAME}_x.bin'))
