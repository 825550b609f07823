"""Benchmark: the state work of one speculative decoding step, three ways, in one process.

* ``max``: MAX's ``gated_delta_recurrence_verify_ring_fwd`` for every layer, then MAX's
  ``gated_delta_state_fold`` for all layers (the verify reads the state, the fold reads
  and writes it: three passes over the state).
* ``ours``: our ``verify_ring`` for every layer, then our ``state_fold`` (three passes).
* ``fused``: our ``verify_ring`` with fold on load for every layer: the previous step's
  accepted records are applied as the state loads, so the state is read and written
  once (two passes).

A step's time is taken as ``bench`` takes a fold's: graphs of R chained steps and of
one, per step = (t_R - t_1) / (R - 1), best of several runs. MAX's ops have no CPU
path: on the CPU only ``ours`` and ``fused`` run. Shapes default to Qwen3-Next-80B's
gated-delta layers, a window of RING_LEN tokens per request and RING_LEN - 1 records
accepted.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeAlias

import numpy as np
from max.driver import Accelerator, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, BufferValue, DeviceRef, Graph, TensorType, TensorValue
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .bench import FoldShape, load_in_parallel, per_link_seconds
from .graph import kernels_path, state_fold
from .window_graph import verify_ring

VARIANTS = ("max", "ours", "fused")

#: GPU keywords of :func:`verify_ring` (``column_tile``, ``requests_per_block``).
WindowTiling: TypeAlias = dict[str, int]
STATE_PASSES = {"max": 3, "ours": 3, "fused": 2}


@dataclass
class StepRow:
    """One measured (variant, dtype, batch)."""

    variant: str
    state_dtype: str
    batch: int
    step_us: float
    state_gb: float
    state_tb_s: float
    #: MAX's time over this variant's (NaN where MAX's ops did not run: the CPU).
    vs_max: float
    #: ``ours`` time over this variant's.
    vs_ours: float


class StepGraphs:
    """Compiled graphs of 1 and R chained decoding steps for each variant.

    ``kernels`` is the Mojo package our variants use (default: the installed one); graphs
    of several packages can live in one session, so that kernel versions are timed side
    by side in one process.
    """

    def __init__(self, session: InferenceSession, device: Device, shape: FoldShape, chain: int,
                 tiling: WindowTiling | None = None, kernels: Path | None = None) -> None:
        self.session, self.device, self.shape, self.chain = session, device, shape, chain
        self.tiling: WindowTiling = tiling or {}
        self.kernels = kernels or kernels_path()
        # Graph names stay distinct across packages, and tilings, in one session.
        self._tag = "" if kernels is None else "_" + hashlib.sha1(
            f"{kernels}|{sorted(self.tiling.items())}".encode()).hexdigest()[:8]
        self._models: dict[tuple[str, DType, int], Model] = {}

    def compile_all(self, variants: Sequence[str], dtypes: Sequence[DType], chained: bool = True) -> None:
        """Compiles the graphs of one step and, when ``chained``, of ``chain`` steps."""
        lengths = (1, self.chain) if chained else (1,)
        keys = [(v, d, r) for v in variants for d in dtypes for r in lengths]
        models = load_in_parallel(self.session, [self._build(*k) for k in keys])
        self._models.update(zip(keys, models, strict=True))

    def _build(self, variant: str, state_dtype: DType, steps: int) -> Graph:
        s = self.shape
        where = DeviceRef.from_device(self.device)
        f32, u32 = DType.float32, DType.uint32
        width = 2 * s.num_key_heads * s.key_dim + s.num_value_heads * s.value_dim
        inputs = [
            BufferType(state_dtype, ["rows", s.num_value_heads, s.key_dim, s.value_dim], where),
            BufferType(f32, ["ring_rows", s.num_key_heads, s.ring_len, s.layout.min_stride], where),
            TensorType(f32, ["tokens", width], where),
            TensorType(f32, ["tokens", s.num_value_heads], where),
            TensorType(f32, ["tokens", s.num_value_heads], where),
            TensorType(u32, [s.num_layers, "batch"], where),
            TensorType(u32, [s.num_layers, "batch"], where),
            TensorType(u32, [s.num_layers, "batch"], where),
            TensorType(u32, ["batch"], where),
            TensorType(u32, ["offsets"], where),
        ]
        extensions = [] if variant == "max" else [self.kernels]
        with Graph(f"step_{variant}{self._tag}_{state_dtype.name}_x{steps}", input_types=inputs,
                   custom_extensions=extensions) as graph:
            pool, ring = graph.inputs[0].buffer, graph.inputs[1].buffer
            qkv, decay, beta, rows, ring_rows, previous_rows, accepted, offsets = (x.tensor for x in graph.inputs[2:])
            readout: TensorValue | None = None
            for _ in range(steps):
                readout = self._step(variant, pool, ring, qkv, decay, beta, rows, ring_rows, previous_rows,
                                     accepted, offsets)
            assert readout is not None
            graph.output(readout)
        return graph

    def _step(self, variant: str, pool: BufferValue, ring: BufferValue, qkv: TensorValue, decay: TensorValue,
              beta: TensorValue, rows: TensorValue, ring_rows: TensorValue, previous_rows: TensorValue,
              accepted: TensorValue, offsets: TensorValue) -> TensorValue:
        s = self.shape
        readout = None
        if variant == "max":
            from max.nn.state_space import (
                gated_delta_recurrence_verify_ring_fwd,
                gated_delta_state_fold,
                verify_width_operand,
            )

            width = verify_width_operand(s.ring_len - 1)
            for layer in range(s.num_layers):
                readout = gated_delta_recurrence_verify_ring_fwd(qkv, decay, beta, pool, ring, rows[layer],
                                                                 ring_rows[layer], offsets, width)
            gated_delta_state_fold(pool, ring, rows, ring_rows, accepted, width)
        elif variant == "ours":
            for layer in range(s.num_layers):
                readout = verify_ring(qkv, decay, beta, pool, ring, rows[layer], ring_rows[layer], offsets,
                                      **self.tiling)
            state_fold(pool, ring, rows, ring_rows, accepted)
        else:
            for layer in range(s.num_layers):
                readout = verify_ring(qkv, decay, beta, pool, ring, rows[layer], ring_rows[layer], offsets,
                                      previous_ring_row_ids=previous_rows[layer], previous_num_accepted=accepted,
                                      **self.tiling)
        assert readout is not None
        return readout

    def model(self, variant: str, state_dtype: DType, steps: int) -> Model:
        """A graph compiled by :meth:`compile_all`."""
        return self._models[(variant, state_dtype, steps)]

    def per_step_seconds(self, variant: str, state_dtype: DType, operands: Sequence[Buffer], repeats: int) -> float:
        """(t_R - t_1) / (R - 1) over graphs of R chained steps and of one."""
        return per_link_seconds(lambda steps: self.model(variant, state_dtype, steps), self.device, operands,
                                self.chain, repeats)


def make_step_operands(device: Device, shape: FoldShape, batch: int, state_dtype: DType, seed: int = 0
                       ) -> list[Buffer]:
    """A pool row per (layer, request), two ring rows per (layer, request), one window each."""
    s = shape
    rng = np.random.default_rng(seed)
    rows = s.num_layers * batch
    tokens = batch * s.ring_len
    width = 2 * s.num_key_heads * s.key_dim + s.num_value_heads * s.value_dim
    pool = Buffer.zeros([rows, s.num_value_heads, s.key_dim, s.value_dim], state_dtype, device)
    ring = Buffer.zeros([2 * rows, s.num_key_heads, s.ring_len, s.layout.min_stride], DType.float32, device)
    ids = np.arange(rows, dtype=np.uint32).reshape(s.num_layers, batch)
    host = [
        rng.standard_normal((tokens, width)).astype(np.float32),
        rng.uniform(0.6, 1.0, (tokens, s.num_value_heads)).astype(np.float32),
        rng.uniform(0.0, 1.0, (tokens, s.num_value_heads)).astype(np.float32),
        ids,
        ids,
        ids + np.uint32(rows),
        np.full(batch, s.accepted, np.uint32),
        np.arange(0, tokens + 1, s.ring_len, dtype=np.uint32),
    ]
    return [pool, ring, *[Buffer.from_numpy(np.ascontiguousarray(h)).to(device) for h in host]]


def run_step_bench(
    batches: Iterable[int],
    dtypes: Iterable[DType] = (DType.float32,),
    *,
    shape: FoldShape | None = None,
    chain: int = 3,
    repeats: int = 5,
    tiling: WindowTiling | None = None,
    console: Console | None = None,
    device: Device | None = None,
) -> list[StepRow]:
    """Measures the variants for every (dtype, batch) on ``device`` (default: the GPU)
    and returns the rows: all three on a GPU, ``ours`` and ``fused`` on the CPU."""
    shape = shape or FoldShape()
    console = console or Console()
    device = device or Accelerator()
    variants = VARIANTS if device.label != "cpu" else ("ours", "fused")
    session = InferenceSession(devices=[device])
    graphs = StepGraphs(session, device, shape, chain, tiling)
    batches, dtypes = list(batches), list(dtypes)
    console.print("compiling the step graphs ...")
    graphs.compile_all(variants, dtypes)
    rows: list[StepRow] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(batches) * len(dtypes) * len(variants))
        for state_dtype in dtypes:
            for batch in batches:
                operands = make_step_operands(device, shape, batch, state_dtype)
                seconds = {"max": float("nan")}
                for variant in variants:
                    progress.update(task, description=f"{variant} {state_dtype.name} batch {batch}")
                    seconds[variant] = graphs.per_step_seconds(variant, state_dtype, operands, repeats)
                    progress.advance(task)
                for variant in variants:
                    moved = STATE_PASSES[variant] * shape.state_bytes(batch, state_dtype)
                    rows.append(StepRow(
                        variant=variant,
                        state_dtype=state_dtype.name,
                        batch=batch,
                        step_us=seconds[variant] * 1e6,
                        state_gb=moved / 1e9,
                        state_tb_s=moved / seconds[variant] / 1e12 if seconds[variant] > 0 else float("nan"),
                        vs_max=_ratio(seconds["max"], seconds[variant]),
                        vs_ours=_ratio(seconds["ours"], seconds[variant]),
                    ))
                del operands
    return rows


def _ratio(baseline: float, seconds: float) -> float:
    return baseline / seconds if seconds > 0 else float("nan")


def render_steps(rows: Sequence[StepRow], console: Console) -> None:
    with_max = any(not math.isnan(r.vs_max) for r in rows)
    table = Table(title="one decoding step's state work (all layers): verify + fold")
    columns = ["variant", "dtype", "batch", "step µs", "state GB moved", "state TB/s"]
    columns += ["speed-up vs MAX"] if with_max else ["speed-up vs ours"]
    for column in columns:
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r.variant, r.state_dtype, str(r.batch), f"{r.step_us:.1f}", f"{r.state_gb:.2f}",
                      f"{r.state_tb_s:.3f}", f"{r.vs_max if with_max else r.vs_ours:.2f}x")
    console.print(table)


def write_step_json(rows: Sequence[StepRow], path: str) -> None:
    """The rows as JSON; a ratio that was not measured (``vs_max`` on the CPU) is null."""
    def plain(row: StepRow) -> dict[str, object]:
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(row).items()}

    with open(path, "w") as out:
        json.dump([plain(r) for r in rows], out, indent=2)
