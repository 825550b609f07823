"""The verify window and the forward on the CPU: parallel over (request, value head);
each task runs a range of neighbouring heads.

When asked to (fold on load), a head first gets the previous step's accepted records,
row by row as the fold applies them (fold_cpu.fold_head_cpu), and is written back; its
columns then run the request's tokens 8 at a time, from a state still in cache (every
column of a head's [K, V] state evolves on its own). Each 8-column block keeps its K x 8
slice of the state in registers and stack. The tokens' norms are computed first, once
per (token, key head), for every block of every value head that reads them.

With `CHANNEL` (per-channel gates, Kimi Delta Attention) a token brings K decays per
value head, `decay[t, h, i]`, and state row i decays by the i-th; a record then holds
the K decays of each value head of its group (record_layout.channel_decay_offset).

With `TREE` (the tree verify) the window's tokens are a token tree's nodes, node i a
child of node `parents[request, i]` (-1: the committed state). A block keeps the
committed state and each node's delta factors for its columns, not a state per node:
a node whose parent is the node before it steps on from that node's state, as a chain
does; any other starts from the committed state with its parent's root path folded in,
root first (`S = fma(k, u, S * d)` of each ancestor, from the ancestor's own key, decay
and delta factors). The fold applies the forward's two roundings to the same operands,
so the state is the parent's, bit for bit. Its fold on load folds the previous step's
accepted path (`previous_accepted_nodes`, fold_head_cpu's PATH).
"""

from max.algorithm import sync_parallelize
from std.math import fma
from std.sys import num_logical_cores

from .float_env import keep_subnormals, write_float_control
from .fold_cpu import fold_head_cpu
from .recurrence_math import REDUCTION_LANES, inverse_norm, lane_tree, query_scale
from .record_layout import (
    channel_decay_offset,
    decay_offset,
    delta_offset,
    first_record_at,
    key_offset,
)
from .state_cast import narrow, widen
from .window_operands import WindowOperands

comptime COLUMN_BLOCK = 8
comptime TASKS_PER_CORE = 8


def windows_cpu[
    state_dtype: DType,
    //,
    K: Int,
    V: Int,
    RING_LEN: Int,
    RECORD: Bool,
    FOLD_PREVIOUS: Bool,
    CHANNEL: Bool = False,
    TREE: Bool = False,
](
    operands: WindowOperands[state_dtype],
    num_value_heads: Int,
    num_key_heads: Int,
    record_stride: Int,
):
    """Runs every request's window; all ids and offsets (and with TREE the parents, every
    window within the ring, and the previous paths) were validated."""
    var readout = operands.readout
    var state = operands.state
    var ring = operands.ring
    var qkv = operands.qkv
    var decay = operands.decay
    var beta = operands.beta
    var row_ids = operands.row_ids
    var ring_row_ids = operands.ring_row_ids
    var offsets = operands.offsets
    var previous_ring_row_ids = operands.previous_ring_row_ids
    var previous_accepted = operands.previous_accepted
    var parents = operands.parents
    var previous_nodes = operands.previous_nodes
    var batch = operands.batch
    comptime W = COLUMN_BLOCK
    comptime BLOCKS = V // W
    var group_size = num_value_heads // num_key_heads
    var qkv_width = 2 * num_key_heads * K + num_value_heads * V
    var readout_width = num_value_heads * V
    comptime scale = query_scale[K]()

    # 1. Every token's 1 / |k| and 1 / |q| / sqrt(K), once per key head: each is read by
    #    the V / 8 blocks of the key head's group_size value heads.
    var num_tokens = Int(offsets[unsafe_offset=batch])  # the offsets were validated
    var norm_items = num_tokens * num_key_heads
    var norms = List[Float32](length=2 * norm_items, fill=0.0)
    var norms_at = norms.unsafe_ptr()

    def norm_tokens(first: Int, last: Int) {imm}:
        var saved_control = keep_subnormals()
        for item in range(first, last):
            var t = item // num_key_heads
            var key_head = item % num_key_heads
            var q_at = t * qkv_width + key_head * K
            var k_at = q_at + num_key_heads * K
            norms_at[unsafe_offset=2 * item] = inverse_norm[K](qkv, k_at)
            norms_at[unsafe_offset=2 * item + 1] = inverse_norm[K](qkv, q_at) * scale
        write_float_control(saved_control)

    split_over_tasks(norm_tokens, norm_items)

    @always_inline
    def inverse_key_norm(t: Int, key_head: Int) {imm} -> Float32:
        return norms_at[unsafe_offset=2 * (t * num_key_heads + key_head)]

    @always_inline
    def query_norm_scale(t: Int, key_head: Int) {imm} -> Float32:
        return norms_at[unsafe_offset=2 * (t * num_key_heads + key_head) + 1]

    @always_inline
    def run_block(request: Int, value_head: Int, head_base: Int, block: Int) {imm}:
        var column = block * W
        var key_head = value_head // group_size
        var group_slot = value_head % group_size
        var start = Int(offsets[unsafe_offset=request])
        var end = Int(offsets[unsafe_offset=request + 1])
        # A window longer than the ring cannot be recorded: the request commits instead
        # (a tree's windows were checked to fit the ring).
        var commit = not RECORD or (not TREE and end - start > RING_LEN)
        var state_base = head_base + column
        var s = Array[SIMD[DType.float32, W], K](uninitialized=True)
        for i in range(K):
            s[i] = widen[state_dtype, W](state.unsafe_load[width=W](state_base + i * V))
        # TREE: the committed state, and each node's delta factors, of these columns.
        var committed = Array[SIMD[DType.float32, W], K if TREE else 1](uninitialized=True)
        var node_deltas = Array[SIMD[DType.float32, W], RING_LEN if TREE else 1](
            uninitialized=True
        )
        comptime if TREE:
            for i in range(K):
                committed[i] = s[i]

        for t in range(start, end):
            comptime if TREE:
                var node = t - start
                var parent = Int(parents[unsafe_offset=request * RING_LEN + node])
                # `s` holds node - 1's state (the committed state before node 0).
                if parent != node - 1:
                    # The parent's root path, from the parent up.
                    var path = Array[Int, RING_LEN](uninitialized=True)
                    var depth = 0
                    var ancestor = parent
                    while ancestor >= 0:
                        path[depth] = ancestor
                        depth += 1
                        ancestor = Int(parents[unsafe_offset=request * RING_LEN + ancestor])
                    for i in range(K):
                        s[i] = committed[i]
                    for step in range(depth - 1, -1, -1):
                        var a_t = start + path[step]
                        var a_k = a_t * qkv_width + num_key_heads * K + key_head * K
                        var a_d = a_t * num_value_heads + value_head
                        comptime if CHANNEL:
                            a_d *= K
                        var a_u = node_deltas[path[step]]
                        for i in range(K):
                            var a_decay = decay[unsafe_offset=a_d]
                            comptime if CHANNEL:
                                a_decay = decay[unsafe_offset=a_d + i]
                            # The fold's order: decay, rounded, then one fused step.
                            s[i] = fma(
                                SIMD[DType.float32, W](qkv[unsafe_offset=a_k + i]), a_u,
                                s[i] * a_decay,
                            )
            var q_at = t * qkv_width + key_head * K
            var k_at = t * qkv_width + num_key_heads * K + key_head * K
            var v_at = t * qkv_width + 2 * num_key_heads * K + value_head * V + column
            var inv_k = inverse_key_norm(t, key_head)
            var q_scale = query_norm_scale(t, key_head)
            # The head's decay, or (per-channel gates) its K decays, one per state row.
            var d_at = t * num_value_heads + value_head
            comptime if CHANNEL:
                d_at *= K
            var d = decay[unsafe_offset=d_at]
            var b = beta[unsafe_offset=t * num_value_heads + value_head]

            # kv = S^T k on the decayed state.
            var lanes = Array[SIMD[DType.float32, W], REDUCTION_LANES](fill=0.0)
            for m in range(K // REDUCTION_LANES):
                comptime for p in range(REDUCTION_LANES):
                    var i = m * REDUCTION_LANES + p
                    comptime if CHANNEL:
                        s[i] = s[i] * decay[unsafe_offset=d_at + i]
                    else:
                        s[i] = s[i] * d
                    lanes[p] = fma(s[i], SIMD[DType.float32, W](qkv[unsafe_offset=k_at + i]), lanes[p])
            var kv = lane_tree[W](lanes)
            var error = fma(-kv, SIMD[DType.float32, W](inv_k), qkv.unsafe_load[width=W](v_at))
            var u = (b * error) * inv_k

            # S += k u^T, then the readout o = S^T (q / ||q|| / sqrt(K)).
            var out_lanes = Array[SIMD[DType.float32, W], REDUCTION_LANES](fill=0.0)
            for m in range(K // REDUCTION_LANES):
                comptime for p in range(REDUCTION_LANES):
                    var i = m * REDUCTION_LANES + p
                    s[i] = fma(SIMD[DType.float32, W](qkv[unsafe_offset=k_at + i]), u, s[i])
                    var q_hat = qkv[unsafe_offset=q_at + i] * q_scale
                    out_lanes[p] = fma(s[i], SIMD[DType.float32, W](q_hat), out_lanes[p])
            readout.unsafe_store(
                t * readout_width + value_head * V + column, lane_tree[W](out_lanes)
            )
            comptime if TREE:
                node_deltas[t - start] = u

            comptime if RECORD:
                if not commit:
                    var record = first_record_at[RING_LEN](
                        Int(ring_row_ids[unsafe_offset=request]), num_key_heads, key_head,
                        record_stride,
                    ) + (t - start) * record_stride
                    ring.unsafe_store(record + delta_offset[K, V](group_slot) + column, u)
                    if block == 0:
                        comptime if CHANNEL:
                            var decays_at = record + channel_decay_offset[K, V](group_size, group_slot)
                            for i in range(K):
                                ring[unsafe_offset=decays_at + i] = decay[unsafe_offset=d_at + i]
                        else:
                            ring[unsafe_offset=record + decay_offset[K, V](group_size, group_slot)] = d
                        if group_slot == 0:
                            for i in range(K):
                                ring[unsafe_offset=record + key_offset() + i] = qkv[unsafe_offset=k_at + i]

        if commit and end > start:
            for i in range(K):
                state.unsafe_store(state_base + i * V, narrow[state_dtype, W](s[i]))

    def run_head(item: Int) {imm}:
        var value_head = item % num_value_heads
        var request = item // num_value_heads
        # Where the head's [K, V] block starts in the pool.
        var head_base = (Int(row_ids[unsafe_offset=request]) * num_value_heads + value_head) * K * V
        var saved_control = keep_subnormals()
        comptime if FOLD_PREVIOUS:
            var accepted = Int(previous_accepted[unsafe_offset=request])
            if accepted >= 1 and accepted <= RING_LEN:
                # What a separate fold leaves in the pool, and what the window reads.
                fold_head_cpu[state_dtype, K, V, RING_LEN, CHANNEL, TREE](
                    state,
                    ring,
                    head_base,
                    first_record_at[RING_LEN](
                        Int(previous_ring_row_ids[unsafe_offset=request]), num_key_heads,
                        value_head // group_size, record_stride,
                    ),
                    record_stride,
                    accepted,
                    group_size,
                    value_head % group_size,
                    # Read with TREE alone (the previous step's accepted path); otherwise
                    # the previous step's records are a chain.
                    previous_nodes,
                    request * RING_LEN,
                )
        for block in range(BLOCKS):
            run_block(request, value_head, head_base, block)
        write_float_control(saved_control)

    @always_inline
    def run_heads(first: Int, last: Int) {imm}:
        for item in range(first, last):
            run_head(item)

    # 2. The heads. A task per 8-column block made a verify layer at batch 8 about 1.6
    #    times slower on two cores, for the tasks' overhead.
    split_over_tasks(run_heads, batch * num_value_heads)
    _ = norms^  # alive until every task is done


def split_over_tasks[Work: def(Int, Int) -> None](work: Work, items: Int):
    """Runs `work(first, last)` over ranges of neighbouring items, TASKS_PER_CORE ranges per
    core, in parallel."""
    if items == 0:
        return
    var tasks = min(items, TASKS_PER_CORE * num_logical_cores())

    def run_range(task: Int) {imm}:
        work(task * items // tasks, (task + 1) * items // tasks)

    sync_parallelize(run_range, tasks)
