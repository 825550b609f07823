"""The fold benchmark: our fold beside an anchor, in one process, on Qwen3-Next-80B shapes.

On a GPU the anchor is MAX's built-in ``gated_delta_state_fold``; on the CPU it is a
numpy copy of the same state bytes. Timing as ``bench.harness`` says. Effective
bandwidth counts the state read and written once plus the record fields read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
from max.driver import CPU, Accelerator, Buffer, Device, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType
from max.graph import Module as GraphModule
from rich.console import Console

from ..ops.fold import state_fold
from ..ops.kernels import kernels_path
from .harness import (
    ChainedGraphs,
    FoldShape,
    device_copy_tb_s,
    numpy_copy_tb_s,
    render_rows,
    sweep,
    times,
)

#: GPU tiling keywords of :func:`state_fold` (``key_dim_tile``, ``rows_per_thread``).
Tiling: TypeAlias = dict[str, int] | None


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


class FoldGraphs(ChainedGraphs):
    """Graphs of 1 and R chained folds, ours (``gdfold``) or MAX's (``max``)."""

    def __init__(self, session: InferenceSession, device: Device, shape: FoldShape, chain: int,
                 tiling: Tiling = None) -> None:
        super().__init__(session, device, shape, chain)
        self.tiling = tiling or {}

    def build(self, variant: str, state_dtype: DType, links: int, module: GraphModule | None = None) -> Graph:
        s = self.shape
        where = DeviceRef.from_device(self.device)
        inputs = [
            BufferType(state_dtype, ["rows", s.num_value_heads, s.key_dim, s.value_dim], where),
            BufferType(DType.float32, ["ring_rows", s.num_key_heads, s.ring_len, s.layout.min_stride], where),
            TensorType(DType.uint32, [s.num_layers, "batch"], where),
            TensorType(DType.uint32, [s.num_layers, "batch"], where),
            TensorType(DType.uint32, ["batch"], where),
        ]
        tag = "_".join(f"{k}{v}" for k, v in sorted(self.tiling.items()))
        extensions = [kernels_path()] if variant == "gdfold" else []
        with Graph(f"bench_{variant}{tag}_{state_dtype.name}_x{links}", input_types=inputs,
                   custom_extensions=extensions, module=module) as graph:
            state, ring, row_ids, ring_row_ids, accepted = graph.inputs
            for _ in range(links):
                if variant == "gdfold":
                    state_fold(state.buffer, ring.buffer, row_ids.tensor, ring_row_ids.tensor, accepted.tensor,
                               key_dim_tile=self.tiling.get("key_dim_tile"),
                               rows_per_thread=self.tiling.get("rows_per_thread"), gate=s.gate)
                else:
                    from max.nn.state_space import gated_delta_state_fold, verify_width_operand

                    gated_delta_state_fold(state.buffer, ring.buffer, row_ids.tensor, ring_row_ids.tensor,
                                           accepted.tensor, verify_width_operand(s.ring_len - 1))
            graph.output()
        return graph


def make_operands(device: Device, shape: FoldShape, batch: int, state_dtype: DType, seed: int = 0) -> list[Buffer]:
    """A pool with one row per (layer, request), its ring, and the row tables."""
    s = shape
    rows = s.num_layers * batch
    rng = np.random.default_rng(seed)
    state = Buffer.zeros([rows, s.num_value_heads, s.key_dim, s.value_dim], state_dtype, device)
    one_ring_row = rng.uniform(-0.05, 0.05, (1, s.num_key_heads, s.ring_len, s.layout.min_stride)).astype(np.float32)
    decays = s.layout.decay_offset(0)
    one_ring_row[..., decays : decays + s.layout.group_size * s.layout.decay_length] = 0.97
    ring = Buffer.from_numpy(np.ascontiguousarray(np.broadcast_to(one_ring_row, (rows, *one_ring_row.shape[1:]))))
    ids = np.arange(rows, dtype=np.uint32).reshape(s.num_layers, batch)
    accepted = np.full(batch, s.accepted, np.uint32)
    tables = [Buffer.from_numpy(t) for t in (ids, rng.permutation(ids.reshape(-1)).reshape(ids.shape), accepted)]
    return [state, ring.to(device), *[t.to(device) for t in tables]]


def _tb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e12 if seconds > 0 else float("nan")


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
    """Measures ours and the anchor for every (dtype, batch) and returns the rows. MAX has
    no fold for per-channel gates: with ``shape.gate == "channel"`` the anchor is always
    the copy of the state (on a GPU, the device's own copy)."""
    shape = shape or FoldShape()
    console = console or Console()
    if device is None:
        device = Accelerator() if accelerator_count() > 0 else CPU()
    on_gpu = device.label != "cpu"
    graphs = FoldGraphs(InferenceSession(devices=[device]), device, shape, chain, tiling)
    dtypes = list(dtypes)
    console.print("compiling the benchmark graphs ...")
    with_max = on_gpu and shape.gate == "head"
    graphs.compile_all(["gdfold", "max"] if with_max else ["gdfold"], dtypes)
    rows: list[BenchRow] = []
    for state_dtype, batch in sweep(dtypes, list(batches), console, "fold"):
        operands = make_operands(device, shape, batch, state_dtype)
        nbytes = shape.fold_bytes(batch, state_dtype)
        state_bytes = shape.state_bytes(batch, state_dtype)
        ours = graphs.per_link_seconds("gdfold", state_dtype, operands, repeats)
        if with_max:
            anchor_name = "MAX gated_delta_state_fold"
            anchor = graphs.per_link_seconds("max", state_dtype, operands, repeats)
            copy_tb_s = device_copy_tb_s(device, state_bytes, repeats)
        elif on_gpu:
            anchor_name = "device copy of the state"
            copy_tb_s = device_copy_tb_s(device, state_bytes, repeats)
            anchor = 2 * state_bytes / (copy_tb_s * 1e12)
        else:
            anchor_name = "numpy copy of the state"
            copy_tb_s = numpy_copy_tb_s(state_bytes, repeats)
            anchor = 2 * state_bytes / (copy_tb_s * 1e12)
        ours_tb_s = _tb_s(nbytes, ours)
        rows.append(BenchRow(
            device=f"{device.label}:{device.id}" + (f" {device.model_name}" if on_gpu else ""),
            state_dtype=state_dtype.name,
            batch=batch,
            ours_us=ours * 1e6,
            ours_tb_s=ours_tb_s,
            anchor=anchor_name,
            anchor_us=anchor * 1e6,
            anchor_tb_s=_tb_s(nbytes, anchor),
            speedup=anchor / ours if ours > 0 else float("nan"),
            copy_tb_s=copy_tb_s,
            share_of_copy=ours_tb_s / copy_tb_s,
        ))
        del operands
    return rows


def render(rows: Sequence[BenchRow], console: Console) -> None:
    """Prints the rows as a table."""
    render_rows("gdfold_max fold vs anchor (per fold; bandwidth = state r+w + records)", [
        ("dtype", lambda r: r.state_dtype),
        ("batch", lambda r: str(r.batch)),
        ("ours µs", lambda r: f"{r.ours_us:.1f}"),
        ("ours GB/s", lambda r: f"{1e3 * r.ours_tb_s:.0f}"),
        ("anchor µs", lambda r: f"{r.anchor_us:.1f}"),
        ("anchor GB/s", lambda r: f"{1e3 * r.anchor_tb_s:.0f}"),
        ("speed-up", lambda r: times(r.speedup)),
        ("copy GB/s", lambda r: f"{1e3 * r.copy_tb_s:.0f}"),
        ("share of copy", lambda r: f"{100 * r.share_of_copy:.0f}%"),
    ], rows, console)
    if rows:
        console.print(f"device: {rows[0].device}; anchor: {rows[0].anchor}")
