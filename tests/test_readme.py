"""Every Python block of README.rst runs, as written.

The blocks run in order, in one namespace, in a fresh process in a temporary
folder (a README reader pastes them one after the other into one session). A
block with ``:name: <file>.py`` is a script the README tells to save and
launch: it is written to that file and run in 2 CPU processes, twice, as the
resume story does. Shell blocks are not run; the ``make`` targets and files
they name must exist.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from launcher import REPO, launch

README = REPO / 'README.rst'
TIMEOUT = 300

# Runs in the fresh process: execs each block, with README line numbers in
# tracebacks, and says which blocks finished.
RUNNER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {'__name__': '__readme__'}
for block in blocks:
    code = '\\n' * (block['line'] - 1) + block['source']
    exec(compile(code, sys.argv[2], 'exec'), namespace)
    print(f"README block at line {block['line']}: ran", flush=True)
"""


def code_blocks(text):
    """``(language, options, first line number, source)`` of every code block."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = re.match(r'^(\s*)\.\. code-block:: *(\w+)\s*$', lines[i])
        i += 1
        if not match:
            continue
        indent = len(match.group(1))
        options = {}
        while i < len(lines) and re.match(r'^\s+:(\w[\w-]*):(.*)$', lines[i]):
            key, value = re.match(r'^\s+:(\w[\w-]*):(.*)$', lines[i]).groups()
            options[key] = value.strip()
            i += 1
        body = []
        start = i + 1
        while i < len(lines) and (not lines[i].strip()
                                  or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        # leading blank lines belong to the directive, not the code
        while body and not body[0].strip():
            body.pop(0)
            start += 1
        blocks.append((match.group(2), options, start, textwrap.dedent('\n'.join(body))))
    return blocks


BLOCKS = code_blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b[0] == 'python' and 'name' not in b[1]]
SCRIPTS = [b for b in BLOCKS if b[0] == 'python' and 'name' in b[1]]
SHELL = [b for b in BLOCKS if b[0] == 'bash']


def test_readme_has_the_blocks_this_test_expects():
    assert {language for language, *_ in BLOCKS} <= {'python', 'bash'}
    assert len(PYTHON) >= 5 and len(SCRIPTS) == 1 and SHELL
    # the parser took whole blocks: each compiles on its own
    for _, _, line, source in PYTHON + SCRIPTS:
        compile('\n' * (line - 1) + source, str(README), 'exec')


@pytest.mark.slow
def test_python_blocks_run_in_order_in_one_process(tmp_path):
    blocks = tmp_path / 'blocks.json'
    blocks.write_text(json.dumps(
        [{'line': line, 'source': source} for _, _, line, source in PYTHON]))
    # Accelerator() of the blocks then runs on CPU on a GPU machine too
    env = dict(os.environ, ACCELERATE_USE_CPU='true')
    proc = subprocess.run(
        [sys.executable, '-c', RUNNER, str(blocks), str(README)], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    ran = re.findall(r'README block at line (\d+): ran', proc.stdout)
    assert [int(line) for line in ran] == [line for _, _, line, _ in PYTHON]
    # what the blocks say they do
    assert (tmp_path / 'checkpoints' / 'latest.json').exists()
    assert (tmp_path / 'checkpoints' / 'epoch-0008').is_dir()
    assert (tmp_path / 'best' / 'params.pt').exists()
    assert (tmp_path / 'final' / 'train_end_params.pt').exists()
    assert (tmp_path / 'weights.pt').exists()
    assert (tmp_path / 'model' / 'params.safetensors').exists()
    assert (tmp_path / 'checkpoints-node0' / 'epoch-0002').is_dir()


@pytest.mark.slow
@pytest.mark.parametrize('name', [b[1]['name'] for b in SCRIPTS])
def test_script_blocks_start_and_resume_in_two_processes(tmp_path, monkeypatch, name):
    _, _, _, source = next(b for b in SCRIPTS if b[1]['name'] == name)
    script = tmp_path / name
    script.write_text(source)
    # what `ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2` gives the script
    env = {'ACCELERATE_USE_CPU': 'true'}
    monkeypatch.chdir(tmp_path)  # the ranks start here: 'checkpoints' is relative
    first = launch(script, nproc=2, timeout=TIMEOUT, env=env).check()
    assert 'No checkpoint in checkpoints; training from scratch.' in first.outputs[0]
    assert (tmp_path / 'checkpoints' / 'epoch-0006').is_dir()
    again = launch(script, nproc=2, timeout=TIMEOUT, env=env).check()
    assert ('Resumed from checkpoints/epoch-0006 after epoch 6; max_epochs had been reached.'
            in again.outputs[0])


def test_make_targets_and_paths_named_in_the_readme_exist():
    makefile = (REPO / 'Makefile').read_text()
    targets = set(re.findall(r'^([\w-]+):', makefile, flags=re.M))
    text = README.read_text()
    named = set(re.findall(r'\bmake ([\w-]+)', '\n'.join(source for *_, source in SHELL)))
    named |= set(re.findall(r'``make ([\w-]+)', text))
    assert named and named <= targets, named - targets
    paths = set(re.findall(r'\b((?:examples|tests|benchmarks)/[\w./-]*\w)', text))
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing
