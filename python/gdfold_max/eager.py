"""Eager entry points: numpy (or MAX ``Buffer``) in, a compiled, cached graph underneath.

Everything is validated on the host before the first byte is written, so a bad call
raises ``ValueError`` (or ``TypeError`` for a wrong kind of object) and leaves the pool
and the ring untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

import ml_dtypes
import numpy as np
from max.driver import CPU, Accelerator, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, DeviceRef, Graph, TensorType

from .graph import check_table_shapes, fold_parameters, kernels_path, state_fold

ArrayOrBuffer: TypeAlias = np.ndarray | Buffer
Cached = TypeVar("Cached")
DeviceLike: TypeAlias = Device | str | None

_NUMPY_STATE_DTYPES = {np.dtype(np.float32): DType.float32, np.dtype(ml_dtypes.bfloat16): DType.bfloat16}


def resolve_device(device: DeviceLike) -> Device:
    """``None`` or ``"cpu"`` is the host; ``"gpu"`` the first accelerator; a Device is kept."""
    if device is None or device == "cpu":
        return CPU()
    if device == "gpu":
        return Accelerator()
    if isinstance(device, Device):
        return device
    raise ValueError(f"device: {device!r} is not 'cpu', 'gpu' or a max.driver.Device")


def _same_device(a: Device, b: Device) -> bool:
    return a.label == b.label and a.id == b.id


@dataclass(frozen=True)
class _Operand:
    """A validated operand: its shape, MAX dtype, and where its bytes live."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    value: ArrayOrBuffer


def _describe(name: str, value: Any, device: Device, *, writable: bool) -> _Operand:
    if isinstance(value, Buffer):
        if not _same_device(value.device, device):
            raise ValueError(
                f"{name}: buffer lives on {value.device.label}:{value.device.id}, not on {device.label}:{device.id}"
            )
        return _Operand(name, tuple(int(d) for d in value.shape), value.dtype, value)
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array or a max.driver.Buffer, got {type(value).__name__}")
    if writable:
        if not value.flags.c_contiguous:
            raise ValueError(f"{name}: the pool must be C-contiguous to be folded in place")
        if not value.flags.writeable:
            raise ValueError(f"{name}: the pool is read-only")
    if value.dtype in _NUMPY_STATE_DTYPES:
        dtype = _NUMPY_STATE_DTYPES[value.dtype]
    else:
        try:
            dtype = DType.from_numpy(value.dtype)
        except Exception as error:  # noqa: BLE001 - any unmappable dtype is a caller error
            raise ValueError(f"{name}: dtype {value.dtype} is unsupported") from error
    return _Operand(name, value.shape, dtype, value)


def _host_table(name: str, value: Any) -> np.ndarray:
    """A row table as a host uint32 array, checked for dtype, sign and range."""
    if isinstance(value, Buffer):
        value = value.to(CPU()).to_numpy()
    table = np.asarray(value)
    if table.dtype.kind not in "iu":
        raise ValueError(f"{name}: dtype {table.dtype} is not an integer dtype")
    if table.size and table.dtype.kind == "i" and int(table.min()) < 0:
        flat = int(np.argmax(table.reshape(-1) < 0))
        raise ValueError(f"{name}: negative id {int(table.reshape(-1)[flat])} at flat index {flat}")
    if table.size and int(table.max()) > np.iinfo(np.uint32).max:
        raise ValueError(f"{name}: value {int(table.max())} does not fit in uint32")
    return table.astype(np.uint32)


def _check_ids(name: str, table: np.ndarray, limit: int) -> None:
    bad = np.flatnonzero(table.reshape(-1) >= limit)
    if bad.size:
        raise ValueError(
            f"{name}: id {int(table.reshape(-1)[bad[0]])} at flat index {int(bad[0])} is out of range"
            f" (must be < {limit})"
        )


@dataclass(frozen=True)
class FoldCall:
    """A fold call whose operands all passed validation."""

    state: _Operand
    ring: _Operand
    row_ids: np.ndarray
    ring_row_ids: np.ndarray
    num_accepted: np.ndarray
    parameters: dict[str, int]


def validate_fold(
    recurrent_state: Any,
    ring: Any,
    row_ids: Any,
    ring_row_ids: Any,
    num_accepted: Any,
    device: Device,
    key_dim_tile: int | None = None,
    rows_per_thread: int | None = None,
) -> FoldCall:
    """Checks every operand of a fold on the host; raises before anything is written."""
    state = _describe("recurrent_state", recurrent_state, device, writable=True)
    ring_op = _describe("ring", ring, device, writable=False)
    parameters = fold_parameters(list(state.shape), state.dtype, list(ring_op.shape), ring_op.dtype, key_dim_tile,
                                 rows_per_thread)
    rows, ring_rows = state.shape[0], ring_op.shape[0]
    ids = _host_table("row_ids", row_ids)
    ring_ids = _host_table("ring_row_ids", ring_row_ids)
    accepted = _host_table("num_accepted", num_accepted)
    check_table_shapes(list(ids.shape), list(ring_ids.shape), list(accepted.shape))
    _check_ids("row_ids", ids, rows)
    _check_ids("ring_row_ids", ring_ids, ring_rows)
    return FoldCall(state, ring_op, ids, ring_ids, accepted, parameters)


class CompiledGraphs:
    """An inference session on one device and the graphs it has compiled, each once."""

    def __init__(self, device: DeviceLike = None) -> None:
        self.device = resolve_device(device)
        self._session = InferenceSession(devices=[self.device])
        self._models: dict[tuple[object, ...], Model] = {}
        self._lock = threading.Lock()

    def compiled(self, key: tuple[object, ...], build: Callable[[], Graph]) -> Model:
        """The model compiled from ``build()`` under ``key``, compiling it on first use."""
        with self._lock:
            if key not in self._models:
                self._models[key] = self._session.load(build())
            return self._models[key]


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

    def model(self, state_dtype: DType, parameters: dict[str, int]) -> Model:
        """The compiled fold for these static dims, compiled on first use."""
        key = (state_dtype, *sorted(parameters.items()))
        return self.compiled(key, lambda: self._build(state_dtype, parameters))

    def _build(self, state_dtype: DType, parameters: dict[str, int]) -> Graph:
        where = DeviceRef.from_device(self.device)
        k, v, ring_len = parameters["K"], parameters["V"], parameters["RING_LEN"]
        inputs = [
            BufferType(state_dtype, ["rows", "nv", k, v], where),
            BufferType(DType.float32, ["ring_rows", "nk", ring_len, "stride"], where),
            TensorType(DType.uint32, ["layers", "batch"], where),
            TensorType(DType.uint32, ["layers", "batch"], where),
            TensorType(DType.uint32, ["batch"], where),
        ]
        name = f"gdfold_fold_{state_dtype.name}_k{k}_v{v}_r{ring_len}"
        with Graph(name, input_types=inputs, custom_extensions=[kernels_path()]) as graph:
            state, ring, row_ids, ring_row_ids, accepted = graph.inputs
            state_fold(
                state.buffer,
                ring.buffer,
                row_ids.tensor,
                ring_row_ids.tensor,
                accepted.tensor,
                key_dim_tile=parameters["KEY_DIM_TILE"],
                rows_per_thread=parameters["ROWS_PER_THREAD"],
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
    ) -> ArrayOrBuffer:
        """Folds ``recurrent_state`` in place and returns it.

        Args:
            recurrent_state: ``[rows, nv, K, V]`` numpy float32 / ``ml_dtypes.bfloat16``
                array (C-contiguous, writable), or a MAX Buffer on this folder's device.
            ring: ``[ring_rows, nk, RING_LEN, stride]`` float32 array or Buffer.
            row_ids, ring_row_ids: ``[num_layers, batch]`` integer tables.
            num_accepted: ``[batch]`` integer counts.

        Raises:
            TypeError, ValueError: naming the bad argument; nothing is written.
        """
        call = validate_fold(recurrent_state, ring, row_ids, ring_row_ids, num_accepted, self.device,
                             self.key_dim_tile, self.rows_per_thread)
        if call.row_ids.size == 0:
            return recurrent_state
        model = self.model(call.state.dtype, call.parameters)
        state_buffer = to_device(call.state.value, self.device)
        tables = [
            Buffer.from_numpy(np.ascontiguousarray(t)).to(self.device)
            for t in (call.row_ids, call.ring_row_ids, call.num_accepted)
        ]
        model.execute(state_buffer, to_device(call.ring.value, self.device), *tables)
        if isinstance(recurrent_state, np.ndarray) and state_buffer.device.label != "cpu":
            _copy_back(state_buffer, recurrent_state)
        return recurrent_state


def to_device(value: ArrayOrBuffer, device: Device) -> Buffer:
    """A Buffer as it is, or a numpy array as a Buffer on ``device`` (shared on the host)."""
    if isinstance(value, Buffer):
        return value
    return _host_buffer(value).to(device)


def _host_buffer(array: np.ndarray) -> Buffer:
    """A host Buffer sharing ``array``'s memory (bf16 travels as its uint16 bits)."""
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        return Buffer.from_numpy(array.view(np.uint16)).view(DType.bfloat16)
    return Buffer.from_numpy(np.ascontiguousarray(array))


def _copy_back(buffer: Buffer, array: np.ndarray) -> None:
    host = buffer.to(CPU())
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        np.copyto(array.view(np.uint16), host.view(DType.uint16).to_numpy())
    else:
        np.copyto(array, host.to_numpy())


class PerDevice(Generic[Cached]):
    """One object per device for the whole process, made on first use."""

    def __init__(self, make: Callable[[Device], Cached]) -> None:
        self._make = make
        self._made: dict[tuple[str, int], Cached] = {}
        self._lock = threading.Lock()

    def __call__(self, device: DeviceLike = None) -> Cached:
        resolved = resolve_device(device)
        key = (resolved.label, resolved.id)
        with self._lock:
            if key not in self._made:
                self._made[key] = self._make(resolved)
            return self._made[key]


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
) -> ArrayOrBuffer:
    """Folds the accepted ring records into ``recurrent_state`` in place and returns it.

    The eager twin of :func:`gdfold_max.state_fold`, over a cached :class:`StateFolder`
    (the first call per static shape compiles, in about 20 s). ``device`` is ``None``
    (the CPU), ``"cpu"``, ``"gpu"`` or a ``max.driver.Device``; numpy arrays are copied
    to and from an accelerator.

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
    return folder_for(device).fold(recurrent_state, ring, row_ids, ring_row_ids, num_accepted)
