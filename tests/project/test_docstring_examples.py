"""Every example in the package's docstrings runs (``make test`` runs them here,
as ``pytest --doctest-modules`` would), each in a temporary folder of its own:
the folders an example names (``'run1'``) are made there."""

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / 'skorch_accel_callbacks'
MODULES = sorted(
    '.'.join(('skorch_accel_callbacks', *path.relative_to(PACKAGE).with_suffix('').parts))
    .removesuffix('.__init__') for path in PACKAGE.rglob('*.py'))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples(name):
    return [test for test in doctest.DocTestFinder().find(importlib.import_module(name))
            if test.examples]


@pytest.mark.parametrize('name', MODULES)
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in _examples(name):
        runner.run(test)
    failed, tried = runner.summarize(verbose=False)
    assert not failed, f"{name}: {failed} of {tried} example(s) failed (doctest's report above)"


def test_every_examples_section_holds_examples_to_run():
    """A section of examples written as plain code would pass the test above unrun."""
    for name in MODULES:
        module = importlib.import_module(name)
        source = Path(module.__file__).read_text()
        if 'Examples\n    --------' in source or 'Examples\n        --------' in source:
            assert _examples(name), f"{name} has an Examples section with no >>> example"
