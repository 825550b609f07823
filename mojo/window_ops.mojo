"""The window ops, as MAX registers them: the verify (`gdfold_verify_ring`), the verify
with fold on load (`gdfold_verify_ring_fold_on_load`) and the forward
(`gdfold_recurrence`), each with head gates and, under a `_channel` name, per-channel
gates. Each gathers its tensors into one WindowOperands (window_operands.mojo) and hands
them to run_windows (window_launch.mojo).

A verify runs the gated delta recurrence over each request's window of tokens and
records one ring entry per token instead of writing the pool (a window longer than
RING_LEN commits the pool instead). The fold-on-load variant first applies the
previous step's accepted records while it loads the state, writes the folded state
back, and then runs the window: a decoding step touches each state element once.

The forward runs the same kernels as the verify with recording off, so a forward over the
accepted tokens and a verify followed by the fold agree bit for bit. The per-channel ops
take a decay of shape [T, nv, K], state row i decaying by the i-th; their records hold the
K decays of each value head of the group. They take the head-gate ops' GPU parameters;
"auto" picks the kernel as for them (window_launch.uses_latency_kernel), the latency kernel
where the throughput kernel's staging does not fit an SM (the Python op decides that).

The tree verify (`gdfold_verify_tree`, `gdfold_verify_tree_fold_on_load` and their
`_channel` twins) runs a window whose tokens are the nodes of a token tree: node i steps
from the state of node `parents[b, i]` (-1: the committed state) and writes record i;
its fold on load folds the previous step's accepted path (`previous_accepted_nodes`).
They run the verify's code with its TREE switch on: on the CPU window_cpu.mojo's, on a
GPU the latency kernel's (window_gpu_latency.mojo) for GPU_PATH auto or latency, or on the
throughput kernel's blocks for GPU_PATH throughput (window_gpu_tree.mojo, a block of
COLUMN_TILE columns a unit). LEAF_WARPS (1, or 4 on the latency kernel) shares each unit's
leaves among that many warps in a small launch (window_launch.tree_leaves_shared).
"""

import extensibility
from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from std.utils import IndexList

from .fold_launch import run_fold
from .window_launch import check_length, run_windows
from .window_operands import WindowOperands


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
        var operands = WindowOperands(
            readout, qkv, decay, beta, recurrent_state, row_ids, input_row_offsets
        ).with_ring(ring, ring_row_ids)
        run_windows[
            target, K, V, RING_LEN, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, True, False,
        ](operands, ctx)


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
        var operands = WindowOperands(
            readout, qkv, decay, beta, recurrent_state, row_ids, input_row_offsets
        ).with_ring(ring, ring_row_ids).with_previous(
            previous_ring_row_ids, previous_num_accepted
        )
        run_windows[
            target, K, V, RING_LEN, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, True, True,
        ](operands, ctx)


@extensibility.register("gdfold_verify_or_forward")
struct VerifyOrForward:
    """The verify with fold on load, or, where MAX's verify width operand (a [K] host
    tensor whose length is the draft width) has length 0, the fold of the previous records
    and then the forward, which commits the pool and records nothing: the choice a
    speculative step makes between a verify and a step without drafts, read on the host
    as the op runs, so a graph whose width is symbolic needs no branch. Each side launches
    what gdfold_verify_ring_fold_on_load, or gdfold_state_fold (the previous ring rows as
    a one-layer table) and gdfold_recurrence, launch, with the same parameters.
    """

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int, COLUMN_TILE: Int,
        REQUESTS_PER_BLOCK: Int,
        GPU_PATH: Int,
        KEY_DIM_TILE: Int,
        ROWS_PER_THREAD: Int,
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
        verify_width: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var forward = WindowOperands(
            readout, qkv, decay, beta, recurrent_state, row_ids, input_row_offsets
        )
        var verify = forward.with_ring(ring, ring_row_ids).with_previous(
            previous_ring_row_ids, previous_num_accepted
        )
        verify_or_forward[
            target, K, V, RING_LEN, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, KEY_DIM_TILE,
            ROWS_PER_THREAD,
        ](verify, forward, verify_width.dim_size(0), ctx)


def verify_or_forward[
    dtype: DType, //,
    target: StaticString, K: Int, V: Int, RING_LEN: Int, COLUMN_TILE: Int,
    REQUESTS_PER_BLOCK: Int, GPU_PATH: Int, KEY_DIM_TILE: Int, ROWS_PER_THREAD: Int,
](
    verify: WindowOperands[dtype], forward: WindowOperands[dtype], width: Int, ctx: DeviceContext
) raises:
    """VerifyOrForward's launches: `verify` (with its ring and previous records) at a
    nonzero `width`; else the fold of `verify`'s previous records into its pool (the
    previous ring rows as a one-layer table), then the forward over `forward`'s window."""
    if width != 0:
        run_windows[
            target, K, V, RING_LEN, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, True, True,
        ](verify, ctx)
        return
    # The fold checks its tables under its own names (ring_row_ids, num_accepted): check
    # the previous step's first, under theirs, as the verify side does.
    check_length(
        "previous_ring_row_ids", verify.previous_ring_row_ids_len, verify.batch,
        "the batch of row_ids",
    )
    check_length(
        "previous_num_accepted", verify.previous_accepted_len, verify.batch,
        "the batch of row_ids",
    )
    run_fold[target, dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD, False, False](
        rebind[Pointer[Scalar[dtype], MutAnyOrigin]](verify.state), verify.state_dims,
        rebind[Pointer[Float32, MutAnyOrigin]](verify.ring), verify.ring_dims,
        rebind[Pointer[UInt32, ImmutAnyOrigin]](verify.row_ids), IndexList[2](1, verify.batch),
        rebind[Pointer[UInt32, ImmutAnyOrigin]](verify.previous_ring_row_ids),
        IndexList[2](1, verify.previous_ring_row_ids_len),
        rebind[Pointer[UInt32, ImmutAnyOrigin]](verify.previous_accepted), verify.previous_accepted_len,
        # The chain's fold reads no node table.
        rebind[Pointer[UInt32, ImmutAnyOrigin]](verify.previous_accepted), IndexList[2](0, 0),
        ctx,
    )
    run_windows[
        target, K, V, 1, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, False, False,
    ](forward, ctx)


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
        var operands = WindowOperands(
            readout, qkv, decay, beta, recurrent_state, row_ids, input_row_offsets
        )
        run_windows[
            target, K, V, 1, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, False, False,
        ](operands, ctx)


@extensibility.register("gdfold_verify_ring_channel")
struct VerifyRingChannel:
    """Readout and per-channel ring records of each request's verify window."""

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int, COLUMN_TILE: Int,
        REQUESTS_PER_BLOCK: Int,
        GPU_PATH: Int,
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
        var operands = WindowOperands(
            readout, qkv, decay, beta, recurrent_state, row_ids, input_row_offsets
        ).with_ring(ring, ring_row_ids)
        run_windows[
            target, K, V, RING_LEN, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, True, False, True,
        ](operands, ctx)


@extensibility.register("gdfold_verify_ring_fold_on_load_channel")
struct VerifyRingFoldOnLoadChannel:
    """A per-channel verify that first folds the previous step's accepted records."""

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int, COLUMN_TILE: Int,
        REQUESTS_PER_BLOCK: Int,
        GPU_PATH: Int,
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
        var operands = WindowOperands(
            readout, qkv, decay, beta, recurrent_state, row_ids, input_row_offsets
        ).with_ring(ring, ring_row_ids).with_previous(
            previous_ring_row_ids, previous_num_accepted
        )
        run_windows[
            target, K, V, RING_LEN, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, True, True, True,
        ](operands, ctx)


@extensibility.register("gdfold_recurrence_channel")
struct RecurrenceChannel:
    """The forward with per-channel gates: runs each request's tokens and commits its row."""

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, COLUMN_TILE: Int, REQUESTS_PER_BLOCK: Int,
        GPU_PATH: Int,
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
        var operands = WindowOperands(
            readout, qkv, decay, beta, recurrent_state, row_ids, input_row_offsets
        )
        run_windows[
            target, K, V, 1, COLUMN_TILE, REQUESTS_PER_BLOCK, GPU_PATH, False, False, True,
        ](operands, ctx)


@extensibility.register("gdfold_verify_tree")
struct VerifyTree:
    """Readout of every node of each request's token tree, and its ring records; the
    pool is read only.
    """

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int, COLUMN_TILE: Int, GPU_PATH: Int,
        LEAF_WARPS: Int,
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
        parents: InputTensor[dtype=DType.int32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var operands = WindowOperands(
            readout, qkv, decay, beta, recurrent_state, row_ids, input_row_offsets
        ).with_ring(ring, ring_row_ids).with_parents(parents)
        run_windows[
            target, K, V, RING_LEN, COLUMN_TILE, 0, GPU_PATH, True, False, False, True, LEAF_WARPS,
        ](operands, ctx)


@extensibility.register("gdfold_verify_tree_channel")
struct VerifyTreeChannel:
    """The tree verify with per-channel gates."""

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int, COLUMN_TILE: Int, GPU_PATH: Int,
        LEAF_WARPS: Int,
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
        parents: InputTensor[dtype=DType.int32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var operands = WindowOperands(
            readout, qkv, decay, beta, recurrent_state, row_ids, input_row_offsets
        ).with_ring(ring, ring_row_ids).with_parents(parents)
        run_windows[
            target, K, V, RING_LEN, COLUMN_TILE, 0, GPU_PATH, True, False, True, True, LEAF_WARPS,
        ](operands, ctx)


@extensibility.register("gdfold_verify_tree_fold_on_load")
struct VerifyTreeFoldOnLoad:
    """A tree verify that first folds the previous step's accepted path into the pool.
    """

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int, COLUMN_TILE: Int, GPU_PATH: Int,
        LEAF_WARPS: Int,
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
        parents: InputTensor[dtype=DType.int32, rank=2, ...],
        previous_ring_row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        previous_num_accepted: InputTensor[dtype=DType.uint32, rank=1, ...],
        previous_accepted_nodes: InputTensor[dtype=DType.uint32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var operands = WindowOperands(
            readout, qkv, decay, beta, recurrent_state, row_ids, input_row_offsets
        ).with_ring(ring, ring_row_ids).with_parents(parents).with_previous(
            previous_ring_row_ids, previous_num_accepted
        ).with_previous_nodes(previous_accepted_nodes)
        run_windows[
            target, K, V, RING_LEN, COLUMN_TILE, 0, GPU_PATH, True, True, False, True, LEAF_WARPS,
        ](operands, ctx)


@extensibility.register("gdfold_verify_tree_fold_on_load_channel")
struct VerifyTreeFoldOnLoadChannel:
    """The tree verify with per-channel gates, folding the previous accepted path first."""

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int, COLUMN_TILE: Int, GPU_PATH: Int,
        LEAF_WARPS: Int,
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
        parents: InputTensor[dtype=DType.int32, rank=2, ...],
        previous_ring_row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        previous_num_accepted: InputTensor[dtype=DType.uint32, rank=1, ...],
        previous_accepted_nodes: InputTensor[dtype=DType.uint32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var operands = WindowOperands(
            readout, qkv, decay, beta, recurrent_state, row_ids, input_row_offsets
        ).with_ring(ring, ring_row_ids).with_parents(parents).with_previous(
            previous_ring_row_ids, previous_num_accepted
        ).with_previous_nodes(previous_accepted_nodes)
        run_windows[
            target, K, V, RING_LEN, COLUMN_TILE, 0, GPU_PATH, True, True, True, True, LEAF_WARPS,
        ](operands, ctx)
