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
](
    operands: WindowOperands[state_dtype],
    num_value_heads: Int,
    num_key_heads: Int,
    record_stride: Int,
):
    """Runs every request's window; all ids and offsets were validated."""
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
        # A window longer than the ring cannot be recorded: the request commits instead.
        var commit = not RECORD or end - start > RING_LEN
        var state_base = head_base + column
        var s = Array[SIMD[DType.float32, W], K](uninitialized=True)
        for i in range(K):
            s[i] = widen[state_dtype, W](state.unsafe_load[width=W](state_base + i * V))

        for t in range(start, end):
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
                fold_head_cpu[state_dtype, K, V, RING_LEN, CHANNEL](
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
                    previous_accepted,  # not read: the previous step's records are a chain
                    0,
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
