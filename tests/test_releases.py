"""The tested releases (skorch_accel_callbacks/_core/releases.py): one range,
stated alike in setup.cfg, the test matrix (noxfile.py) and the code; a
release newer than the range is let through with one warning naming it."""

import ast
import configparser
import re
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from skorch import NeuralNet
from skorch.hf import AccelerateMixin

from common import make_accelerator, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateFixesMixin
from skorch_accel_callbacks._core import releases, skorch_io
from testutil import parse_source

REPO = Path(__file__).resolve().parents[1]


def matrix():
    """noxfile.py's STACKS, read without importing nox."""
    tree = parse_source(REPO / 'noxfile.py')
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], 'id', None) == 'STACKS':
            return ast.literal_eval(node.value)
    raise AssertionError("noxfile.py has no STACKS")


def minor(version):
    return '.'.join(map(str, Version(version).release[:2]))


def test_setup_cfg_and_the_matrix_span_the_tested_range():
    config = configparser.ConfigParser()
    config.read(REPO / 'setup.cfg')
    requires = {Requirement(line).name: Requirement(line) for line in
                config['options']['install_requires'].split('\n') if line.strip()}
    stacks = matrix().values()
    for project, (oldest, newest) in releases.TESTED.items():
        # setup.cfg admits from the oldest tested on, with no ceiling
        assert str(requires[project].specifier) == f'>={oldest}', (project, requires[project])
        tested = sorted({minor(stack[project]) for stack in stacks}, key=Version)
        assert (tested[0], tested[-1]) == (oldest, newest), (project, tested)


def test_the_installed_releases_are_in_the_tested_range():
    # this suite runs on requirements-dev.txt's pins (and nox's matrix)
    assert releases.untested() == []


def test_a_newer_accelerate_is_warned_of_once_naming_the_range(monkeypatch, tmp_path):
    # as if accelerate's installed release were past the newest tested: the
    # newest tested set one minor release below it
    installed = Version(releases.metadata.version('accelerate'))
    below = f'{installed.major}.{installed.minor - 1}'
    monkeypatch.setitem(releases.TESTED, 'accelerate', ('1.0', below))
    assert releases.untested() == [f'accelerate {installed} (tested: 1.0 to {below})']
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('default')
        for _ in range(3):
            AccelerateCheckpoint(dirname=str(tmp_path / 'ck')).initialize().close()
    messages = [str(w.message) for w in caught if 'not tested with' in str(w.message)]
    assert len(messages) == 1, messages
    assert f'accelerate {installed} (tested: 1.0 to {below})' in messages[0]


@pytest.mark.parametrize('project', sorted(releases.TESTED))
def test_an_older_release_is_no_concern_of_the_warning(monkeypatch, project):
    installed = Version(releases.metadata.version(project))
    monkeypatch.setitem(releases.TESTED, project, (minor(str(installed)), '99.0'))
    assert releases.untested() == []


# the package's reads of skorch's private attributes, outside skorch_io
# (accelerate's registries are accelerator._optimizers & co., accelerate_io's)
SKORCH_PRIVATE = re.compile(
    r'(?<!accelerator)\.(_modules|_criteria|_optimizers|_wrapped_with_accelerator)\b')


def test_every_internal_of_skorch_the_package_uses_is_there():
    # run by every stack of noxfile.py's matrix, as the quick subset is
    assert skorch_io.missing_internals() == []


def test_skorch_internals_are_read_in_skorch_io_alone():
    package = REPO / 'skorch_accel_callbacks'
    uses = [f'{path.relative_to(REPO)}:{number}: {line.strip()}'
            for path in sorted(package.rglob('*.py')) if path.name != 'skorch_io.py'
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if SKORCH_PRIVATE.search(line.split('#')[0])]
    assert uses == []


def test_every_private_method_of_skorch_the_mixin_overrides_is_gated():
    # an override of a method skorch renamed would never run: each is in
    # OVERRIDDEN, which check_internals checks at initialize
    overridden = {
        name for name in vars(AccelerateFixesMixin)
        if name.startswith('_') and not name.startswith('__')
        and any(name in vars(cls) for cls in (NeuralNet, AccelerateMixin))}
    gated = {name for names in skorch_io.OVERRIDDEN.values() for name in names}
    assert overridden == gated


def test_a_skorch_that_moved_an_internal_is_refused_at_initialize_naming_it(monkeypatch,
                                                                            tmp_path):
    monkeypatch.delattr(AccelerateMixin, '_unwrap_accelerator')
    net = make_net(make_accelerator(), max_epochs=1,
                   callbacks=[AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))])
    installed = releases.metadata.version('skorch')
    oldest, newest = releases.TESTED['skorch']
    with pytest.raises(RuntimeError) as info:
        net.initialize()
    assert str(info.value).startswith(
        f"FixedNet: skorch {installed} has no AccelerateMixin._unwrap_accelerator, which "
        f"this package uses (tested with skorch {oldest} to {newest}); install a tested skorch")
