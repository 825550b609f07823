"""Token trees of a draft: the tables that describe them, and their checks.

A request's verify window may be a tree of draft tokens instead of a chain (EAGLE-2/3,
Medusa). The window's tokens are the tree's nodes in topological order, and two tables
describe the tree and what the sampler kept of it (``docs/design.md``, "Token trees"):

* ``parents`` ``[batch, RING_LEN]`` int32: node ``i``'s parent inside the request's own
  window, or :data:`COMMITTED` (-1) for a node that continues the committed state (the
  root; several such nodes make a forest). A parent precedes its node:
  ``-1 <= parents[b, i] < i``. Entries past the request's window are not read.
* ``accepted_nodes`` ``[batch, RING_LEN]`` uint32 beside ``num_accepted`` ``[batch]``: the
  first ``num_accepted[b]`` entries name the accepted nodes root first, each the child of
  the one before (the first a child of the committed state). Entries past
  ``num_accepted[b]`` are not read.

A chain is the special case ``parents[b] = [-1, 0, 1, ...]`` (:func:`chain_parents`) and
``accepted_nodes[b] = [0, 1, 2, ...]`` (:func:`chain_path`): today's verify and fold.

This module needs only numpy, like the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

#: The parent of a node that continues the committed state.
COMMITTED = -1


def chain_parents(batch: int, ring_len: int) -> NDArray[np.int32]:
    """The ``parents`` table of chains: every node the child of the one before."""
    return np.tile(np.arange(-1, ring_len - 1, dtype=np.int32), (batch, 1))


def chain_path(batch: int, ring_len: int) -> NDArray[np.uint32]:
    """The ``accepted_nodes`` table of chains: the window's nodes in order."""
    return np.tile(np.arange(ring_len, dtype=np.uint32), (batch, 1))


def parents_from_paths(paths: Sequence[Sequence[int]]) -> NDArray[np.int32]:
    """A tree given as EAGLE's and vLLM's static trees are (``mc_sim_7b_63``,
    ``speculative_token_tree``): each node the path of child ranks from the root to it,
    the root itself left out. Returns the parents of the root and then every node, the
    nodes sorted by ``(len(path), path)`` (vLLM's order, breadth first), so node ``i + 1``
    of the window is the ``i``-th path of that order and node 0 the root.

    Raises:
        ValueError: a path whose own prefix is missing, or a repeated path.
    """
    ordered = sorted((tuple(p) for p in paths), key=lambda p: (len(p), p))
    index: dict[tuple[int, ...], int] = {(): 0}
    for path in ordered:
        if not path:
            raise ValueError("paths: the empty path (the root) is implied; leave it out")
        if path in index:
            raise ValueError(f"paths: {list(path)} appears twice")
        if path[:-1] not in index:
            raise ValueError(f"paths: {list(path)} has no parent path {list(path[:-1])}")
        index[path] = len(index)
    parents = np.full(len(index), COMMITTED, np.int32)
    for path, node in index.items():
        if path:
            parents[node] = index[path[:-1]]
    return parents


def draft_tree(nodes: int, depth: int) -> NDArray[np.int32]:
    """The ``parents`` of one request's tree of ``nodes`` nodes and ``depth`` levels, shaped
    as EAGLE's static trees are: a spine (the drafter's top choice at every level, nodes 0
    to ``depth - 1``) and the other nodes as leaves hung on the spine above its last node,
    shallowest first and in turn (EAGLE's trees are widest near the root). The spine is the
    longest path; the tree has ``nodes - depth + 1`` root-to-leaf paths.

    Raises:
        ValueError: ``depth`` not in 1 to ``nodes``, or leaves with nowhere to hang
            (``depth`` 1 with more than one node).
    """
    if not 1 <= depth <= nodes:
        raise ValueError(f"depth: {depth} is not in 1 to nodes ({nodes})")
    if depth == 1 and nodes > 1:
        raise ValueError(f"depth: 1 leaves {nodes - 1} nodes with no parent but the committed state; give depth 2"
                         " or more")
    spine = np.arange(COMMITTED, depth - 1, dtype=np.int32)
    leaves = np.arange(nodes - depth, dtype=np.int32) % max(depth - 1, 1)
    return np.concatenate([spine, leaves])


def leaves(parents: NDArray) -> list[int]:
    """The nodes no other node names as its parent, in order: one per root-to-leaf path."""
    named = {int(p) for p in parents}
    return [node for node in range(len(parents)) if node not in named]


def root_path(parents: NDArray, node: int) -> list[int]:
    """The nodes from the first after the committed state down to ``node``, in order."""
    path = [node]
    while parents[path[-1]] != COMMITTED:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def _request_table(name: str, table: NDArray, batch: int, ring_len: int) -> NDArray:
    """``table`` as an array, refused unless it is ``[batch, RING_LEN]``."""
    table = np.asarray(table)
    if table.shape != (batch, ring_len):
        raise ValueError(f"{name}: expected shape [{batch}, {ring_len}] ([batch, RING_LEN]), got {list(table.shape)}")
    return table


def check_parents(parents: NDArray, windows: Sequence[int], ring_len: int) -> None:
    """Refuses a ``parents`` table that is not ``[batch, RING_LEN]`` of integers, a window
    longer than RING_LEN (a tree's records must all fit the ring: it has no one path to
    commit), or a node whose parent is not ``-1`` or an earlier node of its window.

    Raises:
        ValueError: naming ``parents`` (or ``input_row_offsets``), the request, the node
            and the bad value.
    """
    parents = _request_table("parents", parents, len(windows), ring_len)
    if not np.issubdtype(parents.dtype, np.integer):
        raise ValueError(f"parents: expected an integer table, got {parents.dtype}")
    for b, window in enumerate(windows):
        if window > ring_len:
            raise ValueError(f"input_row_offsets: request {b} has a window of {window} tokens, past"
                             f" RING_LEN {ring_len}; a tree window must fit the ring")
        for i in range(window):
            parent = int(parents[b, i])
            if not COMMITTED <= parent < i:
                raise ValueError(f"parents: request {b} node {i} has parent {parent}; a parent is -1 (the"
                                 f" committed state) or an earlier node of the window (0 to {i - 1})")


def previous_path_given(previous_ring_row_ids: object, previous_num_accepted: object,
                        previous_accepted_nodes: object) -> bool:
    """Whether a tree verify folds the previous step's accepted path on load: all three
    previous tables given (True) or none (False); raises ValueError for only some."""
    given = [t is not None for t in (previous_ring_row_ids, previous_num_accepted, previous_accepted_nodes)]
    if any(given) and not all(given):
        raise ValueError("previous_ring_row_ids, previous_num_accepted, previous_accepted_nodes: give all three"
                         " (fold on load of the previous path) or none")
    return all(given)


def check_path_nodes(accepted_nodes: NDArray, num_accepted: NDArray, ring_len: int) -> None:
    """What a fold can check of accepted paths without their tree: ``accepted_nodes`` is
    ``[batch, RING_LEN]``, and each path of 1 to RING_LEN nodes names nodes of the ring in
    increasing order (a parent precedes its node, so a path along parent links does). A
    count of 0 or past RING_LEN folds nothing, as in the fold of a chain.

    Raises:
        ValueError: naming ``accepted_nodes``, the request and the bad value.
    """
    accepted_nodes = _request_table("accepted_nodes", accepted_nodes, len(np.asarray(num_accepted)), ring_len)
    if not np.issubdtype(accepted_nodes.dtype, np.integer):
        raise ValueError(f"accepted_nodes: expected an integer table, got {accepted_nodes.dtype}")
    for b, count in enumerate(int(n) for n in np.asarray(num_accepted)):
        if not 0 < count <= ring_len:
            continue
        path = [int(n) for n in accepted_nodes[b, :count]]
        if any(not 0 <= n < ring_len for n in path) or any(a >= c for a, c in zip(path[:-1], path[1:], strict=True)):
            raise ValueError(f"accepted_nodes: request {b} names nodes {path}; a path names nodes 0 to"
                             f" {ring_len - 1} in increasing order")


def check_accepted_nodes(accepted_nodes: NDArray, num_accepted: NDArray, parents: NDArray,
                         windows: Sequence[int], ring_len: int) -> None:
    """Refuses an accepted path that is not a chain of parent links from the committed
    state through ``parents``: a node outside its request's window, a node whose parent
    is not the node before it (the first: not -1), a repeated node, or a path longer than
    RING_LEN or than the window.

    Raises:
        ValueError: naming ``accepted_nodes`` or ``num_accepted``, the request and the
            bad value.
    """
    check_parents(parents, windows, ring_len)
    accepted_nodes = _request_table("accepted_nodes", accepted_nodes, len(windows), ring_len)
    num_accepted = np.asarray(num_accepted)
    if num_accepted.shape != (len(windows),):
        raise ValueError(f"num_accepted: expected shape [{len(windows)}], got {list(num_accepted.shape)}")
    for b, window in enumerate(windows):
        count = int(num_accepted[b])
        if not 0 <= count <= min(window, ring_len):
            raise ValueError(f"num_accepted: request {b} accepts {count} nodes of a window of {window}"
                             f" (RING_LEN {ring_len})")
        previous = COMMITTED
        for j in range(count):
            node = int(accepted_nodes[b, j])
            if not 0 <= node < window:
                raise ValueError(f"accepted_nodes: request {b} entry {j} is node {node}, outside its window"
                                 f" of {window}")
            if int(parents[b, node]) != previous:
                # A repeated node fails here too: its parent is not the node before it.
                raise ValueError(f"accepted_nodes: request {b} entry {j} is node {node}, whose parent is"
                                 f" {int(parents[b, node])}, not {previous}: the path must follow parent"
                                 f" links from the committed state")
            previous = node


__all__ = [
    "COMMITTED",
    "chain_parents",
    "chain_path",
    "check_accepted_nodes",
    "check_parents",
    "check_path_nodes",
    "draft_tree",
    "leaves",
    "parents_from_paths",
    "root_path",
]
