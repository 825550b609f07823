"""The tree verify (``verify_tree``: each window a token tree, ``parents``), on the CPU:
every node's readout and every record bit for bit against ``reference.verify_tree`` for
random trees and forests, fp32 and bf16 pools, head and per-channel gates, with and
without fold on load of the previous accepted path; a chain gives the chain verify's
bits; fold on load equals the fold along the path and then the tree; bad input refused
with the pool and the ring untouched, by the host checks and by the CPU op.

On the GPU (marked ``gpu``), every tree kernel (:data:`TREE_KERNELS`: the latency
kernel with one warp a unit and with leaves shared among four, the throughput kernel's
blocks at three column tiles): the same random forests bit for bit against the reference
in every variant, with and without fold on load; EAGLE-shaped trees; a chain gives the
GPU chain verify's bits; inside a GPU graph a request with bad parents or a bad previous
path is skipped (its readout NaN, its pool and ring rows as they were), the others
exact; the eager API on a GPU with gpu_path "throughput".

Every graph op of a device runs in one graph (``range_matrix.run_many``), one compile;
the eager tests add the eager fp32 head-gate fold-on-load tree graph.
"""

from __future__ import annotations

import itertools
from functools import cache
from typing import Any

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType, TensorValue

from conftest import assert_bits_equal
from gdfold_max import kernels_path, reference, state_fold, verify_ring, verify_tree
from gdfold_max.cases import WindowCase, random_accepted_nodes, random_parents, random_window_case
from gdfold_max.eager.window import WindowRunner, runner_for, validate_window
from gdfold_max.layout import Gate
from gdfold_max.ops.checks import parent_table
from gdfold_max.trees import chain_parents, draft_tree
from range_matrix import Call, run_many

RING_LEN = 6
#: Full windows, an empty one, a single node, shorter ones.
WINDOWS = [RING_LEN, 0, 1, RING_LEN, 3, RING_LEN, 2]
BATCH = len(WINDOWS)
#: Nodes of the previous path per request (RING_LEN + 1 folds nothing; the paths' own
#: lengths replace the others, see tree_case).
SHAPE: dict[str, Any] = {"num_value_heads": 4, "num_key_heads": 2, "key_dim": 32, "value_dim": 48,
                         "ring_len": RING_LEN}
VARIANTS = [(dtype, gate) for dtype in ("float32", "bfloat16") for gate in ("head", "channel")]
CHAIN_VARIANTS = [("float32", "head"), ("bfloat16", "channel")]
#: The variant whose fold on load is also compared with the fold op then the tree op (each
#: op instantiation adds to the graph's compile; the reference checks every variant).
FOLD_THEN_TREE: tuple[str, Gate] = ("bfloat16", "channel")


#: dtype -> (parents entries, what the graph makes of them).
PARENT_CASTS: dict[str, tuple[list[int], list[int]]] = {
    "int64": ([-1, 0, 5, -5, 2**31, -(2**40)], [-1, 0, 5, -2, -2, -2]),
    "uint32": ([0, 5, 2**31, 2**32 - 1], [0, 5, -2, -2]),
    "uint64": ([0, 5, 2**31, 2**63 + 1], [0, 5, -2, -2]),
    "int16": ([-1, 3, -7], [-1, 3, -7]),
    "uint8": ([0, 255], [0, 255]),
}


def variant_seed(state_dtype: str, gate: Gate) -> int:
    return 40 + VARIANTS.index((state_dtype, gate))


#: A batch of WINDOWS repeated this often is a launch too large for a tree unit's leaves to
#: be shared among warps on any GPU of up to 500 SMs (mojo/window_launch.mojo,
#: tree_leaves_shared: 4 warps a unit up to 2 units an SM): asked for leaf_warps=4, its
#: units are one warp each.
ONE_WARP_COPIES = 12
#: The GPU tree kernels, by the suffix of their results' names: verify_tree's keywords.
#: The latency kernel with one warp a unit, and with leaves shared among four in a small
#: launch; the throughput kernel's blocks at the default tile (V's 48 columns: three
#: warps), at 16 (one warp, three tiles a head) and at 8 (half a warp).
TREE_KERNELS: dict[str, dict[str, Any]] = {
    "": {},
    " leaf 4": {"leaf_warps": 4},
    " throughput": {"gpu_path": "throughput"},
    " throughput tile 16": {"gpu_path": "throughput", "column_tile": 16},
    " throughput tile 8": {"gpu_path": "throughput", "column_tile": 8},
}


@cache
def tree_case(seed: int, state_dtype: str, gate: Gate, copies: int = 1
              ) -> tuple[WindowCase, np.ndarray, np.ndarray, np.ndarray]:
    """A ragged batch of token trees (random parents: deep paths, wide nodes, forests)
    and the previous step's accepted paths along random trees of full windows, WINDOWS
    ``copies`` times over. Request 2 folds nothing (a count of 0), request 3 nothing
    either (RING_LEN + 1), request 4 a whole chain; every previous record off its
    request's path is NaN, so a record read by mistake shows. Returns the case,
    ``parents``, the previous nodes and counts."""
    windows = WINDOWS * copies
    batch = len(windows)
    case = random_window_case(seed, windows=windows, state_dtype=state_dtype, gate=gate, **SHAPE)
    parents = random_parents(seed, windows, RING_LEN)
    nodes, counts = random_accepted_nodes(seed + 1, random_parents(seed + 1, [RING_LEN] * batch, RING_LEN),
                                          [RING_LEN] * batch)
    counts[2], counts[3] = 0, RING_LEN + 1
    nodes[4], counts[4] = np.arange(RING_LEN), RING_LEN
    for b in range(batch):
        path = set(int(n) for n in nodes[b, : counts[b]]) if counts[b] <= RING_LEN else set()
        off_path = [n for n in range(RING_LEN) if n not in path]
        case.ring[case.previous_ring_row_ids[b], :, off_path] = np.nan
    case.previous_num_accepted[:] = counts
    return case, parents, nodes, counts


def previous_of(case: WindowCase, nodes: np.ndarray) -> dict[str, np.ndarray]:
    return {"previous_ring_row_ids": case.previous_ring_row_ids, "previous_num_accepted": case.previous_num_accepted,
            "previous_accepted_nodes": nodes}


def reference_tree(case: WindowCase, parents: np.ndarray, nodes: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference's readout, pool and ring (with ``nodes``: folding that path on load)."""
    state, ring = case.fresh()
    previous = previous_of(case, nodes) if nodes is not None else {}
    out = reference.verify_tree(*case.tokens(), state, ring, case.row_ids, case.ring_row_ids,
                                case.input_row_offsets, parents, **previous)
    return out, state, ring


def tree_call(case: WindowCase, parents: np.ndarray, nodes: np.ndarray | None = None, **kernel: Any) -> Call:
    operands = [*case.tokens(), case.state, case.ring, case.row_ids, case.ring_row_ids, case.input_row_offsets,
                parents]
    if nodes is not None:
        operands += [case.previous_ring_row_ids, case.previous_num_accepted, nodes]

    def add(v: list[Any]) -> TensorValue:
        previous = {}
        if nodes is not None:
            previous = {"previous_ring_row_ids": v[9], "previous_num_accepted": v[10],
                        "previous_accepted_nodes": v[11]}
        return verify_tree(*v[:9], **previous, **kernel)
    return Call(operands, (3, 4), add, True)


def ring_call(case: WindowCase) -> Call:
    operands = [*case.tokens(), case.state, case.ring, case.row_ids, case.ring_row_ids, case.input_row_offsets]
    return Call(operands, (3, 4), lambda v: verify_ring(*v), True)


def fold_then_tree_call(case: WindowCase, parents: np.ndarray, nodes: np.ndarray, gate: Gate) -> Call:
    """The fold along the previous path (``state_fold`` with ``accepted_nodes``, one
    layer), then the tree verify without fold on load, on the same pool and ring."""
    operands = [*case.tokens(), case.state, case.ring, case.row_ids, case.ring_row_ids, case.input_row_offsets,
                parents, case.row_ids[None], case.previous_ring_row_ids[None], case.previous_num_accepted, nodes]

    def add(v: list[Any]) -> TensorValue:
        state_fold(v[3], v[4], v[9], v[10], v[11], gate=gate, accepted_nodes=v[12])
        return verify_tree(*v[:9])
    return Call(operands, (3, 4), add, True)


def variant_calls() -> dict[str, Call]:
    """Every variant's tree verify with and without fold on load, and chains through the
    tree verify and the chain verify, by name. The bf16 variants pass int64 parents and
    int32 previous paths padded with -1 (as SGLang's tables are), which the ops cast."""
    calls: dict[str, Call] = {}
    for dtype, gate in VARIANTS:
        case, parents, nodes, counts = tree_case(variant_seed(dtype, gate), dtype, gate)
        if dtype == "bfloat16":
            parents = parents.astype(np.int64)
            nodes = nodes.astype(np.int32)
            for b in range(BATCH):
                nodes[b, min(int(counts[b]), RING_LEN):] = -1
        calls[f"tree {dtype} {gate}"] = tree_call(case, parents)
        calls[f"fold on load {dtype} {gate}"] = tree_call(case, parents, nodes)
    for dtype, gate in CHAIN_VARIANTS:
        case = tree_case(variant_seed(dtype, gate), dtype, gate)[0]
        calls[f"chain tree {dtype} {gate}"] = tree_call(case, chain_parents(BATCH, RING_LEN))
        calls[f"chain ring {dtype} {gate}"] = ring_call(case)
    return calls


@cache
def run_all() -> dict[str, tuple[np.ndarray, ...]]:
    """:func:`variant_calls`, the path fold then the tree, and the casts of
    :data:`PARENT_CASTS`; one graph."""
    calls = variant_calls()
    case, parents, nodes, _ = tree_case(variant_seed(*FOLD_THEN_TREE), *FOLD_THEN_TREE)
    calls["fold then tree"] = fold_then_tree_call(case, parents, nodes, FOLD_THEN_TREE[1])
    for dtype, (entries, _) in PARENT_CASTS.items():
        calls[f"parents as {dtype}"] = Call([np.asarray(entries, dtype)], (), lambda v: parent_table("parents", v[0]),
                                            True)
    results = run_many("cpu", "verify_tree_cpu", list(calls.values()))
    got: dict[str, tuple[np.ndarray, ...]] = {}
    for name, (readout, written) in zip(calls, results, strict=True):
        assert readout is not None
        got[name] = (readout, *written)
    return got


def assert_same(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...], what: str) -> None:
    for part, a, b in zip(("readout", "pool", "ring"), got, want, strict=True):
        assert_bits_equal(a, b, f"{what}: {part}")


@pytest.mark.parametrize(("state_dtype", "gate"), VARIANTS)
def test_tree_matches_the_reference(state_dtype: str, gate: Gate) -> None:
    case, parents, _, _ = tree_case(variant_seed(state_dtype, gate), state_dtype, gate)
    got = run_all()[f"tree {state_dtype} {gate}"]
    assert_same(got, reference_tree(case, parents), "tree vs reference")
    assert_bits_equal(got[1], case.state, "the pool, which a tree verify does not write")
    # Every node of every window wrote its record; the rows of other requests are kept.
    for b, window in enumerate(WINDOWS):
        records = got[2][case.ring_row_ids[b], :, :window]
        assert not np.isnan(records[..., : SHAPE["key_dim"]]).any(), b


@pytest.mark.parametrize(("state_dtype", "gate"), VARIANTS)
def test_fold_on_load_matches_the_reference(state_dtype: str, gate: Gate) -> None:
    case, parents, nodes, counts = tree_case(variant_seed(state_dtype, gate), state_dtype, gate)
    got = run_all()[f"fold on load {state_dtype} {gate}"]
    assert_same(got, reference_tree(case, parents, nodes), "fold on load vs reference")
    # The requests with a path to fold changed their pool rows; the others did not.
    for b in range(BATCH):
        row = case.row_ids[b]
        moved = not np.array_equal(got[1][row].view(np.uint8), case.state[row].view(np.uint8))
        assert moved == (1 <= counts[b] <= RING_LEN), b


@pytest.mark.parametrize(("state_dtype", "gate"), CHAIN_VARIANTS)
def test_a_chain_gives_the_chain_verify_bits(state_dtype: str, gate: Gate) -> None:
    results = run_all()
    case = tree_case(variant_seed(state_dtype, gate), state_dtype, gate)[0]
    chain = results[f"chain ring {state_dtype} {gate}"]
    assert_same(chain, case.run_verify(reference.verify_ring, fold_on_load=False), "chain verify vs reference")
    assert_same(results[f"chain tree {state_dtype} {gate}"], chain, "chain parents vs chain verify")


def test_fold_on_load_equals_the_path_fold_then_the_tree() -> None:
    results = run_all()
    assert_same(results["fold on load {} {}".format(*FOLD_THEN_TREE)], results["fold then tree"],
                "fold on load vs state_fold along the path, then the tree")


# The eager API: one graph, the fp32 head-gate tree verify with fold on load (a plain tree
# verify is its case of previous counts of 0, with the pool then unwritten).

@pytest.fixture(scope="module")
def runner() -> WindowRunner:
    return runner_for("cpu")


@pytest.fixture(scope="module")
def eager_case() -> tuple[WindowCase, np.ndarray, np.ndarray, np.ndarray]:
    return tree_case(50, "float32", "head")


def run_eager(runner: WindowRunner, case: WindowCase, tree: Any, previous_nodes: Any, **changes: Any
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The eager tree verify with fold on load of ``previous_nodes`` on fresh copies of
    the pool and the ring (or on those ``changes`` name), the case's operands replaced
    by ``changes``."""
    state, ring = case.fresh()
    arguments = {"qkv": case.qkv, "decay": case.decay, "beta": case.beta, "recurrent_state": state, "ring": ring,
                 "row_ids": case.row_ids, "ring_row_ids": case.ring_row_ids,
                 "input_row_offsets": case.input_row_offsets, "parents": tree, **previous_of(case, previous_nodes)}
    arguments.update(changes)
    out = runner.verify_tree(**arguments)
    return out, arguments["recurrent_state"], arguments["ring"]


def test_eager_tree_matches_the_reference(runner: WindowRunner, eager_case: tuple) -> None:
    case, parents, nodes, _ = eager_case
    assert_same(run_eager(runner, case, parents, nodes), reference_tree(case, parents, nodes), "eager fold on load")
    # Nothing to fold: the tree verify alone, the pool unwritten.
    nothing = np.zeros(BATCH, np.uint32)
    got = run_eager(runner, case, parents.astype(np.int64), nodes, previous_num_accepted=nothing)
    quiet = WindowCase(**{**case.__dict__, "previous_num_accepted": nothing})
    assert_same(got, reference_tree(quiet, parents), "eager tree")
    assert_bits_equal(got[1], case.state, "the pool, which a tree verify does not write")


def recording_into(case: WindowCase, request: int) -> np.ndarray:
    """Ring rows where request 0 records into the row that ``request`` folds from."""
    rows = case.ring_row_ids.copy()
    rows[0] = case.previous_ring_row_ids[request]
    return rows


def _with(table: np.ndarray, request: int, entries: list[int], dtype: type | None = None) -> np.ndarray:
    table = table.astype(dtype or table.dtype)
    table[request, : len(entries)] = entries
    return table


#: name -> (changes of the eager call, given the case, its parents and previous nodes;
#: error pattern).
#: Request 0's window is RING_LEN nodes, request 4's previous path the whole ring.
BAD_INPUTS = {
    "a node its own parent": (lambda c, p, n: {"parents": _with(p, 0, [-1, 0, 2])},
                              r"parents: request 0 node 2 has parent 2; a parent is -1 \(the committed state\) or an"
                              r" earlier node of the window \(0 to 1\)"),
    "a parent after its node": (lambda c, p, n: {"parents": _with(p, 5, [-1, 4])},
                                r"parents: request 5 node 1 has parent 4"),
    "a parent below -1": (lambda c, p, n: {"parents": _with(p, 3, [-2])},
                          r"parents: request 3 node 0 has parent -2"),
    "the root's parent a node": (lambda c, p, n: {"parents": _with(p, 0, [0])},
                                 r"parents: request 0 node 0 has parent 0"),
    "a parents table of another batch": (lambda c, p, n: {"parents": p[:-1]},
                                         rf"parents: expected shape \[{BATCH}, {RING_LEN}\] \(\[batch, RING_LEN\]\),"
                                         rf" got \[{BATCH - 1}, {RING_LEN}\]"),
    "a parents table past the ring": (lambda c, p, n: {"parents": np.concatenate([p, p[:, :1]], axis=1)},
                                      rf"parents: expected shape \[{BATCH}, {RING_LEN}\]"),
    "a float parents table": (lambda c, p, n: {"parents": p.astype(np.float32)},
                              r"parents: expected an integer table, got float32"),
    "a window past the ring": (lambda c, p, n: {"input_row_offsets": np.cumsum([0, RING_LEN + 1, 0, 0, *WINDOWS[3:]],
                                                                             dtype=np.uint32)},
                               rf"input_row_offsets: request 0 has a window of {RING_LEN + 1} tokens, past RING_LEN"
                               rf" {RING_LEN}; a tree window must fit the ring"),
    "a previous node past the ring": (lambda c, p, n: {"previous_accepted_nodes": _with(n, 4, [0, 1, RING_LEN])},
                                      rf"previous_accepted_nodes: request 4 names nodes \[0, 1, {RING_LEN}, 3, 4,"
                                      rf" 5\]; a path names nodes 0 to {RING_LEN - 1} in increasing order"),
    "previous nodes out of order": (lambda c, p, n: {"previous_accepted_nodes": _with(n, 4, [1, 0])},
                                    r"previous_accepted_nodes: request 4 names nodes \[1, 0, 2, 3, 4, 5\]"),
    "a negative previous node": (lambda c, p, n: {"previous_accepted_nodes": _with(n, 4, [-1], np.int32)},
                                 r"previous_accepted_nodes: request 4 names nodes \[-1, 1, 2, 3, 4, 5\]"),
    "a previous table of another batch": (lambda c, p, n: {"previous_accepted_nodes": n[:-1]},
                                          rf"previous_accepted_nodes: expected shape \[{BATCH}, {RING_LEN}\]"),
    "only two previous tables": (lambda c, p, n: {"previous_accepted_nodes": None},
                                 r"previous_ring_row_ids, previous_num_accepted, previous_accepted_nodes: give all"
                                 r" three"),
    "a ring row folded from and recorded into": (lambda c, p, n: {"ring_row_ids": recording_into(c, 4)},
                                                 r"ring_row_ids: request 0 records into ring row \d+, which request 4"
                                                 r" folds from"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_eager_refuses_bad_input_untouched(runner: WindowRunner, eager_case: tuple, name: str) -> None:
    change, pattern = BAD_INPUTS[name]
    case, parents, nodes, _ = eager_case
    changes = change(case, parents, nodes)
    state, ring = case.fresh()
    with pytest.raises(ValueError, match=pattern):
        run_eager(runner, case, parents, nodes, recurrent_state=state, ring=ring, **changes)
    assert_bits_equal(state, case.state)
    assert_bits_equal(ring, case.ring, "ring")


#: (request, the parents of its first nodes, or None and the offsets of a long window;
#: previous path of request 4, or None; error pattern) the CPU op refuses on its own.
OP_REFUSALS = [
    pytest.param(5, [-1, 1], None, r"parents: request 5 node 1 has parent 1; a parent is -1 \(the committed state\) or"
                 r" an earlier node of the window \(0 to 0\)", id="a node its own parent"),
    pytest.param(3, [-1, 0, 7], None, r"parents: request 3 node 2 has parent 7", id="a parent after its node"),
    pytest.param(0, [-5], None, r"parents: request 0 node 0 has parent -5", id="a parent below -1"),
    pytest.param(0, None, None, rf"input_row_offsets: request 0 has a window of {RING_LEN + 1} tokens, past RING_LEN"
                 rf" {RING_LEN}; a tree window must fit the ring", id="a window past the ring"),
    pytest.param(None, None, [0, 3, 3], r"previous_accepted_nodes: request 4 entry 2 is node 3 \(the entry before:"
                 rf" 3\); a path names nodes 0 to {RING_LEN - 1} in increasing order", id="a repeated previous node"),
    pytest.param(None, None, [0, RING_LEN],
                 rf"previous_accepted_nodes: request 4 entry 1 is node {RING_LEN}", id="a previous node past the ring"),
]


@pytest.mark.parametrize(("request_", "entries", "path", "pattern"), OP_REFUSALS)
def test_cpu_op_refuses_bad_input_before_writing(runner: WindowRunner, eager_case: tuple, request_: int | None,
                                                 entries: list[int] | None, path: list[int] | None,
                                                 pattern: str) -> None:
    """Past the host checks, the compiled CPU op checks the parents, the windows and the
    previous paths before its first store."""
    case, parents, nodes, counts = eager_case
    offsets = case.input_row_offsets
    if request_ is not None and entries is not None:
        parents = _with(parents, request_, entries)
    elif request_ is not None:
        offsets = np.cumsum([0, RING_LEN + 1, 0, 0, *WINDOWS[3:]], dtype=np.uint32)
    counts = counts.copy()
    if path is not None:
        nodes = _with(nodes, 4, path)
        counts[4] = len(path)
    call = validate_window(*case.tokens(), case.state, case.ring,
                           {"row_ids": case.row_ids, "ring_row_ids": case.ring_row_ids,
                            "input_row_offsets": case.input_row_offsets}, runner.device)
    model = runner.model("tree_fold_on_load", call.state.dtype, call.parameters)
    state, ring = case.fresh()
    tables = [np.ascontiguousarray(t, dtype) for t, dtype in (
        (case.row_ids, np.uint32), (case.ring_row_ids, np.uint32), (offsets, np.uint32), (parents, np.int32),
        (case.previous_ring_row_ids, np.uint32), (counts, np.uint32), (nodes, np.uint32))]
    with pytest.raises(ValueError, match=pattern):
        model.execute(*(Buffer.from_numpy(a) for a in (*case.tokens(), state, ring, *tables)))
    assert_bits_equal(state, case.state)
    assert_bits_equal(ring, case.ring, "ring")


def test_graph_refuses_bad_tables() -> None:
    """While the graph is built: parents or a previous path table of a wrong rank, shape
    or dtype, a leaf_warps or gpu_path the kernels do not take, and a column tile that
    does not divide V. (One graph for every case: each graph loads the kernel package.)"""
    k, v, nv, nk = SHAPE["key_dim"], SHAPE["value_dim"], SHAPE["num_value_heads"], SHAPE["num_key_heads"]
    cpu = DeviceRef.CPU()
    inputs = [TensorType(DType.float32, ["T", 2 * nk * k + nv * v], cpu), TensorType(DType.float32, ["T", nv], cpu),
              TensorType(DType.float32, ["T", nv], cpu), BufferType(DType.float32, [16, nv, k, v], cpu),
              BufferType(DType.float32, [16, nk, RING_LEN, 160], cpu),
              *(TensorType(DType.uint32, [n], cpu) for n in (BATCH, BATCH, BATCH + 1)),
              TensorType(DType.int32, [BATCH, RING_LEN], cpu), TensorType(DType.int32, [BATCH], cpu),
              TensorType(DType.int32, [BATCH, RING_LEN + 1], cpu), TensorType(DType.float32, [BATCH, RING_LEN], cpu)]
    with Graph("bad_tree_tables", input_types=inputs, custom_extensions=[kernels_path()]) as graph:
        values = [x.buffer if i in (3, 4) else x.tensor for i, x in enumerate(graph.inputs)]
        window, (parents, flat, wide, floats) = values[:8], values[8:]
        rows = window[5]
        refusals = [
            ({"parents": flat}, rf"parents: expected rank 2 \[batch, RING_LEN\], got shape \[{BATCH}\]"),
            ({"parents": wide}, rf"parents: shape \[{BATCH}, {RING_LEN + 1}\] is not \[batch, RING_LEN\]"),
            ({"parents": floats}, r"parents: dtype DType.float32 is not an integer dtype"),
            ({"previous_accepted_nodes": wide},
             r"previous_ring_row_ids, previous_num_accepted, previous_accepted_nodes: give all three"),
            ({"previous_ring_row_ids": rows, "previous_num_accepted": rows, "previous_accepted_nodes": wide},
             rf"previous_accepted_nodes: shape \[{BATCH}, {RING_LEN + 1}\] is not \[batch, RING_LEN\]"),
            ({"previous_ring_row_ids": rows, "previous_num_accepted": rows, "previous_accepted_nodes": floats},
             r"previous_accepted_nodes: dtype DType.float32 is not an integer dtype"),
            ({"leaf_warps": 2}, r"leaf_warps: 2 must be 1 or 4"),
            ({"leaf_warps": 4, "gpu_path": "throughput"},
             r"leaf_warps: 4 shares leaves on the latency kernel only; gpu_path 'throughput' takes 1"),
            ({"gpu_path": "fastest"}, r"gpu_path: 'fastest' must be one of 'auto', 'latency', 'throughput'"),
            ({"gpu_path": "throughput", "column_tile": 32},
             r"column_tile: 32 must be 4, 8, 16 or a multiple of 16, and divide V=48"),
        ]
        names = ("qkv", "decay", "beta", "recurrent_state", "ring", "row_ids", "ring_row_ids", "input_row_offsets")
        for changes, pattern in refusals:
            arguments = {**dict(zip(names, window, strict=True)), "parents": parents, **changes}
            with pytest.raises(ValueError, match=pattern):
                verify_tree(**arguments)
        graph.output()



def test_the_runner_refuses_a_leaf_warps_the_kernel_does_not_take() -> None:
    with pytest.raises(ValueError, match=r"leaf_warps: 3 must be 1 or 4"):
        WindowRunner("cpu", leaf_warps=3)
    with pytest.raises(ValueError, match=r"leaf_warps: 4 shares leaves on the latency kernel only"):
        WindowRunner("cpu", gpu_path="throughput", leaf_warps=4)
    with pytest.raises(ValueError, match=r"gpu_path: 'fastest' must be one of"):
        WindowRunner("cpu", gpu_path="fastest")


def test_a_graph_casts_parents_without_wrapping() -> None:
    """In a graph, ``parents`` of any integer dtype become int32: -1 stays the committed
    state, and an entry below -1 or past int32 becomes -2, which the CPU op refuses,
    never another node."""
    casts = run_all()
    for dtype, (_, want) in PARENT_CASTS.items():
        got = casts[f"parents as {dtype}"][0]
        assert got.dtype == np.int32 and got.tolist() == want, dtype


# On the GPU: every tree kernel, every variant, in one GPU graph.

#: Inside a GPU graph the host checks nothing: request 0's node 2 names itself, request
#: 5's node 1 names -2 (what the graph makes of a parent int32 cannot hold), and with fold
#: on load request 4's previous path is out of order. The kernel skips those requests.
BAD_PARENTS = {0: [-1, 0, 2], 5: [-1, -2]}
BAD_PATH = {4: [1, 0, 2]}


def bad_tables(parents: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    parents, nodes = parents.copy(), nodes.copy()
    for b, entries in BAD_PARENTS.items():
        parents[b, : len(entries)] = entries
    for b, entries in BAD_PATH.items():
        nodes[b, : len(entries)] = entries
    return parents, nodes


#: EAGLE-shaped trees (trees.draft_tree: a spine with leaves hung on it, shallowest first),
#: NODES x DEPTH, each at a ring of its node count: 16x5 hangs three or two leaves on each
#: inner node, 32x6 five or six, so each of a unit's three leaf warps steps one or two
#: leaves of a parent, by rank.
DRAFT_TREES = [(16, 5), (32, 6)]
DRAFT_VARIANTS = [("float32", "head"), ("bfloat16", "channel")]


@cache
def draft_case(nodes: int, depth: int, state_dtype: str, gate: Gate
               ) -> tuple[WindowCase, np.ndarray, np.ndarray]:
    """Three requests, each the tree ``draft_tree(nodes, depth)`` in a full window, with
    fold on load of a random root path of the same tree (none for one request); every
    previous record off its request's path is NaN. Returns the case, ``parents`` and the
    previous nodes."""
    windows = [nodes] * 3
    seed = 70 + nodes + DRAFT_VARIANTS.index((state_dtype, gate))
    shape = {**SHAPE, "ring_len": nodes}
    case = random_window_case(seed, windows=windows, state_dtype=state_dtype, gate=gate, **shape)
    parents = np.tile(draft_tree(nodes, depth), (len(windows), 1))
    previous, counts = random_accepted_nodes(seed + 1, parents, windows)
    counts[1] = 0
    for b in range(len(windows)):
        path = set(int(n) for n in previous[b, : counts[b]])
        case.ring[case.previous_ring_row_ids[b], :, [n for n in range(nodes) if n not in path]] = np.nan
    case.previous_num_accepted[:] = counts
    return case, parents, previous


@cache
def run_all_gpu() -> dict[str, tuple[np.ndarray, ...]]:
    """run_all's trees (every variant, with and without fold on load) and chains (the
    tree verify and the chain verify) on the GPU; the trees again on every other kernel of
    :data:`TREE_KERNELS` (its suffix ends their names), with the fp32 head-gate case's bad
    tables of :data:`BAD_PARENTS` and :data:`BAD_PATH` each way and the EAGLE-shaped trees
    of :data:`DRAFT_TREES`; a launch too large for leaves shared among four warps, and the
    same launch on the throughput kernel (more units than its resident blocks); a chain
    through the throughput kernel's tree; one GPU graph."""
    calls = variant_calls()
    for suffix, kernel in TREE_KERNELS.items():
        if suffix:
            for dtype, gate in VARIANTS:
                case, parents, nodes, _ = tree_case(variant_seed(dtype, gate), dtype, gate)
                calls[f"tree {dtype} {gate}{suffix}"] = tree_call(case, parents, **kernel)
                calls[f"fold on load {dtype} {gate}{suffix}"] = tree_call(case, parents, nodes, **kernel)
        case, parents, nodes, _ = tree_case(variant_seed("float32", "head"), "float32", "head")
        bad_parents, bad_nodes = bad_tables(parents, nodes)
        calls["bad parents" + suffix] = tree_call(case, bad_parents, **kernel)
        calls["bad parents, fold on load" + suffix] = tree_call(case, bad_parents, bad_nodes, **kernel)
        for (nodes, depth), (dtype, gate) in itertools.product(DRAFT_TREES, DRAFT_VARIANTS):
            case, parents, previous = draft_case(nodes, depth, dtype, gate)
            calls[f"draft {nodes}x{depth} {dtype} {gate}{suffix}"] = tree_call(case, parents, previous, **kernel)
    for dtype, gate in CHAIN_VARIANTS:
        case, parents, nodes, _ = tree_case(variant_seed(dtype, gate), dtype, gate, ONE_WARP_COPIES)
        calls[f"large launch {dtype} {gate} leaf 4"] = tree_call(case, parents, nodes, leaf_warps=4)
        calls[f"large launch {dtype} {gate} throughput"] = tree_call(case, parents, nodes, gpu_path="throughput")
        case = tree_case(variant_seed(dtype, gate), dtype, gate)[0]
        calls[f"chain tree {dtype} {gate} throughput"] = tree_call(case, chain_parents(BATCH, RING_LEN),
                                                                   gpu_path="throughput")
    results = run_many("gpu", "verify_tree_gpu", list(calls.values()))
    got: dict[str, tuple[np.ndarray, ...]] = {}
    for name, (readout, written) in zip(calls, results, strict=True):
        assert readout is not None
        got[name] = (readout, *written)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [" leaf 4", " throughput"])
@pytest.mark.parametrize(("state_dtype", "gate"), CHAIN_VARIANTS)
def test_gpu_tree_of_a_large_launch_matches_the_reference(state_dtype: str, gate: Gate, kernel: str) -> None:
    """The tree verify with fold on load in a launch of 84 requests: asked to share leaves
    among four warps, too large for that (its units are one warp each); on the throughput
    kernel, more units than its resident blocks."""
    case, parents, nodes, _ = tree_case(variant_seed(state_dtype, gate), state_dtype, gate, ONE_WARP_COPIES)
    got = run_all_gpu()[f"large launch {state_dtype} {gate}{kernel}"]
    assert_same(got, reference_tree(case, parents, nodes), f"GPU tree ({kernel.strip()}, a large launch) vs reference")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(TREE_KERNELS))
@pytest.mark.parametrize(("state_dtype", "gate"), VARIANTS)
def test_gpu_tree_matches_the_reference(state_dtype: str, gate: Gate, kernel: str) -> None:
    case, parents, _, _ = tree_case(variant_seed(state_dtype, gate), state_dtype, gate)
    got = run_all_gpu()[f"tree {state_dtype} {gate}{kernel}"]
    assert_same(got, reference_tree(case, parents), "GPU tree vs reference")
    assert_bits_equal(got[1], case.state, "the pool, which a tree verify does not write")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(TREE_KERNELS))
@pytest.mark.parametrize(("state_dtype", "gate"), VARIANTS)
def test_gpu_fold_on_load_matches_the_reference(state_dtype: str, gate: Gate, kernel: str) -> None:
    case, parents, nodes, _ = tree_case(variant_seed(state_dtype, gate), state_dtype, gate)
    got = run_all_gpu()[f"fold on load {state_dtype} {gate}{kernel}"]
    assert_same(got, reference_tree(case, parents, nodes), "GPU fold on load vs reference")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(TREE_KERNELS))
@pytest.mark.parametrize(("state_dtype", "gate"), DRAFT_VARIANTS)
@pytest.mark.parametrize(("nodes", "depth"), DRAFT_TREES)
def test_gpu_draft_tree_matches_the_reference(nodes: int, depth: int, state_dtype: str, gate: Gate,
                                              kernel: str) -> None:
    """EAGLE-shaped trees with fold on load, where a parent has more leaves than a unit
    has leaf warps: every node's readout, the pool and every record."""
    case, parents, previous = draft_case(nodes, depth, state_dtype, gate)
    got = run_all_gpu()[f"draft {nodes}x{depth} {state_dtype} {gate}{kernel}"]
    assert_same(got, reference_tree(case, parents, previous), "GPU draft tree vs reference")


@pytest.mark.gpu
@pytest.mark.parametrize(("state_dtype", "gate"), CHAIN_VARIANTS)
def test_gpu_chain_gives_the_gpu_chain_verify_bits(state_dtype: str, gate: Gate) -> None:
    results = run_all_gpu()
    case = tree_case(variant_seed(state_dtype, gate), state_dtype, gate)[0]
    chain = results[f"chain ring {state_dtype} {gate}"]
    assert_same(chain, case.run_verify(reference.verify_ring, fold_on_load=False), "GPU chain verify vs reference")
    assert_same(results[f"chain tree {state_dtype} {gate}"], chain, "GPU chain parents vs GPU chain verify")
    assert_same(results[f"chain tree {state_dtype} {gate} throughput"], chain,
                "GPU chain parents on the throughput kernel's tree vs GPU chain verify")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(TREE_KERNELS))
@pytest.mark.parametrize("fold_on_load", [False, True], ids=["tree", "fold on load"])
def test_gpu_graph_skips_bad_parents_and_paths(fold_on_load: bool, kernel: str) -> None:
    """A request whose parents (or previous path) the kernel finds bad reads NaN and
    leaves its pool row and ring rows as they were; every other request is the
    reference's (run with the good tables)."""
    case, parents, nodes, _ = tree_case(variant_seed("float32", "head"), "float32", "head")
    name = "bad parents, fold on load" if fold_on_load else "bad parents"
    readout, state, ring = run_all_gpu()[name + kernel]
    want = reference_tree(case, parents, nodes if fold_on_load else None)
    skipped = set(BAD_PARENTS) | (set(BAD_PATH) if fold_on_load else set())
    offsets = case.input_row_offsets
    for b in range(BATCH):
        tokens = slice(int(offsets[b]), int(offsets[b + 1]))
        row, ring_row = case.row_ids[b], case.ring_row_ids[b]
        if b in skipped:
            assert np.isnan(readout[tokens]).all(), b
            assert_bits_equal(state[row], case.state[row], f"request {b}'s pool row, skipped")
            assert_bits_equal(ring[ring_row], case.ring[ring_row], f"request {b}'s ring row, skipped")
        else:
            assert_bits_equal(readout[tokens], want[0][tokens], f"request {b}'s readout")
            assert_bits_equal(state[row], want[1][row], f"request {b}'s pool row")
            assert_bits_equal(ring[ring_row], want[2][ring_row], f"request {b}'s ring row")


@pytest.mark.gpu
def test_gpu_eager_tree_matches_the_reference(eager_case: tuple) -> None:
    """The eager API on a GPU, its runner on the throughput path (the throughput kernel's
    tree blocks), bit for bit, with a path to fold, with one of no nodes, and without the
    previous tables (the plain tree graph)."""
    runner = runner_for("gpu", "throughput")
    case, parents, nodes, _ = eager_case
    assert_same(run_eager(runner, case, parents, nodes), reference_tree(case, parents, nodes),
                "GPU eager fold on load")
    nothing = np.zeros(BATCH, np.uint32)
    got = run_eager(runner, case, parents, nodes, previous_num_accepted=nothing)
    quiet = WindowCase(**{**case.__dict__, "previous_num_accepted": nothing})
    assert_same(got, reference_tree(quiet, parents), "GPU eager tree, nothing to fold")
    plain = run_eager(runner, case, parents, nodes, previous_ring_row_ids=None, previous_num_accepted=None,
                      previous_accepted_nodes=None)
    assert_same(plain, reference_tree(case, parents), "GPU eager tree")
    assert_bits_equal(plain[1], case.state, "the pool, which a tree verify does not write")


@pytest.mark.gpu
def test_gpu_eager_refuses_bad_parents_untouched(eager_case: tuple) -> None:
    """On a GPU the eager API checks the tables on the host, as on the CPU."""
    case, parents, nodes, _ = eager_case
    state, ring = case.fresh()
    bad_parents, _ = bad_tables(parents, nodes)
    with pytest.raises(ValueError, match=r"parents: request 0 node 2 has parent 2"):
        run_eager(runner_for("gpu", "throughput"), case, bad_parents, nodes, recurrent_state=state, ring=ring)
    assert_bits_equal(state, case.state)
    assert_bits_equal(ring, case.ring, "ring")
