"""The `gdfold_state_fold` custom op: checks its operands, then folds on CPU or GPU.

Shape checks run for both targets before anything is launched. On the CPU the row
tables are host memory, so every id is checked too before the first store. On the
GPU the tables live on the device and are trusted for speed, but the kernel never
follows an out-of-range id: it skips that (layer, request).
"""

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from std.utils import IndexList

from .fold_cpu import fold_cpu
from .fold_gpu import RECORD_VEC, fold_block_threads, fold_gpu_kernel
from .record_layout import record_elements


def check_shapes[
    K: Int, V: Int, RING_LEN: Int, KEY_DIM_TILE: Int, ROWS_PER_THREAD: Int
](
    state_dims: IndexList[4],
    ring_dims: IndexList[4],
    row_ids_dims: IndexList[2],
    ring_row_ids_dims: IndexList[2],
    num_accepted_len: Int,
) raises:
    """Raises on operands whose shapes disagree with each other or with K, V, RING_LEN.
    """
    comptime assert K % 8 == 0 and 8 <= K <= 256, "K must be a multiple of 8 up to 256"
    comptime assert V % 8 == 0 and 8 <= V <= 256, "V must be a multiple of 8 up to 256"
    comptime assert 1 <= RING_LEN <= 16, "RING_LEN must be in 1..16"
    comptime assert (
        K % KEY_DIM_TILE == 0 and KEY_DIM_TILE % RECORD_VEC == 0
    ), "KEY_DIM_TILE must divide K and be a multiple of 4"
    comptime assert (
        ROWS_PER_THREAD >= 1 and KEY_DIM_TILE % ROWS_PER_THREAD == 0
    ), "ROWS_PER_THREAD must divide KEY_DIM_TILE"
    if state_dims[2] != K or state_dims[3] != V:
        raise Error(
            t"recurrent_state: expected [rows, nv, {K}, {V}], got last dims"
            t" [{state_dims[2]}, {state_dims[3]}]"
        )
    var num_value_heads = state_dims[1]
    var num_key_heads = ring_dims[1]
    if num_key_heads < 1 or num_value_heads % num_key_heads != 0:
        raise Error(
            t"ring: key heads ({num_key_heads}) must divide the state's value"
            t" heads ({num_value_heads})"
        )
    if ring_dims[2] != RING_LEN:
        raise Error(t"ring: expected RING_LEN {RING_LEN}, got {ring_dims[2]}")
    var needed = record_elements[K, V](num_value_heads // num_key_heads)
    if ring_dims[3] < needed:
        raise Error(
            t"ring: record stride {ring_dims[3]} is smaller than K + G*(V+1) ="
            t" {needed}"
        )
    if ring_dims[3] % RECORD_VEC != 0:
        raise Error(
            t"ring: record stride {ring_dims[3]} is not a multiple of"
            t" {RECORD_VEC} floats (16 bytes)"
        )
    if row_ids_dims != ring_row_ids_dims:
        raise Error(
            t"ring_row_ids: shape [{ring_row_ids_dims[0]}, {ring_row_ids_dims[1]}]"
            t" differs from row_ids [{row_ids_dims[0]}, {row_ids_dims[1]}]"
        )
    if num_accepted_len != row_ids_dims[1]:
        raise Error(
            t"num_accepted: length {num_accepted_len} differs from the batch"
            t" {row_ids_dims[1]} of row_ids"
        )


def check_ids(
    ids: Pointer[UInt32, ImmutAnyOrigin], count: Int, limit: Int, name: StaticString
) raises:
    """Raises on the first id at or past `limit` (host tables only)."""
    for i in range(count):
        var id = Int(ids[unsafe_offset=i])
        if id >= limit:
            raise Error(
                t"{name}: id {id} at flat index {i} is out of range (must be"
                t" < {limit})"
            )


@extensibility.register("gdfold_state_fold")
struct StateFold:
    """Advances the live state pool over the accepted records of every (layer, request).
    """

    @staticmethod
    def execute[
        target: StaticString,
        K: Int,
        V: Int,
        RING_LEN: Int,
        KEY_DIM_TILE: Int,
        ROWS_PER_THREAD: Int,
    ](
        recurrent_state: _MutableInputTensor[rank=4, ...],
        ring: _MutableInputTensor[dtype=DType.float32, rank=4, ...],
        row_ids: InputTensor[dtype=DType.uint32, rank=2, ...],
        ring_row_ids: InputTensor[dtype=DType.uint32, rank=2, ...],
        num_accepted: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime state_dtype = recurrent_state.dtype
        comptime assert (
            state_dtype == DType.float32 or state_dtype == DType.bfloat16
        ), "recurrent_state must be float32 or bfloat16"
        check_shapes[K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD](
            recurrent_state.shape(),
            ring.shape(),
            row_ids.shape(),
            ring_row_ids.shape(),
            num_accepted.dim_size(0),
        )
        var num_layers = row_ids.dim_size(0)
        var batch = row_ids.dim_size(1)
        if num_layers * batch == 0:
            return
        var num_rows = recurrent_state.dim_size(0)
        var num_ring_rows = ring.dim_size(0)
        var num_value_heads = recurrent_state.dim_size(1)
        var num_key_heads = ring.dim_size(1)
        var record_stride = ring.dim_size(3)
        comptime if target == "cpu":
            check_ids(
                row_ids.unsafe_ptr(), num_layers * batch, num_rows, "row_ids"
            )
            check_ids(
                ring_row_ids.unsafe_ptr(),
                num_layers * batch,
                num_ring_rows,
                "ring_row_ids",
            )
            fold_cpu[state_dtype, K, V, RING_LEN](
                recurrent_state.unsafe_ptr(),
                ring.unsafe_ptr(),
                row_ids.unsafe_ptr(),
                ring_row_ids.unsafe_ptr(),
                num_accepted.unsafe_ptr(),
                num_layers,
                batch,
                num_value_heads,
                num_key_heads,
                record_stride,
            )
        elif target == "gpu":
            comptime kernel = fold_gpu_kernel[
                state_dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD
            ]
            ctx.enqueue_function[kernel](
                recurrent_state.unsafe_ptr(),
                ring.unsafe_ptr(),
                row_ids.unsafe_ptr(),
                ring_row_ids.unsafe_ptr(),
                num_accepted.unsafe_ptr(),
                Int32(batch),
                Int32(num_rows),
                Int32(num_ring_rows),
                Int32(num_value_heads),
                Int32(num_key_heads),
                Int32(record_stride),
                grid_dim=(num_value_heads * (K // KEY_DIM_TILE), batch, num_layers),
                block_dim=fold_block_threads[
                    state_dtype, V, KEY_DIM_TILE, ROWS_PER_THREAD
                ](),
            )
        else:
            raise Error(t"gdfold_state_fold: unsupported target {target}")
