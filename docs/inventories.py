"""The inventories of the libraries the pages link to, for intersphinx.

The docs build runs offline (``make docs`` on machines without the network),
so the inventories that Sphinx would fetch from skorch's, torch's and
accelerate's sites are kept here, in ``inventories/<name>.txt``: one line per
object the pages name, in the body format of a Sphinx inventory (``name
domain:role priority uri display``, ``$`` in the uri standing for the name);
the three comment lines above them give the project, its version and the
site's address. accelerate's site publishes no inventory (its pages are not
built by Sphinx); its lines follow the anchors of its reference pages.

:func:`compile_inventories` writes each as the zlib-compressed file that
intersphinx reads; ``tests/project/test_docs.py`` checks that every name listed is an
object of the installed library and that the pages link to every one.
"""

from __future__ import annotations

import pathlib
import zlib

HERE = pathlib.Path(__file__).resolve().parent / 'inventories'


def read_inventory(path: pathlib.Path) -> tuple[dict[str, str], list[str]]:
    """The header fields (``Project``, ``Version``, ``URL``) and the object
    lines of one ``inventories/<name>.txt``."""
    header, lines = {}, []
    for line in path.read_text().splitlines():
        if line.startswith('# '):
            key, _, value = line[2:].partition(': ')
            header[key] = value
        elif line.strip():
            lines.append(line)
    missing = {'Project', 'Version', 'URL'} - header.keys()
    if missing:
        raise ValueError(f"{path}: the header lacks {sorted(missing)}")
    return header, lines


def names(path: pathlib.Path) -> list[str]:
    """The objects one inventory lists."""
    return [line.split(' ', 1)[0] for line in read_inventory(path)[1]]


def compile_inventories(out: pathlib.Path) -> dict[str, tuple[str, str]]:
    """Write ``<out>/<name>.inv`` for every ``inventories/<name>.txt``;
    return ``intersphinx_mapping``: name -> (site, compiled inventory)."""
    out.mkdir(parents=True, exist_ok=True)
    mapping = {}
    for source in sorted(HERE.glob('*.txt')):
        header, lines = read_inventory(source)
        target = out / f'{source.stem}.inv'
        target.write_bytes(
            (f"# Sphinx inventory version 2\n# Project: {header['Project']}\n"
             f"# Version: {header['Version']}\n"
             "# The remainder of this file is compressed using zlib.\n").encode()
            + zlib.compress(('\n'.join(lines) + '\n').encode()))
        mapping[source.stem] = (header['URL'], str(target))
    return mapping
