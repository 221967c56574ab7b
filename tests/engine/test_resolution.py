"""One resolution of "which checkpoint", and one read of its manifest per resume."""

import os

import pytest

from common import make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
from skorch_accel_callbacks.format import (
    HISTORY_NAME,
    MANIFEST_NAME,
    _manifest,
    check_manifest,
    read_manifest,
)
from skorch_accel_callbacks.storage import Found, open_storage
from skorch_accel_callbacks.storage._local import CheckpointFolder
from skorch_accel_callbacks.tools import export
from testutil import replace_everywhere


def train(dirname, resume='latest', max_epochs=2):
    cp = AccelerateCheckpoint(dirname=str(dirname))
    load = AccelerateLoadInitState(cp, resume=resume)
    net = make_net(make_accelerator(), callbacks=[cp, load], max_epochs=max_epochs)
    net.fit(*make_data(n=64))
    return net, load


def counting_reads(monkeypatch):
    reads = []
    original = read_manifest
    replace_everywhere(monkeypatch, original,
                       lambda folder: reads.append(os.fspath(folder)) or original(folder))
    return reads


@pytest.mark.parametrize('resume', ['latest', 'epoch-0002', 'path'])
def test_a_resume_reads_the_manifest_once(tmp_path, monkeypatch, resume):
    train(tmp_path / 'ck')
    expected = str(tmp_path / 'ck' / 'epoch-0002')
    resume = expected if resume == 'path' else resume
    reads = counting_reads(monkeypatch)
    _, load = train(tmp_path / 'ck', resume=resume, max_epochs=2)
    assert load.loaded_from_ == expected
    assert reads == [expected]


def test_the_folder_resolves_every_kind_of_which(tmp_path):
    train(tmp_path / 'ck')
    folder = open_storage(tmp_path / 'ck')
    latest = folder.find_checkpoint('latest')
    assert isinstance(latest, Found) and latest.path == folder.path('epoch-0002')
    assert latest.manifest == read_manifest(latest.path)
    assert folder.find_checkpoint('epoch-0001').path == folder.path('epoch-0001')
    assert folder.find_checkpoint(folder.path('epoch-0001')).manifest['epoch'] == 1
    with pytest.raises(FileNotFoundError, match="no checkpoint epoch-0009 in .*; it has"):
        folder.find_checkpoint('epoch-0009')
    with pytest.raises(FileNotFoundError, match="no best checkpoint in .*there is no"):
        folder.named('best')  # names, not reads
    assert folder.find('latest') == export.find_checkpoint(tmp_path / 'ck')
    assert CheckpointFolder(tmp_path / 'empty').find_checkpoint() is None


def test_verify_and_resume_report_the_same_problems(tmp_path):
    from skorch_accel_callbacks.errors import CheckpointError
    from skorch_accel_callbacks.tools import inspection
    train(tmp_path / 'ck', max_epochs=1)
    path = str(tmp_path / 'ck' / 'epoch-0001')
    os.remove(os.path.join(path, HISTORY_NAME))
    with open(os.path.join(path, _manifest.CALLBACKS_NAME), 'a', encoding='utf-8') as f:
        f.write(' ')
    _, problems = check_manifest(path)
    assert sorted(problem.file for problem in problems) == [
        _manifest.CALLBACKS_NAME, HISTORY_NAME]
    with pytest.raises(CheckpointError) as info:
        read_manifest(path)
    assert str(info.value) == str(problems[0].error)
    damaged = inspection.verify(path).damaged
    assert sorted(damaged) == sorted(str(problem.error) for problem in problems)
    # a newer format: verify says what a resume says
    manifest = os.path.join(path, MANIFEST_NAME)
    with open(manifest, encoding='utf-8') as f:
        text = f.read()
    with open(manifest, 'w', encoding='utf-8') as f:
        f.write(text.replace(f'"format_version": {_manifest.SHARED_STATES_FORMAT}',
                             f'"format_version": {_manifest.FORMAT_VERSION + 1}'))
    with pytest.raises(CheckpointError) as info:
        read_manifest(path)
    assert inspection.verify(path).damaged == [str(info.value)]
