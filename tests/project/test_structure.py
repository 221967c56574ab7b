"""The package's shape, checked on its source: its subpackages and the one
way imports go between them, sizes, and which module may do what (one module
talks across processes, one uses accelerate's internals, one locks; the
callbacks hand every byte down)."""

import ast
import importlib
import inspect
import re
import typing
from pathlib import Path

import pytest

from testutil import parse_source

PACKAGE = Path(__file__).resolve().parents[2] / 'skorch_accel_callbacks'
MODULES = sorted(PACKAGE.rglob('*.py'))
CALLBACK_MODULES = ('callbacks/checkpoint.py', 'callbacks/load_state.py',
                    'params/checkpoint.py', 'params/load.py', 'params/train_end.py')
# the subpackages from the top down: a module imports from its own subpackage
# and those after it, never from one before it (nor from the package root,
# whose __init__ and __main__ sit above all of them); errors.py, at the root,
# imports nothing of the package and is below all of them
LAYERS = ('tools', 'params', 'callbacks', 'engine', 'state', 'storage', 'format', '_core')
ROOT_MODULES = {'__init__.py', '__main__.py', 'errors.py'}

# sizes are review thresholds, not walls: a reviewer reads a class past about
# 250 code lines or a function past about 50 for a second job; these gross
# bounds, which nothing written as a reader wants it reaches, only catch a
# module that grew out of all proportion (code is never squeezed to meet them)
MAX_CLASS_CODE_LINES = 400
MAX_FUNCTION_CODE_LINES = 80


def _tree(path):
    return parse_source(path)


def _code_lines(source_lines, node):
    """Lines of ``node`` that hold code: not blank, not a comment, not a
    docstring; a signature counts as one line however it is laid out (one
    argument a line, as a formatter writes it, must cost nothing)."""
    lines = set(range(node.lineno, node.end_lineno + 1))
    for inner in ast.walk(node):
        body = getattr(inner, 'body', None)
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines -= set(range(inner.lineno + 1, body[0].lineno))
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


def _private_imports_across(tree, own):
    """What ``tree`` imports of a private module (``_x``) of a subpackage
    other than ``own``, in either form (``from ...state._settings import f``,
    ``from ...state import _settings``)."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.module
                and node.module.startswith('skorch_accel_callbacks.')):
            continue
        parts = node.module.split('.')[1:]
        if parts[0] in (own, 'errors'):
            continue
        if len(parts) > 1 and parts[1].startswith('_'):
            found.append(node.module)
        found += [f"{node.module}.{alias.name}" for alias in node.names
                  if len(parts) == 1 and alias.name.startswith('_')]
    return found


@pytest.mark.parametrize('path', MODULES, ids=_name)
def test_subpackages_meet_through_their_faces(path):
    """A module uses another subpackage through what its ``__init__``
    offers, never through its private modules."""
    name = _name(path)
    own = name.split('/')[0] if '/' in name else None
    assert _private_imports_across(_tree(path), own) == []


TESTS = Path(__file__).resolve().parents[1]
TEST_MODULES = sorted(path for path in TESTS.rglob('*.py') if 'data' not in path.parts)


def _offered(layer):
    return set(getattr(importlib.import_module(f'skorch_accel_callbacks.{layer}'), '__all__', ()))


def _reached_past_faces(tree):
    """What ``tree`` takes from a subpackage's private module although the
    subpackage's face offers it: ``from ...format._manifest import
    read_manifest``, or ``_manifest.read_manifest`` after ``from ...format
    import _manifest`` (but where the test replaces it there)."""
    modules, found = {}, []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.module
                and node.module.startswith('skorch_accel_callbacks.')):
            continue
        layer, *inner = node.module.split('.')[1:]
        if layer not in LAYERS or layer == '_core':
            continue
        if inner and inner[0].startswith('_'):
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if alias.name in _offered(layer)]
        elif not inner:
            modules.update({alias.asname or alias.name: layer for alias in node.names
                            if alias.name.startswith('_')})
    attributes = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and isinstance(node.value, ast.Name) and node.value.id in modules]
    # a test that replaces a module's function reads the original from the module
    replaced = {(node.value.id, node.attr) for node in attributes
                if isinstance(node.ctx, ast.Store)}
    found += [f"{node.value.id}.{node.attr}" for node in attributes
              if isinstance(node.ctx, ast.Load) and (node.value.id, node.attr) not in replaced
              and node.attr in _offered(modules[node.value.id])]
    return found


def test_the_face_check_sees_both_forms_and_lets_a_replacement_be():
    source = (
        "from skorch_accel_callbacks.format._manifest import FORMAT_VERSION, read_manifest\n"
        "from skorch_accel_callbacks.format import _atomic as atomic, _manifest\n"
        "_manifest.check_manifest('x')\n"
        "original = atomic.write_json\n"
        "atomic.write_json = lambda *args: original(*args)\n")
    assert _reached_past_faces(ast.parse(source)) == [
        'skorch_accel_callbacks.format._manifest.read_manifest', '_manifest.check_manifest']


@pytest.mark.parametrize('path', TEST_MODULES, ids=lambda path: path.relative_to(TESTS).as_posix())
def test_tests_use_what_a_face_offers_through_it(path):
    """A test reaches into a subpackage's private module only for what its
    face does not offer (an internal under test, a function it replaces to
    inject a fault); what the face offers, it takes from the face."""
    assert _reached_past_faces(_tree(path)) == []


@pytest.mark.parametrize('layer', [layer for layer in LAYERS if layer != '_core'])
def test_each_face_offers_what_its_all_names(layer):
    """A face names what it offers in ``__all__``, each name imported from one
    of its own modules, and says what the room is for."""
    face = importlib.import_module(f'skorch_accel_callbacks.{layer}')
    offered = getattr(face, '__all__', [])
    assert face.__doc__ and len(face.__doc__.split()) > 10, layer
    assert sorted(set(offered)) == sorted(offered), f"{layer}: __all__ names one twice"
    for name in offered:
        offered_object = getattr(face, name)
        if inspect.isfunction(offered_object) or inspect.isclass(offered_object):
            assert offered_object.__module__.startswith(f'skorch_accel_callbacks.{layer}.'), (
                layer, name, offered_object.__module__)


def test_what_a_face_offers_is_used_outside_its_room():
    """Nothing is offered that no other subpackage (or the package root)
    imports: a face is the list of what the rooms share, not of everything."""
    used = {}
    for path in MODULES:
        name = _name(path)
        own = name.split('/')[0] if '/' in name else None
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith('skorch_accel_callbacks.')
                    and len(node.module.split('.')) == 2):
                layer = node.module.split('.')[1]
                if layer != own:
                    used.setdefault(layer, set()).update(alias.name for alias in node.names)
    for layer in LAYERS:
        if layer == '_core':
            continue
        face = importlib.import_module(f'skorch_accel_callbacks.{layer}')
        unused = set(getattr(face, '__all__', [])) - used.get(layer, set())
        assert not unused, f"{layer} offers {sorted(unused)}, which no other subpackage uses"


@pytest.mark.parametrize('path', MODULES, ids=_name)
def test_sizes(path):
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(_tree(path)):
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
    if _name(path) != 'format/_torch_archive.py':
        private = _torch_internals(_tree(path))
        assert not private, f"{path.name} uses torch's internals {private}"


def _torch_internals(tree):
    """The private names of torch that ``tree`` reaches (``torch._C``,
    ``torch.serialization._save``, ...)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = [node.attr]
            inner = node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == 'torch':
                dotted = ['torch', *reversed(chain)]
                if any(part.startswith('_') and not part.startswith('__') for part in dotted):
                    found.add('.'.join(dotted))
        elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('torch'):
            found |= {f"{node.module}.{alias.name}" for alias in node.names
                      if alias.name.startswith('_')} | (
                {node.module} if any(part.startswith('_') for part in node.module.split('.'))
                else set())
    return found


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
        allowed = {'errors', 'format._atomic', 'format._manifest', '_core.accelerate_io',
                   '_core.sync'}
        assert _package_modules(tree) <= allowed, _package_modules(tree)


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


def _public():
    import skorch_accel_callbacks  # pylint: disable=import-outside-toplevel
    return {name: getattr(skorch_accel_callbacks, name) for name in skorch_accel_callbacks.__all__}


def _documented(obj):
    """The names of the Parameters section of ``obj``'s docstring, in order
    (``a, b : int`` documents two), without the stars of ``**kwargs``."""
    from numpydoc.docscrape import NumpyDocString  # pylint: disable=import-outside-toplevel
    names = []
    for parameter in NumpyDocString(inspect.getdoc(obj))['Parameters']:
        names.extend(name.strip().lstrip('*') for name in parameter.name.split(','))
    return names


# what the package raises is documented by its Attributes: users catch these, never build them
EXCEPTIONS_OF = 'skorch_accel_callbacks.errors'
# skorch's callbacks whose drop-ins keep their signature (positional arguments included)
DROP_INS = {'ParamsCheckpoint': 'Checkpoint', 'LoadInitParams': 'LoadInitState',
            'TrainEndParamsCheckpoint': 'TrainEndCheckpoint'}


@pytest.mark.parametrize('name', sorted(_public()))
def test_docstring_parameters_follow_the_signature(name):
    obj = _public()[name]
    if obj.__module__ == EXCEPTIONS_OF:
        return
    signature = inspect.signature(obj)
    # *args/**kwargs handed on to skorch's net need no entry of their own
    expected = [p.name for p in signature.parameters.values()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    documented = [n for n in _documented(obj)
                  if n in expected or n not in {'args', 'kwargs'}]
    assert documented == expected, f"{name}: docstring {documented}, signature {expected}"


@pytest.mark.parametrize('name', sorted(_public()))
def test_documented_defaults_are_the_signature_defaults(name):
    from numpydoc.docscrape import NumpyDocString  # pylint: disable=import-outside-toplevel
    obj = _public()[name]
    if obj.__module__ == EXCEPTIONS_OF:
        return
    parameters = inspect.signature(obj).parameters
    for entry in NumpyDocString(inspect.getdoc(obj))['Parameters']:
        default = re.search(r'\(default=(.*)\)\s*$', entry.type)
        if default is None or entry.name not in parameters:
            continue
        value = parameters[entry.name].default
        shown = getattr(value, '__name__', None) if callable(value) else repr(value)
        assert default.group(1).replace('\\', '') == shown, (
            f"{name}: {entry.name} documented (default={default.group(1)}), is {shown}")


def test_the_checks_above_see_every_parameter():
    """The two tests above compare something: every class of ours documents its arguments."""
    for name, obj in _public().items():
        if obj.__module__ != EXCEPTIONS_OF and inspect.signature(obj).parameters:
            assert _documented(obj), f"{name} has no Parameters section"


@pytest.mark.parametrize('name', sorted(_public()))
def test_arguments_after_the_first_are_keyword_only(name):
    """Every public class and function but the drop-ins (skorch's
    signatures) and the exceptions (which users catch, never build); what
    it hands on to skorch's net (``*args``, ``**kwargs``) aside."""
    obj = _public()[name]
    if name in DROP_INS or obj.__module__ == EXCEPTIONS_OF:
        return
    parameters = [p for p in inspect.signature(obj).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    by_position = [p.name for p in parameters if p.kind != p.KEYWORD_ONLY]
    assert len(by_position) <= 1, f"{name}: {by_position[1:]} should be keyword-only"


@pytest.mark.parametrize('name', sorted(DROP_INS))
def test_drop_ins_keep_skorchs_signature(name):
    """What skorch takes by position, a drop-in takes by position too, with
    skorch's defaults; what it adds (``on_error``) is keyword-only."""
    import skorch.callbacks  # pylint: disable=import-outside-toplevel
    ours = inspect.signature(_public()[name]).parameters
    theirs = inspect.signature(getattr(skorch.callbacks, DROP_INS[name])).parameters
    for key, param in theirs.items():
        assert key in ours, f"{name} lacks skorch's {key}"
        assert (ours[key].kind, ours[key].default) == (param.kind, param.default), key
    assert list(ours)[:len(theirs) - ('kwargs' in theirs)] == [
        k for k in theirs if k != 'kwargs']
    added = [p for k, p in ours.items() if k not in theirs]
    assert all(p.kind == p.KEYWORD_ONLY for p in added), added


@pytest.mark.parametrize('name', sorted(_public()))
def test_arguments_are_annotated_precisely(name):
    """No argument of a public class or function is unannotated or a bare ``Any``
    (its type is known); ``*args``/``**kwargs`` handed on to skorch are."""
    obj = _public()[name]
    # LoadInitParams takes skorch's LoadInitState.__init__ as it is, unannotated
    if obj.__module__ == EXCEPTIONS_OF or name == 'LoadInitParams':
        return
    for param in inspect.signature(obj).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        # a string under ``from __future__ import annotations``
        annotation = param.annotation
        assert annotation is not param.empty, f"{name}: {param.name} is not annotated"
        assert annotation not in (typing.Any, 'Any'), f"{name}: {param.name} is Any"
