"""The tested releases (skorch_accel_callbacks/_core/releases.py): one range,
stated alike in setup.cfg, the test matrix (noxfile.py) and the code; a
release newer than the range is let through with one warning naming it."""

import ast
import configparser
import re
import warnings
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version
from skorch import NeuralNet
from skorch.hf import AccelerateMixin

from common import MLP, FixedNet, StockNet, make_accelerator, make_data, make_net
from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateFixesMixin
from skorch_accel_callbacks._core import accelerate_io, releases, skorch_io
from skorch_accel_callbacks.engine import _consolidate
from testutil import parse_source

REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize('torch_reads_it', [None, False], ids=['installed-torch', 'older-torch'])
def test_a_plain_net_loads_a_checkpoint_without_use_safetensors_on_every_torch(
        monkeypatch, tmp_path, torch_reads_it):
    # torch.load reads a .safetensors file from torch 2.13 on; before, the
    # checkpoint hands skorch's load_params the tensors in torch's format
    # (the installed torch's case, and an older torch's on any)
    if torch_reads_it is None:
        torch_reads_it = releases.torch_loads_safetensors()
    monkeypatch.setattr(_consolidate, 'torch_loads_safetensors', lambda: torch_reads_it)
    X, y = make_data(n=64)
    cp = AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))
    trained = make_net(make_accelerator(), max_epochs=1, callbacks=[cp]).fit(X, y)
    files = cp.get_formatted_files(None)
    assert isinstance(files['f_params'], str) is torch_reads_it
    if not torch_reads_it:
        # what torch older than 2.13 reads: a torch archive, not a safetensors file
        assert torch.load(files['f_params'], weights_only=True).keys() == \
            trained.module_.state_dict().keys()
        files['f_params'].seek(0)
    plain = NeuralNet(MLP, criterion=torch.nn.NLLLoss).initialize()
    plain.load_params(**files)
    for name, tensor in trained.module_.state_dict().items():
        assert torch.equal(plain.module_.state_dict()[name], tensor), name


def test_every_internal_of_accelerate_the_package_uses_is_there():
    # run by every stack of noxfile.py's matrix, as the quick subset is
    assert accelerate_io.missing_internals(make_accelerator()) == []


def accelerate_internals(path):
    """``(line, 'Accelerator.<private>' or 'GradientState.<name>')`` of each
    read in the code of ``path``: of a name ending in ``accelerator``, an
    attribute with a leading ``_``, and any of a ``gradient_state``."""
    found = []
    for node in ast.walk(parse_source(path)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(
            node.value, 'id', '')
        if owner.endswith('accelerator') and node.attr.startswith('_'):
            found.append((node.lineno, f'Accelerator.{node.attr}'))
        elif owner == 'gradient_state':
            found.append((node.lineno, f'GradientState.{node.attr}'))
    return found


def test_accelerate_internals_are_read_in_accelerate_io_alone_and_all_checked():
    package = REPO / 'skorch_accel_callbacks'
    elsewhere = [(str(path.relative_to(REPO)), line, name)
                 for path in sorted(package.rglob('*.py')) if path.name != 'accelerate_io.py'
                 for line, name in accelerate_internals(path)]
    assert elsewhere == []
    read = {name for _, name in accelerate_internals(package / '_core' / 'accelerate_io.py')}
    assert read == ({f'Accelerator.{name}' for name in accelerate_io.ATTRIBUTES}
                    | {f'GradientState.{name}' for name in accelerate_io.GRADIENT_STATE})


@pytest.mark.parametrize('owner', ['net', 'checkpoint'])
def test_an_accelerate_that_moved_an_internal_is_refused_before_training_naming_it(
        tmp_path, owner):
    accelerator = make_accelerator()
    del accelerator._custom_objects
    installed = releases.metadata.version('accelerate')
    oldest, newest = releases.TESTED['accelerate']
    net_cls = FixedNet if owner == 'net' else StockNet
    net = make_net(accelerator, net_cls=net_cls, max_epochs=1,
                   callbacks=[AccelerateCheckpoint(dirname=str(tmp_path / 'ck'))])
    with pytest.raises(RuntimeError) as info:
        net.fit(*make_data(n=64))
    assert str(info.value).startswith(
        f"{'FixedNet' if owner == 'net' else 'AccelerateCheckpoint'}: accelerate "
        f"{installed} has no Accelerator._custom_objects, which this package uses (tested "
        f"with accelerate {oldest} to {newest}); install a tested accelerate")
    assert not (tmp_path / 'ck').exists() or not any((tmp_path / 'ck').glob('epoch-*'))
