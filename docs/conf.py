"""Sphinx configuration of the skorch-accel-callbacks documentation.

``make docs`` builds it with warnings as errors; the benchmark plots are drawn
from ``benchmarks/RESULTS.rst`` at every build (``plot_benchmarks.py``).
"""

import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
# the package of this checkout, not whichever one the environment installed
sys.path.insert(0, str(DOCS.parent))
sys.path.insert(0, str(DOCS))

import inventories  # noqa: E402
import plot_benchmarks  # noqa: E402

import skorch_accel_callbacks  # noqa: E402

project = 'skorch-accel-callbacks'
author = 'the skorch-accel-callbacks authors'
copyright = 'the skorch-accel-callbacks authors'
release = skorch_accel_callbacks.__version__
version = release

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.intersphinx',
    'numpydoc',
]

# skorch's, torch's and accelerate's objects link to their sites, through
# inventories kept in docs/inventories/ (the build runs offline)
intersphinx_mapping = inventories.compile_inventories(DOCS / '_build' / 'inventories')

exclude_patterns = ['_build', '_generated']
html_theme = 'pydata_sphinx_theme'
html_theme_options = {'navigation_with_keys': False}
html_static_path = []

autodoc_member_order = 'bysource'
# the types are the docstrings' (numpydoc's Parameters and Attributes), as
# in skorch's reference; the annotations name private modules' classes
autodoc_typehints = 'none'
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_validation_checks = set()

# nitpicky (-n): every cross-reference resolves; skorch's, torch's and
# accelerate's through the inventories, those of the other libraries the
# docstrings name (which the pages do not link to) are let through
nitpick_ignore_regex = [
    ('py:.*', r'(numpy|np|collections|typing|signal|os|pathlib|'
              r'concurrent|fsspec|sklearn)(\..*)?'),
]


def setup(app):
    app.connect('builder-inited', lambda app: plot_benchmarks.main(DOCS / '_generated'))
