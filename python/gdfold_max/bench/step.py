"""The step benchmark: the state work of one speculative decoding step, side by side in
one process.

* ``max``: MAX's ``gated_delta_recurrence_verify_ring_fwd`` for every layer, then MAX's
  ``gated_delta_state_fold`` for all layers (the verify reads the state, the fold reads
  and writes it: three passes over the state).
* ``max-forward``: MAX's ``gated_delta_recurrence_fwd`` for every layer: the forward
  MAX's Qwen3.5 layer runs on a plain decoding step (a window of one token), the
  anchor for ``forward``.
* ``ours``: our ``verify_ring`` for every layer, then our ``state_fold`` (three passes).
* ``fused``: our ``verify_ring`` with fold on load for every layer: the previous step's
  accepted records are applied as the state loads, so the state is read and written
  once (two passes).
* ``forward``: our ``recurrence`` for every layer: the forward over the same windows,
  committing the state (two passes), the work FLA's kernel below does.
* ``fla``: FLA's Triton ``fused_recurrent_gated_delta_rule`` (the kernel vLLM's and
  SGLang's decode build on) over the same windows and data for every layer, initial
  state in, final state out. It runs where ``torch`` and ``fla`` import, on a GPU; it is
  an anchor, not a dependency of this package (``bench.fla``).
* ``kda``: with per-channel gates, MAX's ``kda_decode`` for every layer, the forward
  over the same windows (its gates and betas go in as pre-activations; the values do not
  change the work, so the timing is the op's). The anchor for ``forward`` there, as
  MAX has no verify ring or fold for per-channel gates.

Timing as ``bench.harness`` says: per step (t_R - t_1) / (R - 1), best of ``repeats``,
every variant in turn for ``rounds`` rounds, the median kept and the per-round ratios'
spread reported. MAX's ops and FLA have no CPU path: on the CPU only ``ours``,
``fused`` and ``forward`` run. Shapes default to Qwen3-Next-80B's gated-delta layers. Every
request verifies a window of W tokens (``window``: 1 is plain decoding, 8 a block of MAX's
DFlash2 drafter, 32 our longest ring) into a ring of RING_LEN = W records, and W - 1 of the
previous step's records are accepted (at W = 1 the one record, as plain decoding keeps every
token: with none accepted ``ours`` and ``fused`` would only read the state). MAX's verify
and fold run only where its ring kernels are compiled for RING_LEN (:data:`MAX_RING_LENS`).

Beside each row stands the state's bytes floor: the state read and written once, at the
bandwidth of the device's own copy of a large buffer (a numpy copy on the CPU).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from max.driver import Accelerator, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, BufferValue, DeviceRef, Graph, TensorType, TensorValue
from max.graph import Module as GraphModule
from rich.console import Console

from ..ops.checks import MAX_RING_LEN
from ..ops.fold import state_fold
from ..ops.kernels import kernels_path
from ..ops.window import WindowTiling, recurrence, verify_ring
from .harness import (
    ChainedGraphs,
    FoldShape,
    device_copy_tb_s,
    measure_rounds,
    numpy_copy_tb_s,
    ratio,
    render_rows,
    sweep,
    times,
)

if TYPE_CHECKING:
    from .fla import FlaSteps

#: The graph variants with one decay per head (FLA runs through torch, beside them).
VARIANTS = ("max", "max-forward", "ours", "fused", "forward")
#: The graph variants with per-channel gates on a GPU: MAX's KDA decode is the anchor.
CHANNEL_VARIANTS = ("kda", "ours", "fused", "forward")


#: Passes over the state each variant makes, so the bytes it must move: a count from
#: the design, not a measurement.
STATE_PASSES = {"max": 3, "max-forward": 2, "ours": 3, "fused": 2, "forward": 2, "fla": 2, "kda": 2}

#: The ring lengths MAX 26.7's ring kernels are compiled for (``COMPILED_RING_LENS`` in
#: ``max.pipelines.architectures.qwen3_5.state_cache``): its verify and fold run at no other.
MAX_RING_LENS = (2, 4, 8)
#: The window widths the benchmark takes: our ring holds 1 to 32 records (MAX_RING_LEN).
WINDOWS = range(1, MAX_RING_LEN + 1)
#: Bytes of the buffer whose device copy gives the floor's bandwidth: large enough that a
#: launch and a synchronisation do not count.
FLOOR_COPY_BYTES = 1 << 30


def window_shape(shape: FoldShape, window: int) -> FoldShape:
    """``shape`` at ``window`` tokens a request: RING_LEN = W, and W - 1 of the previous
    step's records accepted (the one record at W = 1: plain decoding keeps every token)."""
    return dataclasses.replace(shape, ring_len=window, accepted=max(window - 1, 1))


def step_variants(gate: str, window: int, on_gpu: bool) -> tuple[str, ...]:
    """The graph variants timed for ``gate`` at ``window`` tokens per request: MAX's ops
    only on a GPU, and its verify and fold only at a ring length they are compiled for."""
    if window not in WINDOWS:
        raise ValueError(f"window: {window} is not in 1 to {WINDOWS[-1]}")
    if gate == "channel":
        return CHANNEL_VARIANTS if on_gpu else tuple(v for v in CHANNEL_VARIANTS if v != "kda")
    if not on_gpu:
        return tuple(v for v in VARIANTS if not v.startswith("max"))
    return tuple(v for v in VARIANTS if v != "max" or window in MAX_RING_LENS)


@dataclass
class StepRow:
    """One measured (variant, dtype, batch)."""

    variant: str
    state_dtype: str
    batch: int
    #: Tokens per request (RING_LEN).
    window: int
    #: Median over the rounds.
    step_us: float
    rounds: int
    state_gb: float
    state_tb_s: float
    #: MAX's time over this variant's, medians (NaN where MAX's ops did not run: the CPU).
    #: MAX's verify + fold with one decay per head; its KDA decode with per-channel gates.
    vs_max: float
    #: MAX's forward (``max-forward``) time over this variant's, medians (NaN where it did
    #: not run).
    vs_max_forward: float
    #: ``ours`` time over this variant's, medians.
    vs_ours: float
    #: FLA's time over this variant's, medians (NaN where FLA did not run).
    vs_fla: float
    #: The smallest and largest per-round ``ours`` over this variant.
    vs_ours_range: tuple[float, float]
    #: The state read and written once at the copy bandwidth, µs: no step can be faster.
    floor_us: float
    #: This variant's time over the floor.
    over_floor: float


class StepGraphs(ChainedGraphs):
    """Compiled graphs of 1 and R chained decoding steps for each graph variant (the
    graph of one step alone where the steps are timed by replay).

    ``kernels`` is the Mojo package our variants use (default: the installed one); graphs
    of several packages can live in one session, so that kernel versions are timed side
    by side in one process.
    """

    def __init__(self, session: InferenceSession, device: Device, shape: FoldShape, chain: int,
                 tiling: WindowTiling | None = None, kernels: Path | None = None) -> None:
        super().__init__(session, device, shape, chain)
        self.tiling: WindowTiling = tiling or {}
        self.kernel_package = kernels or kernels_path()
        # Graph names stay distinct across packages, and tilings, in one session.
        self._tag = "" if kernels is None and not self.tiling else "_" + hashlib.sha1(
            f"{kernels}|{sorted(self.tiling.items())}".encode()).hexdigest()[:8]

    def build(self, variant: str, state_dtype: DType, links: int, module: GraphModule | None = None) -> Graph:
        inputs = step_input_types(self.shape, state_dtype, DeviceRef.from_device(self.device))
        extensions = [] if variant in ("max", "kda") else [self.kernel_package]
        with Graph(f"step_{variant}{self._tag}_{state_dtype.name}_x{links}", input_types=inputs,
                   custom_extensions=extensions, module=module) as graph:
            pool, ring = graph.inputs[0].buffer, graph.inputs[1].buffer
            qkv, decay, beta, rows, ring_rows, previous_rows, accepted, offsets = (x.tensor for x in graph.inputs[2:])
            readout: TensorValue | None = None
            for _ in range(links):
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
        elif variant == "max-forward":
            from max.nn.state_space import gated_delta_recurrence_fwd

            for layer in range(s.num_layers):
                readout = gated_delta_recurrence_fwd(qkv, decay, beta, pool, rows[layer], offsets)
        elif variant == "kda":
            readout = self._max_kda_forward(qkv, decay, beta, pool, rows, offsets)
        elif variant == "ours":
            for layer in range(s.num_layers):
                readout = verify_ring(qkv, decay, beta, pool, ring, rows[layer], ring_rows[layer], offsets,
                                      **self.tiling)
            state_fold(pool, ring, rows, ring_rows, accepted, gate=s.gate)
        elif variant == "forward":
            for layer in range(s.num_layers):
                readout = recurrence(qkv, decay, beta, pool, rows[layer], offsets, **self.tiling)
        else:
            for layer in range(s.num_layers):
                readout = verify_ring(qkv, decay, beta, pool, ring, rows[layer], ring_rows[layer], offsets,
                                      previous_ring_row_ids=previous_rows[layer], previous_num_accepted=accepted,
                                      **self.tiling)
        assert readout is not None
        return readout

    def _max_kda_forward(self, qkv: TensorValue, decay: TensorValue, beta: TensorValue, pool: BufferValue,
                         rows: TensorValue, offsets: TensorValue) -> TensorValue:
        """MAX's kda_decode for every layer, the decays as raw gates; its int32 tables
        are cast once per step."""
        from max.graph import ops

        slots = ops.cast(rows, DType.int32)
        return max_kda_decode(qkv, decay, beta, pool, [slots[layer] for layer in range(self.shape.num_layers)],
                              ops.cast(offsets, DType.int32), self.shape.num_key_heads)

    def per_step_seconds(self, variant: str, state_dtype: DType, operands: Sequence[Buffer], repeats: int,
                         replay: bool = False) -> float:
        """(t_R - t_1) / (R - 1) over R steps and one: R replays of the captured graph of
        one step with ``replay``, else graphs of R chained steps (see
        ``ChainedGraphs.per_link_seconds``)."""
        return self.per_link_seconds(variant, state_dtype, operands, repeats, replay)


def max_kda_decode(qkv: TensorValue, raw_gate: TensorValue, beta: TensorValue, pool: BufferValue,
                   layer_slots: Sequence[TensorValue], cu_seqlens: TensorValue, num_key_heads: int) -> TensorValue:
    """MAX's ``kda_decode`` on our operands, once per layer (its pool rows in
    ``layer_slots``, int32 like ``cu_seqlens``): q, k and v cut from ``qkv`` ``[T, 2*nk*K +
    nv*V]`` once, ``raw_gate`` ``[T, nv, K]`` decayed as ``exp(-softplus(raw_gate))``
    (``a_log = dt_bias = 0``), ``beta`` ``[T, nv]`` taken as it is. Returns the last
    layer's readout ``[T, nv*V]``, as ours."""
    from max.graph import ops
    from max.nn.state_space import kda_decode

    nv, kd, vd = (int(d) for d in pool.shape[1:])
    nk = num_key_heads
    tokens = qkv.shape[0]
    q = ops.reshape(qkv[:, : nk * kd], [tokens, nk, kd])
    k = ops.reshape(qkv[:, nk * kd : 2 * nk * kd], [tokens, nk, kd])
    v = ops.reshape(qkv[:, 2 * nk * kd :], [tokens, nv, vd])
    a_log = ops.constant(np.zeros(nv, np.float32), DType.float32, qkv.device)
    dt_bias = ops.constant(np.zeros((nv, kd), np.float32), DType.float32, qkv.device)
    readout = None
    for slots in layer_slots:
        readout = kda_decode(q, k, v, raw_gate, beta, a_log, dt_bias, cu_seqlens, pool, slots,
                             output_dtype=DType.float32, gate_mode="original", beta_mode="probability")
    assert readout is not None
    return ops.reshape(readout, [tokens, nv * vd])


#: Where the accepted counts sit among a step's operands (step_input_types, make_step_operands).
ACCEPTED_AT = 8


def step_input_types(shape: FoldShape, state_dtype: DType, where: DeviceRef) -> list[BufferType | TensorType]:
    """The types of one step's operands on ``where``, in :func:`make_step_operands`'
    order: the pool, the ring, qkv, decay, beta, the row, ring-row and previous ring-row
    tables ``[num_layers, batch]``, the accepted counts and the offsets."""
    s = shape
    f32, u32 = DType.float32, DType.uint32
    width = 2 * s.num_key_heads * s.key_dim + s.num_value_heads * s.value_dim
    return [
        BufferType(state_dtype, ["rows", s.num_value_heads, s.key_dim, s.value_dim], where),
        BufferType(f32, ["ring_rows", s.num_key_heads, s.ring_len, s.layout.min_stride], where),
        TensorType(f32, ["tokens", width], where),
        TensorType(f32, ["tokens", s.num_value_heads] + ([s.key_dim] if s.gate == "channel" else []), where),
        TensorType(f32, ["tokens", s.num_value_heads], where),
        TensorType(u32, [s.num_layers, "batch"], where),
        TensorType(u32, [s.num_layers, "batch"], where),
        TensorType(u32, [s.num_layers, "batch"], where),
        TensorType(u32, ["batch"], where),
        TensorType(u32, ["offsets"], where),
    ]


def step_host_inputs(shape: FoldShape, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The tokens and tables of one step: a pool row per (layer, request), two ring rows
    per (layer, request), one window of RING_LEN tokens each."""
    s = shape
    rng = np.random.default_rng(seed)
    rows = s.num_layers * batch
    tokens = batch * s.ring_len
    width = 2 * s.num_key_heads * s.key_dim + s.num_value_heads * s.value_dim
    ids = np.arange(rows, dtype=np.uint32).reshape(s.num_layers, batch)
    return {
        "qkv": rng.standard_normal((tokens, width)).astype(np.float32),
        "decay": rng.uniform(0.6, 1.0, (tokens, s.num_value_heads)
                             + ((s.key_dim,) if s.gate == "channel" else ())).astype(np.float32),
        "beta": rng.uniform(0.0, 1.0, (tokens, s.num_value_heads)).astype(np.float32),
        "row_ids": ids,
        "ring_row_ids": ids,
        "previous_ring_row_ids": ids + np.uint32(rows),
        "num_accepted": np.full(batch, s.accepted, np.uint32),
        "input_row_offsets": np.arange(0, tokens + 1, s.ring_len, dtype=np.uint32),
    }


def make_step_operands(device: Device, shape: FoldShape, batch: int, state_dtype: DType, seed: int = 0,
                       host: dict[str, np.ndarray] | None = None) -> list[Buffer]:
    """The operands of :class:`StepGraphs`' graphs: a zeroed pool and ring, then
    ``host`` (default: :func:`step_host_inputs`) on ``device``."""
    s = shape
    rows = s.num_layers * batch
    pool = Buffer.zeros([rows, s.num_value_heads, s.key_dim, s.value_dim], state_dtype, device)
    ring = Buffer.zeros([2 * rows, s.num_key_heads, s.ring_len, s.layout.min_stride], DType.float32, device)
    host = host if host is not None else step_host_inputs(shape, batch, seed)
    return [pool, ring, *[Buffer.from_numpy(np.ascontiguousarray(h)).to(device) for h in host.values()]]


def run_step_bench(
    batches: Iterable[int],
    dtypes: Iterable[DType] = (DType.float32,),
    *,
    shape: FoldShape | None = None,
    chain: int = 3,
    repeats: int = 5,
    rounds: int = 1,
    tiling: WindowTiling | None = None,
    console: Console | None = None,
    device: Device | None = None,
    with_fla: bool = True,
    replay: bool = True,
    window: int | None = None,
) -> list[StepRow]:
    """Measures the variants for every (dtype, batch) on ``device`` (default: the GPU)
    and returns the rows: MAX's, ours, fused (and FLA's where it imports) on a GPU,
    ours and fused on the CPU. On a GPU with ``replay`` (the default) every graph runs as
    a captured device graph, as MAX's pipelines run decoding steps and as FLA's CUDA
    graphs run: what is timed is the GPU's work, not the host's launches. ``window``
    (default: ``shape.ring_len``) sets the tokens per request and RING_LEN."""
    shape = shape or FoldShape()
    batches = list(batches)
    if window is not None:
        step_variants(shape.gate, window, False)  # refuses a window outside 1 to 32
        shape = window_shape(shape, window)
    console = console or Console()
    device = device or Accelerator()
    on_gpu = device.label != "cpu"
    replay = replay and on_gpu
    # MAX's verify and fold, and FLA's gated delta rule, take one decay per head only;
    # with per-channel gates MAX's KDA decode is the anchor.
    with_anchors = on_gpu and shape.gate == "head"
    anchor = "max" if shape.gate == "head" else "kda"
    graph_variants = step_variants(shape.gate, shape.ring_len, on_gpu)
    if on_gpu and shape.gate == "head" and "max" not in graph_variants:
        console.print(f"MAX's verify and fold are not timed: its ring kernels are compiled for RING_LEN in"
                      f" {MAX_RING_LENS}, not {shape.ring_len}")
    fla: FlaSteps | None = None
    if with_anchors and with_fla:
        from .fla import FlaSteps, fla_missing

        missing = fla_missing()
        if missing:
            console.print(f"FLA is not timed: {missing}")
        else:
            fla = FlaSteps(shape, chain)
    graphs = StepGraphs(InferenceSession(devices=[device]), device, shape, chain, tiling)
    dtypes = list(dtypes)
    console.print("compiling the step graphs ...")
    started = time.perf_counter()
    graphs.compile_all(graph_variants, dtypes, chained=not replay)
    console.print(f"compiled in {time.perf_counter() - started:.0f} s")
    variants = [*graph_variants, *(["fla"] if fla is not None else [])]
    largest = max(shape.state_bytes(max(batches), d) for d in dtypes)
    copy_tb_s = (device_copy_tb_s(device, max(FLOOR_COPY_BYTES, largest), repeats) if on_gpu
                 else numpy_copy_tb_s(largest, repeats))
    console.print(f"copy bandwidth, the floor's: {copy_tb_s:.3f} TB/s (read + write)")
    rows: list[StepRow] = []
    for state_dtype, batch in sweep(dtypes, batches, console, "step"):
        operands = make_step_operands(device, shape, batch, state_dtype)
        timers: dict[str, Callable[[], float]] = {
            v: partial(graphs.per_step_seconds, v, state_dtype, operands, repeats, replay) for v in graph_variants}
        if fla is not None:
            try:
                timers["fla"] = fla.prepare(step_host_inputs(shape, batch), batch, state_dtype, repeats)
            except Exception as error:  # noqa: BLE001 - a failing anchor must not stop ours being timed
                console.print(f"FLA is not timed at {state_dtype.name} batch {batch}: {error}")
                timers["fla"] = lambda: float("nan")
        measured = measure_rounds(variants, rounds, timers)
        for variant in variants:
            seconds = measured.median(variant)
            moved = STATE_PASSES[variant] * shape.state_bytes(batch, state_dtype)
            floor = 2 * shape.state_bytes(batch, state_dtype) / (copy_tb_s * 1e12)
            rows.append(StepRow(
                variant=variant,
                state_dtype=state_dtype.name,
                batch=batch,
                window=shape.ring_len,
                step_us=seconds * 1e6,
                rounds=rounds,
                state_gb=moved / 1e9,
                state_tb_s=moved / seconds / 1e12 if seconds > 0 else float("nan"),
                vs_max=ratio(measured.median(anchor), seconds),
                vs_max_forward=ratio(measured.median("max-forward"), seconds),
                vs_ours=ratio(measured.median("ours"), seconds),
                vs_fla=ratio(measured.median("fla"), seconds),
                vs_ours_range=measured.ratio_range("ours", variant),
                floor_us=floor * 1e6,
                over_floor=ratio(seconds, floor),
            ))
        del operands, timers
    return rows


def render_steps(rows: Sequence[StepRow], console: Console) -> None:
    """Prints the rows; the ratio columns that were measured, and the per-round spread of
    the ratio to ours where there was more than one round."""
    columns: list[tuple[str, Callable[[StepRow], str]]] = [
        ("variant", lambda r: r.variant),
        ("dtype", lambda r: r.state_dtype),
        ("window", lambda r: str(r.window)),
        ("batch", lambda r: str(r.batch)),
        ("step µs", lambda r: f"{r.step_us:.1f}"),
        ("floor µs", lambda r: f"{r.floor_us:.1f}"),
        ("over floor", lambda r: times(r.over_floor)),
        ("state GB moved", lambda r: f"{r.state_gb:.2f}"),
        ("state TB/s", lambda r: f"{r.state_tb_s:.3f}"),
    ]
    if any(not np.isnan(r.vs_max) for r in rows):
        columns.append(("vs MAX", lambda r: times(r.vs_max)))
    if any(not np.isnan(r.vs_max_forward) for r in rows):
        columns.append(("vs MAX forward", lambda r: times(r.vs_max_forward)))
    if any(not np.isnan(r.vs_fla) for r in rows):
        columns.append(("vs FLA", lambda r: times(r.vs_fla)))
    columns.append(("vs ours", lambda r: times(r.vs_ours)))
    if any(r.rounds > 1 for r in rows):
        columns.append(("vs ours, rounds' range",
                        lambda r: f"{times(r.vs_ours_range[0])} - {times(r.vs_ours_range[1])}"))
    render_rows("one decoding step's state work (all layers), medians", columns, rows, console)
