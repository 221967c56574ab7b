"""The release a user installs: ``python -m build`` makes an sdist and a
wheel that ``twine check`` passes; the wheel, installed into a fresh virtual
environment away from this checkout, runs the quick start's blocks, and
with ``[s3]`` checkpoints into a bucket of the local S3 server.

Marked ``release`` (``make release-check``, which CI runs beside the suite):
the environment takes a minute or two to install.
"""

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from test_docs import DOCS, python_blocks

REPO = Path(__file__).resolve().parents[2]
# torch as requirements-dev.txt pins it: an unpinned one is a CUDA build of GBs
TORCH = next(line.strip() for line in (REPO / 'requirements-dev.txt').read_text().splitlines()
             if line.startswith('torch=='))
INSTALL_TIMEOUT = 900
RUN_TIMEOUT = 600

pytestmark = pytest.mark.release


def run(*args, cwd, env=None, timeout=RUN_TIMEOUT):
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def outside_env(venv):
    """The environment of a user's shell with the venv activated: nothing of
    this checkout on the path."""
    env = {key: value for key, value in os.environ.items()
           if key not in ('PYTHONPATH', 'VIRTUAL_ENV', 'PYTHONHOME')}
    env['PATH'] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env['VIRTUAL_ENV'] = str(venv)
    return env


@pytest.fixture(scope='module')
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp('dist')
    # the build back-end of pyproject.toml, from this environment (the
    # registry's setuptools would do too, a download slower)
    run(sys.executable, '-m', 'build', '--no-isolation', '--outdir', out, REPO, cwd=out)
    wheels, sdists = list(out.glob('*.whl')), list(out.glob('*.tar.gz'))
    assert len(wheels) == len(sdists) == 1, list(out.iterdir())
    return {'wheel': wheels[0], 'sdist': sdists[0]}


@pytest.fixture(scope='module')
def installed(dist, tmp_path_factory):
    """A fresh virtual environment with the wheel (and what the quick start
    imports: scikit-learn, the ``examples`` extra) installed by pip."""
    venv = tmp_path_factory.mktemp('venv')
    run(sys.executable, '-m', 'venv', venv, cwd=venv)
    # without pip's cache: its copy of the torch wheel would outlive the run
    run(venv / 'bin' / 'python', '-m', 'pip', 'install', '--quiet', '--no-cache-dir', TORCH,
        f"{dist['wheel']}[examples]", cwd=venv, env=outside_env(venv), timeout=INSTALL_TIMEOUT)
    yield venv
    # a GB that pytest would keep for its last three runs
    shutil.rmtree(venv, ignore_errors=True)


def test_twine_checks_the_sdist_and_the_wheel(dist):
    out = run(sys.executable, '-m', 'twine', 'check', '--strict', dist['wheel'], dist['sdist'],
              cwd=dist['wheel'].parent)
    assert out.stdout.count('PASSED') == 2, out.stdout


def test_the_wheel_holds_the_package_and_the_sdist_its_sources(dist):
    from skorch_accel_callbacks import __version__
    assert dist['wheel'].name == f'skorch_accel_callbacks-{__version__}-py3-none-any.whl'
    names = zipfile.ZipFile(dist['wheel']).namelist()
    assert 'skorch_accel_callbacks/__init__.py' in names
    assert not [name for name in names if name.startswith(('tests/', 'benchmarks/'))]
    entry_points = next(name for name in names if name.endswith('entry_points.txt'))
    assert b'skorch-accel-callbacks = skorch_accel_callbacks.tools.cli:main' in \
        zipfile.ZipFile(dist['wheel']).read(entry_points)
    with tarfile.open(dist['sdist']) as sdist:
        members = sdist.getnames()
    root = members[0].split('/')[0]
    for path in ('setup.cfg', 'pyproject.toml', 'README.rst', 'CHANGES.rst', 'LICENSE',
                 'skorch_accel_callbacks/__init__.py'):
        assert f'{root}/{path}' in members, path


def test_the_installed_wheel_runs_the_quick_start(installed, tmp_path):
    env = outside_env(installed)
    python = installed / 'bin' / 'python'
    where = run(python, '-c', 'import skorch_accel_callbacks as p; print(p.__file__)',
                cwd=tmp_path, env=env).stdout.strip()
    assert where.startswith(str(installed)) and str(REPO) not in where, where
    script = tmp_path / 'quickstart.py'
    script.write_text('\n\n'.join(block['source']
                                  for block in python_blocks(DOCS / 'quickstart.rst')))
    run(python, script, cwd=tmp_path, env=env)
    assert (tmp_path / 'checkpoints' / 'latest.json').exists()
    assert (tmp_path / 'model' / 'params.safetensors').exists()
    # the command line, as the console script the wheel installed
    listed = run(installed / 'bin' / 'skorch-accel-callbacks', 'list', 'checkpoints',
                 cwd=tmp_path, env=env)
    assert 'checkpoint(s), in training order' in listed.stdout


S3_SCRIPT = """
import sys
import numpy as np
from accelerate import Accelerator
from skorch import NeuralNetClassifier
from skorch.hf import AccelerateMixin
import torch
from skorch_accel_callbacks import (AccelerateCheckpoint, AccelerateFixesMixin,
                                    AccelerateLoadInitState)

class Net(AccelerateFixesMixin, AccelerateMixin, NeuralNetClassifier):
    pass

X = np.random.RandomState(0).randn(64, 20).astype(np.float32)
y = (X[:, 0] > 0).astype(np.int64)
cp = AccelerateCheckpoint(dirname=sys.argv[1])
net = Net(torch.nn.Sequential(torch.nn.Linear(20, 2), torch.nn.Softmax(dim=-1)),
          accelerator=Accelerator(cpu=True), max_epochs=int(sys.argv[2]), verbose=0,
          callbacks=[cp, AccelerateLoadInitState(cp)])
net.fit(X, y)
print('epochs', len(net.history), 'newest', cp.committed()[-1])
"""


def test_the_installed_wheel_with_s3_checkpoints_into_a_bucket(installed, dist, s3_bucket,
                                                              tmp_path):
    env = outside_env(installed)
    run(installed / 'bin' / 'python', '-m', 'pip', 'install', '--quiet', '--no-cache-dir',
        f"{dist['wheel']}[s3]", cwd=tmp_path, env=env, timeout=INSTALL_TIMEOUT)
    script = tmp_path / 's3_run.py'
    script.write_text(S3_SCRIPT)
    url = f's3://{s3_bucket}/run'
    first = run(installed / 'bin' / 'python', script, url, 2, cwd=tmp_path, env=env)
    assert 'epochs 2 newest epoch-0002' in first.stdout, first.stdout
    # a relaunch with more epochs resumes from the bucket and trains one more
    again = run(installed / 'bin' / 'python', script, url, 3, cwd=tmp_path, env=env)
    assert 'epochs 3 newest epoch-0003' in again.stdout, again.stdout
