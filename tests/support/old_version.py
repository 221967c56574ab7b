"""The package as it was at a kept commit, to write checkpoints of an older
version on the machine under test.

A resume is bit for bit where the arithmetic is the same: the uninterrupted
run it is compared with is computed here, so the checkpoints it resumes must
be computed here too (checkpoints written on another processor hold weights
that differ in their last bits: the kernels sum in another order).
tests/data/ keeps the folders such a version wrote, as users have them on
disk, for what does not depend on the processor (reading, listing,
verifying, the files and the format), and the source of that version
(:data:`SOURCE`: its package and the worker scripts of its 2-process
trainings, made with ``git archive``, tests/data/README.rst says how), which
:func:`old_tree` unpacks for the resume tests to write theirs with: a clone
without the repository's history runs them too.
"""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the last commit before the package was split into subpackages (format 4)
COMMIT = 'f5cb08a'
SOURCE = REPO / 'tests' / 'data' / f'{COMMIT}-source.tar.gz'


def old_tree(dest):
    """The package and worker scripts of :data:`COMMIT`, unpacked from
    :data:`SOURCE` into ``dest``; the path of the tree."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(SOURCE) as tar:
        tar.extractall(dest, filter='data')
    return dest


def old_environment(tree, *paths):
    """The environment of a process that imports the package from ``tree``
    (then ``paths``), checked: the package of this checkout is installed
    too (editable, which records its own version in the manifests), and
    must not be the one imported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *map(str, paths)]))
    imported = subprocess.run(
        [sys.executable, '-c', 'import skorch_accel_callbacks as p; print(p.__file__)'],
        env=env, cwd=tree, capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert Path(imported.stdout.strip()).is_relative_to(tree), imported.stdout
    return env
