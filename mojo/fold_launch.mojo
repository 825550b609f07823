"""The fold's launch: checks its operands, then folds on CPU or GPU.

Shape checks run for both targets before anything is launched. On the CPU the row
tables are host memory, so every id is checked too before the first store. On the
GPU the tables live on the device and are trusted for speed, but the kernel never
follows an out-of-range id: it skips that (layer, request).
"""

from max.gpu.host import DeviceContext
from std.utils import IndexList

from .fold_cpu import fold_cpu
from .fold_gpu import fold_block_threads, fold_gpu_kernel
from .operand_checks import check_channel_record_stride, check_ids, check_pool_and_ring
from .record_layout import RECORD_VEC


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
    comptime assert (
        K % KEY_DIM_TILE == 0 and KEY_DIM_TILE % RECORD_VEC == 0
    ), "KEY_DIM_TILE must divide K and be a multiple of 4"
    comptime assert (
        ROWS_PER_THREAD >= 1 and KEY_DIM_TILE % ROWS_PER_THREAD == 0
    ), "ROWS_PER_THREAD must divide KEY_DIM_TILE"
    check_pool_and_ring[K, V, RING_LEN](state_dims, ring_dims)
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


def run_fold[
    target: StaticString,
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
    KEY_DIM_TILE: Int,
    ROWS_PER_THREAD: Int,
    CHANNEL: Bool,
](
    state: Pointer[Scalar[state_dtype], MutAnyOrigin],
    state_dims: IndexList[4],
    ring: Pointer[Float32, MutAnyOrigin],
    ring_dims: IndexList[4],
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    row_ids_dims: IndexList[2],
    ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    ring_row_ids_dims: IndexList[2],
    num_accepted: Pointer[UInt32, ImmutAnyOrigin],
    num_accepted_len: Int,
    ctx: DeviceContext,
) raises:
    """Checks every operand, then folds on the CPU or the GPU. `CHANNEL`: per-channel
    records (K decays per value head), whose stride is checked too."""
    comptime assert (
        state_dtype == DType.float32 or state_dtype == DType.bfloat16
    ), "recurrent_state must be float32 or bfloat16"
    check_shapes[K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD](
        state_dims, ring_dims, row_ids_dims, ring_row_ids_dims, num_accepted_len
    )
    var num_value_heads = state_dims[1]
    var num_key_heads = ring_dims[1]
    var record_stride = ring_dims[3]
    comptime if CHANNEL:
        check_channel_record_stride[K, V](num_value_heads, num_key_heads, record_stride)
    var num_layers = row_ids_dims[0]
    var batch = row_ids_dims[1]
    if num_layers * batch == 0:
        return
    var num_rows = state_dims[0]
    var num_ring_rows = ring_dims[0]
    comptime if target == "cpu":
        check_ids(row_ids, num_layers * batch, num_rows, "row_ids")
        check_ids(ring_row_ids, num_layers * batch, num_ring_rows, "ring_row_ids")
        fold_cpu[state_dtype, K, V, RING_LEN, CHANNEL](
            state, ring, row_ids, ring_row_ids, num_accepted, num_layers, batch,
            num_value_heads, num_key_heads, record_stride,
        )
    elif target == "gpu":
        comptime kernel = fold_gpu_kernel[
            state_dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD, CHANNEL
        ]
        ctx.enqueue_function[kernel](
            state,
            ring,
            row_ids,
            ring_row_ids,
            num_accepted,
            Int32(batch),
            Int32(num_rows),
            Int32(num_ring_rows),
            Int32(num_value_heads),
            Int32(num_key_heads),
            Int32(record_stride),
            grid_dim=(num_value_heads * (K // KEY_DIM_TILE), batch, num_layers),
            block_dim=fold_block_threads[state_dtype, V, KEY_DIM_TILE, ROWS_PER_THREAD](),
        )
    else:
        raise Error(t"gdfold_state_fold: unsupported target {target}")
