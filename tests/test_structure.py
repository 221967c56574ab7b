"""The package's shape, checked on its source: its subpackages and the one
way imports go between them, sizes, and which module may do what (one module
talks across processes, one uses accelerate's internals, one locks; the
callbacks hand every byte down)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / 'skorch_accel_callbacks'
MODULES = sorted(PACKAGE.rglob('*.py'))
CALLBACK_MODULES = ('callbacks/checkpoint.py', 'callbacks/load_state.py',
                    'params/checkpoint.py', 'params/load.py', 'params/train_end.py')
# the subpackages from the top down: a module imports from its own subpackage
# and those after it, never from one before it (nor from the package root,
# whose __init__ and __main__ sit above all of them); errors.py, at the root,
# imports nothing of the package and is below all of them
LAYERS = ('tools', 'params', 'callbacks', 'engine', 'state', 'storage', 'format', '_core')
ROOT_MODULES = {'__init__.py', '__main__.py', 'errors.py'}

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


def _name(path):
    return path.relative_to(PACKAGE).as_posix()


def _package_imports(tree):
    """The modules (dotted, below the package) and subpackages that ``tree`` imports from."""
    targets = set()
    for name in _imported(tree):
        if name.startswith('skorch_accel_callbacks.'):
            targets.add(name.removeprefix('skorch_accel_callbacks.'))
        elif name == 'skorch_accel_callbacks':
            targets.add('')
    return targets


def _package_modules(tree):
    """The modules of the package that ``tree`` imports (dotted, below the package)."""
    modules = set()
    for target in _package_imports(tree):
        # ``from skorch_accel_callbacks.format import _atomic``: the module _atomic;
        # ``from skorch_accel_callbacks.errors import RankError``: the module errors
        for candidate in (target, target.rpartition('.')[0]):
            if (PACKAGE / (candidate.replace('.', '/') + '.py')).is_file():
                modules.add(candidate)
                break
    return modules


def test_the_package_has_modules():
    assert len(MODULES) > 20


def test_every_module_is_in_a_subpackage_of_a_layer():
    outside = {_name(path) for path in MODULES if '/' not in _name(path)}
    assert outside == ROOT_MODULES
    subpackages = {path.name for path in PACKAGE.iterdir()
                   if path.is_dir() and path.name != '__pycache__'}
    assert subpackages == set(LAYERS)
    for layer in LAYERS:
        assert (PACKAGE / layer / '__init__.py').is_file(), layer
        assert not [path for path in (PACKAGE / layer).iterdir() if path.is_dir()
                    and path.name != '__pycache__'], f"{layer} has a subpackage of its own"


@pytest.mark.parametrize('path', MODULES, ids=_name)
def test_imports_point_sideways_or_down(path):
    name = _name(path)
    if name in ('__init__.py', '__main__.py'):
        return
    targets = _package_imports(_tree(path))
    if name == 'errors.py':
        assert not targets, f"errors.py imports {targets}: it must import nothing of the package"
        return
    own = LAYERS.index(name.split('/')[0])
    for target in targets:
        first = target.split('.')[0]
        if first == 'errors':
            continue
        assert first in LAYERS, f"{name} imports {target!r} from the package root"
        assert LAYERS.index(first) >= own, (
            f"{name} imports {target}: {first} is above {LAYERS[own]} ({' > '.join(LAYERS)})")


def test_no_import_cycle_between_modules():
    """A cycle inside a subpackage (the layer order rules out one between them)."""
    graph = {}
    for path in MODULES:
        module = _name(path).removesuffix('.py').replace('/', '.')
        graph[module] = _package_modules(_tree(path))
    done, trail = set(), []

    def visit(module):
        if module in trail:
            cycle = trail[trail.index(module):] + [module]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        if module in done:
            return
        trail.append(module)
        for target in sorted(graph[module]):
            visit(target)
        trail.pop()
        done.add(module)

    assert len(graph) == len(MODULES)
    for module in sorted(graph):
        visit(module)


@pytest.mark.parametrize('path', MODULES, ids=_name)
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


@pytest.mark.parametrize('path', MODULES, ids=_name)
def test_one_module_for_each_kind_of_outside_contact(path):
    imported = _imported(_tree(path))
    if _name(path) != '_core/sync.py':
        assert not any(name.startswith('torch.distributed') for name in imported), (
            f"{path.name} talks across processes outside sync.py")
    if _name(path) != '_core/accelerate_io.py':
        # the public classes are imported from ``accelerate`` itself
        internals = {name for name in _modules(_tree(path)) if name.startswith('accelerate.')
                     and name not in ('accelerate.utils', 'accelerate.optimizer')}
        assert not internals, f"{path.name} uses accelerate's internals {internals}"
    if _name(path) != 'storage/_lock.py':
        assert 'fcntl' not in imported, f"{path.name} locks outside storage/_lock.py"


@pytest.mark.parametrize('path', MODULES, ids=_name)
def test_only_storage_knows_the_kind_of_storage(path):
    """Callers open a storage and use its interface: no branch on whether it
    is a local folder or a store outside storage/, and the interface imports
    none of its implementations (storage/_open.py chooses one)."""
    name = _name(path)
    tree = _tree(path)
    if not name.startswith('storage/'):
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        used |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        used |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 for alias in node.names}
        assert 'is_remote' not in used, f"{name} branches on the kind of storage"
        kinds = {'storage._local', 'storage._remote'} & _package_modules(tree)
        assert not kinds, f"{name} uses {kinds}, not the interface"
    if name == 'storage/_interface.py':
        assert _package_modules(tree) <= {'errors', 'format._manifest', '_core.accelerate_io',
                                          '_core.sync'}, _package_modules(tree)


@pytest.mark.parametrize('name', CALLBACK_MODULES)
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
    ours = _package_modules(_tree(PACKAGE / 'format' / '_manifest.py'))
    assert ours <= {'format._atomic', 'errors'}, ours
