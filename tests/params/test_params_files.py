"""The files of a params save (skorch_accel_callbacks.params._files): the
sweep of the temporary files that killed saves left takes those of the
checkpoint's own names only, through atomic.remove_temp_files."""

import os
from pathlib import Path

from skorch_accel_callbacks.format import TEMP_MARK, remove_temp_files
from skorch_accel_callbacks.params import _files as params_files

SUFFIX = f'{TEMP_MARK}0123456789ab'


def touch(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b'')


def test_sweep_takes_the_temporary_files_of_the_checkpoints_names_only(tmp_path: Path) -> None:
    """Templates stand for every epoch's name; the files of another prefix
    (another job's save may be in flight), final files and names that are
    not temporary ones stay."""
    kept = [
        'params_3.pt', 'history.json',
        # another prefix
        f'.a_params_3.pt{SUFFIX}', f'.a_history.json{SUFFIX}',
        # not a name of unique_name
        f'.params_3.pt{TEMP_MARK}0123', f'.history.json{TEMP_MARK}0123456789xy',
        f'.criterion.pt{SUFFIX}',
    ]
    swept = [f'.params_3.pt{SUFFIX}', f'.params_12.pt{SUFFIX}', f'.history.json{SUFFIX}']
    touch(tmp_path, *kept, *swept)
    touch(tmp_path / 'opt', 'optimizer.pt', f'.other.pt{SUFFIX}', f'.optimizer.pt{SUFFIX}')
    params_files.remove_temp_files(str(tmp_path), '', {
        'f_params': 'params_{last_epoch[epoch]}.pt', 'f_history': 'history.json',
        'f_optimizer': 'opt/optimizer.pt', 'f_criterion': None})
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, 'opt'])
    assert sorted(os.listdir(tmp_path / 'opt')) == ['.other.pt' + SUFFIX, 'optimizer.pt']


def test_atomic_sweep_of_no_names_removes_nothing(tmp_path: Path) -> None:
    touch(tmp_path, SUFFIX, f'.params.pt{SUFFIX}')
    remove_temp_files(str(tmp_path), [])
    remove_temp_files(str(tmp_path / 'missing'), ['params\\.pt'])
    assert sorted(os.listdir(tmp_path)) == sorted([SUFFIX, f'.params.pt{SUFFIX}'])
    remove_temp_files(str(tmp_path), ['params\\.pt'])
    assert os.listdir(tmp_path) == [SUFFIX]
