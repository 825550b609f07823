"""What the fold benchmark (``bench.fold``) and the step benchmark (``bench.step``) share.

Timing: a graph of R chained links (folds, or decoding steps) against a graph of one,
per link = (t_R - t_1) / (R - 1), best of several runs, so the graph-call overhead
cancels. Variants are timed side by side in one process, round after round, since
times taken in separate processes differ by up to 10% on a GPU and more on a shared CPU.
Rows render as a rich table and write as JSON, a ratio that was not measured as null.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import Graph
from max.graph import Module as GraphModule
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ..layout import Gate, RecordLayout, check_gate
from ..ops.kernels import kernels_path


@dataclass(frozen=True)
class FoldShape:
    """Model shapes of the benchmarks (defaults: Qwen3-Next-80B's gated-delta layers)."""

    num_layers: int = 36
    num_value_heads: int = 32
    num_key_heads: int = 16
    key_dim: int = 128
    value_dim: int = 128
    ring_len: int = 4
    accepted: int = 3
    #: One decay per head (Gated DeltaNet) or per key channel (Kimi Delta Attention).
    gate: Gate = "head"

    @property
    def layout(self) -> RecordLayout:
        return RecordLayout(self.key_dim, self.value_dim, self.num_value_heads // self.num_key_heads, self.gate)

    @classmethod
    def for_gate(cls, gate: Gate) -> FoldShape:
        """The benchmarks' default model for a gate: Qwen3-Next-80B's 36 gated-delta layers
        (``"head"``), or Kimi-Linear-48B's 20 KDA layers of 32 heads of 128 x 128
        (``"channel"``)."""
        check_gate(gate)
        if gate == "head":
            return cls()
        return cls(num_layers=20, num_value_heads=32, num_key_heads=32, gate="channel")

    def state_bytes(self, batch: int, state_dtype: DType) -> int:
        """Bytes of state one pass over the batch's rows touches (every layer)."""
        elements = self.num_layers * batch * self.num_value_heads * self.key_dim * self.value_dim
        return elements * state_dtype.size_in_bytes

    def record_bytes(self, batch: int) -> int:
        """Bytes of record fields the batch's folds read."""
        records = self.num_layers * batch * self.num_key_heads * self.accepted
        return records * self.layout.elements * 4

    def fold_bytes(self, batch: int, state_dtype: DType) -> int:
        """Bytes a fold moves: the state read and written once, and the records read."""
        return 2 * self.state_bytes(batch, state_dtype) + self.record_bytes(batch)


def best_seconds(run: Callable[[], None], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``run`` (after one warm-up call)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best



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

def per_link_from(time_of: Callable[[int], float], chain: int) -> float:
    """The time of one link from ``time_of(n)``, the time of n links: (t_R - t_1) / (R - 1)
    with R = ``chain``, so the fixed cost of starting and synchronising drops out. Ours
    and the anchors (FLA's CUDA graphs) are differenced by this one rule."""
    one, many = time_of(1), time_of(chain)
    return max(many - one, 0.0) / (chain - 1)


def compile_together(jobs: Sequence[tuple[ChainedGraphs, str]], dtypes: Sequence[DType],
                     chained: bool = True) -> None:
    """Compiles the graphs of every (graph set, variant) of ``jobs`` in as few calls as
    their kernel packages allow: the graphs of one package are built into one
    ``max.graph.Module`` and compiled by one ``load_all``, so that kernels they share are
    compiled once. MAX compiles one graph at a time within a process, so the threads this
    replaced gained little; one module compiled ``bench-step --device cpu``'s three graphs
    in 60 s where the threads took 145 (2 CPU cores, fresh compile caches,
    bench/results/compile-module-cpu-2core-2026-12-04.txt). Sets of other packages
    (copies of the kernels timed side by side) compile in a module each, since their ops
    share names."""
    keyed = [(graphs, (variant, dtype, links)) for graphs, variant in jobs for dtype in dtypes
             for links in ((1, graphs.chain) if chained else (1,))]
    sessions = {id(graphs.session) for graphs, _ in keyed}
    if len(sessions) > 1:
        raise ValueError(f"compile_together: the graph sets must share one session, got {len(sessions)}")
    by_package: dict[Path, list[tuple[ChainedGraphs, tuple[str, DType, int]]]] = {}
    for graphs, key in keyed:
        by_package.setdefault(graphs.kernel_package, []).append((graphs, key))
    for package, members in by_package.items():
        module = GraphModule()
        names = [graphs.build(*key, module=module).name for graphs, key in members]
        models = members[0][0].session.load_all(module, custom_extensions=[package])
        for (graphs, key), name in zip(members, names, strict=True):
            graphs._models[key] = models[name]


class ChainedGraphs:
    """Compiled graphs of 1 and ``chain`` chained links of each (variant, state dtype) on
    one device. Subclasses say how a graph of n links is built, and into which module."""

    def __init__(self, session: InferenceSession, device: Device, shape: FoldShape, chain: int) -> None:
        self.session, self.device, self.shape, self.chain = session, device, shape, chain
        #: The Mojo package of our ops in these graphs (MAX's own variants use none).
        self.kernel_package: Path = kernels_path()
        self._models: dict[tuple[str, DType, int], Model] = {}
        self._capture_keys = itertools.count(1)

    def build(self, variant: str, state_dtype: DType, links: int, module: GraphModule | None = None) -> Graph:
        """The graph of ``links`` links, built into ``module`` when one is given."""
        raise NotImplementedError

    def compile_all(self, variants: Sequence[str], dtypes: Sequence[DType], chained: bool = True) -> None:
        """Compiles, several at a time, the graphs of one link and, when ``chained``, of
        ``chain`` links (which only ``per_link_seconds`` without ``replay`` runs)."""
        compile_together([(self, v) for v in variants], dtypes, chained)

    def synchronize(self, variant: str) -> None:
        """Waits for every device ``variant``'s graphs run on (one, unless a subclass
        spreads its graphs over several)."""
        self.device.synchronize()

    def model(self, variant: str, state_dtype: DType, links: int) -> Model:
        """The graph of ``links`` links, compiled on first use."""
        key = (variant, state_dtype, links)
        if key not in self._models:
            self._models[key] = self.session.load(self.build(*key))
        return self._models[key]

    def per_link_seconds(self, variant: str, state_dtype: DType, operands: Sequence[Buffer], repeats: int,
                         replay: bool = False) -> float:
        """The time of one link (``per_link_from``, R = ``chain``).

        With ``replay`` the graph of one link is captured once as a device graph
        (``Model.capture``) and t_n is the time of n replays back to back, as MAX's
        pipelines replay one graph per decoding step: the host's cost of launching each
        kernel drops out, as it does for FLA's CUDA graphs, and only the one-link graph is
        compiled. Without, t_n is one ``execute()`` of the graph of n chained links."""
        if replay:
            model = self.model(variant, state_dtype, 1)
            key = next(self._capture_keys)
            outputs = model.capture(key, *operands)

            def replays(count: int) -> float:
                def run() -> None:
                    for _ in range(count):
                        model.replay(key, *operands)
                    self.synchronize(variant)

                return best_seconds(run, repeats)

            try:
                return per_link_from(replays, self.chain)
            finally:
                del outputs
                model.release_captured_graph(key)
        else:
            def executed(links: int) -> float:
                model = self.model(variant, state_dtype, links)

                def run() -> None:
                    model.execute(*operands)
                    self.synchronize(variant)

                return best_seconds(run, repeats)

            return per_link_from(executed, self.chain)


def ratio(baseline: float, seconds: float) -> float:
    """``baseline / seconds``, NaN where either was not measured."""
    return baseline / seconds if seconds > 0 and not math.isnan(baseline) else float("nan")


@dataclass(frozen=True)
class Rounds:
    """Per-round times of each variant at one (dtype, batch), in seconds."""

    seconds: dict[str, list[float]]

    def median(self, variant: str) -> float:
        values = self.seconds.get(variant)
        return statistics.median(values) if values else float("nan")

    def ratio_range(self, baseline: str, variant: str) -> tuple[float, float]:
        """The smallest and largest per-round ``baseline / variant``, NaN if not measured."""
        if baseline not in self.seconds or variant not in self.seconds:
            return float("nan"), float("nan")
        each = [ratio(b, v) for b, v in zip(self.seconds[baseline], self.seconds[variant], strict=True)]
        return min(each), max(each)


def measure_rounds(variants: Sequence[str], rounds: int, timers: dict[str, Callable[[], float]]) -> Rounds:
    """Times every variant once per round, in turn, for ``rounds`` rounds."""
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for variant in variants:
            seconds[variant].append(timers[variant]())
    return Rounds(seconds)


def sweep(dtypes: Iterable[DType], batches: Iterable[int], console: Console, what: str
          ) -> Iterator[tuple[DType, int]]:
    """Every (dtype, batch) in order, behind a transient progress bar."""
    cells = [(d, b) for d in dtypes for b in batches]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(what, total=len(cells))
        for state_dtype, batch in cells:
            progress.update(task, description=f"{what}: {state_dtype.name} batch {batch}")
            yield state_dtype, batch
            progress.advance(task)


def render_rows(title: str, columns: Sequence[tuple[str, Callable[[Any], str]]], rows: Sequence[Any],
                console: Console) -> None:
    """Prints ``rows`` as a table: each column a header and how to show a row's cell."""
    table = Table(title=title)
    for header, _ in columns:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*(show(row) for _, show in columns))
    console.print(table)


def times(value: float) -> str:
    """A ratio as the tables print it; a dash where it was not measured."""
    return "-" if math.isnan(value) else f"{value:.2f}x"


def write_json(rows: Sequence[Any], path: str) -> None:
    """Dataclass rows as a JSON list; NaN (not measured) is written as null, which JSON
    has, where a bare NaN is not JSON."""
    def plain(value: Any) -> Any:
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    with open(path, "w") as out:
        json.dump([{k: plain(v) for k, v in asdict(r).items()} for r in rows], out, indent=2, allow_nan=False)
