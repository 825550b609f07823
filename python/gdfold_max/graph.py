"""Graph-level functions: the only door from a MAX graph to the gdfold kernels.

A graph that calls these must be built with ``custom_extensions=[kernels_path()]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from max.dtype import DType
from max.graph import BufferValue, Dim, StaticDim, TensorValue, ops

from .layout import RecordLayout

#: The name our fold op is registered under (MAX's own is ``gated_delta_state_fold``).
FOLD_OP_NAME = "gdfold_state_fold"

#: Supported state dtypes, key/value dims and ring lengths.
STATE_DTYPES = (DType.float32, DType.bfloat16)
MAX_HEAD_DIM = 256
MAX_RING_LEN = 16

_INTEGER_DTYPES = (
    DType.uint8,
    DType.uint16,
    DType.uint32,
    DType.uint64,
    DType.int8,
    DType.int16,
    DType.int32,
    DType.int64,
)


def kernels_path() -> Path:
    """The Mojo package folder to pass to ``Graph(..., custom_extensions=[...])``.

    >>> (kernels_path() / "fold.mojo").is_file()
    True
    """
    installed = Path(str(resources.files("gdfold_max"))) / "mojo"
    if installed.is_dir():
        return installed
    # An editable install or a source checkout: the sources sit at the repository root.
    return Path(__file__).resolve().parents[2] / "mojo"


def _static(dim: Dim | int) -> int | None:
    """A dimension's size where it is known when the graph is built, else None."""
    if isinstance(dim, int):
        return dim
    return int(dim) if isinstance(dim, StaticDim) else None


def check_head_dim(name: str, value: int) -> None:
    """Raises ``ValueError`` unless ``value`` is a multiple of 8 in 8..256."""
    if value % 8 != 0 or not 8 <= value <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: {value} is unsupported (a multiple of 8 up to {MAX_HEAD_DIM})")


#: Preferred GPU tiling per state dtype, (KEY_DIM_TILE, ROWS_PER_THREAD): the best of a
#: sweep on an H200 at Qwen3-Next shapes (bench/tune_tiles.py; bench/tune-h200-*.txt).
#: A thread keeps ROWS_PER_THREAD 16-byte state vectors in flight: 128 bytes for fp32, 256 for bf16.
PREFERRED_TILING = {DType.float32: (64, 8), DType.bfloat16: (128, 16)}


def default_tiling(key_dim: int, state_dtype: DType) -> tuple[int, int]:
    """The (key_dim_tile, rows_per_thread) used when the caller names none.

    The preferred tile is halved until it divides K (K is a multiple of 8).

    >>> default_tiling(128, DType.float32), default_tiling(96, DType.bfloat16)
    ((64, 8), (32, 16))
    """
    tile, rows = PREFERRED_TILING.get(state_dtype, (64, 8))
    while key_dim % tile != 0:
        tile //= 2
    return tile, min(rows, tile)


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
    key_dim, value_dim = _static(state_shape[2]), _static(state_shape[3])
    if key_dim is None or value_dim is None:
        raise ValueError(f"recurrent_state: K and V must be static, got {state_shape[2]} and {state_shape[3]}")
    check_head_dim("recurrent_state: K", key_dim)
    check_head_dim("recurrent_state: V", value_dim)
    return key_dim, value_dim


def fold_parameters(
    state_shape: list[Dim] | list[int],
    state_dtype: DType,
    ring_shape: list[Dim] | list[int],
    ring_dtype: DType,
    key_dim_tile: int | None = None,
    rows_per_thread: int | None = None,
) -> dict[str, int]:
    """Checks static pool and ring shapes and returns the op's compile-time parameters.

    Raises:
        ValueError: naming the argument, the bad value and what was expected.
    """
    key_dim, value_dim = pool_dims(state_shape, state_dtype)
    if len(ring_shape) != 4:
        raise ValueError(f"ring: expected rank 4 [ring_rows, nk, RING_LEN, stride], got rank {len(ring_shape)}")
    if ring_dtype != DType.float32:
        raise ValueError(f"ring: dtype {ring_dtype} is unsupported (float32)")
    ring_len = _static(ring_shape[2])
    if ring_len is None:
        raise ValueError(f"ring: RING_LEN must be static, got {ring_shape[2]}")
    if not 1 <= ring_len <= MAX_RING_LEN:
        raise ValueError(f"ring: RING_LEN {ring_len} is unsupported (1..{MAX_RING_LEN})")
    nv, nk, stride = (_static(d) for d in (state_shape[1], ring_shape[1], ring_shape[3]))
    if nv is not None and nk is not None:
        if nk < 1 or nv % nk != 0:
            raise ValueError(f"ring: key heads nk={nk} must divide the pool's value heads nv={nv}")
        needed = RecordLayout(key_dim, value_dim, nv // nk).elements
        if stride is not None and stride < needed:
            raise ValueError(f"ring: record stride {stride} is smaller than K + G*(V+1) = {needed}")
    if stride is not None and stride % RECORD_VECTOR != 0:
        raise ValueError(f"ring: record stride {stride} is not a multiple of {RECORD_VECTOR} floats (16 bytes)")
    default_tile, default_rows = default_tiling(key_dim, state_dtype)
    tile = default_tile if key_dim_tile is None else key_dim_tile
    if tile < 4 or tile % 4 != 0 or key_dim % tile != 0:
        raise ValueError(f"key_dim_tile: {tile} must be a multiple of 4 that divides K={key_dim}")
    rows = min(default_rows, tile) if rows_per_thread is None else rows_per_thread
    if rows < 1 or tile % rows != 0:
        raise ValueError(f"rows_per_thread: {rows} must divide key_dim_tile={tile}")
    return {"K": key_dim, "V": value_dim, "RING_LEN": ring_len, "KEY_DIM_TILE": tile, "ROWS_PER_THREAD": rows}


def _row_table(name: str, value: TensorValue) -> TensorValue:
    if value.type.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"{name}: dtype {value.type.dtype} is not an integer dtype")
    return value if value.type.dtype == DType.uint32 else value.cast(DType.uint32)


def _shape_text(dims: Sequence[Dim | int]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def check_table_shapes(
    row_ids: Sequence[Dim | int], ring_row_ids: Sequence[Dim | int], num_accepted: Sequence[Dim | int]
) -> None:
    """Checks the row tables' ranks, and that their known sizes agree.

    Raises:
        ValueError: naming the table, its shape and what was expected.
    """
    if len(row_ids) != 2:
        raise ValueError(f"row_ids: expected rank 2 [num_layers, batch], got shape {_shape_text(row_ids)}")
    if len(ring_row_ids) != 2:
        raise ValueError(f"ring_row_ids: expected rank 2 [num_layers, batch], got shape {_shape_text(ring_row_ids)}")
    if len(num_accepted) != 1:
        raise ValueError(f"num_accepted: expected rank 1 [batch], got shape {_shape_text(num_accepted)}")
    for axis in range(2):
        a, b = _static(row_ids[axis]), _static(ring_row_ids[axis])
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"ring_row_ids: shape {_shape_text(ring_row_ids)} differs from row_ids {_shape_text(row_ids)}"
            )
    batch, count = _static(row_ids[1]), _static(num_accepted[0])
    if batch is not None and count is not None and batch != count:
        raise ValueError(f"num_accepted: length {count} differs from the batch {batch} of row_ids")


def state_fold(
    recurrent_state: BufferValue,
    ring: BufferValue,
    row_ids: TensorValue,
    ring_row_ids: TensorValue,
    num_accepted: TensorValue,
    verify_width: TensorValue | None = None,
    *,
    key_dim_tile: int | None = None,
    rows_per_thread: int | None = None,
) -> None:
    """Folds the accepted ring records into the live state pool, for all layers at once.

    A drop-in for ``max.nn.state_space.gated_delta_state_fold`` (same argument order),
    registered as ``gdfold_state_fold``. For every layer ``l`` and request ``b`` it
    applies, in order, the first ``num_accepted[b]`` records of ring row
    ``ring_row_ids[l, b]`` to pool row ``row_ids[l, b]``:
    ``S = fma(k_t, u_t, S * d_t)``, rounded once per step in fp32 (a bf16 pool is
    widened at the load and rounded to nearest even once at the store).

    Args:
        recurrent_state: ``[rows, nv, K, V]`` float32 or bfloat16 buffer, folded in place.
            K and V static, multiples of 8 up to 256.
        ring: ``[ring_rows, nk, RING_LEN, stride]`` float32 buffer; RING_LEN static in
            1..16; ``stride >= K + G*(V+1)`` with ``G = nv // nk``, a multiple of 4.
        row_ids: ``[num_layers, batch]`` integer pool rows (cast to uint32).
        ring_row_ids: ``[num_layers, batch]`` integer ring rows (cast to uint32).
        num_accepted: ``[batch]`` integer count of records to fold per request. 0 and
            counts past RING_LEN leave the request's rows unread and unwritten.
        verify_width: optional, as MAX's ``verify_width_operand``; when its static
            length is 0 the verify wrote no records and nothing is added to the graph.
        key_dim_tile: GPU only: key rows a block keeps in registers (divides K);
            default from :func:`default_tiling`.
        rows_per_thread: GPU only: key rows each thread keeps (divides the tile).

    Raises:
        ValueError: at graph-build time, for a bad rank, dtype or static shape, naming
            the argument. At run time on the CPU, the op raises for a row id out of
            range before it writes anything; on the GPU, an out-of-range id makes the
            kernel skip that (layer, request) and fold every other one.

    Example:
        >>> from max.graph import BufferType, DeviceRef, Graph, TensorType
        >>> cpu = DeviceRef.CPU()
        >>> with Graph("fold", input_types=[
        ...         BufferType(DType.float32, [8, 4, 64, 64], cpu),
        ...         BufferType(DType.float32, [8, 2, 4, 224], cpu),
        ...         TensorType(DType.uint32, [3, 2], cpu),
        ...         TensorType(DType.uint32, [3, 2], cpu),
        ...         TensorType(DType.uint32, [2], cpu)],
        ...         custom_extensions=[kernels_path()]) as graph:
        ...     state_fold(*graph.inputs)
        ...     graph.output()
    """
    if verify_width is not None:
        width = _static(verify_width.shape[0]) if verify_width.rank == 1 else None
        if width == 0:
            return
    parameters = fold_parameters(
        list(recurrent_state.shape),
        recurrent_state.dtype,
        list(ring.shape),
        ring.dtype,
        key_dim_tile,
        rows_per_thread,
    )
    check_table_shapes(list(row_ids.shape), list(ring_row_ids.shape), list(num_accepted.shape))
    ops.inplace_custom(
        FOLD_OP_NAME,
        recurrent_state.device,
        [
            recurrent_state,
            ring,
            _row_table("row_ids", row_ids),
            _row_table("ring_row_ids", ring_row_ids),
            _row_table("num_accepted", num_accepted),
        ],
        parameters=parameters,
    )
