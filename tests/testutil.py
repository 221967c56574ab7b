"""Helpers shared by the test modules of tests/ and tests/faults/.

A plain module with a name of its own (``conftest`` is pytest's: there is
one in tests/ and one in tests/faults/). The pytest configuration puts
tests/, tests/workers, tests/faults and tests/faults/workers on
``sys.path`` (``pythonpath`` in setup.cfg).
"""

import json
from pathlib import Path


def read_results(folder, name, world_size):
    """Each rank's JSON result of a worker script, indexed by rank."""
    results = []
    for rank in range(world_size):
        path = Path(folder) / f'{name}-rank{rank}.json'
        assert path.exists(), f"rank {rank} wrote no result {path.name}"
        results.append(json.loads(path.read_text()))
    return results


def read_json(path):
    return json.loads(Path(path).read_text())
