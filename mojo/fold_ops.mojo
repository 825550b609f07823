"""The fold ops, as MAX registers them: `gdfold_state_fold` (head gates: one decay per
record and value head) and `gdfold_state_fold_channel` (per-channel gates: K decays,
state row i decaying by the i-th). Both hand their operands to run_fold
(fold_launch.mojo), which checks them before anything is written.
"""

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext

from .fold_launch import run_fold


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
        run_fold[
            target, recurrent_state.dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD, False
        ](
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            ring.unsafe_ptr(), ring.shape(),
            row_ids.unsafe_ptr(), row_ids.shape(),
            ring_row_ids.unsafe_ptr(), ring_row_ids.shape(),
            num_accepted.unsafe_ptr(), num_accepted.dim_size(0),
            ctx,
        )


@extensibility.register("gdfold_state_fold_channel")
struct StateFoldChannel:
    """Advances the live state pool over the accepted per-channel records of every
    (layer, request)."""

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
        run_fold[
            target, recurrent_state.dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD, True
        ](
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            ring.unsafe_ptr(), ring.shape(),
            row_ids.unsafe_ptr(), row_ids.shape(),
            ring_row_ids.unsafe_ptr(), ring_row_ids.shape(),
            num_accepted.unsafe_ptr(), num_accepted.dim_size(0),
            ctx,
        )
