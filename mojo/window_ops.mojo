"""The window ops, as MAX registers them: the verify (`gdfold_verify_ring`), the verify
with fold on load (`gdfold_verify_ring_fold_on_load`) and the forward
(`gdfold_recurrence`), each with head gates and, under a `_channel` name, per-channel
gates. Each checks its dtypes and hands its operands to run_windows (window_launch.mojo).

A verify runs the gated delta recurrence over each request's window of tokens and
records one ring entry per token instead of writing the pool (a window longer than
RING_LEN commits the pool instead). The fold-on-load variant first applies the
previous step's accepted records while it loads the state, writes the folded state
back, and then runs the window: a decoding step touches each state element once.

The forward runs the same kernels as the verify with recording off, so a forward over the
accepted tokens and a verify followed by the fold agree bit for bit. The per-channel ops
take a decay of shape [T, nv, K], state row i decaying by the i-th; their records hold the
K decays of each value head of the group. On the GPU they run the latency kernel
(window_gpu_latency.mojo) at every batch.
"""

import extensibility
from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from std.utils import IndexList

from .window_launch import GPU_PATH_LATENCY, head_decay_dims, run_windows


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
