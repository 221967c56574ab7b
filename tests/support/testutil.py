"""Helpers shared by the test modules of every folder of tests/.

A plain module with a name of its own (``conftest`` is pytest's: there is
one in tests/ and one in tests/faults/). The pytest configuration puts
tests/support (the helpers: this module, the launcher, the local S3
server, the shared fits), tests/workers, tests/faults and
tests/faults/workers on ``sys.path`` (``pythonpath`` in setup.cfg).
"""

import ast
import functools
import gc
import json
import os
import sys
from pathlib import Path

import torch


def read_results(folder, name, world_size):
    """Each rank's JSON result of a worker script, indexed by rank."""
    results = []
    for rank in range(world_size):
        path = Path(folder) / f'{name}-rank{rank}.json'
        assert path.exists(), f"rank {rank} wrote no result {path.name}"
        results.append(json.loads(path.read_text()))
    return results


@functools.cache
def parse_source(path):
    """The syntax tree of the Python file at ``path``, parsed once a process.

    CPython 3.11.7 keeps one interpreter-wide recursion counter for building
    an ``ast`` tree; a collection of garbage in the middle of ``ast.parse``
    can run a finalizer, or hand the interpreter to a thread of an earlier
    test, that parses too and leaves the counter off (``SystemError: AST
    constructor recursion depth mismatch``, CPython gh-106905).
    With the collector paused no Python code runs while the tree is built.
    """
    source = Path(path).read_text()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename=str(path))
    finally:
        if was_enabled:
            gc.enable()


def read_json(path):
    return json.loads(Path(path).read_text())


def edit_manifest(folder, edit=None, **changes):
    """Rewrite ``folder/manifest.json``: ``edit(manifest)`` changes it in
    place, ``changes`` replace top-level entries."""
    path = Path(folder) / 'manifest.json'
    manifest = json.loads(path.read_text())
    if edit is not None:
        edit(manifest)
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


def final_state(folder, tag):
    """What every rank of a job wrote to ``<TAG>-rank<r>.pt`` when training
    ended (:func:`common.write_final_state`), rank by rank: parameters,
    optimizer states, history and random states, to compare bit for bit."""
    states = []
    while os.path.exists(path := os.path.join(folder, f'{tag}-rank{len(states)}.pt')):
        states.append(torch.load(path, weights_only=False))
    assert states, f"no rank of {tag!r} wrote its final state to {folder}"
    return states


def assert_identical(a, b):
    """Bit-identical parameters, optimizer states and random states, equal
    per-epoch losses: of one rank (a state), or of every rank (the lists
    :func:`final_state` returns)."""
    if isinstance(a, dict):
        a, b = [a], [b]
    assert len(a) == len(b), f"{len(a)} ranks wrote a final state, then {len(b)}"
    for rank, (state_a, state_b) in enumerate(zip(a, b, strict=True)):
        _assert_rank_identical(state_a, state_b, f"rank {rank}: ")


def _assert_rank_identical(a, b, rank):
    assert a['params'].keys() == b['params'].keys()
    for name in a['params']:
        for key, tensor in a['params'][name].items():
            assert torch.equal(tensor, b['params'][name][key]), f"{rank}{name}.{key} differs"
    assert a['optimizers'].keys() == b['optimizers'].keys()
    for name in a['optimizers']:
        assert_nested_equal(a['optimizers'][name], b['optimizers'][name], f"{rank}{name}")
    assert len(a['history']) == len(b['history']), rank
    for row_a, row_b in zip(a['history'], b['history'], strict=True):
        for key in ('train_loss', 'valid_loss', 'event_lr'):
            assert row_a[key] == row_b[key], (rank, row_a['epoch'], key, row_a[key], row_b[key])
    # a snapshot when the first resumed epoch began has none
    if 'random' in a and 'random' in b:
        assert_nested_equal(a['random'], b['random'], f"{rank}random states")


def assert_nested_equal(a, b, where='state'):
    """``a == b`` down nested dicts, lists and tensors (``torch.equal``),
    naming the first place that differs."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_nested_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_nested_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def replace_everywhere(monkeypatch, function, replacement):
    """Replace ``function`` in every module of the package that looks it up
    by name (the subpackages import what they use from another's face, so
    each user holds its own reference); return those modules' names."""
    replaced = sorted(name for name, module in list(sys.modules.items())
                      if name.startswith('skorch_accel_callbacks.')
                      and getattr(module, function.__name__, None) is function)
    for name in replaced:
        monkeypatch.setattr(sys.modules[name], function.__name__, replacement)
    assert replaced, f"no module of the package holds {function.__name__}"
    return replaced


def machine_lacks(what):
    """Skip a test that this machine cannot run (``what`` says why), except
    in CI, whose machine has what the suite needs: there a missing piece
    fails the test instead of leaving its case untested."""
    # here, not at the top: the launched workers import this module too,
    # and need no pytest in their start-up
    import pytest
    if os.environ.get('CI'):
        pytest.fail(f"CI's machine should have what this test needs: {what}")
    pytest.skip(what)


#: how long one command of the package's command line may take (a fresh
#: interpreter that imports torch, and a checkpoint's files read)
CLI_TIMEOUT = 300


def cli(*args, cwd=None):
    """``python -m skorch_accel_callbacks ARGS`` as a user runs it, with the
    package of this checkout: the completed process, output as text."""
    import subprocess
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(repo), os.environ.get('PYTHONPATH', '')]))
    return subprocess.run(
        [sys.executable, '-m', 'skorch_accel_callbacks', *map(str, args)], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=CLI_TIMEOUT)
