"""The `gdfold_verify_ring` and `gdfold_verify_ring_fold_on_load` custom ops.

A verify runs the gated delta recurrence over each request's window of tokens and
records one ring entry per token instead of writing the pool (a window longer than
RING_LEN commits the pool instead). The fold-on-load variant first applies the
previous step's accepted records while it loads the state, writes the folded state
back, and then runs the window: a decoding step touches each state element once.
"""

import extensibility
from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext

from .window_launch import head_decay_dims, run_windows


@extensibility.register("gdfold_verify_ring")
struct VerifyRing:
    """Readout and ring records of each request's verify window; the pool is read only.
    """

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int, COLUMN_TILE: Int,
        REQUESTS_PER_BLOCK: Int,
        GPU_PATH: Int,
    ](
        readout: OutputTensor[dtype=DType.float32, rank=2, ...],
        qkv: InputTensor[dtype=DType.float32, rank=2, ...],
        decay: InputTensor[dtype=DType.float32, rank=2, ...],
        beta: InputTensor[dtype=DType.float32, rank=2, ...],
        recurrent_state: _MutableInputTensor[rank=4, ...],
        ring: _MutableInputTensor[dtype=DType.float32, rank=4, ...],
        row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        ring_row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime state_dtype = recurrent_state.dtype
        comptime assert (
            state_dtype == DType.float32 or state_dtype == DType.bfloat16
        ), "recurrent_state must be float32 or bfloat16"
        # No previous records: the ring-row table stands in for the unused tables.
        run_windows[target, state_dtype, K, V, RING_LEN, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, True, False](
            readout.unsafe_ptr(), readout.shape(),
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            ring.unsafe_ptr(), ring.shape(),
            qkv.unsafe_ptr(), qkv.shape(),
            decay.unsafe_ptr(), head_decay_dims(decay.shape()),
            beta.unsafe_ptr(), beta.shape(),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            ring_row_ids.unsafe_ptr(), ring_row_ids.dim_size(0),
            input_row_offsets.unsafe_ptr(), input_row_offsets.dim_size(0),
            ring_row_ids.unsafe_ptr(), row_ids.dim_size(0),
            ring_row_ids.unsafe_ptr(), row_ids.dim_size(0),
            ctx,
        )


@extensibility.register("gdfold_verify_ring_fold_on_load")
struct VerifyRingFoldOnLoad:
    """A verify that first folds the previous step's accepted records into the pool.
    """

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int, COLUMN_TILE: Int,
        REQUESTS_PER_BLOCK: Int,
        GPU_PATH: Int,
    ](
        readout: OutputTensor[dtype=DType.float32, rank=2, ...],
        qkv: InputTensor[dtype=DType.float32, rank=2, ...],
        decay: InputTensor[dtype=DType.float32, rank=2, ...],
        beta: InputTensor[dtype=DType.float32, rank=2, ...],
        recurrent_state: _MutableInputTensor[rank=4, ...],
        ring: _MutableInputTensor[dtype=DType.float32, rank=4, ...],
        row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        ring_row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        previous_ring_row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        previous_num_accepted: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime state_dtype = recurrent_state.dtype
        comptime assert (
            state_dtype == DType.float32 or state_dtype == DType.bfloat16
        ), "recurrent_state must be float32 or bfloat16"
        run_windows[target, state_dtype, K, V, RING_LEN, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, True, True](
            readout.unsafe_ptr(), readout.shape(),
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            ring.unsafe_ptr(), ring.shape(),
            qkv.unsafe_ptr(), qkv.shape(),
            decay.unsafe_ptr(), head_decay_dims(decay.shape()),
            beta.unsafe_ptr(), beta.shape(),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            ring_row_ids.unsafe_ptr(), ring_row_ids.dim_size(0),
            input_row_offsets.unsafe_ptr(), input_row_offsets.dim_size(0),
            previous_ring_row_ids.unsafe_ptr(), previous_ring_row_ids.dim_size(0),
            previous_num_accepted.unsafe_ptr(), previous_num_accepted.dim_size(0),
            ctx,
        )
