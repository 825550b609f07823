"""The `gdfold_recurrence` custom op: the plain forward, which commits the pool.

The same kernels as the verify with recording off, so a forward over the accepted
tokens and a verify followed by the fold agree bit for bit.
"""

import extensibility
from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from std.utils import IndexList

from .window_launch import head_decay_dims, run_windows


@extensibility.register("gdfold_recurrence")
struct Recurrence:
    """Readout of every token; each request's pool row ends at its last token's state.
    """

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, COLUMN_TILE: Int, REQUESTS_PER_BLOCK: Int,
        GPU_PATH: Int,
    ](
        readout: OutputTensor[dtype=DType.float32, rank=2, ...],
        qkv: InputTensor[dtype=DType.float32, rank=2, ...],
        decay: InputTensor[dtype=DType.float32, rank=2, ...],
        beta: InputTensor[dtype=DType.float32, rank=2, ...],
        recurrent_state: _MutableInputTensor[rank=4, ...],
        row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime state_dtype = recurrent_state.dtype
        comptime assert (
            state_dtype == DType.float32 or state_dtype == DType.bfloat16
        ), "recurrent_state must be float32 or bfloat16"
        # There is no ring: the readout and the row table stand in for the ring
        # operands (pointers cannot be null), which the kernels never touch when
        # recording is off.
        run_windows[target, state_dtype, K, V, 1, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, False, False](
            readout.unsafe_ptr(), readout.shape(),
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            readout.unsafe_ptr(), IndexList[4](0, 0, 1, 0),
            qkv.unsafe_ptr(), qkv.shape(),
            decay.unsafe_ptr(), head_decay_dims(decay.shape()),
            beta.unsafe_ptr(), beta.shape(),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            input_row_offsets.unsafe_ptr(), input_row_offsets.dim_size(0),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            ctx,
        )
