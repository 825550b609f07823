"""What the eager fold (``eager.fold``) and the eager verify and forward (``eager.window``)
share: device resolution, host-side operand checks, the compiled-graph cache, and the
upload / execute / copy-back sequence.

Every check here runs on the host before the first byte is written, so a bad call raises
``ValueError`` (or ``TypeError`` for a wrong kind of object) and leaves every operand
untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

import ml_dtypes
import numpy as np
from max.driver import CPU, Accelerator, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import Graph
from max.graph import Module as GraphModule

from ..ops.kernels import kernels_path

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
class Operand:
    """A validated operand: its shape, MAX dtype, and where its bytes live."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    value: ArrayOrBuffer


def describe(name: str, value: Any, device: Device, *, writable: bool) -> Operand:
    """Checks that ``value`` is a numpy array or a Buffer on ``device`` (and, if it is to be
    written, a C-contiguous writable array), and returns its shape and MAX dtype."""
    if isinstance(value, Buffer):
        if not _same_device(value.device, device):
            raise ValueError(
                f"{name}: buffer lives on {value.device.label}:{value.device.id}, not on {device.label}:{device.id}"
            )
        return Operand(name, tuple(int(d) for d in value.shape), value.dtype, value)
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array or a max.driver.Buffer, got {type(value).__name__}")
    if writable:
        if not value.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous to be written in place")
        if not value.flags.writeable:
            raise ValueError(f"{name}: the array is read-only")
    if value.dtype in _NUMPY_STATE_DTYPES:
        dtype = _NUMPY_STATE_DTYPES[value.dtype]
    else:
        try:
            dtype = DType.from_numpy(value.dtype)
        except Exception as error:  # noqa: BLE001 - any unmappable dtype is a caller error
            raise ValueError(f"{name}: dtype {value.dtype} is unsupported") from error
    return Operand(name, value.shape, dtype, value)


def host_array(value: Any) -> np.ndarray:
    """A table given as a Buffer (on any device) or as anything numpy takes, on the host."""
    return value.to(CPU()).to_numpy() if isinstance(value, Buffer) else np.asarray(value)


def host_table(name: str, value: Any) -> np.ndarray:
    """A row table as a host uint32 array, checked for dtype, sign and range."""
    table = host_array(value)
    if table.dtype.kind not in "iu":
        raise ValueError(f"{name}: dtype {table.dtype} is not an integer dtype")
    if table.size and table.dtype.kind == "i" and int(table.min()) < 0:
        flat = int(np.argmax(table.reshape(-1) < 0))
        raise ValueError(f"{name}: negative id {int(table.reshape(-1)[flat])} at flat index {flat}")
    if table.size and int(table.max()) > np.iinfo(np.uint32).max:
        raise ValueError(f"{name}: value {int(table.max())} does not fit in uint32")
    return table.astype(np.uint32)


def check_ids(name: str, table: np.ndarray, limit: int) -> None:
    """Raises unless every id in ``table`` is below ``limit``, naming the first that is not."""
    bad = np.flatnonzero(table.reshape(-1) >= limit)
    if bad.size:
        raise ValueError(
            f"{name}: id {int(table.reshape(-1)[bad[0]])} at flat index {int(bad[0])} is out of range"
            f" (must be < {limit})"
        )


def to_device(value: ArrayOrBuffer, device: Device) -> Buffer:
    """A Buffer as it is, or a numpy array as a Buffer on ``device`` (shared on the host)."""
    if isinstance(value, Buffer):
        return value
    return host_buffer(value).to(device)


def host_buffer(array: np.ndarray) -> Buffer:
    """A host Buffer sharing ``array``'s memory where it is C-contiguous (bf16 travels as
    its uint16 bits: DLPack has no bf16)."""
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        return Buffer.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(DType.bfloat16)
    return Buffer.from_numpy(np.ascontiguousarray(array))


def copy_back(buffer: Buffer, array: np.ndarray) -> None:
    """Copies a device Buffer's contents into the numpy array it was uploaded from.

    A bf16 buffer is viewed as its uint16 bits where it lives, before the copy, so that the
    host reads the buffer the copy returned, whose reads MAX orders after the copy, never a
    view of it: in a bf16 MAX layer test on an H100 a pool read through a view of its host
    copy came back as it was before the step
    (bench/results/plain-step-bf16-probe-h100-2026-12-06.txt)."""
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        np.copyto(array.view(np.uint16), buffer.view(DType.uint16).to(CPU()).to_numpy())
    else:
        np.copyto(array, buffer.to(CPU()).to_numpy())


def state_dtype_named(name: str, value: DType | str) -> DType:
    """A pool dtype given as a ``DType`` or by name (``"float32"``, ``"bfloat16"``).

    Raises:
        ValueError: naming ``name`` and the value, for any other dtype.
    """
    dtype = value if isinstance(value, DType) else {"float32": DType.float32, "bfloat16": DType.bfloat16}.get(value)
    if dtype not in (DType.float32, DType.bfloat16):
        raise ValueError(f"{name}: state dtype {value!r} is unsupported (float32 or bfloat16)")
    return dtype


class CompiledGraphs:
    """An inference session on one device and the graphs it has compiled, each once."""

    def __init__(self, device: DeviceLike = None) -> None:
        self.device = resolve_device(device)
        self._session = InferenceSession(devices=[self.device])
        self._models: dict[tuple[object, ...], Model] = {}
        self._lock = threading.Lock()

    def compiled(self, key: tuple[object, ...], build: Callable[[GraphModule | None], Graph]) -> Model:
        """The model compiled from ``build(None)`` under ``key``, compiling it on first use."""
        with self._lock:
            if key not in self._models:
                self._models[key] = self._session.load(build(None))
            return self._models[key]

    @property
    def compiled_keys(self) -> frozenset[tuple[object, ...]]:
        """The keys of the graphs compiled so far."""
        with self._lock:
            return frozenset(self._models)

    def compile_together(self, builds: Mapping[tuple[object, ...], Callable[[GraphModule | None], Graph]]) -> None:
        """Compiles, in one ``max.graph.Module`` and one ``load_all``, every graph of
        ``builds`` (a key and how to build its graph into a module) not compiled yet.
        Kernels the graphs share compile once: eight window graphs took 76 s together
        where one at a time took 216 s (2 CPU cores, fresh compile caches)."""
        with self._lock:
            missing = {key: build for key, build in builds.items() if key not in self._models}
            if not missing:
                return
            module = GraphModule()
            names = {key: build(module).name for key, build in missing.items()}
            models = self._session.load_all(module, custom_extensions=[kernels_path()])
            for key, name in names.items():
                self._models[key] = models[name]

    def execute(self, model: Model, operands: Sequence[Operand], tables: Sequence[np.ndarray],
                written: Sequence[Operand]) -> list[Buffer]:
        """Runs ``model`` on the operands (then the host tables) on this device, and copies
        each ``written`` operand that is a numpy array back from an accelerator. On the
        host, a C-contiguous numpy operand is shared, so it is written in place."""
        buffers = {op.name: to_device(op.value, self.device) for op in operands}
        uploaded = [Buffer.from_numpy(np.ascontiguousarray(t)).to(self.device) for t in tables]
        results = model.execute(*buffers.values(), *uploaded)
        if self.device.label != "cpu":
            for op in written:
                if isinstance(op.value, np.ndarray):
                    copy_back(buffers[op.name], op.value)
        return [r for r in results if isinstance(r, Buffer)]


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
