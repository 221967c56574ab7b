"""One checkpoint uploaded from several nodes, each from its own disk.

With ``save_on_each_node`` (nodes without a shared filesystem) the main
process of each node commits the checkpoint into its node's staging folder:
the files every node writes (the model, the optimizer, the history) and its
own ranks' (their random states, their place in the epoch). No node has
them all, so each node's main process uploads the files that no node
before it has, and node 0 commits the checkpoint in the store once every
node's are there: its manifest, listing the files of them all
(:func:`~skorch_accel_callbacks.format._manifest.merged_manifest`), then the pointers. The
nodes learn each other's files and outcomes through a
:class:`~skorch_accel_callbacks._core.sync.NodeGroup`, from their upload
threads; a node whose upload failed makes every node's fail, and the
checkpoint is not committed: the store keeps the one before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from skorch_accel_callbacks._core.sync import NodeGroup
from skorch_accel_callbacks.errors import CheckpointError
from skorch_accel_callbacks.format import merged_manifest
from skorch_accel_callbacks.storage import _transfer as transfer

__all__ = ['upload_from_nodes']


def upload_from_nodes(nodes: NodeGroup, store: transfer.Store, local: str, name: str,
                      best: bool, replace: bool, before_manifest: Callable[[], None]) -> None:
    """Upload this node's part of checkpoint ``name``, committed into the
    folder ``local``, and on node 0 commit it once every node's part is
    there; on the main process of every node, at the same point.

    Raises :class:`CheckpointError` naming the node whose part failed (its
    own error on that node), or what :func:`transfer.seal` raises on node 0.
    """
    manifest = _agreed(nodes, store, name, lambda: _read(store, local, name, replace, nodes))
    mine = [rel for rel in manifest[nodes.node]['files']
            if not any(rel in before['files'] for before in manifest[:nodes.node])]
    _agreed(nodes, store, name,
            lambda: transfer.send(store, local, name, mine, manifest[nodes.node]))
    if nodes.node == 0:
        transfer.seal(store, name, json.dumps(merged_manifest(manifest)).encode(), best,
                      before_manifest)


def _read(store: transfer.Store, local: str, name: str, replace: bool,
          nodes: NodeGroup) -> dict[str, Any]:
    if replace and nodes.node == 0:
        # before any node sends a file of the new checkpoint
        transfer.remove_manifest(store, name)
    return json.loads(transfer.staged_manifest(local))


def _agreed(nodes: NodeGroup, store: transfer.Store, name: str,
            step: Callable[[], Any]) -> list[Any]:
    """Run ``step`` on every node; the list of their results, node 0's
    first, once every node's succeeded. A node's failure raises on every
    node: its own error there, naming the node elsewhere."""
    result, error = None, None
    try:
        result = step()
    except Exception as exc:  # pylint: disable=broad-except
        error = exc
    outcomes = nodes.exchange(
        (None, f"{type(error).__name__}: {error}") if error is not None else (result, None))
    if error is not None:
        raise error
    failed = [(node, why) for node, (_, why) in enumerate(outcomes) if why is not None]
    if failed:
        node, why = failed[0]
        raise CheckpointError(
            f"node {node} (rank {nodes.ranks[node]}) could not upload its part of "
            f"{store.url(name)}: {why}")
    return [value for value, _ in outcomes]
