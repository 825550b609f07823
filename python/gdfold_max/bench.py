"""Benchmark: our fold beside an anchor, in one process, on Qwen3-Next-80B shapes.

On a GPU the anchor is MAX's built-in ``gated_delta_state_fold``; on the CPU it is a
numpy copy of the same state bytes. A fold's time is taken as DESIGN does: a graph of
R chained folds against a graph of one, per fold = (t_R - t_1) / (R - 1), best of
several runs, so graph-call overhead cancels. Effective bandwidth counts the state
read and written once plus the record fields read.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TypeAlias

import numpy as np
from max.driver import CPU, Accelerator, Buffer, Device, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, DeviceRef, Graph, TensorType
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .graph import kernels_path, state_fold
from .layout import RecordLayout

#: GPU tiling keywords of :func:`state_fold` (``key_dim_tile``, ``rows_per_thread``).
Tiling: TypeAlias = dict[str, int] | None


@dataclass(frozen=True)
class FoldShape:
    """Model shapes of the benchmark (defaults: Qwen3-Next-80B's gated-delta layers)."""

    num_layers: int = 36
    num_value_heads: int = 32
    num_key_heads: int = 16
    key_dim: int = 128
    value_dim: int = 128
    ring_len: int = 4
    accepted: int = 3

    @property
    def layout(self) -> RecordLayout:
        return RecordLayout(self.key_dim, self.value_dim, self.num_value_heads // self.num_key_heads)

    def state_bytes(self, batch: int, state_dtype: DType) -> int:
        """Bytes of state the batch's folds touch (read once, written once: x2 elsewhere)."""
        elements = self.num_layers * batch * self.num_value_heads * self.key_dim * self.value_dim
        return elements * state_dtype.size_in_bytes

    def record_bytes(self, batch: int) -> int:
        """Bytes of record fields the batch's folds read."""
        records = self.num_layers * batch * self.num_key_heads * self.accepted
        return records * self.layout.elements * 4

    def fold_bytes(self, batch: int, state_dtype: DType) -> int:
        return 2 * self.state_bytes(batch, state_dtype) + self.record_bytes(batch)


@dataclass
class BenchRow:
    """One measured configuration."""

    device: str
    state_dtype: str
    batch: int
    ours_us: float
    ours_tb_s: float
    anchor: str
    anchor_us: float
    anchor_tb_s: float
    speedup: float
    copy_tb_s: float
    share_of_copy: float


def best_seconds(run: Callable[[], None], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``run`` (after one warm-up call)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def per_link_seconds(model_of: Callable[[int], Model], device: Device, operands: Sequence[Buffer], chain: int,
                     repeats: int) -> float:
    """The time of one link of a chained graph: (t_R - t_1) / (R - 1), where ``model_of(n)``
    is the graph of n chained links, so the graph-call overhead cancels."""
    def timed(count: int) -> float:
        model = model_of(count)

        def run() -> None:
            model.execute(*operands)
            device.synchronize()

        return best_seconds(run, repeats)

    one = timed(1)
    many = timed(chain)
    return max(many - one, 0.0) / (chain - 1)


def load_in_parallel(session: InferenceSession, graphs: Sequence[Graph]) -> list[Model]:
    """Compiles graphs several at a time. Build them first, one after another: building
    shares the kernel package cache."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(session.load, graphs))


class FoldGraphs:
    """Compiled graphs of 1 and R chained folds, ours or MAX's, on one device."""

    def __init__(self, session: InferenceSession, device: Device, shape: FoldShape, chain: int,
                 tiling: Tiling = None) -> None:
        self.session, self.device, self.shape, self.chain = session, device, shape, chain
        self.tiling = tiling or {}
        self._models: dict[tuple[str, DType, int], Model] = {}

    def model(self, impl: str, state_dtype: DType, repeats: int) -> Model:
        key = (impl, state_dtype, repeats)
        if key not in self._models:
            self._models[key] = self.session.load(self._build(impl, state_dtype, repeats))
        return self._models[key]

    def compile_all(self, impls: Sequence[str], dtypes: Sequence[DType]) -> None:
        """Compiles every graph this run needs, several at a time."""
        keys = [(i, d, r) for i in impls for d in dtypes for r in (1, self.chain)]
        models = load_in_parallel(self.session, [self._build(*k) for k in keys])
        self._models.update(zip(keys, models, strict=True))

    def _build(self, impl: str, state_dtype: DType, repeats: int) -> Graph:
        s = self.shape
        where = DeviceRef.from_device(self.device)
        inputs = [
            BufferType(state_dtype, ["rows", s.num_value_heads, s.key_dim, s.value_dim], where),
            BufferType(DType.float32, ["ring_rows", s.num_key_heads, s.ring_len, s.layout.min_stride], where),
            TensorType(DType.uint32, [s.num_layers, "batch"], where),
            TensorType(DType.uint32, [s.num_layers, "batch"], where),
            TensorType(DType.uint32, ["batch"], where),
        ]
        extensions = [kernels_path()] if impl == "gdfold" else []
        with Graph(f"bench_{impl}_{state_dtype.name}_x{repeats}", input_types=inputs,
                   custom_extensions=extensions) as graph:
            state, ring, row_ids, ring_row_ids, accepted = graph.inputs
            for _ in range(repeats):
                if impl == "gdfold":
                    state_fold(state.buffer, ring.buffer, row_ids.tensor, ring_row_ids.tensor, accepted.tensor,
                               **self.tiling)
                else:
                    from max.nn.state_space import gated_delta_state_fold, verify_width_operand

                    gated_delta_state_fold(state.buffer, ring.buffer, row_ids.tensor, ring_row_ids.tensor,
                                           accepted.tensor, verify_width_operand(s.ring_len - 1))
            graph.output()
        return graph

    def per_fold_seconds(self, impl: str, state_dtype: DType, operands: Sequence[Buffer], repeats: int) -> float:
        """(t_R - t_1) / (R - 1): the graph-call overhead cancels."""
        return per_link_seconds(lambda count: self.model(impl, state_dtype, count), self.device, operands,
                                self.chain, repeats)


def make_operands(device: Device, shape: FoldShape, batch: int, state_dtype: DType, seed: int = 0) -> list[Buffer]:
    """A pool with one row per (layer, request), its ring, and the row tables."""
    s = shape
    rows = s.num_layers * batch
    rng = np.random.default_rng(seed)
    state = Buffer.zeros([rows, s.num_value_heads, s.key_dim, s.value_dim], state_dtype, device)
    one_ring_row = rng.uniform(-0.05, 0.05, (1, s.num_key_heads, s.ring_len, s.layout.min_stride)).astype(np.float32)
    decays = s.layout.decay_offset(0)
    one_ring_row[..., decays : decays + s.layout.group_size] = 0.97
    ring = Buffer.from_numpy(np.ascontiguousarray(np.broadcast_to(one_ring_row, (rows, *one_ring_row.shape[1:]))))
    ids = np.arange(rows, dtype=np.uint32).reshape(s.num_layers, batch)
    accepted = np.full(batch, s.accepted, np.uint32)
    tables = [Buffer.from_numpy(t) for t in (ids, rng.permutation(ids.reshape(-1)).reshape(ids.shape), accepted)]
    return [state, ring.to(device), *[t.to(device) for t in tables]]


def device_copy_tb_s(device: Device, nbytes: int, repeats: int) -> float:
    """Read+write bandwidth of a device-to-device copy of ``nbytes``."""
    count = nbytes // 4
    src = Buffer.zeros([count], DType.float32, device)
    dst = Buffer.zeros([count], DType.float32, device)

    def run() -> None:
        dst.inplace_copy_from(src)
        device.synchronize()

    return 2 * count * 4 / best_seconds(run, repeats) / 1e12


def numpy_copy_tb_s(nbytes: int, repeats: int) -> float:
    """Read+write bandwidth of a numpy copy of ``nbytes`` on the host."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: np.copyto(dst, src), repeats) / 1e12


def run_bench(
    batches: Iterable[int],
    dtypes: Iterable[DType] = (DType.float32, DType.bfloat16),
    *,
    device: Device | None = None,
    shape: FoldShape | None = None,
    chain: int = 8,
    repeats: int = 5,
    tiling: Tiling = None,
    console: Console | None = None,
) -> list[BenchRow]:
    """Measures ours and the anchor for every (dtype, batch) and returns the rows."""
    shape = shape or FoldShape()
    console = console or Console()
    if device is None:
        device = Accelerator() if accelerator_count() > 0 else CPU()
    on_gpu = device.label != "cpu"
    session = InferenceSession(devices=[device])
    graphs = FoldGraphs(session, device, shape, chain, tiling)
    batches, dtypes = list(batches), list(dtypes)
    console.print("compiling the benchmark graphs ...")
    graphs.compile_all(["gdfold", "max"] if on_gpu else ["gdfold"], dtypes)
    rows: list[BenchRow] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(batches) * len(dtypes))
        for state_dtype in dtypes:
            for batch in batches:
                progress.update(task, description=f"{state_dtype.name} batch {batch}")
                operands = make_operands(device, shape, batch, state_dtype)
                nbytes = shape.fold_bytes(batch, state_dtype)
                ours = graphs.per_fold_seconds("gdfold", state_dtype, operands, repeats)
                if on_gpu:
                    anchor_name = "MAX gated_delta_state_fold"
                    anchor = graphs.per_fold_seconds("max", state_dtype, operands, repeats)
                    copy_tb_s = device_copy_tb_s(device, shape.state_bytes(batch, state_dtype), repeats)
                else:
                    anchor_name = "numpy copy of the state"
                    copy_tb_s = numpy_copy_tb_s(shape.state_bytes(batch, state_dtype), repeats)
                    anchor = 2 * shape.state_bytes(batch, state_dtype) / (copy_tb_s * 1e12)
                ours_tb_s = nbytes / ours / 1e12 if ours > 0 else float("nan")
                rows.append(BenchRow(
                    device=f"{device.label}:{device.id}" + (f" {device.model_name}" if on_gpu else ""),
                    state_dtype=state_dtype.name,
                    batch=batch,
                    ours_us=ours * 1e6,
                    ours_tb_s=ours_tb_s,
                    anchor=anchor_name,
                    anchor_us=anchor * 1e6,
                    anchor_tb_s=nbytes / anchor / 1e12 if anchor > 0 else float("nan"),
                    speedup=anchor / ours if ours > 0 else float("nan"),
                    copy_tb_s=copy_tb_s,
                    share_of_copy=ours_tb_s / copy_tb_s,
                ))
                del operands
                progress.advance(task)
    return rows


def render(rows: Sequence[BenchRow], console: Console) -> None:
    """Prints the rows as a table."""
    table = Table(title="gdfold_max fold vs anchor (per fold; bandwidth = state r+w + records)")
    for column in ("dtype", "batch", "ours µs", "ours GB/s", "anchor µs", "anchor GB/s", "speed-up", "copy GB/s",
                   "share of copy"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r.state_dtype, str(r.batch), f"{r.ours_us:.1f}", f"{1e3 * r.ours_tb_s:.0f}", f"{r.anchor_us:.1f}",
                      f"{1e3 * r.anchor_tb_s:.0f}", f"{r.speedup:.2f}x", f"{1e3 * r.copy_tb_s:.0f}",
                      f"{100 * r.share_of_copy:.0f}%")
    console.print(table)
    if rows:
        console.print(f"device: {rows[0].device}; anchor: {rows[0].anchor}")


def write_json(rows: Sequence[BenchRow], path: str) -> None:
    with open(path, "w") as out:
        json.dump([asdict(r) for r in rows], out, indent=2)
