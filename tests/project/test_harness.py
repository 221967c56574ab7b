"""The suite's own rules, run on probe tests under this repository's pytest
configuration: a test that hangs in the pytest process fails at the
configured timeout, and a test that this machine cannot run skips here but
fails where ``CI`` is set; and the longest files, which the suite hands out
first, are files that exist."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from testutil import parse_source

REPO = Path(__file__).resolve().parents[2]

PROBES = textwrap.dedent("""
    import time

    from testutil import machine_lacks


    def test_hangs():
        time.sleep(120)


    def test_lacks_something():
        machine_lacks('a probe of the harness')
""")


def run_probe(tmp_path, name, ci, *options):
    (tmp_path / 'test_probes.py').write_text(PROBES)
    env = {key: value for key, value in os.environ.items() if key != 'CI'}
    if ci:
        env['CI'] = 'true'
    return subprocess.run(
        [sys.executable, '-m', 'pytest', '-c', str(REPO / 'setup.cfg'), '--rootdir', str(REPO),
         '-p', 'no:cacheprovider', '-rs', *options, f"{tmp_path / 'test_probes.py'}::{name}"],
        capture_output=True, text=True, timeout=90, env=env, cwd=REPO)


def test_setup_cfg_bounds_a_test_in_the_pytest_process():
    from configparser import ConfigParser
    config = ConfigParser()
    config.read(REPO / 'setup.cfg')
    assert int(config['tool:pytest']['timeout']) > 0
    assert config['tool:pytest']['timeout_method'] == 'thread'


def test_a_hung_test_fails_at_the_timeout(tmp_path):
    # the configured method, a bound short enough for the probe
    done = run_probe(tmp_path, 'test_hangs', False, '-o', 'timeout=3')
    assert done.returncode != 0, done.stdout
    assert 'Timeout' in done.stdout + done.stderr, done.stdout + done.stderr
    assert 'test_hangs' in done.stdout + done.stderr


def test_a_missing_piece_of_the_machine_skips_saying_what(tmp_path):
    done = run_probe(tmp_path, 'test_lacks_something', False)
    assert done.returncode == 0, done.stdout
    assert 'SKIPPED' in done.stdout and 'a probe of the harness' in done.stdout, done.stdout


def test_in_ci_a_missing_piece_of_the_machine_fails(tmp_path):
    done = run_probe(tmp_path, 'test_lacks_something', True)
    assert done.returncode == 1, done.stdout
    assert "CI's machine should have what this test needs: a probe of the harness" in done.stdout


def test_the_longest_files_handed_out_first_exist():
    # conftest orders them by their paths: a moved file would lose its place
    # unseen, and a worker end up running two long files in turn (read from
    # its source: tests/ and tests/faults each have a module named conftest)
    tree = parse_source(REPO / 'tests' / 'conftest.py')
    listed = next(ast.literal_eval(node.value) for node in tree.body
                  if isinstance(node, ast.Assign) and node.targets[0].id == 'LONGEST_FIRST')
    assert listed and [name for name in listed
                       if not (REPO / 'tests' / name).is_file()] == []
