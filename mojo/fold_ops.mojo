"""The fold ops, as MAX registers them: `gdfold_state_fold` (head gates: one decay per
record and value head) and `gdfold_state_fold_channel` (per-channel gates: K decays,
state row i decaying by the i-th), and their folds along an accepted path of a token
tree, `gdfold_state_fold_path` and `gdfold_state_fold_path_channel`, which take an
`accepted_nodes` [batch, RING_LEN] table beside num_accepted. All hand their operands to
run_fold (fold_launch.mojo), which checks them before anything is written.
"""

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from std.utils import IndexList

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
            target, recurrent_state.dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD, False, False
        ](
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            ring.unsafe_ptr(), ring.shape(),
            row_ids.unsafe_ptr(), row_ids.shape(),
            ring_row_ids.unsafe_ptr(), ring_row_ids.shape(),
            num_accepted.unsafe_ptr(), num_accepted.dim_size(0),
            # The chain's fold reads no node table.
            num_accepted.unsafe_ptr(), IndexList[2](0, 0),
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
            target, recurrent_state.dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD, True, False
        ](
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            ring.unsafe_ptr(), ring.shape(),
            row_ids.unsafe_ptr(), row_ids.shape(),
            ring_row_ids.unsafe_ptr(), ring_row_ids.shape(),
            num_accepted.unsafe_ptr(), num_accepted.dim_size(0),
            # The chain's fold reads no node table.
            num_accepted.unsafe_ptr(), IndexList[2](0, 0),
            ctx,
        )


@extensibility.register("gdfold_state_fold_path")
struct StateFoldPath:
    """Advances the live state pool over the records of each request's accepted path,
    `accepted_nodes[b, :num_accepted[b]]` in order, for every (layer, request).
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
        accepted_nodes: InputTensor[dtype=DType.uint32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        run_fold[
            target, recurrent_state.dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD, False, True
        ](
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            ring.unsafe_ptr(), ring.shape(),
            row_ids.unsafe_ptr(), row_ids.shape(),
            ring_row_ids.unsafe_ptr(), ring_row_ids.shape(),
            num_accepted.unsafe_ptr(), num_accepted.dim_size(0),
            accepted_nodes.unsafe_ptr(), accepted_nodes.shape(),
            ctx,
        )


@extensibility.register("gdfold_state_fold_path_channel")
struct StateFoldPathChannel:
    """Advances the live state pool over the per-channel records of each request's
    accepted path, for every (layer, request).
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
        accepted_nodes: InputTensor[dtype=DType.uint32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        run_fold[
            target, recurrent_state.dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD, True, True
        ](
            recurrent_state.unsafe_ptr(), recurrent_state.shape(),
            ring.unsafe_ptr(), ring.shape(),
            row_ids.unsafe_ptr(), row_ids.shape(),
            ring_row_ids.unsafe_ptr(), ring_row_ids.shape(),
            num_accepted.unsafe_ptr(), num_accepted.dim_size(0),
            accepted_nodes.unsafe_ptr(), accepted_nodes.shape(),
            ctx,
        )
