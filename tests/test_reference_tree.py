"""Token trees in the numpy reference: a tree's readouts and records, the fold along an
accepted path, and the tables' checks (``gdfold_max.trees``).

The oracle for a tree is the forward: node ``i``'s readout must equal the forward's over
the tokens of its root path, and the fold along a path must leave the pool the forward
over that path's tokens leaves, bit for bit. A chain must give today's verify and fold.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_bits_equal
from gdfold_max import reference, trees
from gdfold_max.cases import WindowCase, random_accepted_nodes, random_parents, random_window_case

RING_LEN = 8
#: Ragged windows: full, empty, one node, partial.
WINDOWS = [RING_LEN, 0, 1, 5, RING_LEN]
CASES = [pytest.param("float32", "head", id="fp32-head"), pytest.param("bfloat16", "head", id="bf16-head"),
         pytest.param("float32", "channel", id="fp32-channel"),
         pytest.param("bfloat16", "channel", id="bf16-channel")]


def tree_case(state_dtype: str, gate: str, seed: int = 0) -> tuple[WindowCase, np.ndarray]:
    case = random_window_case(seed, windows=WINDOWS, ring_len=RING_LEN, key_dim=16, value_dim=24,
                              state_dtype=state_dtype, gate=gate)  # type: ignore[arg-type]
    return case, random_parents(seed + 1, WINDOWS, RING_LEN)


def window_of(case: WindowCase, b: int) -> range:
    offsets = case.input_row_offsets
    return range(int(offsets[b]), int(offsets[b + 1]))


def forward_over(case: WindowCase, b: int, nodes: list[int], state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The forward over request ``b``'s tokens of ``nodes`` from ``state``'s row: its
    readout ``[len(nodes), nv*V]`` and the pool row it commits."""
    tokens = [window_of(case, b)[node] for node in nodes]
    pool = state.copy()
    row = case.row_ids[b : b + 1]
    out = reference.recurrence(case.qkv[tokens], case.decay[tokens], case.beta[tokens], pool, row,
                               np.asarray([0, len(tokens)], np.uint32), num_key_heads=case.num_key_heads)
    return out, pool[int(row[0])]


def verify_tree(case: WindowCase, parents: np.ndarray, **previous: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    state, ring = case.fresh()
    out = reference.verify_tree(*case.tokens(), state, ring, case.row_ids, case.ring_row_ids,
                                case.input_row_offsets, parents, **previous)
    return out, state, ring


@pytest.mark.parametrize(("state_dtype", "gate"), CASES)
def test_a_chain_is_today_s_verify(state_dtype: str, gate: str) -> None:
    """Every window of WINDOWS fits the ring; a longer chain verify_ring commits, and a
    tree refuses (test_a_tree_window_past_the_ring_is_refused)."""
    case, _ = tree_case(state_dtype, gate)
    chain = trees.chain_parents(len(WINDOWS), RING_LEN)
    out, state, ring = verify_tree(case, chain)
    want_out, want_state, want_ring = case.run_verify(reference.verify_ring, fold_on_load=False)
    assert_bits_equal(out, want_out, "readout")
    assert_bits_equal(state, want_state, "pool (not written)")
    assert_bits_equal(ring, want_ring, "ring")


@pytest.mark.parametrize(("state_dtype", "gate"), CASES)
def test_every_node_reads_out_as_the_forward_over_its_root_path(state_dtype: str, gate: str) -> None:
    case, parents = tree_case(state_dtype, gate)
    out, state, _ = verify_tree(case, parents)
    assert_bits_equal(state, case.state, "pool (not written)")
    nodes = 0
    for b, window in enumerate(WINDOWS):
        for node in range(window):
            path = trees.root_path(parents[b], node)
            want, _ = forward_over(case, b, path, case.state)
            assert_bits_equal(out[window_of(case, b)[node]], want[-1], f"request {b} node {node} ({path})")
            nodes += 1
    assert nodes == sum(WINDOWS)


@pytest.mark.parametrize(("state_dtype", "gate"), CASES)
def test_the_fold_along_an_accepted_path_is_the_forward_over_it(state_dtype: str, gate: str) -> None:
    case, parents = tree_case(state_dtype, gate)
    _, _, ring = verify_tree(case, parents)
    for seed in range(3):
        nodes, counts = random_accepted_nodes(seed, parents, WINDOWS)
        trees.check_accepted_nodes(nodes, counts, parents, WINDOWS, RING_LEN)
        pool = case.state.copy()
        reference.fold(pool, ring, case.row_ids[None], case.ring_row_ids[None], counts, gate=gate,  # type: ignore[arg-type]
                       accepted_nodes=nodes)
        for b in range(len(WINDOWS)):
            path = [int(n) for n in nodes[b, : counts[b]]]
            row = int(case.row_ids[b])
            want = forward_over(case, b, path, case.state)[1] if path else case.state[row]
            assert_bits_equal(pool[row], want, f"seed {seed} request {b} path {path}")


@pytest.mark.parametrize(("state_dtype", "gate"), CASES)
def test_fold_on_load_of_a_path_is_the_fold_then_the_tree(state_dtype: str, gate: str) -> None:
    """The previous step's tree sits in the previous ring rows; its accepted path folds
    as the new tree's state loads."""
    case, parents = tree_case(state_dtype, gate)
    previous_parents = random_parents(7, WINDOWS, RING_LEN)
    state, ring = case.fresh()
    # The previous step: a tree recorded into the previous rows.
    reference.verify_tree(*case.tokens(), state, ring, case.row_ids, case.previous_ring_row_ids,
                          case.input_row_offsets, previous_parents)
    nodes, counts = random_accepted_nodes(8, previous_parents, WINDOWS)
    fused_state = state.copy()
    fused_ring = ring.copy()
    out = reference.verify_tree(*case.tokens(), fused_state, fused_ring, case.row_ids, case.ring_row_ids,
                                case.input_row_offsets, parents, previous_ring_row_ids=case.previous_ring_row_ids,
                                previous_num_accepted=counts, previous_accepted_nodes=nodes)
    reference.fold(state, ring, case.row_ids[None], case.previous_ring_row_ids[None], counts, gate=gate,  # type: ignore[arg-type]
                   accepted_nodes=nodes)
    want = reference.verify_tree(*case.tokens(), state, ring, case.row_ids, case.ring_row_ids,
                                 case.input_row_offsets, parents)
    assert_bits_equal(out, want, "readout")
    assert_bits_equal(fused_state, state, "pool")
    assert_bits_equal(fused_ring, ring, "ring")


def test_eagle_s_static_tree_becomes_parents() -> None:
    """EAGLE's mc_sim_7b_63 (choices.py): 25 paths of child ranks, 4/8/8/3/2 per depth."""
    paths = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [0, 0, 0],
             [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0], [0, 0, 0, 0],
             [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
    parents = trees.parents_from_paths(paths)
    assert parents.tolist() == [-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 5, 5, 5, 6, 6, 7, 7, 8, 13, 13, 13, 21, 21]
    assert trees.root_path(parents, 24) == [0, 1, 5, 13, 21, 24]
    with pytest.raises(ValueError, match=r"paths: \[1, 0\] has no parent path \[1\]"):
        trees.parents_from_paths([[0], [1, 0]])
    with pytest.raises(ValueError, match=r"paths: \[0\] appears twice"):
        trees.parents_from_paths([[0], [0]])


def test_the_benchmark_s_draft_trees() -> None:
    """A spine of ``depth`` nodes and the rest hung on it above its last node, shallowest
    first: every node's root path is at most ``depth`` long, and the spine is one."""
    parents = trees.draft_tree(16, 5)
    assert parents.tolist() == [-1, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    assert trees.leaves(parents) == list(range(4, 16))
    assert max(len(trees.root_path(parents, n)) for n in range(16)) == 5 == len(trees.root_path(parents, 4))
    trees.check_parents(parents[None], [16], 16)
    assert trees.draft_tree(4, 4).tolist() == trees.chain_parents(1, 4)[0].tolist()
    with pytest.raises(ValueError, match="depth: 9 is not in 1 to nodes"):
        trees.draft_tree(8, 9)
    with pytest.raises(ValueError, match="depth: 1 leaves 3 nodes"):
        trees.draft_tree(4, 1)


def test_a_chain_s_tables() -> None:
    assert trees.chain_parents(2, 4).tolist() == [[-1, 0, 1, 2]] * 2
    assert trees.chain_path(1, 3).tolist() == [[0, 1, 2]]
    trees.check_parents(trees.chain_parents(2, 4), [4, 2], 4)


BAD_PARENTS = [
    pytest.param(1, 2, 2, r"parents: request 1 node 2 has parent 2", id="a node its own parent"),
    pytest.param(0, 3, 5, r"parents: request 0 node 3 has parent 5", id="a parent after its node"),
    pytest.param(0, 1, -2, r"parents: request 0 node 1 has parent -2", id="below -1"),
]


@pytest.mark.parametrize(("b", "node", "parent", "message"), BAD_PARENTS)
def test_parents_that_do_not_precede_their_node_are_refused(b: int, node: int, parent: int, message: str) -> None:
    parents = trees.chain_parents(2, 4)
    parents[b, node] = parent
    with pytest.raises(ValueError, match=message):
        trees.check_parents(parents, [4, 4], 4)


def test_a_parent_table_of_the_wrong_shape_or_a_window_past_the_ring_is_refused() -> None:
    with pytest.raises(ValueError, match=r"parents: expected shape \[2, 4\]"):
        trees.check_parents(trees.chain_parents(2, 3), [3, 3], 4)
    with pytest.raises(ValueError, match=r"parents: expected an integer table, got float32"):
        trees.check_parents(np.zeros((1, 4), np.float32), [1], 4)
    with pytest.raises(ValueError, match=r"input_row_offsets: request 1 has a window of 5 tokens, past RING_LEN 4"):
        trees.check_parents(trees.chain_parents(2, 4), [4, 5], 4)


def test_a_tree_the_reference_is_given_is_checked() -> None:
    case, parents = tree_case("float32", "head")
    parents[3, 4] = 4
    with pytest.raises(ValueError, match=r"parents: request 3 node 4 has parent 4"):
        verify_tree(case, parents)


#: A tree over a window of 6: 0 -> 1 -> 3 -> 5 and 0 -> 2 -> 4.
TREE = np.asarray([[-1, 0, 0, 1, 2, 3, -1, -1]], np.int32)

BAD_PATHS = [
    pytest.param([1, 3], 2, r"accepted_nodes: request 0 entry 0 is node 1, whose parent is 0, not -1",
                 id="not from the committed state"),
    pytest.param([0, 1, 5], 3, r"entry 2 is node 5, whose parent is 3, not 1", id="a skipped node"),
    pytest.param([0, 2, 3], 3, r"entry 2 is node 3, whose parent is 1, not 2", id="across branches"),
    pytest.param([0, 0], 2, r"entry 1 is node 0, whose parent is -1, not 0", id="a repeated node"),
    pytest.param([0, 1, 6], 3, r"entry 2 is node 6, outside its window of 6", id="outside the window"),
    pytest.param([0, 1, 3, 5], 7, r"num_accepted: request 0 accepts 7 nodes of a window of 6",
                 id="longer than the window"),
]


@pytest.mark.parametrize(("path", "count", "message"), BAD_PATHS)
def test_paths_that_are_not_a_chain_of_parent_links_are_refused(path: list[int], count: int, message: str) -> None:
    nodes = np.full((1, 8), 8, np.uint32)
    nodes[0, : len(path)] = path
    with pytest.raises(ValueError, match=message):
        trees.check_accepted_nodes(nodes, np.asarray([count], np.uint32), TREE, [6], 8)


def test_a_path_longer_than_the_ring_is_refused() -> None:
    parents = trees.chain_parents(1, 4)
    with pytest.raises(ValueError, match=r"num_accepted: request 0 accepts 5 nodes of a window of 4 \(RING_LEN 4\)"):
        trees.check_accepted_nodes(trees.chain_path(1, 4), np.asarray([5]), parents, [4], 4)
    trees.check_accepted_nodes(np.asarray([[0, 1, 3, 5, 8, 8, 8, 8]]), np.asarray([4]), TREE, [6], 8)


def test_a_tree_window_past_the_ring_is_refused() -> None:
    case = random_window_case(3, windows=[2, RING_LEN + 1], ring_len=RING_LEN, key_dim=16, value_dim=16)
    with pytest.raises(ValueError, match=r"input_row_offsets: request 1 has a window of 9 tokens, past RING_LEN 8"):
        verify_tree(case, trees.chain_parents(2, RING_LEN))


def test_the_random_trees_are_forests_now_and_then() -> None:
    """So that a later node continuing the committed state, and paths from a second
    root, are exercised by the tests above."""
    _, parents = tree_case("float32", "head")
    assert any(parents[b, i] == -1 for b, w in enumerate(WINDOWS) for i in range(1, w))


def test_folds_along_paths_out_of_the_ring_or_out_of_order_are_refused() -> None:
    case, parents = tree_case("float32", "head")
    _, _, ring = verify_tree(case, parents)
    for path, message in (([0, 0], r"request 0 names nodes \[0, 0\]"), ([2, 1], r"request 0 names nodes \[2, 1\]"),
                          ([0, RING_LEN], r"request 0 names nodes \[0, 8\]")):
        nodes = trees.chain_path(len(WINDOWS), RING_LEN)
        nodes[0, :2] = path
        counts = np.zeros(len(WINDOWS), np.uint32)
        counts[0] = 2
        pool = case.state.copy()
        with pytest.raises(ValueError, match="accepted_nodes: " + message):
            reference.fold(pool, ring, case.row_ids[None], case.ring_row_ids[None], counts, accepted_nodes=nodes)
        assert_bits_equal(pool, case.state, "nothing folded")
    with pytest.raises(ValueError, match=r"previous_ring_row_ids, previous_num_accepted, previous_accepted_nodes"):
        verify_tree(case, parents, previous_ring_row_ids=case.previous_ring_row_ids,
                    previous_num_accepted=case.previous_num_accepted)
