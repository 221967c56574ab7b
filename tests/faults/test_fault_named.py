"""A failed ``load_state`` names a file only if that file is at fault.

The files are read again as ``load_state`` reads them: an intact random-state
file of accelerate's (numpy's state in it) is not blamed for another's fault.
"""

import shutil

import pytest
import torch

import faultjob
from skorch_accel_callbacks import CheckpointError
from skorch_accel_callbacks.format import checksum_file
from testutil import edit_manifest

pytestmark = pytest.mark.faults


def test_optimizer_of_another_layout_blames_no_intact_file(tmp_path):
    ckpt = tmp_path / 'ckpt'
    net, _ = faultjob.build(str(ckpt), max_epochs=1)
    net.fit(*faultjob.data())
    folder = shutil.copytree(ckpt / 'epoch-0001', tmp_path / 'copy' / 'epoch-0001')
    # loads without running code, but is no state of this optimizer
    optimizer = folder / 'optimizer.bin'
    torch.save({'not': torch.zeros(1)}, optimizer)
    edit_manifest(folder, lambda m: (
        m['files'].update({'optimizer.bin': optimizer.stat().st_size}),
        m['checksums'].update({'optimizer.bin': checksum_file(optimizer)})))
    net, _ = faultjob.build(str(folder.parent), resume=str(folder), max_epochs=2)
    with pytest.raises(CheckpointError, match="could not be loaded") as caught:
        net.fit(*faultjob.data())
    assert 'random_states_0.pkl' not in str(caught.value)
    assert str(caught.value).startswith(f"{folder} could not be loaded: KeyError")
    assert len(net.history) == 0
