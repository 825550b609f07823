"""The eager fold: numpy (or MAX ``Buffer``) in, a compiled, cached graph underneath.

Everything is validated on the host before the first byte is written (``eager.base``),
so a bad call raises ``ValueError`` (or ``TypeError`` for a wrong kind of object) and
leaves the pool and the ring untouched.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from max.driver import Device
from max.dtype import DType
from max.engine import Model
from max.graph import BufferType, DeviceRef, Graph, TensorType
from max.graph import Module as GraphModule

from ..layout import Gate, check_gate
from ..ops.fold import check_table_shapes, fold_parameters, fold_tiling, state_fold
from ..ops.kernels import kernels_path
from ..trees import check_path_nodes
from .base import (
    ArrayOrBuffer,
    CompiledGraphs,
    DeviceLike,
    Operand,
    PerDevice,
    check_ids,
    describe,
    host_table,
    state_dtype_named,
)


@dataclass(frozen=True)
class FoldCall:
    """A fold call whose operands all passed validation."""

    state: Operand
    ring: Operand
    row_ids: np.ndarray
    ring_row_ids: np.ndarray
    num_accepted: np.ndarray
    parameters: dict[str, int]
    gate: Gate = "head"
    #: The accepted paths, ``[batch, RING_LEN]`` uint32, or None for the chain's fold.
    accepted_nodes: np.ndarray | None = None


def validate_fold(
    recurrent_state: Any,
    ring: Any,
    row_ids: Any,
    ring_row_ids: Any,
    num_accepted: Any,
    device: Device,
    key_dim_tile: int | None = None,
    rows_per_thread: int | None = None,
    gate: Gate = "head",
    accepted_nodes: Any = None,
) -> FoldCall:
    """Checks every operand of a fold on the host; raises before anything is written."""
    check_gate(gate)
    state = describe("recurrent_state", recurrent_state, device, writable=True)
    ring_op = describe("ring", ring, device, writable=False)
    parameters = fold_parameters(list(state.shape), state.dtype, list(ring_op.shape), ring_op.dtype, key_dim_tile,
                                 rows_per_thread, gate)
    rows, ring_rows = state.shape[0], ring_op.shape[0]
    ids = host_table("row_ids", row_ids)
    ring_ids = host_table("ring_row_ids", ring_row_ids)
    accepted = host_table("num_accepted", num_accepted)
    check_table_shapes(list(ids.shape), list(ring_ids.shape), list(accepted.shape))
    check_ids("row_ids", ids, rows)
    check_ids("ring_row_ids", ring_ids, ring_rows)
    nodes = None if accepted_nodes is None else path_table(accepted_nodes, accepted, parameters["RING_LEN"])
    return FoldCall(state, ring_op, ids, ring_ids, accepted, parameters, gate, nodes)


def path_table(accepted_nodes: Any, num_accepted: np.ndarray, ring_len: int) -> np.ndarray:
    """``accepted_nodes`` as the uint32 table the op reads, refused unless it is an
    integer ``[batch, RING_LEN]`` table whose paths that fold (1 to RING_LEN nodes) name
    nodes 0 to RING_LEN - 1 in increasing order (``trees.check_path_nodes``). Entries
    past a path are not read, so any integer may pad them (SGLang pads with -1)."""
    nodes = np.asarray(accepted_nodes)
    check_path_nodes(nodes, num_accepted, ring_len)
    return np.ascontiguousarray(nodes.astype(np.uint32))


class StateFolder(CompiledGraphs):
    """Compiles the fold graph once per (state dtype, K, V, RING_LEN) on one device.

    Pool rows, heads, record stride, layers and batch are symbolic in the graph, so one
    compiled model serves every pool and batch of those static dims.

    Args:
        device: ``None``/``"cpu"`` for the host, ``"gpu"`` or a ``max.driver.Device``.
        key_dim_tile: GPU only: key rows a block keeps in registers (divides K).
        rows_per_thread: GPU only: key rows each thread keeps (divides the tile).

    Example:
        >>> folder = StateFolder()          # the CPU
        >>> folder.device.label
        'cpu'
    """

    def __init__(self, device: DeviceLike = None, *, key_dim_tile: int | None = None,
                 rows_per_thread: int | None = None) -> None:
        super().__init__(device)
        self.key_dim_tile = key_dim_tile
        self.rows_per_thread = rows_per_thread

    def model(self, state_dtype: DType, parameters: dict[str, int], gate: Gate = "head", path: bool = False) -> Model:
        """The compiled fold for these static dims, compiled on first use; ``path``: the
        fold along accepted paths (an ``accepted_nodes`` input after ``num_accepted``)."""
        key = (state_dtype, gate, path, *sorted(parameters.items()))
        return self.compiled(key, lambda module: self._build(state_dtype, parameters, gate, path, module))

    def precompile(self, state_dtypes: Iterable[DType | str], *, key_dim: int, value_dim: int, ring_len: int,
                   gates: Iterable[Gate] = ("head",), paths: Iterable[bool] = (False,)) -> None:
        """Compiles the fold of every state dtype, gate and kind (``paths``: False for
        the chain's fold, True for the fold along accepted paths) for these static dims
        together, in one module (:meth:`compile_together`), so that folds after it
        compile nothing.

        Raises:
            ValueError: dims or a tiling the fold refuses (as a call would).
        """
        builds = {}
        for dtype in state_dtypes:
            state_dtype = state_dtype_named("state_dtypes", dtype)
            for gate in gates:
                check_gate(gate)
                parameters = {"K": key_dim, "V": value_dim, "RING_LEN": ring_len} | fold_tiling(
                    key_dim, value_dim, state_dtype, self.key_dim_tile, self.rows_per_thread, ring_len=ring_len,
                    gate=gate)
                for path in paths:
                    key = (state_dtype, gate, path, *sorted(parameters.items()))
                    builds[key] = partial(self._build, state_dtype, parameters, gate, path)
        self.compile_together(builds)

    def _build(self, state_dtype: DType, parameters: dict[str, int], gate: Gate, path: bool = False,
               module: GraphModule | None = None) -> Graph:
        where = DeviceRef.from_device(self.device)
        k, v, ring_len = parameters["K"], parameters["V"], parameters["RING_LEN"]
        inputs = [
            BufferType(state_dtype, ["rows", "nv", k, v], where),
            BufferType(DType.float32, ["ring_rows", "nk", ring_len, "stride"], where),
            TensorType(DType.uint32, ["layers", "batch"], where),
            TensorType(DType.uint32, ["layers", "batch"], where),
            TensorType(DType.uint32, ["batch"], where),
        ]
        if path:
            inputs.append(TensorType(DType.uint32, ["batch", ring_len], where))
        name = f"gdfold_fold{'_path' if path else ''}_{gate}_{state_dtype.name}_k{k}_v{v}_r{ring_len}"
        with Graph(name, input_types=inputs, custom_extensions=[kernels_path()], module=module) as graph:
            state, ring, row_ids, ring_row_ids, accepted, *nodes = graph.inputs
            state_fold(
                state.buffer,
                ring.buffer,
                row_ids.tensor,
                ring_row_ids.tensor,
                accepted.tensor,
                key_dim_tile=parameters.get("KEY_DIM_TILE"),
                rows_per_thread=parameters.get("ROWS_PER_THREAD"),
                gate=gate,
                accepted_nodes=nodes[0].tensor if nodes else None,
            )
            graph.output()
        return graph

    def fold(
        self,
        recurrent_state: ArrayOrBuffer,
        ring: ArrayOrBuffer,
        row_ids: Any,
        ring_row_ids: Any,
        num_accepted: Any,
        *,
        gate: Gate = "head",
        accepted_nodes: Any = None,
    ) -> ArrayOrBuffer:
        """Folds ``recurrent_state`` in place and returns it.

        Args:
            recurrent_state: ``[rows, nv, K, V]`` numpy float32 / ``ml_dtypes.bfloat16``
                array (C-contiguous, writable), or a MAX Buffer on this folder's device.
            ring: ``[ring_rows, nk, RING_LEN, stride]`` float32 array or Buffer.
            row_ids, ring_row_ids: ``[num_layers, batch]`` integer tables.
            num_accepted: ``[batch]`` integer counts.
            gate: ``"head"``, or ``"channel"`` for per-channel records.
            accepted_nodes: optional ``[batch, RING_LEN]`` integer table: request ``b``
                folds records ``accepted_nodes[b, :num_accepted[b]]`` in that order (an
                accepted path of a token tree, ``gdfold_max.trees``), each path checked
                to name nodes 0 to RING_LEN - 1 in increasing order.

        Raises:
            TypeError, ValueError: naming the bad argument; nothing is written.
        """
        call = validate_fold(recurrent_state, ring, row_ids, ring_row_ids, num_accepted, self.device,
                             self.key_dim_tile, self.rows_per_thread, gate, accepted_nodes)
        if call.row_ids.size == 0:
            return recurrent_state
        path = call.accepted_nodes is not None
        model = self.model(call.state.dtype, call.parameters, call.gate, path)
        tables = [call.row_ids, call.ring_row_ids, call.num_accepted]
        if call.accepted_nodes is not None:
            tables.append(call.accepted_nodes)
        self.execute(model, [call.state, call.ring], tables, written=[call.state])
        return recurrent_state


_folders = PerDevice(StateFolder)


def folder_for(device: DeviceLike = None) -> StateFolder:
    """The process-wide cached :class:`StateFolder` of a device."""
    return _folders(device)


def fold(
    recurrent_state: ArrayOrBuffer,
    ring: ArrayOrBuffer,
    row_ids: Any,
    ring_row_ids: Any,
    num_accepted: Any,
    *,
    device: DeviceLike = None,
    gate: Gate = "head",
    accepted_nodes: Any = None,
) -> ArrayOrBuffer:
    """Folds the accepted ring records into ``recurrent_state`` in place and returns it.

    The eager twin of :func:`gdfold_max.state_fold`, over a cached :class:`StateFolder`
    (the first call per static shape compiles, in about 20 s). ``device`` is ``None``
    (the CPU), ``"cpu"``, ``"gpu"`` or a ``max.driver.Device``; numpy arrays are copied
    to and from an accelerator. With ``accepted_nodes`` ``[batch, RING_LEN]`` it folds each
    request's accepted path of a token tree (:meth:`StateFolder.fold`).

    Raises:
        TypeError, ValueError: naming the bad argument; the pool and ring are untouched.

    Example:
        >>> import numpy as np, gdfold_max
        >>> state = np.ones((2, 2, 8, 8), np.float32)
        >>> ring = np.zeros((1, 1, 2, 32), np.float32)
        >>> ring[0, 0, 0, :8] = 1.0                 # key
        >>> ring[0, 0, 0, 8:16] = 0.5               # delta row of value head 0
        >>> ring[0, 0, 0, 16:24] = 0.25             # delta row of value head 1
        >>> ring[0, 0, 0, 24:26] = [0.5, 1.0]       # decays
        >>> out = gdfold_max.fold(state, ring, [[1]], [[0]], [1])
        >>> float(state[1, 0, 0, 0]), float(state[1, 1, 0, 0]), float(state[0, 0, 0, 0])
        (1.0, 1.25, 1.0)
    """
    return folder_for(device).fold(recurrent_state, ring, row_ids, ring_row_ids, num_accepted, gate=gate,
                                   accepted_nodes=accepted_nodes)
