"""Small eager runs of every GPU kernel path, each checked bit for bit against the numpy
reference: the fold (fp32 and bf16 pools, heads as small as K = V = 8 with 16 records,
and K = V = 256 with 32), the fold along a token tree's accepted paths, the verify, the verify with fold
on load and the forward (fp32 and bf16 pools, a ragged batch with a window past RING_LEN
and an empty one), on the two GPU window kernels (the latency and throughput kernels,
each forced), the throughput kernel with claimed units (more units than resident blocks
at a narrow column tile), and per-channel gates (the fold, and the verify, fold on load
and forward on each window kernel), and folds on load of two to four record chunks on the
throughput kernel (``chunks``). Then what only a graph reaches (the eager API refuses
bad ids on the host): ids past the pool or the ring in GPU graphs of every op and kernel
(``skips``), and two requests on one row, which race by contract (``shared-row``:
memcheck only). ``tree``: the tree verify on the latency kernel (random forests of up to
4 and 32 nodes, fp32 and bf16 pools, head and per-channel gates, with and without fold on
load of a previous path, eagerly; then in GPU graphs, requests with bad parents or a bad
previous path skipped; with one warp a unit and with leaves shared among four, and on
the throughput kernel's blocks at a 16-column tile; ``tree-shared`` and
``tree-throughput``: those runs alone, for ``SANITIZE_GROUPS``). Small enough to run under
compute-sanitizer (sanitize.sh), which runs the groups side by side:

    python bench/profiling/small_runs.py [GROUP ...]
    # fold path latency throughput claimed channel chunks skips shared-row tree tree-shared tree-throughput
"""

from __future__ import annotations

import itertools
import sys

import numpy as np
from max.driver import CPU
from max.dtype import DType

from gdfold_max import WindowRunner, fold, folder_for, reference, runner_for
from gdfold_max.cases import (
    WindowCase,
    chunked_fold_on_load_case,
    random_accepted_nodes,
    random_fold_case,
    random_parents,
    random_window_case,
)
from gdfold_max.eager.base import copy_back, host_buffer
from gdfold_max.eager.fold import validate_fold
from gdfold_max.layout import Gate


def same_step(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...], what: str) -> None:
    """A window op's readout, pool and ring, each bit for bit."""
    for name, a, b in zip(("readout", "pool", "ring"), got, want, strict=True):
        same_bits(a, b, f"{what}: {name}")


def same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    view = np.uint16 if got.dtype.itemsize == 2 else np.uint32
    differ = int(np.count_nonzero(got.view(view) != want.view(view)))
    print(f"{what}: {'bit-exact' if differ == 0 else f'{differ} elements differ'}", flush=True)
    if differ:
        raise SystemExit(1)


#: The fold's cases: (seed, shape, accepted counts, label). The smallest heads give blocks
#: of fewer threads than records (K = V = 8: 2 threads in bf16), and K = V = 40 a tile of 8
#: rows: every record's decay must still be staged.
FOLD_CASES: list[tuple[int, dict[str, int], list[int], str]] = [
    (1, {}, [0, 1, 4, 5], ""),
    *((2, {"key_dim": k, "value_dim": k, "ring_len": 16}, [16, 15, 1, 16], f"K = V = {k}, RING_LEN 16, ")
      for k in (8, 40)),
    # The longest ring at the largest heads: a tile whose staged records fill 48 KiB of
    # shared memory with per-channel gates (ops/fold.py fold_tiling).
    (3, {"key_dim": 256, "value_dim": 256, "ring_len": 32}, [32, 31, 1, 32], "K = V = 256, RING_LEN 32, "),
]


def run_folds(gate: Gate) -> None:
    for seed, shape, counts, label in FOLD_CASES:
        for dtype in ("float32", "bfloat16"):
            case = random_fold_case(seed, layers=2, batch=4, state_dtype=dtype, num_accepted=counts, gate=gate,
                                    **shape)
            state = case.state_in.copy()
            fold(state, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted, device="gpu", gate=gate)
            same_bits(state, case.state_out, f"fold, {label}{dtype} pool, {gate} gates")


def run_path_folds() -> None:
    """The fold along a random tree's accepted paths (the path kernel), both gates, on the
    fold's shapes: each request folds the records its path names, not the first ones."""
    for seed, shape, _, label in FOLD_CASES:
        ring_len = shape.get("ring_len", 4)
        for gate in ("head", "channel"):
            for dtype in ("float32", "bfloat16"):
                # Every request's records are real (the fold's cases leave the records of a
                # request that folds nothing NaN, and a NaN's bits are not the reference's).
                case = random_fold_case(seed, layers=2, batch=4, state_dtype=dtype, num_accepted=[ring_len] * 4,
                                        gate=gate, **shape)
                windows = [ring_len] * 4
                nodes, kept = random_accepted_nodes(seed, random_parents(seed, windows, ring_len), windows)
                want = reference.fold(case.state_in.copy(), case.ring, case.row_ids, case.ring_row_ids, kept,
                                      gate=gate, accepted_nodes=nodes)
                state = case.state_in.copy()
                fold(state, case.ring, case.row_ids, case.ring_row_ids, kept, device="gpu", gate=gate,
                     accepted_nodes=nodes)
                same_bits(state, want, f"fold along paths {kept.tolist()}, {label}{dtype} pool, {gate} gates")


def run_windows(label: str, runner: WindowRunner, gate: Gate = "head") -> None:
    for dtype in ("float32", "bfloat16"):
        case = random_window_case(2, state_dtype=dtype, gate=gate)
        for previous in (False, True):
            got = case.run_verify(runner.verify_ring, fold_on_load=previous)
            want = case.run_verify(reference.verify_ring, fold_on_load=previous)
            same_step(got, want, f"{'verify with fold on load' if previous else 'verify'}, {dtype} pool, {label}")
        pool = case.state.copy()
        out = runner.recurrence(*case.tokens(), pool, case.row_ids, case.input_row_offsets)
        want_pool = case.state.copy()
        want = reference.recurrence(*case.tokens(), want_pool, case.row_ids, case.input_row_offsets,
                                        num_key_heads=case.num_key_heads)
        same_bits(out, want, f"forward, {dtype} pool, {label}: readout")
        same_bits(pool, want_pool, f"forward, {dtype} pool, {label}: pool")


def run_channel() -> None:
    run_folds("channel")
    # Each kernel forced ("auto" runs per-channel gates on the throughput kernel).
    run_windows("per-channel gates, latency kernel", WindowRunner("gpu", gpu_path="latency"), "channel")
    run_windows("per-channel gates, throughput kernel", WindowRunner("gpu", gpu_path="throughput"), "channel")


def run_chunks() -> None:
    """Folds on load in chunks (cases.chunked_fold_on_load_case) on the throughput kernel,
    three units a block."""
    runner = WindowRunner("gpu", requests_per_block=3, gpu_path="throughput")
    for gate, dtype in itertools.product(("head", "channel"), ("float32", "bfloat16")):
        case = chunked_fold_on_load_case(dtype, gate)
        same_step(case.run_verify(runner.verify_ring, fold_on_load=True),
                  case.run_verify(reference.verify_ring, fold_on_load=True),
                  f"fold on load in chunks, {dtype} pool, {gate} gates")


def run_in_graph(runner: WindowRunner, kind: str, case: WindowCase, tables: dict[str, np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Readout, pool and ring after the graph of ``kind`` on fresh copies, with these
    tables as they are: in a graph the host checks nothing, the kernels guard every id."""
    parameters = {"K": case.state.shape[2], "V": case.state.shape[3], "RING_LEN": case.ring.shape[2],
                  "CHANNEL": int(case.decay.ndim == 3)}
    model = runner.model(kind, DType.float32 if case.state.dtype == np.float32 else DType.bfloat16, parameters)
    state, ring = case.fresh()
    pool, ring_buffer = (host_buffer(x).to(runner.device) for x in (state, ring))
    operands = [pool] if kind == "forward" else [pool, ring_buffer]
    uploaded = [host_buffer(np.ascontiguousarray(t)).to(runner.device) for t in tables.values()]
    (out,) = model.execute(*(host_buffer(x).to(runner.device) for x in case.tokens()), *operands, *uploaded)
    copy_back(pool, state)
    copy_back(ring_buffer, ring)
    return np.asarray(out.to(CPU()).to_numpy()), state, ring


def check_skipped(what: str, got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...], case: WindowCase,
                  skipped: int) -> None:
    """The request ``skipped`` reads NaN and leaves its pool and ring rows as they were;
    every other request's readout, pool rows and ring rows are the reference's."""
    readout, state, ring = got
    offsets = case.input_row_offsets
    mine = slice(int(offsets[skipped]), int(offsets[skipped + 1]))
    print(f"{what}: skipped request reads NaN: {bool(np.isnan(readout[mine]).all())}", flush=True)
    if not np.isnan(readout[mine]).all():
        raise SystemExit(1)
    others = np.r_[0 : mine.start, mine.stop : readout.shape[0]]
    same_bits(readout[others], want[0][others], f"{what}: other requests' readout")
    rows = [int(r) for b, r in enumerate(case.row_ids) if b != skipped]
    same_bits(state[rows], want[1][rows], f"{what}: other requests' pool rows")
    untouched = np.setdiff1d(np.arange(state.shape[0]), rows)
    same_bits(state[untouched], case.state[untouched], f"{what}: every other pool row")
    own_rings = [int(case.ring_row_ids[skipped]), int(case.previous_ring_row_ids[skipped])]
    other_rings = np.setdiff1d(np.arange(ring.shape[0]), own_rings)
    same_bits(ring[other_rings], want[2][other_rings], f"{what}: other requests' ring rows")


def run_skips() -> None:
    """Ids past the pool or the ring inside GPU graphs (the eager API refuses them on the
    host, so only a graph reaches the kernels' guards): the fold, and on every window
    kernel the verify, the verify with fold on load and the forward."""
    case = random_fold_case(3, layers=3, batch=4, num_accepted=[1, 4, 2, 3])
    row_ids, ring_row_ids = case.row_ids.copy(), case.ring_row_ids.copy()
    row_ids[0, 2] = case.state_in.shape[0] + 5
    ring_row_ids[1, 1] = case.ring.shape[0]
    row_ids[2, 3] = 0xFFFFFFFF
    folder = folder_for("gpu")
    call = validate_fold(case.state_in, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted, folder.device)
    model = folder.model(call.state.dtype, call.parameters)
    pool = host_buffer(case.state_in.copy()).to(folder.device)
    model.execute(pool, host_buffer(case.ring).to(folder.device),
                  *(host_buffer(t).to(folder.device) for t in (row_ids, ring_row_ids, case.num_accepted)))
    want = case.state_out_skipping({(0, 2), (1, 1), (2, 3)})
    same_bits(pool.to(CPU()).to_numpy(), want, "fold in a graph, ids past the pool and the ring skipped")
    for path in ("latency", "throughput"):
        runner = runner_for("gpu", path)
        window = random_window_case(6, windows=[4, 2, 3, 1])
        rows, ring_rows = window.state.shape[0], window.ring.shape[0]
        base = {"row_ids": window.row_ids, "ring_row_ids": window.ring_row_ids,
                "input_row_offsets": window.input_row_offsets,
                "previous_ring_row_ids": window.previous_ring_row_ids,
                "previous_num_accepted": window.previous_num_accepted}
        verify_tables = {k: base[k] for k in ("row_ids", "ring_row_ids", "input_row_offsets")}
        bad_row = window.row_ids.copy()
        bad_row[1] = rows + 2
        bad_ring = window.ring_row_ids.copy()
        bad_ring[1] = ring_rows
        bad_previous = window.previous_ring_row_ids.copy()
        bad_previous[1] = 0xFFFFFFFF
        for previous in (False, True):
            kind = "fold_on_load" if previous else "verify"
            tables = base if previous else verify_tables
            want = window.run_verify(reference.verify_ring, fold_on_load=previous)
            bads = [("row_ids", bad_row), ("ring_row_ids", bad_ring)] + (
                [("previous_ring_row_ids", bad_previous)] if previous else [])
            for name, table in bads:
                got = run_in_graph(runner, kind, window, tables | {name: table})
                check_skipped(f"{kind} in a graph, {path} kernel, {name} out of range", got, want, window, 1)
        want_pool = window.state.copy()
        want_out = reference.recurrence(*window.tokens(), want_pool, window.row_ids, window.input_row_offsets,
                                            num_key_heads=window.num_key_heads)
        got = run_in_graph(runner, "forward", window, {"row_ids": bad_row,
                                                       "input_row_offsets": window.input_row_offsets})
        check_skipped(f"forward in a graph, {path} kernel, row_ids out of range", got,
                      (want_out, want_pool, window.ring), window, 1)


#: The tree group's windows: (RING_LEN, windows), full ones, an empty one, a single node;
#: at RING_LEN 32, 32-node trees.
TREE_WINDOWS = [(4, [4, 0, 1, 4, 3]), (32, [32, 0, 1, 32, 17])]


def run_trees() -> None:
    """The tree verify with one warp a unit and with leaves shared among four
    (``leaf_warps``; these launches are small enough for four), and on the throughput
    kernel's blocks."""
    for leaf_warps in (1, 4):
        run_tree_kernel(WindowRunner("gpu", leaf_warps=leaf_warps))
    run_tree_kernel(throughput_tree_runner())


def throughput_tree_runner() -> WindowRunner:
    """The tree verify on the throughput kernel's blocks at a 16-column tile: the
    default K = V = 64 head is then four blocks of one warp."""
    return WindowRunner("gpu", gpu_path="throughput", column_tile=16)


def run_tree_kernel(runner: WindowRunner) -> None:
    """The tree verify on the GPU (on the kernel the runner's path and leaf warps pick),
    eagerly, bit for bit against the reference; then GPU graphs whose request 0 has a
    node that names itself as parent and, with fold on load, whose request 3 has a
    previous path out of order: those requests are skipped, the others exact."""
    for (ring_len, windows), gate, dtype in itertools.product(TREE_WINDOWS, ("head", "channel"),
                                                               ("float32", "bfloat16")):
        batch = len(windows)
        case = random_window_case(7, windows=windows, state_dtype=dtype, gate=gate, ring_len=ring_len)
        parents = random_parents(7, windows, ring_len)
        nodes, counts = random_accepted_nodes(8, random_parents(8, [ring_len] * batch, ring_len),
                                              [ring_len] * batch)
        case.previous_num_accepted[:] = counts
        tables = {"row_ids": case.row_ids, "ring_row_ids": case.ring_row_ids,
                  "input_row_offsets": case.input_row_offsets}
        previous = {"previous_ring_row_ids": case.previous_ring_row_ids,
                    "previous_num_accepted": case.previous_num_accepted, "previous_accepted_nodes": nodes}
        for fold_on_load in (False, True):
            extra = previous if fold_on_load else {}
            state, ring = case.fresh()
            got = runner.verify_tree(*case.tokens(), state, ring, **tables, parents=parents, **extra)
            want_state, want_ring = case.fresh()
            want = reference.verify_tree(*case.tokens(), want_state, want_ring, **tables, parents=parents,
                                         **extra)
            what = (f"tree verify{' with fold on load' if fold_on_load else ''}, RING_LEN {ring_len}, {dtype}"
                    f" pool, {gate} gates, leaf_warps {runner.leaf_warps}, {runner.gpu_path} path")
            same_step((got, state, ring), (want, want_state, want_ring), what)
    # In GPU graphs: request 0's node 1 names itself; with fold on load, either that or
    # request 0's previous path backwards (it folds the whole ring, in order, otherwise).
    ring_len, windows = TREE_WINDOWS[0]
    batch = len(windows)
    case = random_window_case(9, windows=windows, previous_num_accepted=[4, 2, 0, 1, 3])
    parents = random_parents(9, windows, ring_len)
    nodes = np.tile(np.arange(ring_len, dtype=np.uint32), (batch, 1))
    bad_parents = parents.copy()
    bad_parents[0, 1] = 1
    bad_nodes = nodes.copy()
    bad_nodes[0] = nodes[0, ::-1]
    tables = {"row_ids": case.row_ids, "ring_row_ids": case.ring_row_ids,
              "input_row_offsets": case.input_row_offsets, "parents": parents}
    previous = {"previous_ring_row_ids": case.previous_ring_row_ids,
                "previous_num_accepted": case.previous_num_accepted, "previous_accepted_nodes": nodes}
    runs = [("tree", {"parents": bad_parents}, "parents"),
            ("tree_fold_on_load", {"parents": bad_parents}, "parents"),
            ("tree_fold_on_load", {"previous_accepted_nodes": bad_nodes}, "previous path")]
    for kind, bad, what in runs:
        extra = previous if kind == "tree_fold_on_load" else {}
        state, ring = case.fresh()
        want = reference.verify_tree(*case.tokens(), state, ring, **tables, **extra)
        got = run_in_graph(runner, kind, case, tables | extra | bad)
        check_skipped(f"{kind} in a graph, leaf_warps {runner.leaf_warps}, {runner.gpu_path} path, request 0's {what}"
                      " bad", got,
                      (want, state, ring), case, 0)


def run_shared_row() -> None:
    """Two requests of one layer on one pool row (padding on a null block): they race by
    contract, so only memcheck runs this; every other row must fold exactly."""
    case = random_fold_case(4, layers=2, batch=4, num_accepted=[2, 3, 1, 4])
    row_ids = case.row_ids.copy()
    row_ids[0, 3] = row_ids[0, 2]
    state = case.state_in.copy()
    folder_for("gpu").fold(state, case.ring, row_ids, case.ring_row_ids, case.num_accepted)
    shared = int(row_ids[0, 2])
    others = np.setdiff1d(np.arange(state.shape[0]), [shared])
    want = case.state_in.copy()
    reference.fold(want, case.ring, row_ids[1:], case.ring_row_ids[1:], case.num_accepted)
    counts = case.num_accepted.copy()
    counts[[2, 3]] = 0
    reference.fold(want, case.ring, row_ids[:1], case.ring_row_ids[:1], counts)
    same_bits(state[others], want[others], "fold with two requests on one row: every other row")


GROUPS = {
    "fold": lambda: run_folds("head"),
    "path": run_path_folds,
    "latency": lambda: run_windows("latency kernel", WindowRunner("gpu", gpu_path="latency")),
    "throughput": lambda: run_windows("throughput kernel", WindowRunner("gpu", gpu_path="throughput")),
    "claimed": lambda: run_windows("claimed units", WindowRunner("gpu", column_tile=8, requests_per_block=3,
                                                                 gpu_path="throughput")),
    "channel": run_channel,
    "chunks": run_chunks,
    "skips": run_skips,
    "shared-row": run_shared_row,
    "tree": run_trees,
    "tree-shared": lambda: run_tree_kernel(WindowRunner("gpu", leaf_warps=4)),
    "tree-throughput": lambda: run_tree_kernel(throughput_tree_runner()),
}


def main() -> None:
    # With no group named, every group once: `tree` already runs tree-shared's and
    # tree-throughput's runs.
    names = sys.argv[1:] or [name for name in GROUPS if name not in ("tree-shared", "tree-throughput")]
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise SystemExit(f"unknown groups {unknown}: choose from {list(GROUPS)}")
    for name in names:
        GROUPS[name]()


if __name__ == "__main__":
    main()
