"""The fold along an accepted path of a token tree (``accepted_nodes``), on the CPU and the
GPU: bit for bit against ``reference.fold(..., accepted_nodes=...)`` for random trees and
paths, fp32 and bf16 pools, head and per-channel gates; a chain's path folds the chain's
bits; bad paths refused with nothing written (host and CPU op), and skipped inside a GPU
graph without following the bad node.

Every op of a device runs in one graph (``range_matrix.run_many``), one compile; the eager
tests add the eager fp32 head-gate path graph.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType

from conftest import assert_bits_equal
from gdfold_max import StateFolder, folder_for, kernels_path, reference, state_fold
from gdfold_max.cases import FoldCase, random_accepted_nodes, random_fold_case, random_parents
from gdfold_max.eager.fold import validate_fold
from gdfold_max.layout import Gate
from range_matrix import Call, fold_call, run_many

RING_LEN = 6
BATCH = 7
LAYERS = 3
VARIANTS = [(dtype, gate) for dtype in ("float32", "bfloat16") for gate in ("head", "channel")]
DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def path_case(seed: int, state_dtype: str, gate: Gate) -> tuple[FoldCase, np.ndarray, np.ndarray, np.ndarray]:
    """Random records of every node of a ring (each request's tree fills it), random
    accepted paths along random trees, and the reference fold of those paths. Request 0
    accepts nothing, request 1 more than RING_LEN (neither is read), request 2 the whole
    ring; every record off a request's path is NaN, so a record read by mistake shows.
    Returns the case (its ``num_accepted`` and ``state_out`` the path's), the node table
    and its count."""
    case = random_fold_case(seed, layers=LAYERS, batch=BATCH, ring_len=RING_LEN, state_dtype=state_dtype, gate=gate,
                            num_accepted=[RING_LEN] * BATCH)
    windows = [RING_LEN] * BATCH
    nodes, counts = random_accepted_nodes(seed, random_parents(seed, windows, RING_LEN), windows)
    counts[0], counts[1] = 0, RING_LEN + 1
    nodes[2], counts[2] = np.arange(RING_LEN), RING_LEN
    ring = case.ring.copy()
    for layer in range(LAYERS):
        for b in range(BATCH):
            path = set(int(n) for n in nodes[b, : counts[b]]) if counts[b] <= RING_LEN else set()
            off_path = [n for n in range(RING_LEN) if n not in path]
            ring[case.ring_row_ids[layer, b], :, off_path] = np.nan
    state_out = reference.fold(case.state_in.copy(), ring, case.row_ids, case.ring_row_ids, counts, gate=gate,
                               accepted_nodes=nodes)
    folded = FoldCase(state_in=case.state_in, ring=ring, row_ids=case.row_ids, ring_row_ids=case.ring_row_ids,
                      num_accepted=counts, state_out=state_out, meta=case.meta)
    return folded, nodes, counts, ring


def path_call(case: FoldCase, nodes: np.ndarray, gate: Gate) -> Call:
    def add(v: list[Any]) -> None:
        state_fold(*v[:5], gate=gate, accepted_nodes=v[5])
    return Call([case.state_in, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted, nodes], (0, 1),
                add, False)


def chain_case(seed: int, state_dtype: str, gate: Gate) -> FoldCase:
    """Counts of 0, 1, RING_LEN and RING_LEN + 1, records past them NaN."""
    return random_fold_case(seed, layers=LAYERS, batch=BATCH, ring_len=RING_LEN, state_dtype=state_dtype, gate=gate)


def chain_nodes(dtype: type = np.uint32) -> np.ndarray:
    return np.tile(np.arange(RING_LEN, dtype=dtype), (BATCH, 1))


def bad_paths(nodes: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, set[int]]:
    """Paths a GPU graph must skip: a node past the ring, two nodes out of order, a node
    twice; the requests they are in. Every other request keeps its path."""
    nodes, counts = nodes.copy(), counts.copy()
    nodes[3, :3], counts[3] = [0, 2, RING_LEN], 3
    nodes[4, :2], counts[4] = [3, 1], 2
    nodes[5, :2], counts[5] = [2, 2], 2
    return nodes, counts, {3, 4, 5}


@cache
def run_all(device: str) -> dict[str, np.ndarray]:
    """Every variant's path fold, a chain folded by the plain op and by the path op, and
    (GPU only: the CPU op refuses them) the bad paths of :func:`bad_paths`; one graph."""
    calls: dict[str, Call] = {}
    for i, (dtype, gate) in enumerate(VARIANTS):
        case, nodes, _, _ = path_case(90 + i, dtype, gate)
        # bf16 variants pass int32 tables padded past each path with -1, as SGLang's are.
        if dtype == "bfloat16":
            nodes = nodes.astype(np.int32)
            for b in range(BATCH):
                nodes[b, min(int(case.num_accepted[b]), RING_LEN):] = -1
        calls[f"path {dtype} {gate}"] = path_call(case, nodes, gate)
        chain = chain_case(80 + i, dtype, gate)
        calls[f"chain {dtype} {gate}"] = fold_call(chain, gate)
        calls[f"chain as a path {dtype} {gate}"] = path_call(chain, chain_nodes(), gate)
    if device == "gpu":
        case, nodes, counts, _ = path_case(99, "float32", "head")
        nodes, counts, _ = bad_paths(nodes, counts)
        calls["bad paths"] = path_call(FoldCase(state_in=case.state_in, ring=case.ring, row_ids=case.row_ids,
                                                ring_row_ids=case.ring_row_ids, num_accepted=counts,
                                                state_out=case.state_out, meta=case.meta), nodes, "head")
    results = run_many(device, f"fold_path_{device}", list(calls.values()))
    return {name: written[0] for name, (_, written) in zip(calls, results, strict=True)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("state_dtype", "gate"), VARIANTS)
def test_path_fold_matches_the_reference(device: str, state_dtype: str, gate: Gate) -> None:
    case, _, counts, _ = path_case(90 + VARIANTS.index((state_dtype, gate)), state_dtype, gate)
    got = run_all(device)[f"path {state_dtype} {gate}"]
    assert_bits_equal(got, case.state_out)
    # The folded requests changed; those of 0 and RING_LEN + 1 accepted did not.
    for layer in range(LAYERS):
        for b in range(BATCH):
            row = case.row_ids[layer, b]
            moved = not np.array_equal(got[row].view(np.uint8), case.state_in[row].view(np.uint8))
            assert moved == (1 <= counts[b] <= RING_LEN), (layer, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("state_dtype", "gate"), VARIANTS)
def test_a_chain_as_a_path_folds_the_chain(device: str, state_dtype: str, gate: Gate) -> None:
    results = run_all(device)
    chain = chain_case(80 + VARIANTS.index((state_dtype, gate)), state_dtype, gate)
    assert_bits_equal(results[f"chain {state_dtype} {gate}"], chain.state_out, "plain fold vs reference")
    assert_bits_equal(results[f"chain as a path {state_dtype} {gate}"], results[f"chain {state_dtype} {gate}"],
                      "arange path vs plain fold")


@pytest.mark.gpu
def test_gpu_graph_skips_a_request_with_a_bad_path() -> None:
    """Inside a GPU graph the path is trusted for speed but never followed past the ring
    or out of order: that request is skipped in every layer, the others exact."""
    case, nodes, counts, ring = path_case(99, "float32", "head")
    nodes, counts, skipped = bad_paths(nodes, counts)
    kept = counts.copy()
    kept[sorted(skipped)] = 0
    want = reference.fold(case.state_in.copy(), ring, case.row_ids, case.ring_row_ids, kept, accepted_nodes=nodes)
    assert_bits_equal(run_all("gpu")["bad paths"], want)


@pytest.fixture(scope="module", params=[pytest.param("cpu", id="cpu"),
                                        pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)])
def folder(request: pytest.FixtureRequest) -> StateFolder:
    return folder_for(str(request.param))


@pytest.fixture(scope="module")
def eager_case() -> tuple[FoldCase, np.ndarray, np.ndarray, np.ndarray]:
    return path_case(95, "float32", "head")


def test_eager_path_fold_matches_the_reference(folder: StateFolder, eager_case: tuple) -> None:
    case, nodes, counts, ring = eager_case
    state = case.state_in.copy()
    folder.fold(state, ring, case.row_ids, case.ring_row_ids, counts, accepted_nodes=nodes)
    assert_bits_equal(state, case.state_out)
    # A chain's path through the eager API too (records of a path-less ring: all kept).
    whole = random_fold_case(96, layers=2, batch=BATCH, ring_len=RING_LEN)
    state = whole.state_in.copy()
    folder.fold(state, whole.ring, whole.row_ids, whole.ring_row_ids, whole.num_accepted,
                accepted_nodes=chain_nodes(np.int64))
    assert_bits_equal(state, whole.state_out)


def _replace(nodes: np.ndarray, request: int, path: list[int]) -> np.ndarray:
    nodes = nodes.copy()
    nodes[request, : len(path)] = path
    return nodes


#: name -> (change of (nodes, counts), error pattern). Request 2's path is the whole ring.
BAD_PATHS = {
    "a node past the ring": (lambda n, c: (_replace(n, 2, [0, 1, RING_LEN]), c),
                             rf"accepted_nodes: request 2 names nodes \[0, 1, {RING_LEN}, 3, 4, 5\]; a path names"
                             rf" nodes 0 to {RING_LEN - 1} in increasing order"),
    "a negative node": (lambda n, c: (_replace(n.astype(np.int32), 2, [-1]), c),
                        r"accepted_nodes: request 2 names nodes \[-1, 1, 2, 3, 4, 5\]"),
    "nodes out of order": (lambda n, c: (_replace(n, 2, [1, 0]), c),
                           r"accepted_nodes: request 2 names nodes \[1, 0, 2, 3, 4, 5\]"),
    "a repeated node": (lambda n, c: (_replace(n, 2, [0, 0]), c),
                        r"accepted_nodes: request 2 names nodes \[0, 0, 2, 3, 4, 5\]"),
    "a table past the ring": (lambda n, c: (np.concatenate([n, n[:, :1]], axis=1), c),
                              rf"accepted_nodes: expected shape \[{BATCH}, {RING_LEN}\] \(\[batch, RING_LEN\]\),"
                              rf" got \[{BATCH}, {RING_LEN + 1}\]"),
    "a table of another batch": (lambda n, c: (n[:-1], c),
                                 rf"accepted_nodes: expected shape \[{BATCH}, {RING_LEN}\] \(\[batch, RING_LEN\]\),"
                                 rf" got \[{BATCH - 1}, {RING_LEN}\]"),
    "a float table": (lambda n, c: (n.astype(np.float32), c),
                      r"accepted_nodes: expected an integer table, got float32"),
}


@pytest.mark.parametrize("name", sorted(BAD_PATHS))
def test_eager_refuses_a_bad_path_untouched(folder: StateFolder, eager_case: tuple, name: str) -> None:
    change, pattern = BAD_PATHS[name]
    case, nodes, counts, ring = eager_case
    nodes, counts = change(nodes, counts)
    state, ring_in = case.state_in.copy(), ring.copy()
    with pytest.raises(ValueError, match=pattern):
        folder.fold(state, ring_in, case.row_ids, case.ring_row_ids, counts, accepted_nodes=nodes)
    assert_bits_equal(state, case.state_in)
    assert_bits_equal(ring_in, ring, "ring")


def test_bad_nodes_past_a_path_are_not_read(cpu_folder: StateFolder, eager_case: tuple) -> None:
    """Entries past num_accepted[b] are padding: any integer passes, none is read."""
    case, nodes, counts, ring = eager_case
    padded = nodes.astype(np.int64)
    for b in range(BATCH):
        padded[b, min(int(counts[b]), RING_LEN):] = [-1, 2**40, RING_LEN][b % 3]
    state = case.state_in.copy()
    cpu_folder.fold(state, ring, case.row_ids, case.ring_row_ids, counts, accepted_nodes=padded)
    assert_bits_equal(state, case.state_out)


@pytest.mark.parametrize(("path", "entry", "node", "before"), [([0, 1, RING_LEN], 2, RING_LEN, 1),
                                                               ([3, 1], 1, 1, 3), ([2, 2], 1, 2, 2)])
def test_cpu_op_refuses_a_bad_path_before_writing(cpu_folder: StateFolder, eager_case: tuple, path: list[int],
                                                  entry: int, node: int, before: int) -> None:
    """Past the host checks, the compiled CPU op checks every path before its first store."""
    case, nodes, counts, ring = eager_case
    nodes = _replace(nodes, 5, path)
    counts = counts.copy()
    counts[5] = len(path)
    call = validate_fold(case.state_in, ring, case.row_ids, case.ring_row_ids, case.num_accepted, cpu_folder.device)
    model = cpu_folder.model(call.state.dtype, call.parameters, "head", path=True)
    state = case.state_in.copy()
    tables = [Buffer.from_numpy(np.ascontiguousarray(t, np.uint32))
              for t in (case.row_ids, case.ring_row_ids, counts, nodes)]
    pattern = (rf"accepted_nodes: request 5 entry {entry} is node {node} \(the entry before: {before}\); a path"
               rf" names nodes 0 to {RING_LEN - 1} in increasing order")
    with pytest.raises(ValueError, match=pattern):
        model.execute(Buffer.from_numpy(state), Buffer.from_numpy(ring.copy()), *tables)
    assert_bits_equal(state, case.state_in)


#: (shape of a uint32 accepted_nodes, error pattern) refused while the graph is built.
BAD_TABLE_SHAPES = [
    ([BATCH], rf"accepted_nodes: expected rank 2 \[batch, RING_LEN\], got shape \[{BATCH}\]"),
    ([BATCH, RING_LEN + 1], rf"accepted_nodes: shape \[{BATCH}, {RING_LEN + 1}\] is not \[batch, RING_LEN\] ="
                            rf" \[{BATCH}, {RING_LEN}\]"),
    ([BATCH + 1, RING_LEN], rf"accepted_nodes: shape \[{BATCH + 1}, {RING_LEN}\] is not \[batch, RING_LEN\]"),
]


def test_graph_refuses_a_path_table_of_a_wrong_shape_or_dtype() -> None:
    """(One graph for every case: each graph loads the kernel package.)"""
    cpu = DeviceRef.CPU()
    tables = [TensorType(DType.uint32, [LAYERS, BATCH], cpu), TensorType(DType.uint32, [LAYERS, BATCH], cpu),
              TensorType(DType.uint32, [BATCH], cpu)]
    bad = [*((TensorType(DType.uint32, shape, cpu), pattern) for shape, pattern in BAD_TABLE_SHAPES),
           (TensorType(DType.float32, [BATCH, RING_LEN], cpu),
            r"accepted_nodes: dtype DType.float32 is not an integer dtype")]
    inputs = [BufferType(DType.float32, [8, 4, 64, 64], cpu), BufferType(DType.float32, [8, 2, RING_LEN, 224], cpu),
              *tables, *(table for table, _ in bad)]
    with Graph("bad_path_tables", input_types=inputs, custom_extensions=[kernels_path()]) as graph:
        state, ring, *values = graph.inputs
        for (_, pattern), nodes in zip(bad, values[3:], strict=True):
            with pytest.raises(ValueError, match=pattern):
                state_fold(state.buffer, ring.buffer, *(t.tensor for t in values[:3]), accepted_nodes=nodes.tensor)
        graph.output()

