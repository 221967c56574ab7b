"""The package as it was at a kept commit, to write checkpoints of an older
version on the machine under test.

A resume is bit for bit where the arithmetic is the same: the uninterrupted
run it is compared with is computed here, so the checkpoints it resumes must
be computed here too (checkpoints written on another processor hold weights
that differ in their last bits: the kernels sum in another order).
tests/data/ keeps the folders such a version wrote, as users have them on
disk, for what does not depend on the processor (reading, listing,
verifying, the files and the format); the resume tests write theirs with
:func:`old_tree`'s package, from the repository's own history.
"""

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from testutil import machine_lacks

REPO = Path(__file__).resolve().parents[2]
# the last commit before the package was split into subpackages (format 4)
COMMIT = 'f5cb08a'


def old_tree(dest):
    """The repository's files at :data:`COMMIT`, extracted into ``dest``
    (``git archive``); the path of the tree."""
    dest = Path(dest)
    archive = subprocess.run(['git', '-C', str(REPO), 'archive', '--format=tar', COMMIT],
                             capture_output=True, timeout=120)
    if archive.returncode != 0:
        machine_lacks(f"the repository's history up to commit {COMMIT} (git archive: "
                      f"{archive.stderr.decode(errors='replace').strip()})")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
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
