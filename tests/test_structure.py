"""The package's shape, checked on its source: sizes, and which module may
do what (one module talks across processes, one uses accelerate's
internals, one locks; the callbacks hand every byte down)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / 'skorch_accel_callbacks'
MODULES = sorted(PACKAGE.glob('*.py'))
CALLBACK_MODULES = ('checkpoint.py', 'load_state.py', 'params.py', 'params_load.py',
                    'params_train_end.py')

# sizes are review thresholds, not walls: a module is one concept however long
# its docstrings are; a class or function past these has more than one job
MAX_CLASS_CODE_LINES = 250
MAX_FUNCTION_CODE_LINES = 50


def _tree(path):
    return ast.parse(path.read_text(), filename=str(path))


def _code_lines(source_lines, node):
    """Lines of ``node`` that hold code: not blank, not a comment, not a docstring."""
    lines = set(range(node.lineno, node.end_lineno + 1))
    for inner in ast.walk(node):
        body = getattr(inner, 'body', None)
        if (isinstance(inner, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            lines -= set(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for line in lines
               if source_lines[line - 1].strip()
               and not source_lines[line - 1].strip().startswith('#'))


def _imported(tree):
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _modules(tree):
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
            for alias in node.names} | {
        node.module for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module}


def test_the_package_has_modules():
    assert len(MODULES) > 20


@pytest.mark.parametrize('path', MODULES, ids=lambda p: p.name)
def test_sizes(path):
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = _code_lines(lines, node)
            assert size <= MAX_CLASS_CODE_LINES, f"{path.name}: class {node.name}: {size}"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            size = _code_lines(lines, node)
            assert size <= MAX_FUNCTION_CODE_LINES, f"{path.name}: {node.name}: {size}"


@pytest.mark.parametrize('path', MODULES, ids=lambda p: p.name)
def test_one_module_for_each_kind_of_outside_contact(path):
    imported = _imported(_tree(path))
    if path.name != 'sync.py':
        assert not any(name.startswith('torch.distributed') for name in imported), (
            f"{path.name} talks across processes outside sync.py")
    if path.name != 'accelerate_io.py':
        # the public classes are imported from ``accelerate`` itself
        internals = {name for name in _modules(_tree(path)) if name.startswith('accelerate.')
                     and name not in ('accelerate.utils', 'accelerate.optimizer')}
        assert not internals, f"{path.name} uses accelerate's internals {internals}"
    if path.name != 'lock.py':
        assert 'fcntl' not in imported, f"{path.name} locks outside lock.py"


@pytest.mark.parametrize('name', [name for name in CALLBACK_MODULES
                                  if (PACKAGE / name).exists()])
def test_callbacks_hand_every_byte_down(name):
    """No callback renames, locks, or talks to a store or the other ranks itself."""
    tree = _tree(PACKAGE / name)
    imported = _imported(tree)
    assert not imported & {'fcntl', 'fsspec', 'shutil', 'torch.distributed'}, imported
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert (node.value.id, node.attr) not in {
                ('os', 'replace'), ('os', 'rename'), ('dist', 'all_reduce'),
            }, f"{name}:{node.lineno} {node.value.id}.{node.attr}"


def test_the_format_sits_at_the_bottom():
    ours = {name.split('.')[1] for name in _imported(_tree(PACKAGE / 'format.py'))
            if name.startswith('skorch_accel_callbacks.')}
    assert ours <= {'atomic', 'errors'}, ours
