"""The archive writer of the optimizer files: what ``torch.save`` writes,
without the CRC-32 of its records, read by ``torch.load`` on every release
of the test matrix; a file that cannot be written raises an OSError naming
it, and the process lives on."""

import os
import zipfile

import pytest
import torch

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks.format import save_without_crc
from testutil import machine_lacks


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
    save_without_crc(state, str(path))
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
        save_without_crc(state, '/dev/full')
    assert info.value.filename == '/dev/full'
    # the process is alive and writes the next file as usual
    save_without_crc(state, str(tmp_path / 'optimizer.bin'))
    assert torch.equal(torch.load(tmp_path / 'optimizer.bin', weights_only=True)[
        'state'][0]['exp_avg'], state['state'][0]['exp_avg'])
