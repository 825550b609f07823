"""Eager verify (of a chain or of a token tree) and forward: numpy (or MAX
``Buffer``) in, cached compiled graphs underneath.

Every operand is validated on the host before the first byte is written, so a bad call
raises ``ValueError`` (or ``TypeError``) and leaves the pool and the ring untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from max.driver import CPU
from max.dtype import DType
from max.engine import Model
from max.graph import BufferType, DeviceRef, Graph, TensorType
from max.graph import Module as GraphModule

from ..layout import Gate, check_gate
from ..ops.checks import pool_dims, ring_parameters
from ..ops.kernels import kernels_path
from ..ops.window import (
    GPU_PATHS,
    WindowTiling,
    check_leaf_warps,
    check_qkv_width,
    recurrence,
    verify_ring,
    verify_tree,
)
from ..trees import check_parents, previous_path_given
from .base import (
    ArrayOrBuffer,
    CompiledGraphs,
    DeviceLike,
    Operand,
    PerDevice,
    check_ids,
    describe,
    host_array,
    host_table,
    state_dtype_named,
)
from .fold import path_table

_TOKEN_INPUTS = ("qkv", "decay", "beta")
#: The graphs a window runner compiles: the verify, with fold on load, the forward, and
#: the tree verify with and without fold on load.
WINDOW_KINDS = ("verify", "fold_on_load", "forward", "tree", "tree_fold_on_load")


def _check_lengths(tables: dict[str, np.ndarray], batch: int) -> None:
    for name, table in tables.items():
        if table.ndim != 1:
            raise ValueError(f"{name}: expected rank 1, got shape {list(table.shape)}")
        expected = batch + 1 if name == "input_row_offsets" else batch
        if table.shape[0] != expected:
            what = "batch + 1" if name == "input_row_offsets" else "the batch of row_ids"
            raise ValueError(f"{name}: length {table.shape[0]} differs from {what} ({expected})")


def check_offsets(offsets: np.ndarray, num_tokens: int) -> None:
    """Raises unless the offsets start at 0, never decrease and end at the token count."""
    if int(offsets[0]) != 0:
        raise ValueError(f"input_row_offsets: must start at 0, got {int(offsets[0])}")
    steps = np.diff(offsets.astype(np.int64))
    if np.any(steps < 0):
        at = int(np.argmax(steps < 0)) + 1
        raise ValueError(
            f"input_row_offsets: decreases at index {at} ({int(offsets[at - 1])} then {int(offsets[at])})"
        )
    if int(offsets[-1]) != num_tokens:
        raise ValueError(f"input_row_offsets: ends at {int(offsets[-1])}, but qkv has {num_tokens} tokens")


def check_no_ring_overlap(
    ring_row_ids: np.ndarray,
    offsets: np.ndarray,
    previous_ring_row_ids: np.ndarray,
    previous_num_accepted: np.ndarray,
    ring_len: int,
) -> None:
    """Raises if a ring row that receives new records is also one the fold reads."""
    windows = np.diff(offsets.astype(np.int64))
    writers = np.flatnonzero((windows > 0) & (windows <= ring_len))
    readers = np.flatnonzero((previous_num_accepted > 0) & (previous_num_accepted <= ring_len))
    read_rows = {int(previous_ring_row_ids[r]): int(r) for r in readers[::-1]}
    for writer in writers:
        row = int(ring_row_ids[writer])
        if row in read_rows:
            raise ValueError(
                f"ring_row_ids: request {int(writer)} records into ring row {row}, which request"
                f" {read_rows[row]} folds from (previous_ring_row_ids); alternate between two ring rows per request"
            )


@dataclass(frozen=True)
class WindowCall:
    """A verify or forward call whose operands all passed validation."""

    tokens: tuple[Operand, Operand, Operand]
    state: Operand
    ring: Operand | None
    tables: dict[str, np.ndarray]
    parameters: dict[str, int]


def _token_operands(qkv: Any, decay: Any, beta: Any, device: Any, num_value_heads: int, key_dim: int
                    ) -> tuple[tuple[Operand, ...], Gate]:
    """The token operands, checked, and the gate the decay's shape names (``[T, nv]``:
    one decay per head; ``[T, nv, K]``: per-channel gates)."""
    operands = tuple(
        describe(name, value, device, writable=False)
        for name, value in zip(_TOKEN_INPUTS, (qkv, decay, beta), strict=True)
    )
    for operand in operands:
        if operand.dtype != DType.float32:
            raise ValueError(f"{operand.name}: dtype {operand.dtype.name} is unsupported (float32)")
        if len(operand.shape) != 2 and not (operand.name == "decay" and len(operand.shape) == 3):
            expected = "rank 2 [T, nv] or rank 3 [T, nv, K]" if operand.name == "decay" else "rank 2"
            raise ValueError(f"{operand.name}: expected {expected}, got shape {list(operand.shape)}")
    num_tokens = operands[0].shape[0]
    gate: Gate = "channel" if len(operands[1].shape) == 3 else "head"
    for operand in operands[1:]:
        expected_shape: tuple[int, ...] = (num_tokens, num_value_heads)
        if operand.name == "decay" and gate == "channel":
            expected_shape = (num_tokens, num_value_heads, key_dim)
        if operand.shape != expected_shape:
            raise ValueError(f"{operand.name}: expected {list(expected_shape)}, got {list(operand.shape)}")
    return operands, gate


def validate_window(
    qkv: Any,
    decay: Any,
    beta: Any,
    recurrent_state: Any,
    ring: Any,
    tables: dict[str, Any],
    device: Any,
) -> WindowCall:
    """Checks every operand of a verify (``ring`` given) or a forward on the host."""
    state = describe("recurrent_state", recurrent_state, device, writable=True)
    key_dim, value_dim = pool_dims(state.shape, state.dtype)
    rows, nv = state.shape[:2]
    ring_op = None
    num_key_heads = None
    tokens, gate = _token_operands(qkv, decay, beta, device, nv, key_dim)
    parameters = {"K": key_dim, "V": value_dim, "RING_LEN": 1}
    if ring is not None:
        ring_op = describe("ring", ring, device, writable=True)
        parameters = ring_parameters(list(state.shape), state.dtype, list(ring_op.shape), ring_op.dtype, gate)
        num_key_heads = ring_op.shape[1]
    parameters["CHANNEL"] = int(gate == "channel")
    check_qkv_width(tokens[0].shape[1], nv, key_dim, value_dim, num_key_heads)
    host = {name: host_table(name, value) for name, value in tables.items()}
    batch = host["row_ids"].shape[0] if host["row_ids"].ndim == 1 else -1
    _check_lengths(host, batch)
    check_offsets(host["input_row_offsets"], tokens[0].shape[0])
    check_ids("row_ids", host["row_ids"], rows)
    if ring_op is not None:
        ring_rows, ring_len = ring_op.shape[0], ring_op.shape[2]
        check_ids("ring_row_ids", host["ring_row_ids"], ring_rows)
        if "previous_ring_row_ids" in host:
            check_ids("previous_ring_row_ids", host["previous_ring_row_ids"], ring_rows)
            check_no_ring_overlap(host["ring_row_ids"], host["input_row_offsets"], host["previous_ring_row_ids"],
                                  host["previous_num_accepted"], ring_len)
    return WindowCall((tokens[0], tokens[1], tokens[2]), state, ring_op, host, parameters)


class WindowRunner(CompiledGraphs):
    """Compiles the verify / fold-on-load verify / forward graphs once per static shape.

    Tokens, pool rows, heads, record stride and batch are symbolic in each graph, so one
    compiled model serves every batch of the same (state dtype, K, V, RING_LEN).

    Args:
        device: ``None``/``"cpu"`` for the host, ``"gpu"`` or a ``max.driver.Device``.
        column_tile: GPU only: value columns one block owns (4, 8, 16 or a multiple of 16
            that divides V).
        requests_per_block: GPU only: units of work per block, where a unit is one request
            on one column tile of one value head (not a whole request), as in
            :func:`gdfold_max.verify_ring`.
        gpu_path: GPU only: ``"auto"``, ``"latency"`` or ``"throughput"``, as in
            :func:`gdfold_max.verify_ring`.
        leaf_warps: GPU only, the tree verify's: 1 or 4, as in
            :func:`gdfold_max.verify_tree` (1 with ``gpu_path="throughput"``).

    Raises:
        ValueError: an unknown ``gpu_path``, a ``leaf_warps`` other than 1 or 4, or other
            than 1 with ``gpu_path="throughput"``.
    """

    def __init__(self, device: DeviceLike = None, *, column_tile: int | None = None,
                 requests_per_block: int | None = None, gpu_path: str = "auto", leaf_warps: int = 1) -> None:
        check_leaf_warps(leaf_warps, gpu_path)
        super().__init__(device)
        self.column_tile = column_tile
        self.requests_per_block = requests_per_block
        self.gpu_path = gpu_path
        self.leaf_warps = leaf_warps

    def model(self, kind: str, state_dtype: DType, parameters: dict[str, int]) -> Model:
        """The compiled graph of ``kind`` (verify, fold_on_load, forward, tree or
        tree_fold_on_load), built on first use."""
        return self.compiled(self._key(kind, state_dtype, parameters),
                             lambda module: self._build(kind, state_dtype, parameters, module))

    @staticmethod
    def _key(kind: str, state_dtype: DType, parameters: dict[str, int]) -> tuple[object, ...]:
        return (kind, state_dtype, parameters["K"], parameters["V"], parameters["RING_LEN"],
                parameters.get("CHANNEL", 0))

    def precompile(self, graphs: Iterable[tuple[str, DType | str]], *, key_dim: int, value_dim: int, ring_len: int,
                   gate: Gate = "head") -> None:
        """Compiles the graph of every ``(kind, state dtype)`` of ``graphs`` (kinds:
        ``"verify"``, ``"fold_on_load"``, ``"forward"``, ``"tree"``,
        ``"tree_fold_on_load"``) for these static dims together, in one module
        (:meth:`compile_together`), so that the calls after it compile nothing. Worth it
        before several kinds or dtypes are called: the kernels they share compile once.

        Raises:
            ValueError: an unknown kind, or dims the ops refuse (as a call would).
        """
        check_gate(gate)
        builds = {}
        for kind, dtype in graphs:
            if kind not in WINDOW_KINDS:
                raise ValueError(f"graphs: kind {kind!r} is not one of {', '.join(WINDOW_KINDS)}")
            state_dtype = state_dtype_named("graphs", dtype)
            parameters = {"K": key_dim, "V": value_dim, "RING_LEN": 1 if kind == "forward" else ring_len,
                          "CHANNEL": int(gate == "channel")}
            builds[self._key(kind, state_dtype, parameters)] = partial(self._build, kind, state_dtype, parameters)
        self.compile_together(builds)

    def _build(self, kind: str, state_dtype: DType, parameters: dict[str, int],
               module: GraphModule | None = None) -> Graph:
        where = DeviceRef.from_device(self.device)
        k, v, ring_len = parameters["K"], parameters["V"], parameters["RING_LEN"]
        tiling: WindowTiling = {"column_tile": self.column_tile, "requests_per_block": self.requests_per_block,
                                "gpu_path": self.gpu_path}
        f32, u32 = DType.float32, DType.uint32
        channel = bool(parameters.get("CHANNEL", 0))
        inputs = [
            TensorType(f32, ["tokens", "width"], where),
            TensorType(f32, ["tokens", "nv", k] if channel else ["tokens", "nv"], where),
            TensorType(f32, ["tokens", "nv"], where),
            BufferType(state_dtype, ["rows", "nv", k, v], where),
        ]
        if kind != "forward":
            inputs.append(BufferType(f32, ["ring_rows", "nk", ring_len, "stride"], where))
        tree = kind.startswith("tree")
        fold_on_load = kind.endswith("fold_on_load")
        tables = 2 if kind == "forward" else (5 if fold_on_load else 3)
        rows = [TensorType(u32, ["batch_plus_one" if i == (1 if kind == "forward" else 2) else "batch"], where)
                for i in range(tables)]
        if tree:
            # The tree's tables: parents after the offsets, the previous path's nodes last.
            rows.insert(3, TensorType(DType.int32, ["batch", ring_len], where))
            if fold_on_load:
                rows.append(TensorType(u32, ["batch", ring_len], where))
        inputs += rows
        name = f"gdfold_{kind}{'_channel' if channel else ''}_{state_dtype.name}_k{k}_v{v}_r{ring_len}"
        with Graph(name, input_types=inputs, custom_extensions=[kernels_path()], module=module) as graph:
            qkv, decay, beta = (x.tensor for x in graph.inputs[:3])
            state = graph.inputs[3].buffer
            if kind == "forward":
                rows, offsets = (x.tensor for x in graph.inputs[4:])
                out = recurrence(qkv, decay, beta, state, rows, offsets, **tiling)
            elif tree:
                ring = graph.inputs[4].buffer
                rest = [x.tensor for x in graph.inputs[5:]]
                previous = {}
                if fold_on_load:
                    previous = {"previous_ring_row_ids": rest[4], "previous_num_accepted": rest[5],
                                "previous_accepted_nodes": rest[6]}
                out = verify_tree(qkv, decay, beta, state, ring, *rest[:4], **previous, leaf_warps=self.leaf_warps,
                                  gpu_path=self.gpu_path, column_tile=self.column_tile)
            else:
                ring = graph.inputs[4].buffer
                rest = [x.tensor for x in graph.inputs[5:]]
                out = verify_ring(qkv, decay, beta, state, ring, rest[0], rest[1], rest[2],
                                  previous_ring_row_ids=rest[3] if fold_on_load else None,
                                  previous_num_accepted=rest[4] if fold_on_load else None, **tiling)
            graph.output(out)
        return graph

    def _run(self, kind: str, call: WindowCall, tables: list[np.ndarray] | None = None) -> np.ndarray:
        """Runs ``kind`` on a validated call, with its host tables in the graph's order
        (by default the call's own)."""
        tokens = call.tokens[0].shape[0]
        nv, value_dim = call.state.shape[1], call.state.shape[3]
        if not call.tables["row_ids"].size:
            return np.zeros((tokens, nv * value_dim), np.float32)
        model = self.model(kind, call.state.dtype, call.parameters)
        written = [call.state] + ([call.ring] if call.ring is not None else [])
        tables = list(call.tables.values()) if tables is None else tables
        (readout,) = self.execute(model, [*call.tokens, *written], tables, written)
        return np.asarray(readout.to(CPU()).to_numpy())

    def verify_ring(
        self,
        qkv: ArrayOrBuffer,
        decay: ArrayOrBuffer,
        beta: ArrayOrBuffer,
        recurrent_state: ArrayOrBuffer,
        ring: ArrayOrBuffer,
        row_ids: Any,
        ring_row_ids: Any,
        input_row_offsets: Any,
        *,
        previous_ring_row_ids: Any = None,
        previous_num_accepted: Any = None,
    ) -> np.ndarray:
        """The eager twin of :func:`gdfold_max.verify_ring`; returns the readout.

        The ring (and, with fold on load or a window past RING_LEN, the pool) is
        written in place.

        Raises:
            TypeError, ValueError: naming the bad argument; nothing is written.
        """
        if (previous_ring_row_ids is None) != (previous_num_accepted is None):
            raise ValueError("previous_ring_row_ids, previous_num_accepted: give both for fold on load, or neither")
        tables = {"row_ids": row_ids, "ring_row_ids": ring_row_ids, "input_row_offsets": input_row_offsets}
        kind = "verify"
        if previous_ring_row_ids is not None:
            tables |= {"previous_ring_row_ids": previous_ring_row_ids, "previous_num_accepted": previous_num_accepted}
            kind = "fold_on_load"
        call = validate_window(qkv, decay, beta, recurrent_state, ring, tables, self.device)
        return self._run(kind, call)

    def verify_tree(
        self,
        qkv: ArrayOrBuffer,
        decay: ArrayOrBuffer,
        beta: ArrayOrBuffer,
        recurrent_state: ArrayOrBuffer,
        ring: ArrayOrBuffer,
        row_ids: Any,
        ring_row_ids: Any,
        input_row_offsets: Any,
        parents: Any,
        *,
        previous_ring_row_ids: Any = None,
        previous_num_accepted: Any = None,
        previous_accepted_nodes: Any = None,
    ) -> np.ndarray:
        """The eager twin of :func:`gdfold_max.ops.window.verify_tree`: each request's
        window as a token tree (``parents`` ``[batch, RING_LEN]``), with fold on load of
        the previous step's accepted path when the three previous tables are given;
        returns every node's readout. The ring (and, with fold on load, the pool) is
        written in place. On a GPU it runs on the latency kernel with the runner's
        ``leaf_warps`` for ``gpu_path`` "auto" and "latency", and on the throughput
        kernel's blocks (at the runner's ``column_tile``) for "throughput"; the tables
        are checked
        here, on the host, before anything is written, on either device.

        Raises:
            TypeError, ValueError: naming the bad argument, nothing written: besides
                :meth:`verify_ring`'s checks, ``parents`` that do not
                describe trees of the windows or a window longer than RING_LEN
                (``trees.check_parents``), a previous path with a node past the ring or
                out of order (``trees.check_path_nodes``), only some of the three
                previous tables.
        """
        tables = {"row_ids": row_ids, "ring_row_ids": ring_row_ids, "input_row_offsets": input_row_offsets}
        kind = "tree"
        if previous_path_given(previous_ring_row_ids, previous_num_accepted, previous_accepted_nodes):
            tables |= {"previous_ring_row_ids": previous_ring_row_ids, "previous_num_accepted": previous_num_accepted}
            kind = "tree_fold_on_load"
        call = validate_window(qkv, decay, beta, recurrent_state, ring, tables, self.device)
        ring_len = call.parameters["RING_LEN"]
        host = call.tables
        parents = host_array(parents)
        check_parents(parents, np.diff(host["input_row_offsets"].astype(np.int64)).tolist(), ring_len)
        # Entries past a window are not read: any integer may pad them.
        ordered = [host["row_ids"], host["ring_row_ids"], host["input_row_offsets"],
                   np.ascontiguousarray(parents.astype(np.int32))]
        if kind == "tree_fold_on_load":
            try:
                nodes = path_table(host_array(previous_accepted_nodes), host["previous_num_accepted"], ring_len)
            except ValueError as error:
                # The fold's check names its own argument, accepted_nodes.
                raise ValueError(f"previous_{error}") from None
            ordered += [host["previous_ring_row_ids"], host["previous_num_accepted"], nodes]
        return self._run(kind, call, ordered)

    def recurrence(
        self,
        qkv: ArrayOrBuffer,
        decay: ArrayOrBuffer,
        beta: ArrayOrBuffer,
        recurrent_state: ArrayOrBuffer,
        row_ids: Any,
        input_row_offsets: Any,
    ) -> np.ndarray:
        """The eager twin of :func:`gdfold_max.recurrence`: commits the pool in place and
        returns the readout.

        Raises:
            TypeError, ValueError: naming the bad argument; nothing is written.
        """
        tables = {"row_ids": row_ids, "input_row_offsets": input_row_offsets}
        call = validate_window(qkv, decay, beta, recurrent_state, None, tables, self.device)
        return self._run("forward", call)


_runners = {path: PerDevice(functools.partial(WindowRunner, gpu_path=path)) for path in GPU_PATHS}


def runner_for(device: DeviceLike = None, gpu_path: str = "auto") -> WindowRunner:
    """The process-wide cached :class:`WindowRunner` of a device (and, on a GPU, of a
    kernel choice: ``"auto"``, ``"latency"`` or ``"throughput"``)."""
    if gpu_path not in _runners:
        raise ValueError(f"gpu_path: {gpu_path!r} must be one of {', '.join(map(repr, GPU_PATHS))}")
    return _runners[gpu_path](device)
