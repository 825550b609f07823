"""The verify window and the forward on the GPU for launches with few units of work:
one warp per request on one narrow column slab of one value head, the slab's state in
registers from start to end.

The throughput kernel (window_gpu.mojo) hides memory behind resident blocks that each
work through many units; a launch with few units leaves every block alone on its SM,
and then each step of that pipeline (staged tiles, block barriers, tensor boxes, the
outbox) sits on the unit's critical path. Here a unit is one warp and nothing else:

0. launched as a programmatic dependent (small launches, window_launch.mojo), it asks
   L2 for its state rows and records while the kernel before it ends, then waits for it;
1. every thread reads the request's ids (one round trip), then issues its state loads
   straight into registers and asynchronous copies of the first chunk of records and
   tokens into the warp's own shared memory, so that all of them are in flight at once;
2. the warp computes the chunk's norms once, folds the previous step's accepted
   records into the registers (fold on load) and stores the folded state;
3. it runs the window token by token, storing each token's readout and delta columns
   as it goes, and commits the state at the end for a forward or a window too long
   for the ring.

The arithmetic is the throughput kernel's, term for term: a thread holds one reduction
lane (key rows p, p + 8, ...) of COLUMN_VECTOR neighbouring columns, each sum over K is
one fma chain per column in the thread and three butterfly steps across the column's
eight lanes, in the fixed order of recurrence_math.mojo. So both kernels produce the
same bits, and the op picks between them at run time (window_launch.mojo).

With `CHANNEL` (per-channel gates, Kimi Delta Attention) a token brings K decays per
value head and a record holds them (record_layout.channel_decay_offset); they are
staged like the keys and read by the same lanes, so that state row i decays by the
i-th. The throughput kernel takes them too (window_gpu.mojo), in the same order of
arithmetic.

With `TREE` (the tree verify, windows_gpu_latency_tree_kernel; the chain kernel is the
same unit, latency_unit, with it off) the window's tokens are a token tree's nodes: the
request's parents and previous path are checked before any load, the fold on load reads
the previous accepted path's records from the ring, and the nodes that are some node's
parent step in the window's order as chain tokens, each followed by its leaf children
(step_leaves, leaf_token: stepped on its state, which they leave as it was). Such a node
whose parent is not the last of them stepped reloads the committed state from the pool
and folds its parent's root path in, root first (fold_root_path). The tree on the
throughput kernel's blocks (window_gpu_tree.mojo) reuses these two folds and the checks.

A tree unit may be LEAF_WARPS warps (a launch with few units: window_launch.mojo). Its
first warp does all that one warp does but step leaves: it stages, folds on load and steps
the inner nodes, and where one warp would step a node's leaves (step_leaves) it writes the
node's state, as it holds it, to one of two state buffers in shared memory and meets the
other warps at a block barrier (publish_state). The other LEAF_WARPS - 1 warps, the leaf
warps, meet it there once for each node with leaf children (-1, the committed state, first,
then the inner nodes in the window's order: leaf_warps_unit), read the state into the same
registers the first warp held it in, and step their share of its leaves, every (LEAF_WARPS -
1)-th by rank among them, with leaf_token's arithmetic: the same floats, the same bits. So a
unit's chain of steps is its inner nodes, with its leaves stepped beside the next inner node.
At the barrier of the next node with leaves every leaf warp is done with the buffer before,
which the first warp writes only after it.
"""

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, block_idx, thread_idx
from max.gpu.memory import async_copy_commit_group, async_copy_wait_all
from max.gpu.primitives.warp import shuffle_xor
from max.gpu.sync import syncwarp
from std.math import fma
from std.sys import inlined_assembly, size_of
from std.utils import StaticTuple
from std.utils.numerics import nan

from .fold_gpu import path_is_valid
from .record_layout import channel_decay_offset, decay_offset, delta_offset, first_record_at, key_offset
from .grid_dependency import load_hint, prefetch_l2, release_next_grid, wait_for_previous_grid
from .recurrence_math import L2_EPS, REDUCTION_LANES, query_scale, rounded_sqrt
from .column_groups import column_slot, column_sum, gather_columns
from .window_gpu_staging import (
    COPY_FLOATS,
    TOKEN_SCALARS,
    DECAY_AT,
    BETA_AT,
    WARP_THREADS,
    WINDOW_CHUNK,
    SharedFloats,
    copy_rows_async,
    copy_scalars_async,
    lane_sum,
    natural_pitch,
    shared_floats,
)

# Column groups of a warp: 32 threads, eight reduction lanes per column group.
comptime SLAB_GROUPS = WARP_THREADS // REDUCTION_LANES


def latency_slab_columns[COLUMN_VECTOR: Int]() -> Int:
    """Value columns one warp of the latency kernel owns."""
    return SLAB_GROUPS * COLUMN_VECTOR


def latency_column_vector[K: Int, V: Int]() -> Int:
    """Columns per thread: four where V allows 16-column slabs and K rows of four columns
    leave registers for the rest (K <= 128: 64 of them), else two (8-column slabs)."""
    return 4 if V % latency_slab_columns[4]() == 0 and K <= 128 else 2


@always_inline
def slab_column_sum[CV: Int](partial: SIMD[DType.float32, CV], lane: Int) -> Float32:
    """The whole sum over the column group's eight lanes of column `slab_slot[CV](lane)`,
    in the fixed order (p, p + 4), (p, p + 2), (p, p + 1): each butterfly step where a
    lane still holds more than one column passes on the half its partner keeps."""
    comptime if CV == 4:
        return column_sum(rebind[SIMD[DType.float32, 4]](partial), lane)
    else:
        comptime assert CV == 2, "the latency kernel holds two or four columns per thread"
        var high = (lane & 4) != 0
        var keep = partial[1] if high else partial[0]
        var send = partial[0] if high else partial[1]
        var half = keep + shuffle_xor(send, UInt32(4))  # (p, p + 4)
        var quad = half + shuffle_xor(half, UInt32(2))  # (p, p + 2)
        return quad + shuffle_xor(quad, UInt32(1))  # (p, p + 1)


@always_inline
def slab_slot[CV: Int](lane: Int) -> Int:
    """The column of its group whose whole sum lane `lane` ends with."""
    comptime if CV == 4:
        return column_slot(lane)
    else:
        return (lane >> 2) & 1


@always_inline
def slab_gather[CV: Int](mine: Float32, lane: Int) -> SIMD[DType.float32, CV]:
    """The group's CV column values, from the lanes that hold one each."""
    comptime if CV == 4:
        return rebind[SIMD[DType.float32, CV]](gather_columns(mine, lane))
    else:
        var other = shuffle_xor(mine, UInt32(4))
        if (lane & 4) != 0:
            return SIMD[DType.float32, CV](other, mine)
        return SIMD[DType.float32, CV](mine, other)


@always_inline
def prefetch_record_lines[
    K: Int, V: Int, CHANNEL: Bool
](
    ring: Pointer[Float32, MutAnyOrigin],
    first_record: Int,
    count: Int,
    record_stride: Int,
    group_size: Int,
    group_slot: Int,
    slab_start: Int,
    tid: Int,
):
    """Asks L2 for what a fold on load reads of `count` records from `first_record`: the
    raw key, the slab's delta columns and the decay (or, per-channel, K decays) of each,
    a 128-byte line a lane."""
    comptime LINE_FLOATS = 32
    comptime KEY_LINES = K // LINE_FLOATS
    comptime DECAY_LINES = K // LINE_FLOATS if CHANNEL else 1
    comptime LINES = KEY_LINES + 1 + DECAY_LINES
    comptime assert LINES <= WARP_THREADS, "a record's lines must fit one warp"
    if tid >= LINES:
        return
    for t in range(count):
        var record = first_record + t * record_stride
        var at: Int
        if tid < KEY_LINES:
            at = record + key_offset() + tid * LINE_FLOATS
        elif tid == KEY_LINES:
            at = record + delta_offset[K, V](group_slot) + slab_start
        else:
            comptime if CHANNEL:
                at = record + channel_decay_offset[K, V](group_size, group_slot) + (
                    tid - KEY_LINES - 1
                ) * LINE_FLOATS
            else:
                at = record + decay_offset[K, V](group_size, group_slot)
        prefetch_l2(ring.unsafe_offset(at))


struct SlabStaging[K: Int, V: Int, CV: Int, FOLD_PREVIOUS: Bool, CHANNEL: Bool](
    ImplicitlyCopyable
):
    """The warp's shared memory: a chunk of tokens (q and k as they arrive, the slab's
    value columns, decay and beta; per-channel, their K decays) and a chunk of records
    (keys, the slab's deltas, a decay or K of each), and the copies that fill them."""

    comptime SLAB = latency_slab_columns[Self.CV]()
    comptime CHUNK = WINDOW_CHUNK
    comptime NATURAL = natural_pitch[Self.K]()

    var pairs: SharedFloats
    var values: SharedFloats
    var scalars: SharedFloats
    var record_keys: SharedFloats
    var record_deltas: SharedFloats
    var record_decays: SharedFloats
    var token_decays: SharedFloats

    @always_inline
    def __init__(
        out self,
        pairs: SharedFloats,
        values: SharedFloats,
        scalars: SharedFloats,
        record_keys: SharedFloats,
        record_deltas: SharedFloats,
        record_decays: SharedFloats,
        token_decays: SharedFloats,
    ):
        self.pairs = pairs
        self.values = values
        self.scalars = scalars
        self.record_keys = record_keys
        self.record_deltas = record_deltas
        self.record_decays = record_decays
        self.token_decays = token_decays

    @always_inline
    def copy_tokens(
        self,
        qkv: Pointer[Float32, ImmutAnyOrigin],
        decay: Pointer[Float32, ImmutAnyOrigin],
        beta: Pointer[Float32, ImmutAnyOrigin],
        first: Int,
        count: Int,
        num_key_heads: Int,
        key_head: Int,
        num_value_heads: Int,
        value_head: Int,
        slab_start: Int,
        tid: Int,
    ):
        """Starts the copies of `count` tokens from token `first`: q and k of key head
        `key_head`, the slab's value columns, decays and betas of `value_head`."""
        var qkv_width = 2 * num_key_heads * Self.K + num_value_heads * Self.V
        var token = first * qkv_width
        copy_rows_async[Self.K, Self.CHUNK, WARP_THREADS, 2 * Self.NATURAL](
            self.pairs, qkv, token + key_head * Self.K, qkv_width, count, tid
        )
        copy_rows_async[Self.K, Self.CHUNK, WARP_THREADS, 2 * Self.NATURAL](
            self.pairs.unsafe_offset(Self.NATURAL), qkv,
            token + (num_key_heads + key_head) * Self.K, qkv_width, count, tid,
        )
        copy_rows_async[Self.SLAB, Self.CHUNK, WARP_THREADS](
            self.values, qkv,
            token + 2 * num_key_heads * Self.K + value_head * Self.V + slab_start,
            qkv_width, count, tid,
        )
        var at = first * num_value_heads + value_head
        comptime if Self.CHANNEL:
            copy_rows_async[Self.K, Self.CHUNK, WARP_THREADS](
                self.token_decays, decay, at * Self.K, num_value_heads * Self.K, count, tid
            )
        else:
            copy_scalars_async(
                self.scalars.unsafe_offset(DECAY_AT), decay, at, num_value_heads, count,
                tid, TOKEN_SCALARS,
            )
        copy_scalars_async(
            self.scalars.unsafe_offset(BETA_AT), beta, at, num_value_heads, count, tid,
            TOKEN_SCALARS,
        )

    @always_inline
    def copy_records(
        self,
        ring: Pointer[Float32, MutAnyOrigin],
        base: Int,
        record_stride: Int,
        count: Int,
        group_size: Int,
        group_slot: Int,
        slab_start: Int,
        tid: Int,
    ):
        """Starts the copies of `count` records from the one at `base` in the ring: the
        keys, the slab's delta columns and the decays of value head slot `group_slot`."""
        copy_rows_async[Self.K, Self.CHUNK, WARP_THREADS, Self.NATURAL](
            self.record_keys, ring, base + key_offset(), record_stride, count, tid
        )
        copy_rows_async[Self.SLAB, Self.CHUNK, WARP_THREADS](
            self.record_deltas, ring,
            base + delta_offset[Self.K, Self.V](group_slot) + slab_start,
            record_stride, count, tid,
        )
        comptime if Self.CHANNEL:
            copy_rows_async[Self.K, Self.CHUNK, WARP_THREADS](
                self.record_decays, ring,
                base + channel_decay_offset[Self.K, Self.V](group_size, group_slot),
                record_stride, count, tid,
            )
        else:
            copy_scalars_async(
                self.record_decays, ring,
                base + decay_offset[Self.K, Self.V](group_size, group_slot),
                record_stride, count, tid,
            )


@always_inline
def lane_values[
    ROWS: Int
](buffer: SharedFloats, at: Int, lane: Int) -> Array[Float32, ROWS]:
    """Lane p's elements p, p + 8, ... of the K-vector at `at` of a staged buffer."""
    var x = Array[Float32, ROWS](uninitialized=True)
    comptime for m in range(ROWS):
        x[m] = buffer[unsafe_offset=at + m * REDUCTION_LANES + lane]
    return x^


@always_inline
def lane_decays[
    K: Int, CHANNEL: Bool
](buffer: SharedFloats, t: Int, lane: Int) -> Array[Float32, K // REDUCTION_LANES]:
    """The decays of entry `t` of a staged buffer for this lane's rows: one for every
    row, or (per-channel gates) row m * 8 + lane's own."""
    comptime if CHANNEL:
        return lane_values[K // REDUCTION_LANES](buffer, t * K, lane)
    else:
        return Array[Float32, K // REDUCTION_LANES](fill=buffer[unsafe_offset=t])


@always_inline
def token_lane_decays[
    K: Int, CHANNEL: Bool
](token_decays: SharedFloats, scalars: SharedFloats, c: Int, lane: Int) -> Array[
    Float32, K // REDUCTION_LANES
]:
    """Token c's decays for this lane's rows, as lane_decays: per channel from the
    tokens' decays, else the one in its scalars."""
    comptime if CHANNEL:
        return lane_values[K // REDUCTION_LANES](token_decays, c * K, lane)
    else:
        return Array[Float32, K // REDUCTION_LANES](
            fill=scalars[unsafe_offset=c * TOKEN_SCALARS + DECAY_AT]
        )


@always_inline
def chunk_norms[
    CHUNK: Int, //, K: Int
](
    pairs: SharedFloats,
    count: Int,
    lane: Int,
    mut inverse_key_norms: Array[Float32, CHUNK],
    mut query_scales: Array[Float32, CHUNK],
):
    """The staged chunk's norms, once for all its tokens: 1/|k| and q's scale
    1/|q| * 1/sqrt(K)."""
    comptime ROWS = K // REDUCTION_LANES
    comptime NATURAL = natural_pitch[K]()
    comptime scale = query_scale[K]()
    comptime for c in range(CHUNK):
        if c < count:
            var k = lane_values[ROWS](pairs, (2 * c + 1) * NATURAL, lane)
            var q = lane_values[ROWS](pairs, 2 * c * NATURAL, lane)
            var k_squares = Float32(0.0)
            var q_squares = Float32(0.0)
            comptime for m in range(ROWS):
                k_squares = fma(k[m], k[m], k_squares)
                q_squares = fma(q[m], q[m], q_squares)
            inverse_key_norms[c] = Float32(1.0) / rounded_sqrt(lane_sum(k_squares) + L2_EPS)
            query_scales[c] = (
                Float32(1.0) / rounded_sqrt(lane_sum(q_squares) + L2_EPS)
            ) * scale


@always_inline
def slab_token[
    ROWS: Int, CV: Int, //, K: Int, CHANNEL: Bool
](
    mut held: Array[SIMD[DType.float32, CV], ROWS],
    pairs: SharedFloats,
    values: SharedFloats,
    scalars: SharedFloats,
    token_decays: SharedFloats,
    c: Int,
    inv_k: Float32,
    q_scale: Float32,
    value_at: Int,
    lane: Int,
) -> Tuple[Float32, Float32]:
    """Staged token c on the held slab: decays the state, adds k u^T, and returns the
    readout o and the delta u of this lane's column (value_at: its value in `values`)."""
    comptime NATURAL = natural_pitch[K]()
    comptime Columns = SIMD[DType.float32, CV]
    var d = token_lane_decays[K, CHANNEL](token_decays, scalars, c, lane)
    var b = scalars[unsafe_offset=c * TOKEN_SCALARS + BETA_AT]
    var k = lane_values[ROWS](pairs, (2 * c + 1) * NATURAL, lane)
    # kv = S^T k on the decayed state.
    var partial = Columns(0.0)
    comptime for m in range(ROWS):
        held[m] = held[m] * d[m]
        partial = fma(held[m], Columns(k[m]), partial)
    var kv = slab_column_sum[CV](partial, lane)
    var v = values[unsafe_offset=value_at]
    var u = (b * fma(-kv, inv_k, v)) * inv_k
    var u_columns = slab_gather[CV](u, lane)
    # S += k u^T, then the readout o = S^T (q / |q| / sqrt(K)).
    var q = lane_values[ROWS](pairs, 2 * c * NATURAL, lane)
    var out = Columns(0.0)
    comptime for m in range(ROWS):
        held[m] = fma(Columns(k[m]), u_columns, held[m])
        out = fma(held[m], Columns(q[m] * q_scale), out)
    return (slab_column_sum[CV](out, lane), u)


@always_inline
def write_chunk_records[
    K: Int, V: Int, CHANNEL: Bool
](
    ring: Pointer[Float32, MutAnyOrigin],
    first: Int,
    record_stride: Int,
    count: Int,
    pairs: SharedFloats,
    scalars: SharedFloats,
    token_decays: SharedFloats,
    group_size: Int,
    group_slot: Int,
    tid: Int,
):
    """The records' raw keys (once per key head: the group's first value head writes
    them) and decays (once per value head) of a staged chunk of `count` tokens, the
    first at `first` in the ring; the deltas leave with the tokens."""
    comptime NATURAL = natural_pitch[K]()
    comptime KEY_VECTORS = K // COPY_FLOATS
    comptime if CHANNEL:
        for i in range(tid, count * KEY_VECTORS, WARP_THREADS):
            var c = i // KEY_VECTORS
            var at = (i % KEY_VECTORS) * COPY_FLOATS
            ring.unsafe_store[alignment=16](
                first + c * record_stride
                + channel_decay_offset[K, V](group_size, group_slot) + at,
                token_decays.unsafe_load[width=COPY_FLOATS, alignment=16](
                    c * K + at
                ),
            )
    else:
        if tid < count:
            ring[unsafe_offset=first + tid * record_stride + decay_offset[K, V](
                group_size, group_slot
            )] = scalars[unsafe_offset=tid * TOKEN_SCALARS + DECAY_AT]
    if group_slot == 0:
        for i in range(tid, count * KEY_VECTORS, WARP_THREADS):
            var c = i // KEY_VECTORS
            var at = (i % KEY_VECTORS) * COPY_FLOATS
            ring.unsafe_store[alignment=16](
                first + c * record_stride + key_offset() + at,
                pairs.unsafe_load[width=COPY_FLOATS, alignment=16](
                    (2 * c + 1) * NATURAL + at
                ),
            )


@always_inline
def fold_staged_records[
    ROWS: Int, CV: Int, V: Int, FOLD_PREVIOUS: Bool, //, K: Int, CHANNEL: Bool
](
    mut held: Array[SIMD[DType.float32, CV], ROWS],
    staged: SlabStaging[K, V, CV, FOLD_PREVIOUS, CHANNEL],
    count: Int,
    column: Int,
    lane: Int,
):
    """Applies the `count` staged records to the held state, in order, as the fold
    does: S = S * decay + k u^T (`column`: the thread's first column in the slab)."""
    comptime NATURAL = natural_pitch[K]()
    comptime SLAB = latency_slab_columns[CV]()
    for t in range(count):
        var d = lane_decays[K, CHANNEL](staged.record_decays, t, lane)
        var u = staged.record_deltas.unsafe_load[width=CV, alignment=CV * 4](
            t * SLAB + column
        )
        var k = lane_values[ROWS](staged.record_keys, t * NATURAL, lane)
        comptime for m in range(ROWS):
            held[m] = fma(SIMD[DType.float32, CV](k[m]), u, held[m] * d[m])


@always_inline
def tree_is_valid[
    RING_LEN: Int
](
    parents: Pointer[Int32, ImmutAnyOrigin],
    previous_nodes: Pointer[UInt32, ImmutAnyOrigin],
    nodes_at: Int,
    window: Int,
    accepted: Int,
) -> Bool:
    """Whether a tree verify's request may run: its window fits the ring, each node's
    parent is -1 or an earlier node (so every root path ends, and its nodes come before
    the node), and the first `accepted` entries of its previous path are nodes of the
    ring in increasing order (fold_gpu.path_is_valid). Every lane reads the same."""
    if window > RING_LEN:
        return False
    for node in range(window):
        var parent = Int(parents[unsafe_offset=nodes_at + node])
        if parent < -1 or parent >= node:
            return False
    return path_is_valid[RING_LEN](previous_nodes, nodes_at, accepted)


@always_inline
def warp_ring_visible():
    """Makes every global store a lane of the warp issued before it visible to every
    lane's loads after it: a fence of the lane's stores at the CTA's scope (the block: the
    warp, or a tree unit's warps, of which only the first reads these stores back), then
    the warp's barrier, which orders memory among the lanes that pass it (PTX
    bar.warp.sync)."""
    inlined_assembly["fence.acq_rel.cta;", NoneType, constraints="~{memory}", has_side_effect=True]()
    syncwarp()


@always_inline
def fold_ring_record[
    ROWS: Int, CV: Int, //, K: Int, V: Int, CHANNEL: Bool
](
    mut held: Array[SIMD[DType.float32, CV], ROWS],
    ring: Pointer[Float32, MutAnyOrigin],
    record: Int,
    group_size: Int,
    group_slot: Int,
    column: Int,
    lane: Int,
):
    """Applies the record at `record` in the ring to the held state as the fold does,
    S = fma(k, u, S * decay), from the ring itself (`column`: the thread's first column
    in the head)."""
    var u = ring.unsafe_load[width=CV, alignment=CV * 4](
        record + delta_offset[K, V](group_slot) + column
    )
    var d = Array[Float32, ROWS](uninitialized=True)
    comptime if CHANNEL:
        comptime for m in range(ROWS):
            d[m] = ring[unsafe_offset=record + channel_decay_offset[K, V](group_size, group_slot)
                + m * REDUCTION_LANES + lane]
    else:
        var one = ring[unsafe_offset=record + decay_offset[K, V](group_size, group_slot)]
        comptime for m in range(ROWS):
            d[m] = one
    comptime for m in range(ROWS):
        var k = ring[unsafe_offset=record + key_offset() + m * REDUCTION_LANES + lane]
        held[m] = fma(SIMD[DType.float32, CV](k), u, held[m] * d[m])


@always_inline
def fold_root_path[
    ROWS: Int, CV: Int, //, K: Int, V: Int, RING_LEN: Int, CHANNEL: Bool
](
    mut held: Array[SIMD[DType.float32, CV], ROWS],
    ring: Pointer[Float32, MutAnyOrigin],
    qkv: Pointer[Float32, ImmutAnyOrigin],
    decay: Pointer[Float32, ImmutAnyOrigin],
    parents: Pointer[Int32, ImmutAnyOrigin],
    request: Int,
    parent: Int,
    first_record: Int,
    record_stride: Int,
    start: Int,
    num_key_heads: Int,
    key_head: Int,
    num_value_heads: Int,
    value_head: Int,
    group_slot: Int,
    column: Int,
    lane: Int,
):
    """Folds node `parent`'s root path into the held (committed) state, root first, as
    the tree verify on the CPU does: `S = fma(k, u, S * d)` of each ancestor, from its
    raw key and decay (the window's inputs, the very floats its record holds) and its
    delta columns (its record in the ring, first at `first_record`, which this warp
    wrote). A root path's nodes increase from the root (each parent comes before its
    child), so the path in order is its nodes' set in increasing order."""
    var on_path = 0
    var ancestor = parent
    while ancestor >= 0:  # parents checked: each step goes to an earlier node
        on_path |= 1 << ancestor
        ancestor = Int(parents[unsafe_offset=request * RING_LEN + ancestor])
    var qkv_width = 2 * num_key_heads * K + num_value_heads * V
    for node in range(parent + 1):
        if (on_path >> node) & 1 == 0:
            continue
        var t = start + node
        var k_at = t * qkv_width + (num_key_heads + key_head) * K
        var d_at = t * num_value_heads + value_head
        var u = ring.unsafe_load[width=CV, alignment=CV * 4](
            first_record + node * record_stride + delta_offset[K, V](group_slot) + column
        )
        var d = Array[Float32, ROWS](uninitialized=True)
        comptime if CHANNEL:
            comptime for m in range(ROWS):
                d[m] = decay[unsafe_offset=d_at * K + m * REDUCTION_LANES + lane]
        else:
            var one = decay[unsafe_offset=d_at]
            comptime for m in range(ROWS):
                d[m] = one
        comptime for m in range(ROWS):
            var k = qkv[unsafe_offset=k_at + m * REDUCTION_LANES + lane]
            # The fold's order: decay, rounded, then one fused step.
            held[m] = fma(SIMD[DType.float32, CV](k), u, held[m] * d[m])


@always_inline
def leaf_token[
    ROWS: Int, CV: Int, //, K: Int, V: Int, CHANNEL: Bool
](
    held: Array[SIMD[DType.float32, CV], ROWS],
    qkv: Pointer[Float32, ImmutAnyOrigin],
    decay: Pointer[Float32, ImmutAnyOrigin],
    beta: Pointer[Float32, ImmutAnyOrigin],
    t: Int,
    num_key_heads: Int,
    key_head: Int,
    num_value_heads: Int,
    value_head: Int,
    column: Int,
    lane: Int,
) -> Tuple[Float32, Float32]:
    """Token t (a leaf of a token tree: no node's state starts from its own) on the held
    slab, its parent's state, which it leaves as it was: the readout o and the delta u of
    this lane's column. Read from the window's inputs, not the staged chunk (a leaf is
    stepped while its parent's state is held, out of the window's order), with the
    arithmetic of chunk_norms and slab_token term for term: the same floats in the same
    order, so the same bits. The decayed and updated state is summed into the readout
    instead of stored (each decayed element computed twice: a product, the same bits)."""
    comptime Columns = SIMD[DType.float32, CV]
    var qkv_width = 2 * num_key_heads * K + num_value_heads * V
    var q_at = t * qkv_width + key_head * K + lane
    var k_at = t * qkv_width + (num_key_heads + key_head) * K + lane
    var d_at = t * num_value_heads + value_head

    # The row's decay and the key and query elements are read again where each pass uses
    # them (L1 holds them): held as arrays across the passes they spilled.
    @always_inline
    def row_decay(m: Int) {imm} -> Float32:
        comptime if CHANNEL:
            return decay[unsafe_offset=d_at * K + m * REDUCTION_LANES + lane]
        else:
            return decay[unsafe_offset=d_at]

    # chunk_norms' norms.
    var k_squares = Float32(0.0)
    var q_squares = Float32(0.0)
    comptime for m in range(ROWS):
        var k = qkv[unsafe_offset=k_at + m * REDUCTION_LANES]
        var q = qkv[unsafe_offset=q_at + m * REDUCTION_LANES]
        k_squares = fma(k, k, k_squares)
        q_squares = fma(q, q, q_squares)
    var inv_k = Float32(1.0) / rounded_sqrt(lane_sum(k_squares) + L2_EPS)
    comptime scale = query_scale[K]()
    var q_scale = (Float32(1.0) / rounded_sqrt(lane_sum(q_squares) + L2_EPS)) * scale
    # slab_token's step.
    var partial = Columns(0.0)
    comptime for m in range(ROWS):
        partial = fma(held[m] * row_decay(m), Columns(qkv[unsafe_offset=k_at + m * REDUCTION_LANES]), partial)
    var kv = slab_column_sum[CV](partial, lane)
    var v = qkv[unsafe_offset=t * qkv_width + 2 * num_key_heads * K + value_head * V + column
        + slab_slot[CV](lane)]
    var u = (beta[unsafe_offset=d_at] * fma(-kv, inv_k, v)) * inv_k
    var u_columns = slab_gather[CV](u, lane)
    var out = Columns(0.0)
    comptime for m in range(ROWS):
        var k = qkv[unsafe_offset=k_at + m * REDUCTION_LANES]
        var q = qkv[unsafe_offset=q_at + m * REDUCTION_LANES]
        out = fma(fma(Columns(k), u_columns, held[m] * row_decay(m)), Columns(q * q_scale), out)
    return (slab_column_sum[CV](out, lane), u)


@always_inline
def tree_inner_nodes(parents: Pointer[Int32, ImmutAnyOrigin], nodes_at: Int, window: Int) -> Int:
    """The bit set of the tree's nodes that are some node's parent (checked parents:
    -1 or an earlier node). Every lane reads the same."""
    var inner = 0
    for node in range(window):
        var parent = Int(parents[unsafe_offset=nodes_at + node])
        if parent >= 0:
            inner |= 1 << parent
    return inner


@always_inline
def step_leaves[
    ROWS: Int, CV: Int, //, K: Int, V: Int, RING_LEN: Int, CHANNEL: Bool, LEAF_WARPS: Int
](
    readout: Pointer[Float32, MutAnyOrigin],
    ring: Pointer[Float32, MutAnyOrigin],
    qkv: Pointer[Float32, ImmutAnyOrigin],
    decay: Pointer[Float32, ImmutAnyOrigin],
    beta: Pointer[Float32, ImmutAnyOrigin],
    parents: Pointer[Int32, ImmutAnyOrigin],
    held: Array[SIMD[DType.float32, CV], ROWS],
    inner: Int,
    parent: Int,
    request: Int,
    start: Int,
    window: Int,
    record_row_base: Int,
    record_stride: Int,
    num_key_heads: Int,
    key_head: Int,
    num_value_heads: Int,
    value_head: Int,
    group_slot: Int,
    column: Int,
    lane: Int,
    writes_column: Bool,
    records: Bool,
    leaf_warp: Int,
):
    """Steps the leaves (nodes outside `inner`) whose parent is `parent` (-1: the
    committed state) on the held state, `parent`'s, which they leave as it was
    (leaf_token): each one's readout, and its delta columns into its record. Of a unit
    of LEAF_WARPS warps, leaf warp `leaf_warp` (1 to LEAF_WARPS - 1) steps the leaves of
    `parent` whose rank among them is leaf_warp - 1 modulo LEAF_WARPS - 1."""
    var slot = slab_slot[CV](lane)
    var rank = 0
    for node in range(parent + 1, window):
        if (inner >> node) & 1 != 0:
            continue
        if Int(parents[unsafe_offset=request * RING_LEN + node]) != parent:
            continue
        comptime if LEAF_WARPS > 1:
            var mine = rank % (LEAF_WARPS - 1) == leaf_warp - 1
            rank += 1
            if not mine:
                continue
        var leaf = leaf_token[K, V, CHANNEL](
            held, qkv, decay, beta, start + node, num_key_heads, key_head, num_value_heads,
            value_head, column, lane,
        )
        if writes_column:
            readout[unsafe_offset=(start + node) * num_value_heads * V + value_head * V + column
                + slot] = leaf[0]
            if records:
                ring[unsafe_offset=(record_row_base + node) * record_stride
                    + delta_offset[K, V](group_slot) + column + slot] = leaf[1]


@always_inline
def parents_of_leaves(parents: Pointer[Int32, ImmutAnyOrigin], nodes_at: Int, window: Int) -> Int:
    """The bit set of the parents that have leaf children: bit p + 1 for parent p (bit 0
    for -1, the committed state; checked parents). Every lane reads the same."""
    var inner = tree_inner_nodes(parents, nodes_at, window)
    var marks = 0
    for node in range(window):
        if (inner >> node) & 1 == 0:
            marks |= 1 << (Int(parents[unsafe_offset=nodes_at + node]) + 1)
    return marks


@always_inline
def unit_barrier():
    """The tree unit's block barrier, where the first warp (publish_state) and the leaf
    warps (leaf_warps_unit) meet, each at a barrier instruction of its own. That needs
    PTX's non-aligned form, barrier.sync: the aligned one that barrier() emits (bar.sync)
    requires every thread of the block at the same instruction, and compute-sanitizer's
    synccheck reports the block divergent where they are not. Like bar.sync it orders the
    shared memory writes before it for the loads after it, at the block's scope."""
    inlined_assembly["barrier.sync 0;", NoneType, constraints="~{memory}", has_side_effect=True]()


@always_inline
def published_at[ROWS: Int, CV: Int](round: Int, tid: Int, m: Int) -> Int:
    """Where thread `tid` of a warp keeps state row m of its columns in the state buffer
    of round `round` (two buffers, alternated): 16-byte vectors side by side, so that a
    warp's stores and loads of one row meet no bank twice."""
    return (round % 2) * (ROWS * WARP_THREADS * CV) + (m * WARP_THREADS + tid) * CV


@always_inline
def publish_state[
    ROWS: Int, CV: Int, //
](published: SharedFloats, held: Array[SIMD[DType.float32, CV], ROWS], round: Int, tid: Int):
    """The first warp of a tree unit: writes the state it holds, a parent's, to the state
    buffer of round `round`, then meets the leaf warps, which read it past the barrier.
    Every leaf warp is done with that buffer's last state, round - 2's: it met this warp
    at round - 1's barrier after stepping its leaves."""
    comptime for m in range(ROWS):
        published.unsafe_store[alignment=CV * 4](published_at[ROWS, CV](round, tid, m), held[m])
    unit_barrier()


@always_inline
def leaf_warps_unit[
    ROWS: Int, CV: Int, K: Int, V: Int, RING_LEN: Int, CHANNEL: Bool, LEAF_WARPS: Int
](
    published: SharedFloats,
    with_leaves: Int,
    readout: Pointer[Float32, MutAnyOrigin],
    ring: Pointer[Float32, MutAnyOrigin],
    qkv: Pointer[Float32, ImmutAnyOrigin],
    decay: Pointer[Float32, ImmutAnyOrigin],
    beta: Pointer[Float32, ImmutAnyOrigin],
    parents: Pointer[Int32, ImmutAnyOrigin],
    request: Int,
    start: Int,
    window: Int,
    record_row_base: Int,
    record_stride: Int,
    num_key_heads: Int,
    key_head: Int,
    num_value_heads: Int,
    value_head: Int,
    group_slot: Int,
    column: Int,
    lane: Int,
    writes_column: Bool,
    records: Bool,
    tid: Int,
    leaf_warp: Int,
):
    """A leaf warp's part of a tree unit: for each parent with leaf children, in the order
    the first warp publishes them (-1, then the inner nodes in the window's order), the
    parent's state read from the round's buffer into the registers the first warp held it
    in, and this warp's share of its leaves stepped on it (step_leaves)."""
    var inner = tree_inner_nodes(parents, request * RING_LEN, window)
    var round = 0
    for parent in range(-1, window):
        if (with_leaves >> (parent + 1)) & 1 == 0:
            continue
        unit_barrier()  # the first warp has published the parent's state
        var held = Array[SIMD[DType.float32, CV], ROWS](uninitialized=True)
        comptime for m in range(ROWS):
            held[m] = published.unsafe_load[width=CV, alignment=CV * 4](
                published_at[ROWS, CV](round, tid, m)
            )
        step_leaves[K, V, RING_LEN, CHANNEL, LEAF_WARPS](
            readout, ring, qkv, decay, beta, parents, held, inner, parent, request, start,
            window, record_row_base, record_stride, num_key_heads, key_head, num_value_heads,
            value_head, group_slot, column, lane, writes_column, records, leaf_warp,
        )
        round += 1


@always_inline
def hint_slab_rows[
    state_dtype: DType, //, K: Int, V: Int
](
    state: Pointer[Scalar[state_dtype], MutAnyOrigin],
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    request: Int,
    num_rows: Int,
    num_value_heads: Int,
    value_head: Int,
    slab_start: Int,
    group_column: Int,
    lane: Int,
):
    """Asks L2 for the thread's state rows of the slab, at the row id as it is now."""
    comptime ROWS = K // REDUCTION_LANES
    var hinted_row = Int(load_hint(row_ids.unsafe_offset(request)))
    if hinted_row < num_rows:
        var hinted_rows = state.unsafe_offset(
            hinted_row * (num_value_heads * K * V) + value_head * K * V + lane * V
            + slab_start + group_column
        )
        comptime for m in range(ROWS):
            prefetch_l2(hinted_rows.unsafe_offset(m * REDUCTION_LANES * V))


@always_inline
def latency_unit[
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
    RECORD: Bool,
    FOLD_PREVIOUS: Bool,
    CV: Int,
    CHANNEL: Bool,
    TREE: Bool,
    LEAF_WARPS: Int = 1,
](
    readout: Pointer[Float32, MutAnyOrigin],
    state: Pointer[Scalar[state_dtype], MutAnyOrigin],
    ring: Pointer[Float32, MutAnyOrigin],
    qkv: Pointer[Float32, ImmutAnyOrigin],
    decay: Pointer[Float32, ImmutAnyOrigin],
    beta: Pointer[Float32, ImmutAnyOrigin],
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    offsets: Pointer[UInt32, ImmutAnyOrigin],
    previous_ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    previous_accepted: Pointer[UInt32, ImmutAnyOrigin],
    batch_i32: Int32,
    num_tokens_i32: Int32,
    num_rows_i32: Int32,
    num_ring_rows_i32: Int32,
    num_value_heads_i32: Int32,
    num_key_heads_i32: Int32,
    record_stride_i32: Int32,
    dependent_i32: Int32,
    parents: Pointer[Int32, ImmutAnyOrigin],
    previous_nodes: Pointer[UInt32, ImmutAnyOrigin],
):
    """One warp's unit: a request on one slab of SLAB value columns of one value head,
    its state in the warp's registers from the first load to the last store.

    With `TREE` (windows_gpu_latency_tree_kernel) the window is a token tree, node i a
    child of node `parents[request, i]`; `parents` and `previous_nodes` are read with
    TREE alone. A tree unit may be LEAF_WARPS warps: the first steps what one warp steps
    but the leaves, the others the leaves, from the states it publishes (publish_state,
    leaf_warps_unit)."""
    comptime assert LEAF_WARPS == 1 or TREE, "only a tree's leaves are shared among warps"
    comptime SLAB = latency_slab_columns[CV]()
    comptime SLABS_PER_HEAD = V // SLAB
    comptime ROWS = K // REDUCTION_LANES
    comptime CHUNK = WINDOW_CHUNK
    comptime NATURAL = natural_pitch[K]()
    comptime ROW_BYTES = CV * size_of[state_dtype]()
    comptime Columns = SIMD[DType.float32, CV]
    comptime assert V % SLAB == 0, "the slabs must divide V"
    var num_value_heads = Int(num_value_heads_i32)
    var num_key_heads = Int(num_key_heads_i32)
    var record_stride = Int(record_stride_i32)
    var num_tokens = Int(num_tokens_i32)
    var group_size = num_value_heads // num_key_heads
    var readout_width = num_value_heads * V

    # The unit: request `request` on the slab from column `slab_start` of value head
    # `value_head`.
    var unit = Int(block_idx.x)
    var slab_start = (unit % SLABS_PER_HEAD) * SLAB
    var value_head = (unit // SLABS_PER_HEAD) % num_value_heads
    var request = unit // (SLABS_PER_HEAD * num_value_heads)
    if request >= Int(batch_i32):
        return
    var key_head = value_head // group_size
    var group_slot = value_head - key_head * group_size
    var tid = Int(thread_idx.x)
    # The thread's warp in the unit, and from here on its index in that warp.
    var leaf_warp = 0
    comptime if LEAF_WARPS > 1:
        leaf_warp = tid // WARP_THREADS
        tid = tid % WARP_THREADS
    var lane = tid % REDUCTION_LANES
    var group_column = (tid // REDUCTION_LANES) * CV  # this thread's first column in a slab
    var slot = slab_slot[CV](lane)
    # One lane of each column stores its sums.
    var writes_column = (lane & (REDUCTION_LANES // CV - 1)) == 0

    # 0. Launched as a programmatic dependent (`dependent`, window_launch.mojo), the
    # unit may start while the kernel before it on the stream still runs, possibly
    # writing the pool, the ring or the tables. Until the wait it only asks L2 for the
    # state rows of its slab, and the records a fold on load reads, at the ids it
    # reads now: hints that save a trip to memory when right and cost nothing else when
    # wrong.
    var num_rows = Int(num_rows_i32)
    var num_ring_rows = Int(num_ring_rows_i32)
    if dependent_i32 != 0:
        hint_slab_rows[K, V](
            state, row_ids, request, num_rows, num_value_heads, value_head, slab_start,
            group_column, lane,
        )
        # Inline, not a function beside hint_slab_rows: as one the fold on load
        # compiles to other PTX (the same instructions, other registers).
        comptime if FOLD_PREVIOUS:
            var hinted_count = Int(load_hint(previous_accepted.unsafe_offset(request)))
            var hinted_ring_row = Int(load_hint(previous_ring_row_ids.unsafe_offset(request)))
            if hinted_count <= RING_LEN and hinted_ring_row < num_ring_rows:
                var hinted_records = first_record_at[RING_LEN](
                    hinted_ring_row, num_key_heads, key_head, record_stride
                )
                prefetch_record_lines[K, V, CHANNEL](
                    ring, hinted_records, hinted_count, record_stride, group_size, group_slot,
                    slab_start, tid,
                )
        wait_for_previous_grid()
        # Every block of this kernel has started: the next kernel's blocks may take the
        # SM slots left and give their own hints while this one runs.
        release_next_grid()

    # The request's ids, read by every thread (the loads broadcast).
    var start = Int(offsets[unsafe_offset=request])
    var end = Int(offsets[unsafe_offset=request + 1])
    var row = Int(row_ids[unsafe_offset=request])
    var ring_row = 0
    comptime if RECORD:
        ring_row = Int(ring_row_ids[unsafe_offset=request])
    var accepted = 0
    var previous_row = 0
    comptime if FOLD_PREVIOUS:
        accepted = Int(previous_accepted[unsafe_offset=request])
        previous_row = Int(previous_ring_row_ids[unsafe_offset=request])
        if accepted > RING_LEN:
            accepted = 0  # that verify committed the state itself
    if not (start <= end and end <= num_tokens):
        return  # offsets out of range: nothing to read, nothing written
    var commit = not RECORD or end - start > RING_LEN
    var bad_id = row >= num_rows
    bad_id = bad_id or (RECORD and not commit and ring_row >= num_ring_rows)
    bad_id = bad_id or (accepted > 0 and previous_row >= num_ring_rows)
    comptime if TREE:
        # A tree's tables are trusted for speed too, but never followed: a window past
        # the ring (it would commit, and a tree has no one path to commit), a parent
        # that is neither -1 nor an earlier node, or a previous path out of order or
        # past the ring sends the request away before any load of the state or the ring.
        bad_id = bad_id or not tree_is_valid[RING_LEN](
            parents, previous_nodes, request * RING_LEN, end - start, accepted
        )
    if bad_id:
        # Never follow an id out of bounds; make the request's readout loudly invalid.
        if writes_column and leaf_warp == 0:  # a tree unit's first warp, for all
            for t in range(start, end):
                for _ in range(1):  # a loop of one: see the slab's pass below
                    readout[unsafe_offset=t * readout_width + value_head * V + slab_start
                        + group_column + slot] = nan[DType.float32]()
        return

    # A tree unit of several warps: the leaf warps step the leaves from the states the
    # first warp publishes, and are done (leaf_warps_unit).
    var published = shared_floats[(2 * ROWS * WARP_THREADS * CV if LEAF_WARPS > 1 else 0) + COPY_FLOATS]()
    var with_leaves = 0
    var rounds = 0  # the states the first warp has published
    comptime if LEAF_WARPS > 1:
        with_leaves = parents_of_leaves(parents, request * RING_LEN, end - start)
        if leaf_warp != 0:
            leaf_warps_unit[ROWS, CV, K, V, RING_LEN, CHANNEL, LEAF_WARPS](
                published, with_leaves, readout, ring, qkv, decay, beta, parents, request,
                start, end - start, (ring_row * num_key_heads + key_head) * RING_LEN,
                record_stride, num_key_heads, key_head, num_value_heads, value_head,
                group_slot, slab_start + group_column, lane, writes_column,
                RECORD and not commit, tid, leaf_warp,
            )
            return

    # The warp's shared memory (SlabStaging), allocated here: allocated in SlabStaging's
    # constructor, the buffers compile to other PTX.
    var pairs = shared_floats[CHUNK * 2 * NATURAL]()
    var values = shared_floats[CHUNK * SLAB]()
    var scalars = shared_floats[CHUNK * TOKEN_SCALARS]()
    var record_keys = shared_floats[(CHUNK * NATURAL if FOLD_PREVIOUS else 0) + COPY_FLOATS]()
    var record_deltas = shared_floats[(CHUNK * SLAB if FOLD_PREVIOUS else 0) + COPY_FLOATS]()
    comptime DECAYS = K if CHANNEL else 1
    var record_decays = shared_floats[CHUNK * DECAYS + COPY_FLOATS]()
    var token_decays = shared_floats[(CHUNK * K if CHANNEL else 0) + COPY_FLOATS]()
    var staged = SlabStaging[K, V, CV, FOLD_PREVIOUS, CHANNEL](
        pairs, values, scalars, record_keys, record_deltas, record_decays, token_decays
    )

    # The pass calls the copies through these closures: with the methods called
    # directly (and the coordinates in a struct) every latency kernel compiled to
    # other PTX.
    @always_inline
    def copy_tokens(first: Int, count: Int) {imm}:
        staged.copy_tokens(
            qkv, decay, beta, first, count, num_key_heads, key_head, num_value_heads,
            value_head, slab_start, tid,
        )

    var records_at = first_record_at[RING_LEN](previous_row, num_key_heads, key_head, record_stride)

    @always_inline
    def copy_records(first: Int, count: Int) {imm}:
        staged.copy_records(
            ring, records_at + first * record_stride, record_stride, count, group_size,
            group_slot, slab_start, tid,
        )

    var head_rows = state.unsafe_offset(
        row * (num_value_heads * K * V) + value_head * K * V + lane * V + group_column
    )
    var record_row_base = (ring_row * num_key_heads + key_head) * RING_LEN
    var records = RECORD and not commit
    # The chunk's norms, once: 1/|k| and q's scale 1/|q| * 1/sqrt(K).
    var inverse_key_norms = Array[Float32, CHUNK](fill=0.0)
    var query_scales = Array[Float32, CHUNK](fill=0.0)

    # The unit is one pass over its slab, written as the loop of one pass it was while a
    # warp could take several slabs (the walking kernel, removed): LLVM optimizes the
    # loop, with the pass index in `pass_start`, `staged_column` and `staging` and the
    # `restage` test, otherwise than straight-line code, and the straight-line kernel's
    # PTX differs (ptxas: the same registers within 2, or fewer in the forward, fp32 228
    # to 195 and bf16 232 to 200 with head gates; no spills either way). Until that PTX
    # is tested and timed on a GPU, the loop keeps this kernel's code as it was measured.
    var restage = end - start > CHUNK or accepted > CHUNK
    for slab_pass in range(1):
        var pass_start = slab_start + slab_pass * SLAB
        var staged_column = slab_pass * SLAB + group_column  # in the staged value columns
        var column = pass_start + group_column
        var slab = pass_start // SLAB
        var staging = slab_pass == 0 or restage

        # 1. Everything the pass needs first is in flight at once.
        var state_rows = head_rows.unsafe_offset(pass_start)
        if staging:
            comptime if not TREE:  # a tree's fold on load reads its path from the ring
                var first_records = min(CHUNK, accepted)
                if first_records > 0:
                    copy_records(0, first_records)
            copy_tokens(start, min(CHUNK, end - start))
            async_copy_commit_group()
        # held[m] is state row m * 8 + lane of the thread's CV columns.
        var held = Array[Columns, ROWS](uninitialized=True)
        comptime for m in range(ROWS):
            held[m] = state_rows.unsafe_load[width=CV, alignment=ROW_BYTES](
                m * REDUCTION_LANES * V
            ).cast[DType.float32]()

        @always_inline
        def store_state() {mut}:
            comptime for m in range(ROWS):
                state_rows.unsafe_store[alignment=ROW_BYTES](
                    m * REDUCTION_LANES * V, held[m].cast[state_dtype]()
                )

        if staging:
            async_copy_wait_all()
            syncwarp()

        # 2. Fold on load: the previous step's accepted records, as the fold applies them.
        comptime if FOLD_PREVIOUS:
            if accepted > 0:
                comptime if TREE:
                    # The previous step's accepted path (previous_nodes), node by node
                    # from the ring, as the path fold applies it.
                    for t in range(accepted):
                        var node = Int(previous_nodes[unsafe_offset=request * RING_LEN + t])
                        fold_ring_record[K, V, CHANNEL](
                            held, ring, records_at + node * record_stride, group_size,
                            group_slot, column, lane,
                        )
                else:
                    for chunk_start in range(0, accepted, CHUNK):
                        var count = min(CHUNK, accepted - chunk_start)
                        if chunk_start > 0:
                            syncwarp()  # every lane is done with the previous chunk
                            copy_records(chunk_start, count)
                            async_copy_commit_group()
                            async_copy_wait_all()
                            syncwarp()
                        fold_staged_records[K, CHANNEL](held, staged, count, staged_column, lane)
                # What a separate fold leaves in the pool, and what the window reads back.
                comptime for m in range(ROWS):
                    held[m] = held[m].cast[state_dtype]().cast[DType.float32]()
                if not commit:
                    store_state()

        # A tree's nodes that are some node's parent are stepped in the window's order,
        # each from the state `held` holds (last_stepped's); its leaves are stepped with
        # their parent, its state held (step_leaves), and leave it as it was.
        var inner = 0
        var last_stepped = -1
        comptime if TREE:
            inner = tree_inner_nodes(parents, request * RING_LEN, end - start)
            # The leaves whose parent is the committed state.
            comptime if LEAF_WARPS > 1:
                if with_leaves & 1 != 0:
                    publish_state(published, held, rounds, tid)
                    rounds += 1
            else:
                step_leaves[K, V, RING_LEN, CHANNEL, LEAF_WARPS](
                    readout, ring, qkv, decay, beta, parents, held, inner, -1, request, start,
                    end - start, record_row_base, record_stride, num_key_heads, key_head,
                    num_value_heads, value_head, group_slot, column, lane, writes_column,
                    records, leaf_warp,
                )

        # 3. The window, a chunk of tokens at a time.
        for chunk_start in range(start, end, CHUNK):
            var count = min(CHUNK, end - chunk_start)
            if chunk_start > start:
                syncwarp()  # every lane is done with the previous chunk
                copy_tokens(chunk_start, count)
                async_copy_commit_group()
                async_copy_wait_all()
                syncwarp()
            if staging or chunk_start > start:
                chunk_norms[K](pairs, count, lane, inverse_key_norms, query_scales)
            comptime if TREE:
                # Not unrolled: a node's leaves step between it and the next.
                for c in range(count):
                    var token = chunk_start + c
                    var node = token - start
                    # A leaf stepped with its parent (step_leaves).
                    var steps = (inner >> node) & 1 != 0
                    var parent = Int(parents[unsafe_offset=request * RING_LEN + node])
                    # `held` holds last_stepped's state (the committed state before
                    # the first); a node whose parent is another starts from the
                    # committed state with its parent's root path folded in. The
                    # parent is the warp's (every lane read it), so the warp branches
                    # as one.
                    if steps and parent != last_stepped:
                        # The committed state: the pool, which a verify never writes
                        # but for a fold on load's result, stored above by this very
                        # thread (the same addresses: program order).
                        comptime for m in range(ROWS):
                            held[m] = state_rows.unsafe_load[width=CV, alignment=ROW_BYTES](
                                m * REDUCTION_LANES * V
                            ).cast[DType.float32]()
                        # The root path's delta columns of this thread were stored
                        # to the ring by other lanes of this warp (the lanes that
                        # write each column): their stores must be visible to this
                        # lane's loads.
                        warp_ring_visible()
                        fold_root_path[K, V, RING_LEN, CHANNEL](
                            held, ring, qkv, decay, parents, request, parent,
                            record_row_base * record_stride, record_stride, start,
                            num_key_heads, key_head, num_value_heads, value_head,
                            group_slot, column, lane,
                        )
                    # The chain's step below, under `steps` (written twice: with the
                    # chain's inside this branch, its kernels compiled to other PTX).
                    if steps:
                        var tree_step = slab_token[K, CHANNEL](
                            held, pairs, values, scalars, token_decays, c, inverse_key_norms[c],
                            query_scales[c], c * SLAB + staged_column + slot, lane,
                        )
                        if writes_column:
                            readout[unsafe_offset=token * readout_width + value_head * V + column
                                + slot] = tree_step[0]
                            if records:
                                ring[unsafe_offset=(record_row_base + node) * record_stride
                                    + delta_offset[K, V](group_slot) + column + slot] = tree_step[1]
                        last_stepped = node
                        comptime if LEAF_WARPS > 1:
                            if (with_leaves >> (node + 1)) & 1 != 0:
                                publish_state(published, held, rounds, tid)
                                rounds += 1
                        else:
                            step_leaves[K, V, RING_LEN, CHANNEL, LEAF_WARPS](
                                readout, ring, qkv, decay, beta, parents, held, inner, node,
                                request, start, end - start, record_row_base, record_stride,
                                num_key_heads, key_head, num_value_heads, value_head,
                                group_slot, column, lane, writes_column, records, leaf_warp,
                            )
            else:
                # Unrolled, so that a token's readout shuffles overlap the next token's sums.
                comptime for c in range(CHUNK):
                    if c < count:
                        var token = chunk_start + c
                        var readout_and_delta = slab_token[K, CHANNEL](
                            held, pairs, values, scalars, token_decays, c, inverse_key_norms[c],
                            query_scales[c], c * SLAB + staged_column + slot, lane,
                        )
                        var o = readout_and_delta[0]
                        var u = readout_and_delta[1]
                        if writes_column:
                            readout[unsafe_offset=token * readout_width + value_head * V + column + slot] = o
                            if records:
                                ring[unsafe_offset=(record_row_base + token - start) * record_stride
                                    + delta_offset[K, V](group_slot) + column + slot] = u
            comptime if RECORD:
                if records and slab == 0:
                    write_chunk_records[K, V, CHANNEL](
                        ring, (record_row_base + chunk_start - start) * record_stride,
                        record_stride, count, pairs, scalars, token_decays, group_size,
                        group_slot, tid,
                    )

        # 4. A forward, or a window too long for the ring, commits the state.
        if commit and (end > start or accepted > 0):
            store_state()


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(WARP_THREADS)),
)
def windows_gpu_latency_kernel[
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
    RECORD: Bool,
    FOLD_PREVIOUS: Bool,
    CV: Int,
    CHANNEL: Bool = False,
](
    readout: Pointer[Float32, MutAnyOrigin],
    state: Pointer[Scalar[state_dtype], MutAnyOrigin],
    ring: Pointer[Float32, MutAnyOrigin],
    qkv: Pointer[Float32, ImmutAnyOrigin],
    decay: Pointer[Float32, ImmutAnyOrigin],
    beta: Pointer[Float32, ImmutAnyOrigin],
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    offsets: Pointer[UInt32, ImmutAnyOrigin],
    previous_ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    previous_accepted: Pointer[UInt32, ImmutAnyOrigin],
    batch_i32: Int32,
    num_tokens_i32: Int32,
    num_rows_i32: Int32,
    num_ring_rows_i32: Int32,
    num_value_heads_i32: Int32,
    num_key_heads_i32: Int32,
    record_stride_i32: Int32,
    dependent_i32: Int32,
):
    """One warp's unit: a request on one slab of SLAB value columns of one value head,
    its state in the warp's registers from the first load to the last store (a chain
    verify, a verify with fold on load, or a forward: latency_unit)."""
    latency_unit[state_dtype, K, V, RING_LEN, RECORD, FOLD_PREVIOUS, CV, CHANNEL, False](
        readout,
        state,
        ring,
        qkv,
        decay,
        beta,
        row_ids,
        ring_row_ids,
        offsets,
        previous_ring_row_ids,
        previous_accepted,
        batch_i32,
        num_tokens_i32,
        num_rows_i32,
        num_ring_rows_i32,
        num_value_heads_i32,
        num_key_heads_i32,
        record_stride_i32,
        dependent_i32,
        Pointer[Int32, ImmutAnyOrigin](unsafe_from_address=Int(row_ids)),  # read with TREE alone
        row_ids,
    )


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(WARP_THREADS * LEAF_WARPS)),
)
def windows_gpu_latency_tree_kernel[
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
    FOLD_PREVIOUS: Bool,
    CV: Int,
    CHANNEL: Bool = False,
    LEAF_WARPS: Int = 1,
](
    readout: Pointer[Float32, MutAnyOrigin],
    state: Pointer[Scalar[state_dtype], MutAnyOrigin],
    ring: Pointer[Float32, MutAnyOrigin],
    qkv: Pointer[Float32, ImmutAnyOrigin],
    decay: Pointer[Float32, ImmutAnyOrigin],
    beta: Pointer[Float32, ImmutAnyOrigin],
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    offsets: Pointer[UInt32, ImmutAnyOrigin],
    previous_ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    previous_accepted: Pointer[UInt32, ImmutAnyOrigin],
    batch_i32: Int32,
    num_tokens_i32: Int32,
    num_rows_i32: Int32,
    num_ring_rows_i32: Int32,
    num_value_heads_i32: Int32,
    num_key_heads_i32: Int32,
    record_stride_i32: Int32,
    dependent_i32: Int32,
    parents: Pointer[Int32, ImmutAnyOrigin],
    previous_nodes: Pointer[UInt32, ImmutAnyOrigin],
):
    """The tree verify's unit (latency_unit with TREE): a request's token tree on one
    slab of one value head, a block of LEAF_WARPS warps that share its leaves. It
    records, as a chain verify does, and never commits."""
    latency_unit[state_dtype, K, V, RING_LEN, True, FOLD_PREVIOUS, CV, CHANNEL, True, LEAF_WARPS](
        readout,
        state,
        ring,
        qkv,
        decay,
        beta,
        row_ids,
        ring_row_ids,
        offsets,
        previous_ring_row_ids,
        previous_accepted,
        batch_i32,
        num_tokens_i32,
        num_rows_i32,
        num_ring_rows_i32,
        num_value_heads_i32,
        num_key_heads_i32,
        record_stride_i32,
        dependent_i32,
        parents,
        previous_nodes,
    )
