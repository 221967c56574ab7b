"""Reading checkpoints from an object store for inference: ``export`` (the
function and the command) and ``load_params(checkpoint=...)`` with a URL,
against the local S3 server (tests/conftest.py ``s3_bucket``)."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from common import make_accelerator, make_data, make_net, plain_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
from skorch_accel_callbacks.storage._remote import default_staging
from skorch_accel_callbacks.tools import cli
from skorch_accel_callbacks.tools.export import export

pytestmark = pytest.mark.slow

X, y = make_data(n=160)


@pytest.fixture
def trained(s3_bucket):
    """A net trained 3 epochs into ``s3://<bucket>/run``, its staging
    folder deleted (the checkpoints are in the bucket only), the URL and the
    predictions of each epoch's model."""
    url = f's3://{s3_bucket}/run'
    probas = []

    cp = AccelerateCheckpoint(dirname=url, keep_last=3)
    torch.manual_seed(0)
    net = make_net(make_accelerator(), callbacks=[cp, AccelerateLoadInitState(cp)],
                   max_epochs=3)
    net.initialize()
    for _ in range(3):
        net.partial_fit(X, y, epochs=1)
        probas.append(net.predict_proba(X))
    shutil.rmtree(default_staging(url))
    return url, probas


def predictions(files):
    net = plain_net().initialize()
    net.load_params(**files, use_safetensors=True)
    return net.predict_proba(X)


def leftovers():
    """The export folders left under the temporary folder."""
    return sorted(path.name for path in Path(tempfile.gettempdir()).glob('skorch-accel-export-*'))


def test_export_and_load_params_from_a_url(trained, tmp_path, monkeypatch, s3_endpoint):
    url, probas = trained
    files = export(url, out=tmp_path / 'newest')
    assert set(files) == {'f_params', 'f_history'}
    np.testing.assert_allclose(predictions(files), probas[-1], rtol=0, atol=0)
    assert leftovers() == []

    net = plain_net().initialize()
    net.load_params(checkpoint=AccelerateCheckpoint(dirname=url))
    np.testing.assert_allclose(net.predict_proba(X), probas[-1], rtol=0, atol=0)
    assert len(net.history) == 3

    # only the options reach the server: without them the default endpoint
    # (real AWS) would be asked, which this machine cannot reach
    monkeypatch.delenv('AWS_ENDPOINT_URL')
    files = export(url, out=tmp_path / 'second', which='epoch-0002', storage_options={
        'key': 'testing', 'secret': 'testing', 'client_kwargs': {'endpoint_url': s3_endpoint}})
    np.testing.assert_allclose(predictions(files), probas[1], rtol=0, atol=0)


def test_the_export_command_on_a_url(trained, tmp_path, capsys):
    url, probas = trained
    out = tmp_path / 'out'
    assert cli.main(['export', url, 'epoch-0001', str(out)]) == cli.OK
    printed = capsys.readouterr().out
    assert f'exported the model(s) of {url}/epoch-0001 into {out}' in printed
    np.testing.assert_allclose(predictions({'f_params': out / 'params.safetensors'}),
                               probas[0], rtol=0, atol=0)
    assert cli.main(['export', url, 'epoch-0009', str(out)]) == cli.USAGE
    assert f'no checkpoint epoch-0009 in {url}' in capsys.readouterr().err
    assert leftovers() == []


def test_the_command_on_a_url_behaves_as_on_a_folder(trained, tmp_path, capsys):
    """issue 30 item 6: one policy, so one behaviour."""
    url, _ = trained
    bucket = url.split('/')[2]
    assert cli.main(['list', f's3://{bucket}-missing/run']) == cli.USAGE
    assert capsys.readouterr().err == f"list: no such folder: s3://{bucket}-missing/run\n"
    # no checkpoint was saved because of `monitor`
    assert cli.main(['export', url, 'best', str(tmp_path / 'out')]) == cli.USAGE
    assert f"no best checkpoint in {url}" in capsys.readouterr().err
    assert cli.main(['verify', f'{url}/epoch-0002']) == cli.OK
    assert capsys.readouterr().out.startswith(f"{url}/epoch-0002: intact (")
    assert cli.main(['list', url]) == cli.OK
    listed = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in listed[2:5]]
    assert [row[0] for row in rows] == ['epoch-0001', 'epoch-0002', 'epoch-0003']
    # a local folder's lock file and leftovers: a store has neither
    assert not [line for line in listed if line.startswith(('left over', 'lock:'))], listed
    # the score column reads each checkpoint's history in the store
    assert all(row[4] == 'valid_loss' and float(row[5]) > 0 for row in rows), rows
    assert leftovers() == []


def test_a_mistyped_url_is_refused_not_made_a_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(['list', 's3:/bucket/run1']) == cli.USAGE
    assert "'s3:/bucket/run1' looks like a mistyped URL" in capsys.readouterr().err
    cp = AccelerateCheckpoint(dirname='s3:/bucket/run1')
    net = make_net(make_accelerator(), callbacks=[cp], max_epochs=1)
    with pytest.raises(ValueError, match="looks like a mistyped URL"):
        net.fit(X, y)
    assert not (tmp_path / 's3:').exists()


def test_a_closed_endpoint_is_one_line(tmp_path, monkeypatch, capsys):
    import socket
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]  # closed once the with ends: nothing listens
    monkeypatch.setenv('AWS_ENDPOINT_URL', f'http://127.0.0.1:{port}')
    assert cli.main(['list', 's3://bucket/run']) == cli.DAMAGED
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 's3://bucket/run' in err and 'Traceback' not in err, err


def test_the_staging_lock_refusal_names_the_url(s3_bucket):
    """A job of this machine holds the default staging folder (named after
    a hash of the URL): the refusal names the URL the user gave."""
    import os
    import subprocess
    import sys

    from skorch_accel_callbacks.errors import FolderInUseError
    from skorch_accel_callbacks.storage import open_storage
    url = f's3://{s3_bucket}/run'
    staging = default_staging(url)
    os.makedirs(staging, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, '-c', 'import sys; from skorch_accel_callbacks.storage._lock import '
         'FolderLock; lock = FolderLock(sys.argv[1]).acquire(); print("held", flush=True); '
         'sys.stdin.read()', staging],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, 'PYTHONPATH': os.getcwd()})
    try:
        assert holder.stdout.readline() == 'held\n'
        net = make_net(make_accelerator(), max_epochs=1).initialize()
        with pytest.raises(FolderInUseError, match=f"^{url} is in use by another running "
                                                   "job on this machine"):
            open_storage(url).claim(net)
    finally:
        holder.communicate('', timeout=30)
