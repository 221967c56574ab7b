"""The releases of torch, accelerate and skorch the package is tested with.

The package reaches into internals of accelerate and skorch (accelerate's in
:mod:`.accelerate_io`), which a release may move. setup.cfg admits every
release from the oldest tested on; one newer than the newest tested is let
through with a warning naming the range, not refused: the test matrix
(noxfile.py) is what grows the range.
"""

from __future__ import annotations

import warnings
from importlib import metadata

from packaging.version import Version

# project name: (oldest, newest) tested minor release; noxfile.py's STACKS
# span these, setup.cfg's install_requires begins at the oldest
TESTED: dict[str, tuple[str, str]] = {
    'torch': ('2.11', '2.14'),
    'accelerate': ('1.13', '1.16'),
    'skorch': ('1.3', '1.4'),
}


def refuse_moved_internals(owner: str, project: str, missing: list[str]) -> None:
    """Raise ``RuntimeError`` if ``missing`` (internals of ``project`` that
    the package uses, as ``'Accelerator._models'``) is not empty: it names
    them, the installed release, the tested range and the ``pip install``
    of a tested release; ``owner`` begins the message."""
    if missing:
        oldest, newest = TESTED[project]
        raise RuntimeError(
            f"{owner}: {project} {metadata.version(project)} has no {', '.join(missing)}, "
            f"which this package uses (tested with {project} {oldest} to {newest}); install "
            f"a tested {project}: pip install '{project}>={oldest},<{next_minor(newest)}'")


def next_minor(release: str) -> str:
    """The minor release after ``release``: ``'1.16'`` -> ``'1.17'``."""
    major, minor = release.split('.')[:2]
    return f'{major}.{int(minor) + 1}'


def torch_loads_safetensors() -> bool:
    """Whether ``torch.load`` reads a ``.safetensors`` file (from torch 2.13
    on), as skorch's ``load_params`` does without ``use_safetensors``."""
    return Version(metadata.version('torch')).release[:2] >= (2, 13)


def untested() -> list[str]:
    """Each installed release newer than the newest tested of its project,
    as ``'accelerate 1.17.0 (tested: 1.13 to 1.16)'``."""
    found = []
    for project, (oldest, newest) in TESTED.items():
        installed = Version(metadata.version(project))
        if (installed.major, installed.minor) > Version(newest).release[:2]:
            found.append(f"{project} {installed} (tested: {oldest} to {newest})")
    return found


def warn_if_untested() -> None:
    """One warning per process (the warning registry of this line) if a
    release newer than the tested range is installed."""
    found = untested()
    if found:
        warnings.warn(
            f"skorch-accel-callbacks is not tested with {', '.join(found)}: it uses "
            "internals of accelerate and skorch that a release may change; if a save or "
            "resume fails, install a tested release and report it",
            UserWarning, stacklevel=3)
