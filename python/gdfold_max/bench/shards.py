"""The sharded step benchmark: a decoding step's state work on tensor-parallel shards,
every device on its own heads, against one device running one shard alone, side by side
in one process.

* ``shards``: one graph over the devices. Each step broadcasts the accepted counts from
  the first device (``ops.distributed_broadcast``, as MAX's Qwen3.5 rollback does), then
  runs, layer by layer, every device's verify with fold on load over its shard: nv / n
  value heads and nk / n key heads, its own pool, ring and row tables.
* ``one``: the same graph for the first shard alone, on the first device: the work each
  device does in ``shards``.

Nothing crosses devices but the counts, so ``shards`` should take the time of ``one``:
the ratio one / shards is the claim, 1 when the devices run fully in parallel. Timed as
``bench.harness`` says, graphs of R chained steps against one step, each ``execute()``
followed by a synchronisation of every device (graphs over several devices are not
captured), both variants in turn for ``rounds`` rounds, the medians kept.

On the CPU the shards all run on the CPU, one after another, with no broadcast: that
checks the graphs build and run, not the claim.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, DeviceRef, Graph, TensorType, TensorValue
from max.graph import Module as GraphModule
from max.nn.comm import Signals
from rich.console import Console

from ..ops.kernels import kernels_path
from ..ops.window import verify_ring
from ..sharded import broadcast_counts
from .harness import ChainedGraphs, FoldShape, measure_rounds, render_rows, sweep
from .step import ACCEPTED_AT, make_step_operands, step_input_types

#: ``shards``: every shard on its device; ``one``: the first shard alone on the first device.
SHARD_VARIANTS = ("shards", "one")

@dataclass
class ShardRow:
    """One measured (number of shards, dtype, batch)."""

    shards: int
    state_dtype: str
    batch: int
    #: Medians over the rounds, µs per step.
    shards_us: float
    one_us: float
    #: ``one_us / shards_us``: 1 when the devices run their shards fully in parallel.
    one_over_shards: float
    rounds: int


def shard_shape(shape: FoldShape, num_shards: int) -> FoldShape:
    """The shapes one device holds when the heads split evenly over ``num_shards``.

    Raises:
        ValueError: if the key heads do not split evenly.
    """
    if num_shards < 1 or shape.num_key_heads % num_shards:
        raise ValueError(f"num_shards: {num_shards} does not divide the {shape.num_key_heads} key heads evenly")
    return replace(shape, num_value_heads=shape.num_value_heads // num_shards,
                   num_key_heads=shape.num_key_heads // num_shards)


class ShardedSteps(ChainedGraphs):
    """Compiled graphs of 1 and ``chain`` steps for ``shards`` (shard i on ``devices[i]``)
    and ``one`` (shard 0 alone on ``devices[0]``)."""

    def __init__(self, session: InferenceSession, devices: Sequence[Device], shape: FoldShape, chain: int) -> None:
        super().__init__(session, devices[0], shard_shape(shape, len(devices)), chain)
        self.devices = list(devices)
        self.where = [DeviceRef.from_device(device) for device in devices]
        distinct = list(dict.fromkeys(self.where))
        self.signals = Signals(distinct) if len(distinct) > 1 else None

    def placement(self, variant: str) -> list[DeviceRef]:
        return self.where if variant == "shards" else self.where[:1]

    def devices_of(self, variant: str) -> list[Device]:
        return self.devices if variant == "shards" else self.devices[:1]

    def serving(self, variant: str) -> str:
        """The variant whose graphs run ``variant``: on one device ``one`` is ``shards``,
        compiled once."""
        return "shards" if len(self.devices) == 1 else variant

    def model(self, variant: str, state_dtype: DType, links: int) -> Model:
        return super().model(self.serving(variant), state_dtype, links)

    def compile_all(self, variants: Sequence[str], dtypes: Sequence[DType], chained: bool = True) -> None:
        super().compile_all(list(dict.fromkeys(map(self.serving, variants))), dtypes, chained)

    def build(self, variant: str, state_dtype: DType, links: int, module: GraphModule | None = None) -> Graph:
        s = self.shape
        where = self.placement(variant)
        # Every shard's step operands on its device (the first shard's counts are the
        # sampler's, broadcast to the others, whose own counts go unread).
        inputs: list[BufferType | TensorType] = [t for ref in where for t in step_input_types(s, state_dtype, ref)]
        per = len(inputs) // len(where)
        if variant == "shards" and self.signals is not None:
            inputs += self.signals.input_types()
        with Graph(f"shards_{variant}_{len(where)}_{state_dtype.name}_x{links}", input_types=inputs,
                   custom_extensions=[kernels_path()], module=module) as graph:
            values = list(graph.inputs)
            shards = [values[i * per: (i + 1) * per] for i in range(len(where))]
            signal_buffers = [v.buffer for v in values[len(where) * per:]]
            readouts: list[TensorValue] = []
            for _ in range(links):
                # Once a step, as MAX's rollback broadcasts once before its folds.
                counts = broadcast_counts(shards[0][ACCEPTED_AT].tensor, where, signal_buffers)
                for layer in range(s.num_layers):
                    readouts = [
                        verify_ring(qkv.tensor, decay.tensor, beta.tensor, pool.buffer, ring.buffer,
                                    rows.tensor[layer], ring_rows.tensor[layer], offsets.tensor,
                                    previous_ring_row_ids=previous.tensor[layer],
                                    previous_num_accepted=counts[i])
                        for i, (pool, ring, qkv, decay, beta, rows, ring_rows, previous, _, offsets)
                        in enumerate(shards)]
            graph.output(*readouts)
        return graph

    def operands(self, variant: str, state_dtype: DType, batch: int) -> list[Buffer]:
        """Every shard's step operands on its device (``make_step_operands``), and the
        signal buffers where the counts are broadcast."""
        buffers = [b for index, device in enumerate(self.devices_of(variant))
                   for b in make_step_operands(device, self.shape, batch, state_dtype, seed=index)]
        if variant == "shards" and self.signals is not None:
            buffers += self.signals.buffers()
        return buffers

    def synchronize(self, variant: str) -> None:
        for device in dict.fromkeys(self.devices_of(variant)):
            device.synchronize()


def run_shard_bench(devices: Sequence[Device], batches: Iterable[int], dtypes: Iterable[DType] = (DType.float32,),
                    *, shape: FoldShape | None = None, chain: int = 3, repeats: int = 5, rounds: int = 1,
                    console: Console | None = None) -> list[ShardRow]:
    """Times ``shards`` (shard i on ``devices[i]``) against ``one`` for every (dtype,
    batch) and returns the rows."""
    console = console or Console()
    steps = ShardedSteps(InferenceSession(devices=list(dict.fromkeys(devices))), devices, shape or FoldShape(),
                         chain)
    dtypes = list(dtypes)
    console.print(f"compiling the sharded step graphs ({len(devices)} shards) ...")
    started = time.perf_counter()
    steps.compile_all(SHARD_VARIANTS, dtypes)
    console.print(f"compiled in {time.perf_counter() - started:.0f} s")
    rows = []
    for state_dtype, batch in sweep(dtypes, list(batches), console, "sharded step"):
        timers: dict[str, Callable[[], float]] = {
            variant: partial(steps.per_link_seconds, variant, state_dtype,
                             steps.operands(variant, state_dtype, batch), repeats)
            for variant in SHARD_VARIANTS}
        measured = measure_rounds(SHARD_VARIANTS, rounds, timers)
        shards_s, one_s = measured.median("shards"), measured.median("one")
        rows.append(ShardRow(shards=len(devices), state_dtype=state_dtype.name, batch=batch,
                             shards_us=shards_s * 1e6, one_us=one_s * 1e6,
                             one_over_shards=one_s / shards_s if shards_s > 0 else float("nan"), rounds=rounds))
        del timers
    return rows


def render_shard_rows(rows: Sequence[ShardRow], console: Console) -> None:
    render_rows("a sharded decoding step's state work (all layers), medians", [
        ("shards", lambda r: str(r.shards)),
        ("dtype", lambda r: r.state_dtype),
        ("batch", lambda r: str(r.batch)),
        ("every shard µs", lambda r: f"{r.shards_us:.1f}"),
        ("one shard alone µs", lambda r: f"{r.one_us:.1f}"),
        ("one / every", lambda r: f"{r.one_over_shards:.3f}"),
    ], rows, console)
