"""Build-time checks the graph-level ops share: static shapes, dtypes and the ring.

Each raises ``ValueError`` naming the argument, the bad value and what was expected,
before anything is added to the graph.
"""

from __future__ import annotations

from collections.abc import Sequence

from max.dtype import DType
from max.graph import Dim, StaticDim, TensorValue, ops

from ..layout import Gate, RecordLayout

#: Supported state dtypes, key/value dims and ring lengths.
STATE_DTYPES = (DType.float32, DType.bfloat16)
MAX_HEAD_DIM = 256
MAX_RING_LEN = 32

INTEGER_DTYPES = (
    DType.uint8,
    DType.uint16,
    DType.uint32,
    DType.uint64,
    DType.int8,
    DType.int16,
    DType.int32,
    DType.int64,
)


def static_size(dim: Dim | int) -> int | None:
    """A dimension's size where it is known when the graph is built, else None."""
    if isinstance(dim, int):
        return dim
    return int(dim) if isinstance(dim, StaticDim) else None


def check_head_dim(name: str, value: int) -> None:
    """Raises ``ValueError`` unless ``value`` is a multiple of 8 in 8..256."""
    if value % 8 != 0 or not 8 <= value <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: {value} is unsupported (a multiple of 8 up to {MAX_HEAD_DIM})")


#: Record strides are whole multiples of this many floats, so records load 16 bytes at a time.
RECORD_VECTOR = 4


def pool_dims(state_shape: Sequence[Dim | int], state_dtype: DType) -> tuple[int, int]:
    """Checks a pool's rank, dtype and static K, V, and returns (K, V).

    Raises:
        ValueError: naming ``recurrent_state``, the bad value and what was expected.
    """
    if len(state_shape) != 4:
        raise ValueError(f"recurrent_state: expected rank 4 [rows, nv, K, V], got rank {len(state_shape)}")
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"recurrent_state: dtype {state_dtype} is unsupported (float32 or bfloat16)")
    key_dim, value_dim = static_size(state_shape[2]), static_size(state_shape[3])
    if key_dim is None or value_dim is None:
        raise ValueError(f"recurrent_state: K and V must be static, got {state_shape[2]} and {state_shape[3]}")
    check_head_dim("recurrent_state: K", key_dim)
    check_head_dim("recurrent_state: V", value_dim)
    return key_dim, value_dim


def ring_parameters(
    state_shape: Sequence[Dim | int],
    state_dtype: DType,
    ring_shape: Sequence[Dim | int],
    ring_dtype: DType,
    gate: Gate = "head",
) -> dict[str, int]:
    """Checks a pool and a ring against each other and returns the static K, V, RING_LEN.
    ``gate="channel"``: the records hold K decays per value head (their stride must fit).

    Raises:
        ValueError: naming ``recurrent_state`` or ``ring``, the bad value and what was expected.
    """
    key_dim, value_dim = pool_dims(state_shape, state_dtype)
    if len(ring_shape) != 4:
        raise ValueError(f"ring: expected rank 4 [ring_rows, nk, RING_LEN, stride], got rank {len(ring_shape)}")
    if ring_dtype != DType.float32:
        raise ValueError(f"ring: dtype {ring_dtype} is unsupported (float32)")
    ring_len = static_size(ring_shape[2])
    if ring_len is None:
        raise ValueError(f"ring: RING_LEN must be static, got {ring_shape[2]}")
    if not 1 <= ring_len <= MAX_RING_LEN:
        raise ValueError(f"ring: RING_LEN {ring_len} is unsupported (1..{MAX_RING_LEN})")
    nv, nk, stride = (static_size(d) for d in (state_shape[1], ring_shape[1], ring_shape[3]))
    if nv is not None and nk is not None:
        if nk < 1 or nv % nk != 0:
            raise ValueError(f"ring: key heads nk={nk} must divide the pool's value heads nv={nv}")
        needed = RecordLayout(key_dim, value_dim, nv // nk, gate).elements
        if stride is not None and stride < needed:
            formula = "K + G*(V+K)" if gate == "channel" else "K + G*(V+1)"
            raise ValueError(f"ring: record stride {stride} is smaller than {formula} = {needed}")
    if stride is not None and stride % RECORD_VECTOR != 0:
        raise ValueError(f"ring: record stride {stride} is not a multiple of {RECORD_VECTOR} floats (16 bytes)")
    return {"K": key_dim, "V": value_dim, "RING_LEN": ring_len}


#: What a table entry that uint32 cannot hold becomes in a graph: larger than any pool, ring,
#: count or offset the ops accept, so the (layer, request) it names is refused on the CPU and
#: skipped on the GPU instead of wrapping onto another row (2**32 + 1 would become row 1).
OUT_OF_RANGE_ID = 2**32 - 1


def row_table(name: str, value: TensorValue) -> TensorValue:
    """An integer table as the uint32 table the kernels read, added to the graph.

    uint8, uint16 and uint32 convert exactly. Every other integer dtype saturates: a
    negative entry or one past ``2**32 - 1`` becomes ``OUT_OF_RANGE_ID``.

    Raises:
        ValueError: naming ``name`` where ``value`` is not of an integer dtype.
    """
    dtype = value.type.dtype
    if dtype not in INTEGER_DTYPES:
        raise ValueError(f"{name}: dtype {dtype} is not an integer dtype")
    if dtype in (DType.uint8, DType.uint16, DType.uint32):
        return value if dtype == DType.uint32 else value.cast(DType.uint32)
    wide = value if dtype in (DType.int64, DType.uint64) else value.cast(DType.int64)
    limit = ops.constant(OUT_OF_RANGE_ID, wide.dtype, device=value.device)
    outside = ops.greater(wide, limit)
    if wide.dtype == DType.int64:
        outside = ops.logical_or(outside, ops.greater(ops.constant(0, DType.int64, device=value.device), wide))
    return ops.where(outside, limit, wide).cast(DType.uint32)


#: What a ``parents`` entry that int32 cannot hold, or below -1, becomes in a graph: a
#: parent no node has (below -1), so the CPU op refuses it instead of reading it as -1.
OUT_OF_RANGE_PARENT = -2


def parent_table(name: str, value: TensorValue) -> TensorValue:
    """A token tree's ``parents`` table as the int32 table the tree verify reads, added
    to the graph. int8, int16, int32, uint8 and uint16 convert exactly; uint32, uint64 and
    int64 saturate: an entry below -1 or past ``2**31 - 1`` becomes
    :data:`OUT_OF_RANGE_PARENT` (-1 stays the committed state, and no entry wraps onto
    another node).

    Raises:
        ValueError: naming ``name`` where ``value`` is not of an integer dtype.
    """
    dtype = value.type.dtype
    if dtype not in INTEGER_DTYPES:
        raise ValueError(f"{name}: dtype {dtype} is not an integer dtype")
    if dtype in (DType.int8, DType.int16, DType.int32, DType.uint8, DType.uint16):
        return value if dtype == DType.int32 else value.cast(DType.int32)
    # Compared in the table's own dtype, so a uint64 entry past int64's range is caught too.
    outside = ops.greater(value, ops.constant(2**31 - 1, dtype, device=value.device))
    if dtype == DType.int64:
        outside = ops.logical_or(outside, ops.greater(ops.constant(-1, dtype, device=value.device), value))
    wide = value.cast(DType.int64)
    bad = ops.constant(OUT_OF_RANGE_PARENT, DType.int64, device=value.device)
    return ops.where(outside, bad, wide).cast(DType.int32)


def check_tree_table_shape(name: str, shape: Sequence[Dim | int], batch: Dim | int, ring_len: int) -> None:
    """Refuses a token tree's table (``parents``, ``accepted_nodes``) that is not rank 2
    or whose known sizes are not ``[batch, RING_LEN]``.

    Raises:
        ValueError: naming ``name``, its shape and what was expected.
    """
    if len(shape) != 2:
        raise ValueError(f"{name}: expected rank 2 [batch, RING_LEN], got shape {shape_text(shape)}")
    known_batch, rows, nodes = static_size(batch), static_size(shape[0]), static_size(shape[1])
    if (known_batch is not None and rows is not None and known_batch != rows) or (nodes is not None
                                                                                 and nodes != ring_len):
        raise ValueError(f"{name}: shape {shape_text(shape)} is not [batch, RING_LEN] ="
                         f" {shape_text([batch, ring_len])}")


def shape_text(dims: Sequence[Dim | int]) -> str:
    """A shape as error messages print it."""
    return "[" + ", ".join(str(d) for d in dims) + "]"
