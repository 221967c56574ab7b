"""The support matrix: each combination of the releases the package supports,
installed in a virtual environment of its own, runs the quick test subset.

``nox -s compat`` runs every combination, ``nox -s "compat(stack='oldest')"``
one of them (``make compat`` runs the oldest and the newest, as CI does). The
package is installed from this checkout with its dependencies resolved by
pip against setup.cfg, so a combination that setup.cfg refuses fails here.

Every supported release of torch, accelerate and skorch is in some
combination, and each Python the package supports (3.11 to 3.13; an
interpreter that pyenv installed is found without being on the PATH). The
registry has a CPU build of torch 2.13.0 for Python 3.11 only; the other
torch builds are CUDA builds, which run on the CPU too but download a few GB
each (2.14.1 is the newest that installs on our test machines). The pins of
the test tools are requirements-dev.txt's.
"""

import glob
import os
import shutil
import subprocess

import nox

nox.options.default_venv_backend = 'venv'
nox.options.reuse_existing_virtualenvs = False

# name: the releases of that combination (setup.cfg's ranges are the span of
# these; skorch_accel_callbacks/_core/accelerate_io.py's TESTED the same)
STACKS = {
    'oldest': {'python': '3.11', 'torch': '2.11.0', 'accelerate': '1.13.0', 'skorch': '1.3.1'},
    'torch-2.12': {'python': '3.12', 'torch': '2.12.1', 'accelerate': '1.14.0',
                   'skorch': '1.4.0'},
    'pinned': {'python': '3.11', 'torch': '2.13.0', 'accelerate': '1.15.0', 'skorch': '1.4.0'},
    'newest': {'python': '3.13', 'torch': '2.14.1', 'accelerate': '1.16.0', 'skorch': '1.4.0'},
}
# requirements-dev.txt's pins but the stack under test and the tools no
# test imports (lint, docs, release): what the quick subset needs besides.
# setuptools and wheel build the release only, and torch pins its own
# setuptools on Python 3.12 and newer
STACK = ('torch', 'accelerate', 'skorch')
NOT_FOR_TESTS = ('ruff', 'sphinx', 'pydata-sphinx-theme', 'nox', 'build',
                 'twine', 'matplotlib', 'setuptools', 'wheel')


def test_requirements() -> list[str]:
    """``name==version`` of requirements-dev.txt for the quick subset, less
    :data:`STACK` and :data:`NOT_FOR_TESTS`."""
    found = []
    with open('requirements-dev.txt') as f:
        for line in f:
            line = line.split('#')[0].strip()
            name = line.split('==')[0].split('[')[0].lower()
            if '==' in line and name not in STACK + NOT_FOR_TESTS:
                found.append(line)
    return found


@nox.session(python=False)
@nox.parametrize('stack', list(STACKS))
def compat(session: nox.Session, stack: str) -> None:
    """Install one combination in a fresh virtual environment and run the
    quick subset (``make test-quick``'s selection) in it."""
    releases = STACKS[stack]
    venv = f'.nox/compat-{stack}'
    session.run(interpreter(releases['python']), '-m', 'venv', '--clear', venv, external=True)
    # a CUDA build of torch is 5-6 GB installed: each environment goes as
    # soon as its tests ran (the next session would clear it anyway), and
    # pip keeps no second copy of the wheels in its cache, or CI's disk
    # holds every combination's at once and the release's install after
    # them finds it full
    try:
        python = f'{venv}/bin/python'
        session.run(python, '-m', 'pip', 'install', '--quiet', '--no-cache-dir',
                    f"torch=={releases['torch']}", f"accelerate=={releases['accelerate']}",
                    f"skorch=={releases['skorch']}", '.', *test_requirements(), external=True)
        session.run(python, '-m', 'pip', 'check', external=True)
        session.run(python, '-c', VERSIONS.format(**releases), external=True)
        session.run(python, '-m', 'pytest', '-n', '2', '--dist', 'loadfile',
                    '--no-loadscope-reorder', '-q', '-p', 'no:cacheprovider',
                    '-m', 'not slow and not faults and not release', 'tests', external=True)
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def interpreter(version: str) -> str:
    """The path of a Python ``version`` (``'3.12'``): ``python3.12`` on the
    PATH if it runs, else one that pyenv installed but did not put on the
    PATH (its shims answer only for the versions it was told to use)."""
    command = f'python{version}'
    found = shutil.which(command)
    if found and subprocess.run([found, '--version'], capture_output=True).returncode == 0:
        return found
    root = os.environ.get('PYENV_ROOT', os.path.expanduser('~/.pyenv'))
    installed = sorted(glob.glob(os.path.join(root, 'versions', f'{version}.*', 'bin', command)))
    if installed:
        return installed[-1]
    raise nox.command.CommandFailed(f"no Python {version} here ({command} is not on the PATH "
                                    f"and not under {root}/versions): install it to run "
                                    "this combination")


# the environment holds the combination asked for, not what pip preferred
VERSIONS = """
import accelerate, skorch, torch
got = (torch.__version__.split('+')[0], accelerate.__version__, skorch.__version__)
assert got == ('{torch}', '{accelerate}', '{skorch}'), got
print('torch', got[0], 'accelerate', got[1], 'skorch', got[2])
"""
