"""The verify, the verify with fold on load and the forward with per-channel gates
(Kimi Delta Attention): `gdfold_verify_ring_channel`,
`gdfold_verify_ring_fold_on_load_channel` and `gdfold_recurrence_channel`.

They are the head-gate ops with a decay of shape [T, nv, K], K decays per token and
value head, state row i decaying by the i-th; the records hold the K decays of each
value head of the group. On the GPU they run the latency kernel
(window_gpu_latency.mojo), one warp per request on a column slab, at every batch.
"""

import extensibility
from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from std.utils import IndexList

from .window_launch import GPU_PATH_LATENCY, run_windows

# The throughput kernel's tiling, which run_windows checks at compile time; per-channel
# gates never run that kernel.
comptime UNUSED_COLUMN_TILE = 8
comptime UNUSED_REQUESTS_PER_BLOCK = 0


def check_pool_dtype[state_dtype: DType]():
    comptime assert (
        state_dtype == DType.float32 or state_dtype == DType.bfloat16
    ), "recurrent_state must be float32 or bfloat16"


@extensibility.register("gdfold_verify_ring_channel")
struct VerifyRingChannel:
    """Readout and per-channel ring records of each request's verify window."""

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int
    ](
        readout: OutputTensor[dtype=DType.float32, rank=2, ...],
        qkv: InputTensor[dtype=DType.float32, rank=2, ...],
        decay: InputTensor[dtype=DType.float32, rank=3, ...],
        beta: InputTensor[dtype=DType.float32, rank=2, ...],
        recurrent_state: _MutableInputTensor[rank=4, ...],
        ring: _MutableInputTensor[dtype=DType.float32, rank=4, ...],
        row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        ring_row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime state_dtype = recurrent_state.dtype
        check_pool_dtype[state_dtype]()
        run_windows[
            target, state_dtype, K, V, RING_LEN, UNUSED_COLUMN_TILE, UNUSED_REQUESTS_PER_BLOCK,
            GPU_PATH_LATENCY, True, False, True,
        ](
            readout.unsafe_ptr(), readout.shape(),
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            ring.unsafe_ptr(), ring.shape(),
            qkv.unsafe_ptr(), qkv.shape(),
            decay.unsafe_ptr(), decay.shape(),
            beta.unsafe_ptr(), beta.shape(),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            ring_row_ids.unsafe_ptr(), ring_row_ids.dim_size(0),
            input_row_offsets.unsafe_ptr(), input_row_offsets.dim_size(0),
            ring_row_ids.unsafe_ptr(), row_ids.dim_size(0),
            ring_row_ids.unsafe_ptr(), row_ids.dim_size(0),
            ctx,
        )


@extensibility.register("gdfold_verify_ring_fold_on_load_channel")
struct VerifyRingFoldOnLoadChannel:
    """A per-channel verify that first folds the previous step's accepted records."""

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int
    ](
        readout: OutputTensor[dtype=DType.float32, rank=2, ...],
        qkv: InputTensor[dtype=DType.float32, rank=2, ...],
        decay: InputTensor[dtype=DType.float32, rank=3, ...],
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
        check_pool_dtype[state_dtype]()
        run_windows[
            target, state_dtype, K, V, RING_LEN, UNUSED_COLUMN_TILE, UNUSED_REQUESTS_PER_BLOCK,
            GPU_PATH_LATENCY, True, True, True,
        ](
            readout.unsafe_ptr(), readout.shape(),
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            ring.unsafe_ptr(), ring.shape(),
            qkv.unsafe_ptr(), qkv.shape(),
            decay.unsafe_ptr(), decay.shape(),
            beta.unsafe_ptr(), beta.shape(),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            ring_row_ids.unsafe_ptr(), ring_row_ids.dim_size(0),
            input_row_offsets.unsafe_ptr(), input_row_offsets.dim_size(0),
            previous_ring_row_ids.unsafe_ptr(), previous_ring_row_ids.dim_size(0),
            previous_num_accepted.unsafe_ptr(), previous_num_accepted.dim_size(0),
            ctx,
        )


@extensibility.register("gdfold_recurrence_channel")
struct RecurrenceChannel:
    """The forward with per-channel gates: runs each request's tokens and commits its row."""

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int
    ](
        readout: OutputTensor[dtype=DType.float32, rank=2, ...],
        qkv: InputTensor[dtype=DType.float32, rank=2, ...],
        decay: InputTensor[dtype=DType.float32, rank=3, ...],
        beta: InputTensor[dtype=DType.float32, rank=2, ...],
        recurrent_state: _MutableInputTensor[rank=4, ...],
        row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime state_dtype = recurrent_state.dtype
        check_pool_dtype[state_dtype]()
        # No ring: the readout and the row table stand in for the ring operands, which
        # the kernels never touch when recording is off (as gdfold_recurrence does).
        run_windows[
            target, state_dtype, K, V, 1, UNUSED_COLUMN_TILE, UNUSED_REQUESTS_PER_BLOCK,
            GPU_PATH_LATENCY, False, False, True,
        ](
            readout.unsafe_ptr(), readout.shape(),
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            readout.unsafe_ptr(), IndexList[4](0, 0, 1, 0),
            qkv.unsafe_ptr(), qkv.shape(),
            decay.unsafe_ptr(), decay.shape(),
            beta.unsafe_ptr(), beta.shape(),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            input_row_offsets.unsafe_ptr(), input_row_offsets.dim_size(0),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            row_ids.unsafe_ptr(), row_ids.dim_size(0),
            ctx,
        )
