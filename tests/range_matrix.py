"""The supported range, for the range tests (test_range_fold.py, test_range_verify.py,
test_range_forward.py): a covering set of static shapes (``RANGE``), K and V from 8 to 256
(equal and unequal, odd multiples of 8 among them), RING_LEN 1, 2, middle values, 16 and 32,
G = 1, 2 and 3, fp32 and bf16 pools, head and per-channel gates; the cases each point runs;
and ``run_many``, which compiles one graph holding one op of every point.

Every point runs full windows and accepted counts of 0, 1, RING_LEN and RING_LEN + 1, and
a fold with every record of every request accepted: the count that once outnumbered the
threads of a small fold block (K = V = 8 to 40 at long rings). A graph's compile costs
more than the kernels in it, so each test compiles one graph and names each point whose
bits differ. The tests are three files so that workers share them. The GPU runs every
point, the CPU one of each shape (``CPU_RANGE``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from max.driver import CPU, Accelerator, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType, TensorValue

from conftest import bits
from gdfold_max import kernels_path, recurrence, reference, state_fold, verify_ring, verify_tree
from gdfold_max.cases import (
    FoldCase,
    WindowCase,
    random_accepted_nodes,
    random_fold_case,
    random_parents,
    random_window_case,
    spec_decode_case,
)
from gdfold_max.eager.base import copy_back, host_buffer
from gdfold_max.layout import Gate
from gdfold_max.ops.shared_memory import check_column_tile_fits
from gdfold_max.ops.window import default_column_tile


@dataclass(frozen=True)
class Point:
    """One static shape of the range, with the G it runs at."""

    key_dim: int
    value_dim: int
    ring_len: int
    group_size: int
    state_dtype: str
    gate: Gate

    def __str__(self) -> str:
        dtype = "fp32" if self.state_dtype == "float32" else "bf16"
        return f"{dtype}-{self.gate}-K{self.key_dim}-V{self.value_dim}-R{self.ring_len}-G{self.group_size}"

    def shape(self) -> dict[str, Any]:
        num_key_heads = 2 if self.group_size < 3 else 1
        return {"key_dim": self.key_dim, "value_dim": self.value_dim, "ring_len": self.ring_len,
                "num_key_heads": num_key_heads, "num_value_heads": num_key_heads * self.group_size,
                "state_dtype": self.state_dtype, "gate": self.gate}


def points(key_dim: int, value_dim: int, ring_len: int, groups: tuple[int, int, int], channel_dtype: str
           ) -> list[Point]:
    """A shape in fp32 and bf16 with head gates, and with per-channel gates, each at its own G."""
    return [Point(key_dim, value_dim, ring_len, groups[0], "float32", "head"),
            Point(key_dim, value_dim, ring_len, groups[1], "bfloat16", "head"),
            Point(key_dim, value_dim, ring_len, groups[2], channel_dtype, "channel")]


#: The covering set. The first four shapes are those the GPU fold once got wrong.
RANGE: list[Point] = [
    *points(8, 8, 16, (3, 1, 2), "bfloat16"),
    *points(16, 16, 16, (1, 2, 3), "float32"),
    *points(24, 24, 8, (2, 3, 1), "bfloat16"),
    *points(40, 40, 12, (1, 3, 2), "float32"),
    *points(8, 8, 1, (3, 2, 1), "float32"),
    *points(8, 256, 2, (2, 1, 3), "bfloat16"),
    *points(256, 8, 16, (3, 2, 1), "float32"),
    *points(72, 136, 5, (1, 2, 3), "bfloat16"),
    *points(256, 128, 16, (3, 1, 2), "float32"),
    *points(256, 256, 4, (2, 3, 1), "bfloat16"),
    # The longest ring at the largest heads: in bf16 (head and per-channel gates) the
    # fold's default tile halves to fit its staged records in 48 KiB (ops/fold.py
    # fold_tiling); the fp32 tile fits as it is.
    *points(256, 256, 32, (1, 2, 3), "bfloat16"),
]

#: On the CPU one point of each shape, the dtype and gate rotating: no CPU loop is sized by
#: a thread count, so the shapes are what the CPU needs covered (every dtype and gate runs
#: in the op's own tests), and a third of the points is a third of CI's compile time.
CPU_RANGE: list[Point] = [RANGE[3 * i + i % 3] for i in range(len(RANGE) // 3)]


def range_on(device: str) -> list[Point]:
    """The points a device runs: every one on the GPU, :data:`CPU_RANGE` on the CPU."""
    return CPU_RANGE if device == "cpu" else RANGE


CPU_TARGET = pytest.param(("cpu", "auto"), id="cpu")
#: Each GPU kernel forced, and "auto" (with per-channel gates the throughput kernel, but the
#: latency kernel where the throughput kernel's staging does not fit an SM).
GPU_TARGETS = [pytest.param(("gpu", path), id=f"gpu-{path}", marks=pytest.mark.gpu)
               for path in ("latency", "throughput", "auto")]
DEVICES = [CPU_TARGET, pytest.param(("gpu", "auto"), id="gpu", marks=pytest.mark.gpu)]


def on_path(point: Point, device: str, path: str, kind: str) -> bool:
    """Whether a point runs ``kind`` (verify, fold_on_load or forward) on a path: every
    point on the CPU and on the GPU's latency kernel; on its throughput kernel every one
    whose block fits an SM (per-channel gates stage K decays per token and per record,
    which at K = 256 with a fold on load pass the 48 KiB of static shared memory; its
    verify and forward fit)."""
    if device == "cpu" or path != "throughput" or point.gate == "head":
        return True
    tile = default_column_tile(point.value_dim)
    try:
        check_column_tile_fits(max_dtype(np.zeros(0, point.state_dtype)), point.key_dim, tile,
                               fold_on_load=kind == "fold_on_load", channel=True)
    except ValueError:
        return False
    return True


@cache
def session(device: str) -> tuple[InferenceSession, Device]:
    where = CPU() if device == "cpu" else Accelerator()
    return InferenceSession(devices=[where]), where


@dataclass
class Call:
    """One op of a many-op graph: its numpy operands, which of them are buffers (those it
    may write in place: the pool, and the ring, a buffer even where only read), and how it
    is added to the graph (returning its readout, if any)."""

    operands: list[np.ndarray]
    written: tuple[int, ...]
    add: Callable[[list[Any]], TensorValue | None]
    has_readout: bool


def max_dtype(array: np.ndarray) -> DType:
    return DType.bfloat16 if array.dtype == np.dtype(ml_dtypes.bfloat16) else DType.from_numpy(array.dtype)


def run_many(device: str, name: str, calls: list[Call]) -> list[tuple[np.ndarray | None, list[np.ndarray]]]:
    """Compiles one graph holding every call's op and runs it once on fresh copies of the
    written operands; returns each call's readout (or None) and written operands."""
    inference, where = session(device)
    ref = DeviceRef.from_device(where)
    types: list[BufferType | TensorType] = []
    for call in calls:
        types += [(BufferType if i in call.written else TensorType)(max_dtype(a), a.shape, ref)
                  for i, a in enumerate(call.operands)]
    with Graph(name, input_types=types, custom_extensions=[kernels_path()]) as graph:
        readouts, at = [], 0
        for call in calls:
            values = [graph.inputs[at + i].buffer if i in call.written else graph.inputs[at + i].tensor
                      for i in range(len(call.operands))]
            at += len(call.operands)
            out = call.add(values)
            if out is not None:
                readouts.append(out)
        graph.output(*readouts)
    model = inference.load(graph)
    copies = [[a.copy() if i in call.written else a for i, a in enumerate(call.operands)] for call in calls]
    uploaded = [[host_buffer(np.ascontiguousarray(a)).to(where) for a in arrays] for arrays in copies]
    outputs = iter(model.execute(*(b for buffers in uploaded for b in buffers)))
    results: list[tuple[np.ndarray | None, list[np.ndarray]]] = []
    for call, arrays, buffers in zip(calls, copies, uploaded, strict=True):
        for i in call.written:
            copy_back(buffers[i], arrays[i])
        readout = next(outputs).to(CPU()).to_numpy() if call.has_readout else None
        results.append((readout, [arrays[i] for i in call.written]))
    return results


def differences(what: str, got: np.ndarray, want: np.ndarray) -> list[str]:
    count = int(np.count_nonzero(bits(got) != bits(want)))
    return [f"{what}: {count} of {got.size} elements differ in their bits"] if count else []


@cache
def fold_cases(point: Point) -> list[FoldCase]:
    """A real verify of full windows kept whole, in part and not at all; random records with
    every one accepted; random counts of 0, 1, RING_LEN - 1, RING_LEN and RING_LEN + 1."""
    r = point.ring_len
    return [spec_decode_case(21, layers=3, batch=4, verify_width=r - 1, num_accepted=[r, 0, 1, r], **point.shape()),
            *(random_fold_case(24, layers=3, batch=len(counts), num_accepted=counts, **point.shape())
              for counts in ([r] * 5, [0, 1, r, r + 1, max(r - 1, 1)]))]


@cache
def window_case(point: Point, seed: int) -> WindowCase:
    """Full windows, empty and single ones, one past the ring (it commits) and a long one;
    previous counts of RING_LEN, 1, 0 and RING_LEN + 1 (nothing to fold)."""
    r = point.ring_len
    return random_window_case(seed, windows=[r, 0, 1, r + 1, r, 2 * r + 3],
                              previous_num_accepted=[r, 1, 0, r + 1, r], **point.shape())


def fold_call(case: FoldCase, gate: Gate) -> Call:
    def add(v: list[Any]) -> None:
        state_fold(*v, gate=gate)
    return Call([case.state_in, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted], (0, 1), add, False)


def window_call(case: WindowCase, kind: str, path: str) -> Call:
    tables = ([case.row_ids, case.input_row_offsets] if kind == "forward" else
              [case.row_ids, case.ring_row_ids, case.input_row_offsets])
    if kind == "fold_on_load":
        tables += [case.previous_ring_row_ids, case.previous_num_accepted]
    written = (3,) if kind == "forward" else (3, 4)
    operands = [*case.tokens(), case.state] + ([] if kind == "forward" else [case.ring]) + tables

    def add(v: list[Any]) -> TensorValue:
        if kind == "forward":
            return recurrence(*v, gpu_path=path)
        previous = {"previous_ring_row_ids": v[8], "previous_num_accepted": v[9]} if kind == "fold_on_load" else {}
        return verify_ring(*v[:8], **previous, gpu_path=path)
    return Call(operands, written, add, True)


@cache
def tree_case(point: Point) -> tuple[WindowCase, np.ndarray, np.ndarray]:
    """Random forests in full, empty, single and part windows, with the previous step's
    accepted paths along random trees of full windows (none for one request, and a count
    past the ring for another: nothing folds). Returns the case, ``parents`` and the
    previous nodes (the case's counts are the paths')."""
    r = point.ring_len
    windows = [r, 0, 1, max(r - 1, 1), r]
    case = random_window_case(25, windows=windows, previous_num_accepted=[0] * len(windows), **point.shape())
    parents = random_parents(25, windows, r)
    nodes, counts = random_accepted_nodes(26, random_parents(26, [r] * len(windows), r), [r] * len(windows))
    counts[1] = r + 1
    case.previous_num_accepted[:] = counts
    return case, parents, nodes


def tree_call(point: Point, leaf_warps: int = 1) -> Call:
    case, parents, nodes = tree_case(point)
    operands = [*case.tokens(), case.state, case.ring, case.row_ids, case.ring_row_ids, case.input_row_offsets,
                parents, case.previous_ring_row_ids, case.previous_num_accepted, nodes]

    def add(v: list[Any]) -> TensorValue:
        return verify_tree(*v[:9], previous_ring_row_ids=v[9], previous_num_accepted=v[10],
                           previous_accepted_nodes=v[11], leaf_warps=leaf_warps)
    return Call(operands, (3, 4), add, True)


def tree_wants(point: Point) -> tuple[np.ndarray, ...]:
    """The reference's readout, pool and ring for the point's tree case."""
    case, parents, nodes = tree_case(point)
    pool, ring = case.fresh()
    out = reference.verify_tree(*case.tokens(), pool, ring, case.row_ids, case.ring_row_ids, case.input_row_offsets,
                                parents, previous_ring_row_ids=case.previous_ring_row_ids,
                                previous_num_accepted=case.previous_num_accepted, previous_accepted_nodes=nodes)
    return out, pool, ring


def check_tree_op(device: str, leaf_warps: int = 1) -> None:
    """The tree verify with fold on load of a previous path for every point of the
    device's range, in one graph, against the reference; on a GPU with ``leaf_warps``
    (4: each unit's leaves shared among four warps, these launches being small)."""
    points = range_on(device)
    failures = []
    calls = [tree_call(p, leaf_warps) for p in points]
    for point, (readout, written) in zip(points, run_many(device, f"range_tree_{device}_leaf{leaf_warps}", calls),
                                         strict=True):
        assert readout is not None
        for part, got, expected in zip(("readout", "pool", "ring"), (readout, *written), tree_wants(point),
                                       strict=True):
            failures += differences(f"{point}, tree: {part}", got, expected)
    assert not failures, "\n".join(failures)


def window_wants(point: Point, kind: str) -> tuple[np.ndarray, ...]:
    """The reference's readout, pool (and ring) for the point's window case."""
    if kind == "forward":
        case = window_case(point, 23)
        pool = case.state.copy()
        out = reference.recurrence(*case.tokens(), pool, case.row_ids, case.input_row_offsets,
                                       num_key_heads=case.num_key_heads)
        return out, pool
    return window_case(point, 22).run_verify(reference.verify_ring, fold_on_load=kind == "fold_on_load")


def check_window_op(device: str, path: str, kind: str) -> None:
    """Runs ``kind`` (verify, fold_on_load or forward) on ``path`` for every point that
    has it, in one graph, against the reference."""
    covered = [p for p in range_on(device) if on_path(p, device, path, kind)]
    calls = [window_call(window_case(p, 23 if kind == "forward" else 22), kind, path) for p in covered]
    failures = []
    for point, (readout, written) in zip(covered, run_many(device, f"range_{kind}_{device}_{path}", calls),
                                         strict=True):
        want = window_wants(point, kind)
        assert readout is not None
        parts = ("readout", "pool", "ring")[: len(want)]
        for part, got, expected in zip(parts, (readout, *written), want, strict=True):
            failures += differences(f"{point}, {kind}: {part}", got, expected)
    assert not failures, "\n".join(failures)
