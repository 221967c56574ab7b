"""Every Python block of the README and of the docs pages runs, as written.

The blocks of a page (``README.rst``, ``docs/*.rst``) run in order, in one
namespace, in a fresh process in a temporary folder (a reader pastes them
one after the other into one session). A page with the comment
``.. test-setup: quickstart.rst`` starts from the quick start's set-up: the
first Python block of ``docs/quickstart.rst`` runs before its own, as its
text says. A block with ``:name: <file>.py`` is a script the page tells to
save and launch: it is written to that file and run in 2 CPU processes,
twice, as the resume story does. The command lines of shell blocks run
too (make test-extended), and a transcript (``$ <command>`` and what it
printed) must be what the command prints, numbers aside; the ``make``
targets and files that any page names must exist.
"""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from launcher import REPO, launch

DOCS = REPO / 'docs'
PAGES = [REPO / 'README.rst', *sorted(DOCS.glob('*.rst'))]
TIMEOUT = 300

# Runs in the fresh process: execs each block, with the page's line numbers
# in tracebacks, and says which blocks finished.
RUNNER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {'__name__': '__docs__'}
for block in blocks:
    code = '\\n' * (block['line'] - 1) + block['source']
    exec(compile(code, block['page'], 'exec'), namespace)
    print(f"block at {block['page']}:{block['line']}: ran", flush=True)
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


def python_blocks(page):
    """The blocks a fresh process runs for ``page``: the set-up it names
    (``.. test-setup: <page>``: that page's first Python block), then its own
    Python blocks but scripts, as ``{'page', 'line', 'source'}``."""
    text = page.read_text()
    blocks = []
    for setup in re.findall(r'^\.\. test-setup: *(\S+)\s*$', text, flags=re.M):
        _, _, line, source = next(b for b in code_blocks((DOCS / setup).read_text())
                                  if b[0] == 'python')
        blocks.append({'page': str(DOCS / setup), 'line': line, 'source': source})
    return blocks + [{'page': str(page), 'line': line, 'source': source}
                     for language, options, line, source in code_blocks(text.replace('\t', ' '))
                     if language == 'python' and 'name' not in options]


BLOCKS = {page: code_blocks(page.read_text()) for page in PAGES}
RUN = {page: python_blocks(page) for page in PAGES if python_blocks(page)}
SCRIPTS = [(page, options['name'], source) for page, blocks in BLOCKS.items()
           for language, options, _, source in blocks
           if language == 'python' and 'name' in options]
SHELL = [source for blocks in BLOCKS.values() for language, _, _, source in blocks
         if language == 'bash']

# what the blocks of each page say they leave behind, in its folder
LEAVES = {
    'README.rst': ['checkpoints/latest.json', 'checkpoints/epoch-0008'],
    'quickstart.rst': ['checkpoints/latest.json', 'checkpoints/epoch-0008',
                       'model/params.safetensors', 'search'],
    'mid_epoch.rst': ['checkpoints-steps/epoch-0001-step-00000005', 'checkpoints-steps/epoch-0002'],
    'params.rst': ['best/params.pt', 'final/train_end_params.pt', 'weights.pt'],
    'several_machines.rst': ['checkpoints-node0/epoch-0002'],
}


def test_the_pages_have_the_blocks_this_test_expects():
    languages = {language for blocks in BLOCKS.values() for language, *_ in blocks}
    assert languages <= {'python', 'bash'}
    assert len(RUN) >= 8 and SHELL
    assert [(page.name, name) for page, name, _ in SCRIPTS] == [('resume.rst', 'train.py')]
    assert set(LEAVES) <= {page.name for page in RUN}
    # the parser took whole blocks: each compiles on its own
    for blocks in RUN.values():
        for block in blocks:
            compile('\n' * (block['line'] - 1) + block['source'], block['page'], 'exec')
    for _, name, source in SCRIPTS:
        compile(source, name, 'exec')


@pytest.mark.slow
@pytest.mark.parametrize('page', list(RUN), ids=lambda page: page.name)
def test_python_blocks_of_a_page_run_in_order_in_one_process(tmp_path, page):
    blocks = tmp_path / 'blocks.json'
    blocks.write_text(json.dumps(RUN[page]))
    # Accelerator() of the blocks then runs on CPU on a GPU machine too
    env = dict(os.environ, ACCELERATE_USE_CPU='true')
    proc = subprocess.run(
        [sys.executable, '-c', RUNNER, str(blocks)], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    ran = re.findall(r'block at (.+):(\d+): ran', proc.stdout)
    assert ran == [(block['page'], str(block['line'])) for block in RUN[page]]
    missing = [path for path in LEAVES.get(page.name, []) if not (tmp_path / path).exists()]
    assert not missing, proc.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize('name', [name for _, name, _ in SCRIPTS], ids=str)
def test_script_blocks_start_and_resume_in_two_processes(tmp_path, monkeypatch, name):
    source = next(source for _, script, source in SCRIPTS if script == name)
    script = tmp_path / name
    script.write_text(source)
    # what `ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2` gives the script
    env = {'ACCELERATE_USE_CPU': 'true'}
    monkeypatch.chdir(tmp_path)  # the ranks start here: 'checkpoints' is relative
    first = launch(script, nproc=2, timeout=TIMEOUT, env=env).check()
    assert 'No checkpoint in checkpoints; training from scratch.' in first.outputs[0]
    manifest = json.loads((tmp_path / 'checkpoints' / 'epoch-0006' / 'manifest.json').read_text())
    assert manifest['world_size'] == 2  # the script ran in 2 processes, not in 2 alone
    again = launch(script, nproc=2, timeout=TIMEOUT, env=env).check()
    assert ('Resumed from checkpoints/epoch-0006 after epoch 6; max_epochs had been reached.'
            in again.outputs[0])


def test_make_targets_and_paths_named_in_the_pages_exist():
    makefile = (REPO / 'Makefile').read_text()
    targets = set(re.findall(r'^([\w-]+):', makefile, flags=re.M))
    text = '\n'.join(page.read_text() for page in PAGES)
    named = set(re.findall(r'\bmake ([\w-]+)', '\n'.join(SHELL)))
    named |= set(re.findall(r'``make ([\w-]+)', text))
    assert named and named <= targets, named - targets
    paths = set(re.findall(r'\b((?:examples|tests|benchmarks|docs)/[\w./-]*\w)', text))
    # what a docs build writes
    paths -= {'docs/_build/html', 'docs/_build/html/index.html', 'docs/_generated'}
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing


def test_the_readme_links_to_pages_that_exist():
    text = (REPO / 'README.rst').read_text()
    links = set(re.findall(r'<(docs/[\w/.-]+\.rst)>`__', text))
    # every page but the site's own index is linked, and nothing else under docs/
    assert links == {f'docs/{page.name}' for page in DOCS.glob('*.rst')} - {'docs/index.rst'}
    assert len(text.splitlines()) < 300


# the command lines of the pages' shell blocks, as a user types them
CLI = [line.split('#')[0].strip() for source in SHELL for line in source.splitlines()
       if line.strip().startswith('python -m skorch_accel_callbacks ')]


def best_at_epoch_3(net):
    return len(net.history) == 3


@pytest.fixture(scope='module')
def checkpoints_folder(tmp_path_factory):
    """A working folder whose ``checkpoints`` holds what the pages' command
    lines name: epochs 1 to 4, epoch 3 the best."""
    from common import make_accelerator, make_data, make_net
    from skorch_accel_callbacks import AccelerateCheckpoint, AccelerateLoadInitState
    where = tmp_path_factory.mktemp('cli')
    cp = AccelerateCheckpoint(dirname=str(where / 'checkpoints'), monitor=best_at_epoch_3,
                              keep_best=1, keep_last=4)
    make_net(make_accelerator(), max_epochs=4,
             callbacks=[cp, AccelerateLoadInitState(cp)]).fit(*make_data(n=64))
    return where


def test_the_pages_have_command_lines():
    assert len(CLI) >= 4, CLI
    assert {line.split()[3] for line in CLI} == {'list', 'verify', 'export'}


# each line starts an interpreter that imports torch: make test-extended
# (which CI runs), to keep make test within its 30 minutes
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize('line', CLI)
def test_each_command_line_of_the_pages_runs_as_written(checkpoints_folder, line):
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.run([sys.executable, *line.split()[1:]], cwd=checkpoints_folder, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{line}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_the_wheel_the_pages_name_is_this_version_s():
    from skorch_accel_callbacks import __version__
    named = {name for page in PAGES
             for name in re.findall(r'skorch_accel_callbacks-[\w.]+-py3-none-any\.whl',
                                    page.read_text())}
    assert named == {f'skorch_accel_callbacks-{__version__}-py3-none-any.whl'}, named


def transcripts(page):
    """``(command, output lines)`` of each literal block of ``page`` that
    shows a command line (``$ ...``) and what it printed."""
    found = []
    for match in re.finditer(r'::\n\n((?:(?: {4}.*)?\n)+)', page.read_text()):
        lines = textwrap.dedent(match.group(1)).strip('\n').splitlines()
        if lines and lines[0].startswith('$ '):
            found.append((lines[0][2:], lines[1:]))
    return found


def shape(line):
    """A pattern of ``line`` whose words must match and whose numbers (any
    word with a digit: sizes, scores, times, pids) may differ."""
    words = [r'\S*\d\S*' if re.search(r'\d', word) else re.escape(word)
             for word in line.split()]
    return re.compile(r'\s*' + r'\s+'.join(words) + r'\s*')


INSPECTION = dict(transcripts(DOCS / 'inspection.rst'))


@pytest.fixture
def killed_in_the_save_of_epoch_4(tmp_path):
    """The folder of inspection.rst's transcripts: epochs 2 and 3 kept,
    ``latest.json`` naming epoch 3 and the partial folder of epoch 4's save,
    as a job killed in it leaves them."""
    from common import make_accelerator, make_data, make_net
    from skorch_accel_callbacks import AccelerateCheckpoint
    folder = tmp_path / 'checkpoints'
    cp = AccelerateCheckpoint(dirname=str(folder), keep_last=3)
    make_net(make_accelerator(), max_epochs=4, callbacks=[cp]).fit(*make_data(n=64))
    (folder / 'epoch-0004').rename(folder / 'epoch-0004.partial')
    (folder / 'latest.json').write_text(json.dumps({'name': 'epoch-0003'}))
    return tmp_path


def run_cli(command, cwd, monkeypatch, capsys):
    from skorch_accel_callbacks.tools.cli import main
    monkeypatch.chdir(cwd)
    code = main(command.split()[3:])
    # the page's machine is called vm
    return code, capsys.readouterr().out.replace(socket.gethostname(), 'vm').splitlines()


def assert_shaped(printed, shown):
    assert len(printed) == len(shown), (printed, shown)
    for got, expected in zip(printed, shown, strict=True):
        assert shape(expected).fullmatch(got), (got, expected)


def test_the_transcripts_of_list_and_verify_are_what_they_print(
        killed_in_the_save_of_epoch_4, monkeypatch, capsys):
    # the pages' only transcripts, each run here
    assert [page.name for page in PAGES if transcripts(page)] == ['inspection.rst']
    assert sorted(INSPECTION) == ['python -m skorch_accel_callbacks list checkpoints',
                                  'python -m skorch_accel_callbacks verify checkpoints']
    listed = 'python -m skorch_accel_callbacks list checkpoints'
    code, printed = run_cli(listed, killed_in_the_save_of_epoch_4, monkeypatch, capsys)
    assert code == 0
    assert_shaped(printed, INSPECTION[listed])
    # the page's damage: the first byte of the model file's header
    model = killed_in_the_save_of_epoch_4 / 'checkpoints' / 'epoch-0003' / 'model.safetensors'
    data = bytearray(model.read_bytes())
    data[8] = 0xff
    model.write_bytes(bytes(data))
    verified = 'python -m skorch_accel_callbacks verify checkpoints'
    code, printed = run_cli(verified, killed_in_the_save_of_epoch_4, monkeypatch, capsys)
    assert code == 1
    assert_shaped(printed, INSPECTION[verified])


# the pages a user reads from start to end (not the contributors' page, the
# changelog or the tables of measurements)
USER_PAGES = [page for page in PAGES
              if page.name not in ('development.rst', 'changes.rst', 'benchmarks.rst')]
# a line that begins a list item, a directive, a table or a title's underline
NOT_PROSE = re.compile(r'^\s*(- |\* |\d+\. |#\. |\.\. |[=+|]|[-=~^]{3,}\s*$)')


def prose_paragraphs(text):
    """``(line number, lines)`` of each paragraph and list item of ``text``,
    outside literal blocks, code blocks and tables."""
    found, current, literal = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        indent = len(line) - len(line.lstrip())
        if literal is not None and (not line.strip() or indent > literal):
            continue
        literal = None
        starts_item = re.match(r'^\s*(- |\* |\d+\. |#\. )', line)
        if not line.strip() or (NOT_PROSE.match(line) and not starts_item) or starts_item:
            if current:
                found.append(current)
            current = []
        if line.strip() and not (NOT_PROSE.match(line) and not starts_item):
            current.append((number, line))
        if line.rstrip().endswith('::') or re.match(r'^\s*\.\. (code-block|list-table)', line):
            literal = indent
            if current:
                found.append(current)
            current = []
    if current:
        found.append(current)
    return [(lines[0][0], [line for _, line in lines]) for lines in found]


def test_no_paragraph_of_a_user_page_is_longer_than_8_lines():
    long = [f'{page.name}:{number}: {len(lines)} lines'
            for page in USER_PAGES
            for number, lines in prose_paragraphs(page.read_text()) if len(lines) > 8]
    assert long == []


def _inventories():
    sys.path.insert(0, str(DOCS))
    try:
        import inventories
    finally:
        sys.path.remove(str(DOCS))
    return inventories


def _resolve(name):
    """The object a dotted name stands for: the longest importable module
    prefix, then attributes."""
    import importlib
    parts = name.split('.')
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module('.'.join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(name)


def test_every_object_of_the_kept_inventories_exists_and_is_linked_to():
    # docs/inventories/ stands in for the sites' own (the build is offline):
    # a name that the installed library lacks would link to nothing, and one
    # that no page links to is dead weight
    inventories = _inventories()
    sources = [*PAGES, *sorted((REPO / 'skorch_accel_callbacks').rglob('*.py'))]
    text = '\n'.join(path.read_text() for path in sources)
    listed = {path.stem: inventories.names(path)
              for path in sorted(inventories.HERE.glob('*.txt'))}
    assert sorted(listed) == ['accelerate', 'skorch', 'torch']
    for project, names in listed.items():
        assert names, project
        for name in names:
            assert name.split('.')[0] == project, (project, name)
            assert callable(_resolve(name)), name
            assert re.search(rf"(:[a-z]+:`~?|<){re.escape(name)}(`|>)", text), \
                f"no page or docstring links to {name} ({project}.txt)"


def test_the_built_inventories_are_what_intersphinx_reads(tmp_path):
    # Sphinx is a tool of make docs, not of the support matrix's environments
    inventory = pytest.importorskip('sphinx.util.inventory')
    inventories = _inventories()
    mapping = inventories.compile_inventories(tmp_path)
    for project, (site, path) in mapping.items():
        assert site.startswith('https://') and site.endswith('/'), site
        with open(path, 'rb') as f:
            loaded = inventory.InventoryFile.load(f, site, lambda base, uri: base + uri)
        found = {name: entry for objects in loaded.values() for name, entry in objects.items()}
        assert sorted(found) == sorted(inventories.names(inventories.HERE / f'{project}.txt'))
        for name, entry in found.items():
            # the '$' of a line stands for its name, as in Sphinx's own files
            assert entry.uri.startswith(site) and entry.uri.endswith('#' + name), entry
