"""The fold on the CPU: parallel over (layer, request, value head), SIMD along V.

With `PATH` (the fold along an accepted path of a token tree) the t-th record folded is
record `accepted_nodes[request, t]`, a node run_fold checked before the first store.
"""

from max.algorithm import sync_parallelize
from std.math import fma
from std.memory import stack_allocation

from .float_env import keep_subnormals, write_float_control
from .record_layout import channel_decay_offset, decay_offset, delta_offset, first_record_at, key_offset
from .state_cast import narrow, widen

# Lanes per SIMD step along the value dimension. K and V are multiples of 8.
comptime CPU_LANES = 8


@always_inline
def fold_head_cpu[
    state_dtype: DType, K: Int, V: Int, RING_LEN: Int, CHANNEL: Bool = False, PATH: Bool = False
](
    state: Pointer[Scalar[state_dtype], MutAnyOrigin],
    ring: Pointer[Float32, _],
    state_base: Int,
    record_base: Int,
    record_stride: Int,
    accepted: Int,
    group_size: Int,
    group_slot: Int,
    nodes: Pointer[UInt32, ImmutAnyOrigin],
    nodes_at: Int,
):
    """Folds `accepted` records (1 to RING_LEN, record r at `record_base + r *
    record_stride`) into one value head's [K, V] block at `state_base`, row by row: the
    first `accepted`, or with PATH records `nodes[nodes_at + t]` for t in order (`nodes`
    is not read without PATH).

    With `CHANNEL` (per-channel gates) a record holds K decays per value head and row i
    decays by the i-th. The caller sets the float control (keep_subnormals) around it."""
    # Vectors of one row processed together (V is a multiple of CPU_LANES).
    comptime GROUP = 4 if V % (4 * CPU_LANES) == 0 else (
        2 if V % (2 * CPU_LANES) == 0 else 1
    )
    # Copy the head's accepted records into scratch that cannot alias the pool, so
    # the loops below keep them in cache and registers.
    var keys = stack_allocation[RING_LEN * K, DType.float32]()
    var deltas = stack_allocation[RING_LEN * V, DType.float32]()
    comptime DECAYS = K if CHANNEL else 1
    var decays = stack_allocation[RING_LEN * DECAYS, DType.float32]()
    var delta_at = delta_offset[K, V](group_slot)
    var decay_at = decay_offset[K, V](group_size, group_slot)
    comptime if CHANNEL:
        decay_at = channel_decay_offset[K, V](group_size, group_slot)
    for t in range(accepted):
        var node = t
        comptime if PATH:
            node = Int(nodes[unsafe_offset=nodes_at + t])
        var record = record_base + node * record_stride
        comptime if CHANNEL:
            for i in range(0, K, CPU_LANES):
                decays.unsafe_store(t * K + i, ring.unsafe_load[width=CPU_LANES](record + decay_at + i))
        else:
            decays[unsafe_offset=t] = ring[unsafe_offset=record + decay_at]
        for i in range(0, K, CPU_LANES):
            keys.unsafe_store(t * K + i, ring.unsafe_load[width=CPU_LANES](record + key_offset() + i))
        for j in range(0, V, CPU_LANES):
            deltas.unsafe_store(t * V + j, ring.unsafe_load[width=CPU_LANES](record + delta_at + j))

    for i in range(K):
        for j in range(0, V, GROUP * CPU_LANES):
            var at = state_base + i * V + j
            # GROUP independent vectors per step, so their fma chains overlap.
            var s = Array[SIMD[DType.float32, CPU_LANES], GROUP](uninitialized=True)
            comptime for c in range(GROUP):
                s[c] = widen[state_dtype, CPU_LANES](
                    state.unsafe_load[width=CPU_LANES](at + c * CPU_LANES)
                )
            for t in range(accepted):
                var key = SIMD[DType.float32, CPU_LANES](keys[unsafe_offset=t * K + i])
                var decay = decays[unsafe_offset=t * DECAYS + (i if CHANNEL else 0)]
                comptime for c in range(GROUP):
                    var delta = deltas.unsafe_load[width=CPU_LANES](t * V + j + c * CPU_LANES)
                    # The verify's order: decay, rounded, then one fused step.
                    s[c] = fma(key, delta, s[c] * decay)
            comptime for c in range(GROUP):
                state.unsafe_store(at + c * CPU_LANES, narrow[state_dtype, CPU_LANES](s[c]))


def fold_cpu[
    state_dtype: DType, K: Int, V: Int, RING_LEN: Int, CHANNEL: Bool = False, PATH: Bool = False
](
    state: Pointer[Scalar[state_dtype], MutAnyOrigin],
    ring: Pointer[Float32, ImmutAnyOrigin],
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    num_accepted: Pointer[UInt32, ImmutAnyOrigin],
    accepted_nodes: Pointer[UInt32, ImmutAnyOrigin],
    num_layers: Int,
    batch: Int,
    num_value_heads: Int,
    num_key_heads: Int,
    record_stride: Int,
):
    """Folds every (layer, request, value head) block; ids (and with PATH the paths of
    `accepted_nodes`, [batch, RING_LEN]) were validated. `CHANNEL`: the records hold
    per-channel decays (fold_head_cpu)."""
    var group_size = num_value_heads // num_key_heads

    def fold_one_head(item: Int) {imm}:
        var value_head = item % num_value_heads
        var pair = item // num_value_heads  # layer * batch + request
        var request = pair % batch
        var accepted = Int(num_accepted[unsafe_offset=request])
        if accepted == 0 or accepted > RING_LEN:
            return
        var key_head = value_head // group_size
        var state_base = (
            (Int(row_ids[unsafe_offset=pair]) * num_value_heads + value_head) * K * V
        )
        var record_base = first_record_at[RING_LEN](
            Int(ring_row_ids[unsafe_offset=pair]), num_key_heads, key_head, record_stride
        )
        var saved_control = keep_subnormals()
        fold_head_cpu[state_dtype, K, V, RING_LEN, CHANNEL, PATH](
            state, ring, state_base, record_base, record_stride, accepted, group_size,
            value_head % group_size, accepted_nodes, request * RING_LEN,
        )
        write_float_control(saved_control)

    sync_parallelize(fold_one_head, num_layers * batch * num_value_heads)
