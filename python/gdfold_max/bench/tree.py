"""The tree step benchmark: one speculative decoding step over token trees, against the
chain of the tree's depth and against each root-to-leaf path verified as its own chain,
side by side in one process (``bench-step --tree``).

Every request drafts the same tree (``trees.draft_tree``: ``nodes`` nodes, ``depth``
levels, shaped as EAGLE's static trees), and the previous step accepted ``depth - 1``
nodes along its spine. Every variant folds that path on load and verifies, for every
layer:

* ``tree``: our ``verify_tree`` with fold on load of the previous accepted path.
* ``tree-shared-leaves``: the same with ``leaf_warps=4``: in a launch small enough, each
  unit's first warp steps the inner nodes and three more its leaves, from each parent's
  state in shared memory (the same bits; on the CPU the same code).
* ``tree-throughput``: the same with ``gpu_path="throughput"``: the tree on the
  throughput kernel's blocks, a block a request's 64-column tile of a value head, its
  warps sharing each node's staged inputs (the same bits; on the CPU the same code).
* ``chain``: our ``verify_ring`` with fold on load over a chain of ``depth`` tokens (the
  same depth, ``nodes - depth`` fewer candidates), on the kernel ``auto`` picks (on a GPU
  the throughput kernel): what a tree costs over the chain a user runs today.
* ``chain-latency``: the same chain on the latency kernel, which ``tree`` runs on a GPU:
  what the tree's extra nodes cost on one kernel.
* ``chain-nodes``: our ``verify_ring`` with the same fold on load over a chain of ``nodes``
  tokens, on the kernel ``auto`` picks: as many token steps as the tree has nodes, on the
  throughput kernel at these batches: a bound for ``tree-throughput`` if staging its
  tokens by node cost what staging a chain costs (a leaf steps as a token does, without
  storing the state).
* ``paths``: our ``verify_ring`` with fold on load over every root-to-leaf path of the
  tree as a request of its own, each with its own pool row: what a caller without a tree
  verify does. The copies of the state into those rows are not counted, so this is the
  separate chains' best case.

Timing as ``bench.harness`` says (captured graphs replayed on a GPU, the median of the
rounds). The floor beside each row is the tree's state read and written once at the copy
bandwidth: the least any variant could move (``paths`` moves that once per leaf).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from max.driver import Accelerator, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType
from max.graph import Module as GraphModule
from rich.console import Console

from ..ops.checks import MAX_RING_LEN
from ..ops.window import verify_ring, verify_tree
from ..trees import draft_tree, leaves, root_path
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
from .step import FLOOR_COPY_BYTES, make_step_operands, step_host_inputs, step_input_types

TREE_VARIANTS = ("tree", "tree-shared-leaves", "tree-throughput", "chain", "chain-latency", "chain-nodes", "paths")
#: The variants that run a tree verify, whose rows carry the ratios to the others, and
#: the keywords each gives verify_tree.
TREE_VERIFIES: dict[str, dict[str, Any]] = {
    "tree": {}, "tree-shared-leaves": {"leaf_warps": 4}, "tree-throughput": {"gpu_path": "throughput"}}
#: The rows that carry the separate paths' time over theirs: the tree verifies', and
#: ``chain-nodes``', what a tree verify on the throughput kernel would give.
PATHS_COMPARED = (*TREE_VERIFIES, "chain-nodes")


@dataclass(frozen=True)
class TreeShape:
    """A draft tree's size: ``nodes`` nodes over ``depth`` levels."""

    nodes: int
    depth: int

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """``"16x5"``: 16 nodes, depth 5. Refuses a tree the ring cannot hold.

        Raises:
            ValueError: naming ``--tree`` and the bad value.
        """
        try:
            nodes, depth = (int(part) for part in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"--tree: {text!r} is not NODESxDEPTH, e.g. 16x5") from None
        if not 1 <= nodes <= MAX_RING_LEN:
            raise ValueError(f"--tree: {text!r} has {nodes} nodes; a tree's records must fit the ring, which"
                             f" holds 1 to {MAX_RING_LEN}")
        if not 2 <= depth <= nodes:
            raise ValueError(f"--tree: {text!r} has depth {depth}; give 2 to {nodes}")
        return cls(nodes, depth)

    @property
    def parents(self) -> np.ndarray:
        return draft_tree(self.nodes, self.depth)

    @property
    def path_lengths(self) -> list[int]:
        """The lengths of the root-to-leaf paths, in leaf order."""
        parents = self.parents
        return [len(root_path(parents, leaf)) for leaf in leaves(parents)]


@dataclass
class TreeRow:
    """One measured (variant, dtype, batch) for one tree."""

    variant: str
    state_dtype: str
    nodes: int
    depth: int
    batch: int
    #: Requests the variant runs: the batch, or for ``paths`` the batch times the leaves.
    requests: int
    #: Median over the rounds.
    step_us: float
    rounds: int
    #: The tree's state read and written once at the copy bandwidth, µs.
    floor_us: float
    over_floor: float
    #: On a tree verify's row: its time over the chain's (the issue's bound: at most 2x).
    tree_over_chain: float
    #: On a tree verify's row: its time over the chain's on the latency kernel.
    tree_over_chain_latency: float
    #: On a tree verify's row: the separate paths' time over the tree's; on
    #: ``chain-nodes``' row, over that chain's.
    paths_over_tree: float


class TreeStepGraphs(ChainedGraphs):
    """The graphs of one step of each variant for one tree. Every variant's graph takes
    :func:`bench.step.step_input_types`' operands at its own ring length (the tree's
    nodes, or its depth); the tree's adds the ``parents`` and previous path tables."""

    def __init__(self, session: InferenceSession, device: Device, shape: FoldShape, tree: TreeShape,
                 chain: int) -> None:
        super().__init__(session, device, shape, chain)
        self.tree = tree
        accepted = tree.depth - 1
        self.shapes = {
            "tree": dataclasses.replace(shape, ring_len=tree.nodes, accepted=accepted),
            "tree-shared-leaves": dataclasses.replace(shape, ring_len=tree.nodes, accepted=accepted),
            "tree-throughput": dataclasses.replace(shape, ring_len=tree.nodes, accepted=accepted),
            "chain": dataclasses.replace(shape, ring_len=tree.depth, accepted=accepted),
            "chain-latency": dataclasses.replace(shape, ring_len=tree.depth, accepted=accepted),
            "chain-nodes": dataclasses.replace(shape, ring_len=tree.nodes, accepted=accepted),
            "paths": dataclasses.replace(shape, ring_len=tree.depth, accepted=accepted),
        }

    def build(self, variant: str, state_dtype: DType, links: int, module: GraphModule | None = None) -> Graph:
        shape = self.shapes[variant]
        where = DeviceRef.from_device(self.device)
        inputs = step_input_types(shape, state_dtype, where)
        if variant in TREE_VERIFIES:
            inputs += [TensorType(DType.int32, ["batch", shape.ring_len], where),
                       TensorType(DType.uint32, ["batch", shape.ring_len], where)]
        name = f"tree_step_{variant}_{self.tree.nodes}x{self.tree.depth}_{state_dtype.name}_x{links}"
        with Graph(name, input_types=inputs, custom_extensions=[self.kernel_package], module=module) as graph:
            pool, ring = graph.inputs[0].buffer, graph.inputs[1].buffer
            qkv, decay, beta, rows, ring_rows, previous_rows, accepted, offsets, *tree_tables = (
                x.tensor for x in graph.inputs[2:])
            readout = None
            for _ in range(links):
                for layer in range(shape.num_layers):
                    previous = {"previous_ring_row_ids": previous_rows[layer], "previous_num_accepted": accepted}
                    if variant in TREE_VERIFIES:
                        parents, previous_nodes = tree_tables
                        readout = verify_tree(qkv, decay, beta, pool, ring, rows[layer], ring_rows[layer], offsets,
                                              parents, previous_accepted_nodes=previous_nodes, **previous,
                                              **TREE_VERIFIES[variant])
                    else:
                        path = "latency" if variant == "chain-latency" else "auto"
                        readout = verify_ring(qkv, decay, beta, pool, ring, rows[layer], ring_rows[layer], offsets,
                                              gpu_path=path, **previous)
            assert readout is not None
            graph.output(readout)
        return graph

    def operands(self, variant: str, batch: int, state_dtype: DType) -> list[Buffer]:
        """A zeroed pool and ring and the step's tokens and tables for ``variant``."""
        shape = self.shapes[variant]
        if variant != "paths":
            operands = make_step_operands(self.device, shape, batch, state_dtype)
            if variant in TREE_VERIFIES:
                parents = np.tile(self.tree.parents, (batch, 1))
                path = np.zeros(self.tree.nodes, np.uint32)
                path[: shape.accepted] = np.arange(shape.accepted)  # the spine: nodes 0, 1, ...
                operands += [Buffer.from_numpy(np.ascontiguousarray(t)).to(self.device)
                             for t in (parents, np.tile(path, (batch, 1)))]
            return operands
        # Every path its own request, with its own window: the offsets follow the paths,
        # and the tokens are the first of a step's whose windows are all the depth long.
        lengths = np.tile(self.tree.path_lengths, batch)
        host = step_host_inputs(shape, len(lengths))
        tokens = int(lengths.sum())
        host |= {name: host[name][:tokens] for name in ("qkv", "decay", "beta")}
        host["input_row_offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
        return make_step_operands(self.device, shape, len(lengths), state_dtype, host=host)


def check_tree_variants(variants: Iterable[str]) -> tuple[str, ...]:
    """``variants`` as a tuple, each one of :data:`TREE_VARIANTS` and none twice.

    Raises:
        ValueError: naming ``variants`` and the bad one.
    """
    chosen = tuple(variants)
    if not chosen:
        raise ValueError(f"variants: none given; choose from {', '.join(TREE_VARIANTS)}")
    for variant in chosen:
        if variant not in TREE_VARIANTS:
            raise ValueError(f"variants: {variant!r} is not one of {', '.join(TREE_VARIANTS)}")
        if chosen.count(variant) > 1:
            raise ValueError(f"variants: {variant!r} is given twice")
    return chosen


def _untimed(console: Console, what: str, error: Exception) -> None:
    console.print(f"{what} is not timed: {str(error).splitlines()[0][:160]}")


def _timed(console: Console, what: str, time_it: Callable[[], float]) -> float:
    """The time, or NaN where running fails (the separate paths' activations may not fit)."""
    try:
        return time_it()
    except Exception as error:  # noqa: BLE001 - a variant that does not fit must not stop the others
        _untimed(console, what, error)
        return float("nan")


def run_tree_bench(
    trees: Iterable[TreeShape],
    batches: Iterable[int],
    dtypes: Iterable[DType] = (DType.float32,),
    *,
    shape: FoldShape | None = None,
    chain: int = 3,
    repeats: int = 5,
    rounds: int = 1,
    console: Console | None = None,
    device: Device | None = None,
    variants: Sequence[str] = TREE_VARIANTS,
) -> list[TreeRow]:
    """Measures ``variants`` (default: all of :data:`TREE_VARIANTS`, in that order) for
    every tree, dtype and batch on ``device`` (default: the GPU) and returns the rows. A
    ratio whose other variant is not among them is NaN; only the variants asked for are
    compiled.

    Raises:
        ValueError: naming ``variants`` and the unknown or repeated one.
    """
    variants = check_tree_variants(variants)
    shape = shape or FoldShape()
    console = console or Console()
    device = device or Accelerator()
    on_gpu = device.label != "cpu"
    batches, dtypes = list(batches), list(dtypes)
    session = InferenceSession(devices=[device])
    sets = [TreeStepGraphs(session, device, shape, tree, chain) for tree in trees]
    console.print("compiling the tree step graphs ...")
    started = time.perf_counter()
    for graphs in sets:
        graphs.compile_all(variants, dtypes, chained=not on_gpu)
    console.print(f"compiled in {time.perf_counter() - started:.0f} s")
    largest = max(shape.state_bytes(max(batches), d) for d in dtypes)
    copy_tb_s = (device_copy_tb_s(device, max(FLOOR_COPY_BYTES, largest), repeats) if on_gpu
                 else numpy_copy_tb_s(largest, repeats))
    console.print(f"copy bandwidth, the floor's: {copy_tb_s:.3f} TB/s (read + write)")
    rows: list[TreeRow] = []
    for graphs in sets:
        tree = graphs.tree
        for state_dtype, batch in sweep(dtypes, batches, console, f"tree {tree.nodes}x{tree.depth}"):
            timers: dict[str, Callable[[], float]] = {}
            operands: dict[str, list[Buffer]] = {}
            where = f"{tree.nodes}x{tree.depth} {state_dtype.name} batch {batch}"
            for v in variants:
                try:
                    operands[v] = graphs.operands(v, batch, state_dtype)
                except Exception as error:  # noqa: BLE001 - the separate paths' pools may not fit; time the rest
                    _untimed(console, f"{v} at {where}", error)
                    timers[v] = lambda: float("nan")
                    continue
                timers[v] = partial(_timed, console, f"{v} at {where}",
                                    partial(graphs.per_link_seconds, v, state_dtype, operands[v], repeats, on_gpu))
            measured = measure_rounds(variants, rounds, timers)
            floor = 2 * shape.state_bytes(batch, state_dtype) / (copy_tb_s * 1e12)
            median = {v: measured.median(v) if v in variants else float("nan") for v in TREE_VARIANTS}
            for variant in variants:
                seconds = median[variant]
                on_tree = variant in TREE_VERIFIES
                rows.append(TreeRow(
                    variant=variant,
                    state_dtype=state_dtype.name,
                    nodes=tree.nodes,
                    depth=tree.depth,
                    batch=batch,
                    requests=batch * (len(tree.path_lengths) if variant == "paths" else 1),
                    step_us=seconds * 1e6,
                    rounds=rounds,
                    floor_us=floor * 1e6,
                    over_floor=ratio(seconds, floor),
                    tree_over_chain=ratio(seconds, median["chain"]) if on_tree else float("nan"),
                    tree_over_chain_latency=ratio(seconds, median["chain-latency"]) if on_tree else float("nan"),
                    paths_over_tree=ratio(median["paths"], seconds) if variant in PATHS_COMPARED else float("nan"),
                ))
            del operands, timers
    return rows


def render_tree_rows(rows: Sequence[TreeRow], console: Console) -> None:
    """Prints the rows as one table."""
    columns: list[tuple[str, Callable[[TreeRow], str]]] = [
        ("variant", lambda r: r.variant),
        ("dtype", lambda r: r.state_dtype),
        ("tree", lambda r: f"{r.nodes}x{r.depth}"),
        ("batch", lambda r: str(r.batch)),
        ("requests", lambda r: str(r.requests)),
        ("step µs", lambda r: f"{r.step_us:.1f}"),
        ("floor µs", lambda r: f"{r.floor_us:.1f}"),
        ("over floor", lambda r: times(r.over_floor)),
        ("tree / chain", lambda r: times(r.tree_over_chain)),
        ("tree / chain on latency", lambda r: times(r.tree_over_chain_latency)),
        ("paths / this", lambda r: times(r.paths_over_tree)),
    ]
    render_rows("one decoding step over token trees (all layers, fold on load), medians", columns, rows, console)
