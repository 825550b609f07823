"""The fold's launch: checks its operands, then folds on CPU or GPU.

Shape checks run for both targets before anything is launched. On the CPU the row
tables are host memory, so every id is checked too before the first store. On the
GPU the tables live on the device and are trusted for speed, but the kernel never
follows an out-of-range id: it skips that (layer, request).

With `PATH` the records folded for request b are `accepted_nodes[b, :num_accepted[b]]`
(a path along a token tree, [batch, RING_LEN]). On the CPU each such path is checked to
name nodes 0 to RING_LEN - 1 in increasing order before the first store; on the GPU a
request whose path does not is skipped (fold_gpu.mojo).
"""

from max.gpu.host import DeviceContext
from std.utils import IndexList

from .fold_cpu import fold_cpu
from .fold_gpu import fold_block_threads, fold_gpu_kernel, fold_path_gpu_kernel
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


def check_path_shape[RING_LEN: Int](accepted_nodes_dims: IndexList[2], batch: Int) raises:
    """Raises unless the node table is [batch, RING_LEN]."""
    if accepted_nodes_dims[0] != batch or accepted_nodes_dims[1] != RING_LEN:
        raise Error(
            t"accepted_nodes: shape [{accepted_nodes_dims[0]}, {accepted_nodes_dims[1]}]"
            t" is not [{batch}, {RING_LEN}] ([batch, RING_LEN])"
        )


def check_paths[
    RING_LEN: Int
](
    accepted_nodes: Pointer[UInt32, ImmutAnyOrigin],
    num_accepted: Pointer[UInt32, ImmutAnyOrigin],
    batch: Int,
    name: StaticString = "accepted_nodes",
) raises:
    """Raises on the first path (of a request that folds: 1 to RING_LEN nodes) that
    names a node past the ring or one not after the node before it (host tables only).
    A path in topological order increases, so this is all a fold can check of it
    without the tree. `name`: the table's argument, for the message."""
    for request in range(batch):
        var accepted = Int(num_accepted[unsafe_offset=request])
        if accepted == 0 or accepted > RING_LEN:
            continue
        var previous = -1
        for t in range(accepted):
            var node = Int(accepted_nodes[unsafe_offset=request * RING_LEN + t])
            if node >= RING_LEN or node <= previous:
                raise Error(
                    t"{name}: request {request} entry {t} is node {node}"
                    t" (the entry before: {previous}); a path names nodes 0 to"
                    t" {RING_LEN - 1} in increasing order"
                )
            previous = node


def run_fold[
    target: StaticString,
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
    KEY_DIM_TILE: Int,
    ROWS_PER_THREAD: Int,
    CHANNEL: Bool,
    PATH: Bool,
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
    accepted_nodes: Pointer[UInt32, ImmutAnyOrigin],
    accepted_nodes_dims: IndexList[2],
    ctx: DeviceContext,
) raises:
    """Checks every operand, then folds on the CPU or the GPU. `CHANNEL`: per-channel
    records (K decays per value head), whose stride is checked too. `PATH`: the records
    of `accepted_nodes` (the module docstring); without it that table is not read."""
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
    comptime if PATH:
        check_path_shape[RING_LEN](accepted_nodes_dims, batch)
    if num_layers * batch == 0:
        return
    var num_rows = state_dims[0]
    var num_ring_rows = ring_dims[0]
    comptime if target == "cpu":
        check_ids(row_ids, num_layers * batch, num_rows, "row_ids")
        check_ids(ring_row_ids, num_layers * batch, num_ring_rows, "ring_row_ids")
        comptime if PATH:
            check_paths[RING_LEN](accepted_nodes, num_accepted, batch)
        fold_cpu[state_dtype, K, V, RING_LEN, CHANNEL, PATH](
            state, ring, row_ids, ring_row_ids, num_accepted, accepted_nodes, num_layers,
            batch, num_value_heads, num_key_heads, record_stride,
        )
    elif target == "gpu":
        comptime threads = fold_block_threads[state_dtype, V, KEY_DIM_TILE, ROWS_PER_THREAD]()
        comptime if PATH:
            comptime kernel = fold_path_gpu_kernel[
                state_dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD, CHANNEL
            ]
            ctx.enqueue_function[kernel](
                state,
                ring,
                row_ids,
                ring_row_ids,
                num_accepted,
                accepted_nodes,
                Int32(batch),
                Int32(num_rows),
                Int32(num_ring_rows),
                Int32(num_value_heads),
                Int32(num_key_heads),
                Int32(record_stride),
                grid_dim=(num_value_heads * (K // KEY_DIM_TILE), batch, num_layers),
                block_dim=threads,
            )
        else:
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
                block_dim=threads,
            )
    else:
        raise Error(t"gdfold_state_fold: unsupported target {target}")
