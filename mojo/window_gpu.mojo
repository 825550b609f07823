"""The verify window and the forward on the GPU: blocks that work through units, one
request on one column tile of one value head each, of one layer.

A head's [K, V] state splits into independent column tiles (kv[j] and the readout
only ever sum down column j). A thread holds one reduction lane of four neighbouring
columns: lane p's key rows p, p + 8, p + 16, ... as 16-byte vectors. Each sum over K
is then one fma chain per column inside the thread and three butterfly steps across
the column group's eight lanes, in the fixed order of recurrence_math.mojo; q and k
are read four elements at a time where they are used, so registers go to the state.

Per unit, the block
1. waits for the asynchronous copies of the unit's state tile, first records and
   first tokens (window_gpu_staging.mojo), puts q, k and the records' keys in
   lane-major order and computes the tokens' norms, once, and moves the state tile to
   registers; meanwhile it reads the next unit's ids and claims the one after;
2. starts the copies for its next unit, so that they land while it computes, and
   asks L2 for the next unit's state tile;
3. folds the previous step's accepted records into the state when asked to (fold on
   load) and writes the folded state back: a decoding step reads and writes each
   state element once. The folded state goes back into the staged tile and leaves as
   tensor boxes (the copy engine, not the warps, waits on memory); the next unit's
   tile comes in as soon as the copy engine has read it out;
4. runs the window token by token; a token's readout sums finish while the next token
   computes. Its readout and, for a verify, its delta row wait in a shared-memory
   outbox, and each warp sends its columns on as 16-byte stores after a chunk of
   tokens, with the ring records' keys and decays. A forward, or a window longer than
   the ring, writes the state instead of records.

The grid holds as many blocks as the GPU runs at once, each working through several
units, so the copies of one unit overlap the arithmetic of another. A block runs the
unit of its own index, then the one a grid further on, and then, where blocks run more
than two units each, claims units from a counter until none are left: blocks that run
faster than others (on a less busy SM, with shorter windows) take more units instead of
waiting for them. Without the counter (two units or fewer each) a block runs the units
a grid apart.

With `CHANNEL` (per-channel gates, Kimi Delta Attention) a token brings K decays per
value head and a record keeps them (record_layout.channel_decay_offset). They arrive
beside the keys, are put in lane-major order with them, and each lane reads the decays
of its own rows four at a time, so that state row i decays by the i-th, in the order
of the latency kernel and the reference. Without it the kernel compiles to the code it
had before it took the parameter (bench/profiling/same_ptx.sh).
"""

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, barrier, block_idx, grid_dim, thread_idx
from max.gpu.sync import syncwarp
from max.gpu.host.nvidia.tma import TMADescriptor
from max.gpu.memory import async_copy_commit_group, async_copy_wait_all, external_memory
from max.gpu.primitives.warp import shuffle_xor
from std.math import ceildiv, fma
from std.memory import AddressSpace, bitcast, stack_allocation
from std.sys import inlined_assembly, size_of
from std.utils import StaticTuple
from std.utils.numerics import nan

from .bulk_copy import (
    SWIZZLE_ALIGNMENT,
    SharedBarrier,
    arrive_expecting_bytes,
    init_barrier,
    shared_writes_visible_to_bulk_copies,
    wait_bulk_copies_read,
    wait_phase,
)
from .grid_dependency import load_hint, release_next_grid, wait_for_previous_grid
from .record_layout import (
    channel_decay_offset,
    decay_offset,
    delta_offset,
    first_record_at,
    key_offset,
)
from .recurrence_math import REDUCTION_LANES
from .window_gpu_staging import (
    BETA_AT,
    BLOCK_SHARED_LIMIT,
    BLOCK_SHARED_MAX,
    DECAY_AT,
    INVERSE_KEY_NORM_AT,
    PLAN_FIELDS,
    PLAN_SLOTS,
    SharedFloats,
    SharedUInts,
    TOKEN_SCALARS,
    WINDOW_CHUNK,
    copy_channel_records_async,
    copy_channel_tokens_async,
    copy_records_async,
    copy_state_tile_async,
    copy_tokens_async,
    lane_major_floats,
    natural_pitch,
    stage_lane_major,
    quotient,
    remainder,
    permuted_pitch,
    RequestPlan,
    store_state_tile_boxes,
    copy_state_tile_boxes,
    prefetch_state_tile_boxes,
    staged_at,
    tile_in_boxes,
    plan_request,
    UnitPlace,
    claim_unit,
    place_of,
    divide,
    plan_field_reader,
    read_plan_field,
    unit_claimer,
    shared_floats,
    window_blocks_per_sm,
    window_static_bytes,
    window_tile_bytes,
    outbox_in_record_keys,
    OUTBOX_ROWS_PER_TOKEN,
    WARP_THREADS,
    COPY_FLOATS,
)
from .column_groups import COLUMN_VECTOR, Columns, column_slot, column_sum, gather_columns

def window_block_threads[COLUMN_TILE: Int]() -> Int:
    return (COLUMN_TILE // COLUMN_VECTOR) * REDUCTION_LANES


@always_inline
def rounded_to[
    ROWS: Int, //, dtype: DType
](held: Array[Columns, ROWS]) -> Array[SIMD[dtype, COLUMN_VECTOR], ROWS]:
    """The held state in the pool's dtype, as the pool stores it."""
    var rounded = Array[SIMD[dtype, COLUMN_VECTOR], ROWS](uninitialized=True)
    comptime for m in range(ROWS):
        rounded[m] = held[m].cast[dtype]()
    return rounded^


@always_inline
def bf16_pair(low: Float32, high: Float32) -> UInt32:
    """Two fp32 values rounded to bf16 (to nearest even) in one instruction: `low` in the
    word's low half, `high` in its high half, as a pool stores neighbouring columns."""
    return inlined_assembly["cvt.rn.bf16x2.f32 $0, $1, $2;", UInt32, constraints="=r,f,f"](
        high, low
    )


@always_inline
def folded_state_rounded[
    ROWS: Int, //, dtype: DType
](mut held: Array[Columns, ROWS]) -> Array[SIMD[dtype, COLUMN_VECTOR], ROWS]:
    """What a separate fold leaves in the pool: the held state rounded to the pool's dtype,
    and the held state set to that rounded value widened back, as a verify reads it. In bf16
    two columns round in one instruction and widen from the packed word (a shift for the
    low half, a mask for the high): rounding and widening element by element took about
    twice the instructions."""
    var stored = Array[SIMD[dtype, COLUMN_VECTOR], ROWS](uninitialized=True)
    comptime if dtype == DType.bfloat16:
        comptime for m in range(ROWS):
            var words = SIMD[DType.uint32, COLUMN_VECTOR // 2](
                bf16_pair(held[m][0], held[m][1]), bf16_pair(held[m][2], held[m][3])
            )
            stored[m] = bitcast[dtype, COLUMN_VECTOR](words)
            held[m] = Columns(
                bitcast[DType.float32](words[0] << 16),
                bitcast[DType.float32](words[0] & 0xFFFF0000),
                bitcast[DType.float32](words[1] << 16),
                bitcast[DType.float32](words[1] & 0xFFFF0000),
            )
    else:
        comptime for m in range(ROWS):
            stored[m] = held[m].cast[dtype]()
            held[m] = stored[m].cast[DType.float32]()
    return stored^


@always_inline
def lane_start[K: Int](buffer: SharedFloats, row: Int, lane: Int) -> SharedFloats:
    """Where lane `lane` of vector `row` of a lane-major buffer starts. A lane's elements
    are read four at a time (16-byte loads, lane_vector) right where they are used, not
    held: registers go to the state."""
    return buffer.unsafe_offset((row * REDUCTION_LANES + lane) * permuted_pitch[K]())


@always_inline
def lane_vector(lane_values: SharedFloats, j: Int) -> SIMD[DType.float32, 4]:
    """Elements 4j .. 4j + 3 of a lane's run (lane_start)."""
    return lane_values.unsafe_load[width=4, alignment=16](4 * j)


@always_inline
def row_decay[
    CHANNEL: Bool
](decay_lane: SharedFloats, one_decay: Float32, j: Int, e: Int) -> Float32:
    """The decay of held row 4j + e (state row (4j + e) * 8 + lane): per-channel, element e
    of the lane's j-th vector of lane-major decays in shared memory (read again where it is
    used, not held in registers); else the token's one decay."""
    comptime if CHANNEL:
        return lane_vector(decay_lane, j)[e]
    else:
        return one_decay


@always_inline
def tile_token[
    ROWS: Int, //, K: Int, CHANNEL: Bool = False, KEEP: Bool = True
](
    mut held: Array[Columns, ROWS],
    mut pending_out: Columns,
    scalars: SharedFloats,
    keys: SharedFloats,
    queries: SharedFloats,
    values: SharedFloats,
    c: Int,
    value_at: Int,
    lane: Int,
    decay_rows: SharedFloats,
) -> Tuple[Float32, Float32]:
    """Staged token c on the held tile: decays the state, adds k u^T and leaves this
    thread's partial readout sums in `pending_out`. Returns the whole readout of the
    token before, whose sums (`pending_out` as it came in) finish here so that their
    shuffles overlap this token's arithmetic, and the delta u of this lane's column
    (value_at: its value in `values`). With per-channel gates row m * 8 + lane decays
    by its own decay, read from the lane-major `decay_rows` as k is; without, every
    row by the token's one decay and `decay_rows` is unused.

    Without KEEP (a token tree's leaf: no node steps from its state) the held state is
    left as it came in: the decayed and updated state is summed into the readout
    instead of stored, each decayed element computed again in the second pass (the same
    product: the same bits)."""
    comptime LANE_VECTORS = ceildiv(ROWS, 4)
    var token_scalars_c = scalars.unsafe_load[width=TOKEN_SCALARS, alignment=16](
        c * TOKEN_SCALARS
    )
    var d = token_scalars_c[DECAY_AT]
    var b = token_scalars_c[BETA_AT]
    var inv_k = token_scalars_c[INVERSE_KEY_NORM_AT]
    var k_lane = lane_start[K](keys, c, lane)
    var q_lane = lane_start[K](queries, c, lane)
    var d_lane = lane_start[K](decay_rows, c, lane)
    var previous_o = column_sum(pending_out, lane)
    # kv = S^T k on the decayed state.
    var partial = Columns(0.0)
    comptime if KEEP:
        comptime for j in range(LANE_VECTORS):
            var k4 = lane_vector(k_lane, j)
            comptime if CHANNEL:
                var d4 = lane_vector(d_lane, j)
                comptime for e in range(min(4, ROWS - 4 * j)):
                    held[4 * j + e] = held[4 * j + e] * d4[e]
                    partial = fma(held[4 * j + e], Columns(k4[e]), partial)
            else:
                comptime for e in range(min(4, ROWS - 4 * j)):
                    held[4 * j + e] = held[4 * j + e] * d
                    partial = fma(held[4 * j + e], Columns(k4[e]), partial)
    else:
        comptime for j in range(LANE_VECTORS):
            var k4 = lane_vector(k_lane, j)
            comptime for e in range(min(4, ROWS - 4 * j)):
                partial = fma(held[4 * j + e] * row_decay[CHANNEL](d_lane, d, j, e), Columns(k4[e]), partial)
    var kv = column_sum(partial, lane)
    var v = values[unsafe_offset=value_at]
    var error = fma(-kv, inv_k, v)
    var u = (b * error) * inv_k
    var u_columns = gather_columns(u, lane)
    # S += k u^T, then the readout o = S^T (q / |q| / sqrt(K)).
    var out = Columns(0.0)
    comptime for j in range(LANE_VECTORS):
        var k4 = lane_vector(k_lane, j)
        var q4 = lane_vector(q_lane, j)
        comptime for e in range(min(4, ROWS - 4 * j)):
            comptime if KEEP:
                held[4 * j + e] = fma(Columns(k4[e]), u_columns, held[4 * j + e])
                out = fma(held[4 * j + e], Columns(q4[e]), out)
            else:
                var updated = fma(
                    Columns(k4[e]), u_columns, held[4 * j + e] * row_decay[CHANNEL](d_lane, d, j, e)
                )
                out = fma(updated, Columns(q4[e]), out)
    pending_out = out
    return (previous_o, u)


@always_inline
def fold_staged_records[
    ROWS: Int, //, K: Int, COLUMN_TILE: Int, CHANNEL: Bool = False
](
    mut held: Array[Columns, ROWS],
    record_keys: SharedFloats,
    record_deltas: SharedFloats,
    record_decays: SharedFloats,
    count: Int,
    tile_column: Int,
    lane: Int,
    record_decay_rows: SharedFloats,
):
    """Applies `count` staged records (keys in lane-major order) to the held tile, in
    order, as the fold does: S = S * decay + k u^T. With per-channel gates row
    m * 8 + lane decays by its own decay, read from the lane-major `record_decay_rows`
    as the keys are (`record_decays` is unused); without, by the record's one decay in
    `record_decays` (`record_decay_rows` is unused)."""
    comptime LANE_VECTORS = ceildiv(ROWS, 4)
    for t in range(count):
        var d = record_decays[unsafe_offset=t]
        var u = record_deltas.unsafe_load[width=COLUMN_VECTOR, alignment=16](
            t * COLUMN_TILE + tile_column
        )
        var k_lane = lane_start[K](record_keys, t, lane)
        var d_lane = lane_start[K](record_decay_rows, t, lane)
        comptime for j in range(LANE_VECTORS):
            var k4 = lane_vector(k_lane, j)
            comptime if CHANNEL:
                var d4 = lane_vector(d_lane, j)
                comptime for e in range(min(4, ROWS - 4 * j)):
                    held[4 * j + e] = fma(Columns(k4[e]), u, held[4 * j + e] * d4[e])
            else:
                comptime for e in range(min(4, ROWS - 4 * j)):
                    held[4 * j + e] = fma(Columns(k4[e]), u, held[4 * j + e] * d)


@always_inline
def write_chunk_records[
    K: Int, V: Int, THREADS: Int, CHANNEL: Bool = False
](
    ring: Pointer[Float32, MutAnyOrigin],
    first: Int,
    record_stride: Int,
    count: Int,
    pairs: SharedFloats,
    scalars: SharedFloats,
    group_size: Int,
    group_slot: Int,
    tid: Int,
    token_decays: SharedFloats,
):
    """The records' raw keys (once per key head: the group's first value head writes
    them) and decays (once per value head) of a staged chunk of `count` tokens, the
    first at `first` in the ring; the deltas leave through the outbox. With per-channel
    gates the decays are each token's K, as they arrived (`token_decays`, rows
    `natural_pitch` apart), 16 bytes a store; without, `token_decays` is unused."""
    comptime NATURAL = natural_pitch[K]()
    comptime if CHANNEL:
        comptime DECAY_VECTORS = K // COPY_FLOATS
        for i in range(tid, count * DECAY_VECTORS, THREADS):
            var c = quotient[DECAY_VECTORS](i)
            var at = remainder[DECAY_VECTORS](i) * COPY_FLOATS
            ring.unsafe_store[alignment=16](
                first + c * record_stride + channel_decay_offset[K, V](group_size, group_slot)
                + at,
                token_decays.unsafe_load[width=COPY_FLOATS, alignment=16](c * NATURAL + at),
            )
    else:
        if tid < count:
            ring[unsafe_offset=first + tid * record_stride + decay_offset[K, V](
                group_size, group_slot
            )] = scalars[unsafe_offset=tid * TOKEN_SCALARS + DECAY_AT]
    if group_slot == 0:
        comptime KEY_VECTORS = K // COPY_FLOATS
        for i in range(tid, count * KEY_VECTORS, THREADS):
            var c = quotient[KEY_VECTORS](i)
            var at = remainder[KEY_VECTORS](i) * COPY_FLOATS
            ring.unsafe_store[alignment=16](
                first + c * record_stride + key_offset() + at,
                pairs.unsafe_load[width=COPY_FLOATS, alignment=16](
                    (2 * c + 1) * NATURAL + at
                ),
            )


@always_inline
def channel_decays[K: Int](pairs: SharedFloats) -> SharedFloats:
    """With per-channel gates, where the K decays of a chunk of tokens arrive: right
    after the chunk's q and k pairs, rows `natural_pitch` apart."""
    return pairs.unsafe_offset(WINDOW_CHUNK * 2 * natural_pitch[K]())


@always_inline
def record_channel_decays[K: Int](arrived_record_keys: SharedFloats) -> SharedFloats:
    """With per-channel gates, where the K decays of a chunk of records arrive: right
    after the records' keys, rows `natural_pitch` apart."""
    return arrived_record_keys.unsafe_offset(WINDOW_CHUNK * natural_pitch[K]())


@always_inline
def lane_major_decays[K: Int](lane_major_keys: SharedFloats) -> SharedFloats:
    """With per-channel gates, where a chunk's decays sit in lane-major order: right
    after the chunk's lane-major keys (tokens' or records')."""
    return lane_major_keys.unsafe_offset(WINDOW_CHUNK * lane_major_floats[K]())


@always_inline
def copy_unit_tokens[
    K: Int, V: Int, COLUMN_TILE: Int, THREADS: Int, CHANNEL: Bool
](
    pairs: SharedFloats,
    values: SharedFloats,
    scalars: SharedFloats,
    qkv: Pointer[Float32, ImmutAnyOrigin],
    decay: Pointer[Float32, ImmutAnyOrigin],
    beta: Pointer[Float32, ImmutAnyOrigin],
    first_token: Int,
    count: Int,
    num_key_heads: Int,
    key_head: Int,
    num_value_heads: Int,
    value_head: Int,
    column: Int,
    tid: Int,
):
    """Starts the copies of `count` tokens (copy_tokens_async; per-channel, with their K
    decays after the q and k pairs, channel_decays, copy_channel_tokens_async). A function of its own rather than
    a branch inside the kernel's start_copies closure: there, even the branch compiled
    out changed the head-gate kernels' PTX (two address computations swapped)."""
    comptime if CHANNEL:
        copy_channel_tokens_async[K, V, COLUMN_TILE, THREADS](
            pairs, values, scalars, channel_decays[K](pairs), qkv, decay, beta, first_token, count,
            num_key_heads, key_head, num_value_heads, value_head, column, tid,
        )
    else:
        copy_tokens_async[K, V, COLUMN_TILE, THREADS](
            pairs, values, scalars, qkv, decay, beta, first_token, count, num_key_heads,
            key_head, num_value_heads, value_head, column, tid,
        )


@always_inline
def stage_tokens[
    K: Int, V: Int, COLUMN_TILE: Int, FOLD_PREVIOUS: Bool, CHANNEL: Bool = False
](
    pairs: SharedFloats,
    values: SharedFloats,
    scalars: SharedFloats,
    queries: SharedFloats,
    keys: SharedFloats,
    record_keys: SharedFloats,
    qkv: Pointer[Float32, ImmutAnyOrigin],
    decay: Pointer[Float32, ImmutAnyOrigin],
    beta: Pointer[Float32, ImmutAnyOrigin],
    first: Int,
    count: Int,
    num_key_heads: Int,
    key_head: Int,
    num_value_heads: Int,
    value_head: Int,
    tile_start: Int,
    tid: Int,
    token_decays: SharedFloats,
    decay_rows: SharedFloats,
):
    """Copies `count` tokens from token `first` into the block's buffers and, once every
    thread's copies have landed, puts q and k (per-channel, also the decays, from
    `token_decays` into `decay_rows`) in lane-major order with their norms
    (stage_lane_major). The block's threads call it together."""
    comptime THREADS = window_block_threads[COLUMN_TILE]()
    copy_unit_tokens[K, V, COLUMN_TILE, THREADS, CHANNEL](
        pairs, values, scalars, qkv, decay, beta, first, count, num_key_heads, key_head,
        num_value_heads, value_head, tile_start, tid,
    )
    async_copy_commit_group()
    async_copy_wait_all()
    barrier()
    stage_lane_major[K, THREADS, FOLD_PREVIOUS, CHANNEL](
        pairs, queries, keys, count, scalars, record_keys, record_keys, 0, tid,
        token_decays, decay_rows, record_keys, record_keys,
    )


@fieldwise_init
struct UnitThread(ImplicitlyCopyable):
    """A unit's place, and this thread's in it: reduction lane `lane` of columns
    `column .. column + 3` (`tile_column` in the tile), ending each column sum with the
    whole sum of column `column + slot`."""

    var place: UnitPlace
    var tid: Int
    var lane: Int
    var tile_column: Int
    var column: Int
    var slot: Int


@always_inline
def locate[COLUMN_TILE: Int, TILES: Int](block_column: Int, group_size: Int) -> UnitThread:
    """The unit's and thread's coordinates, made from an opaque zero at the start of every
    unit: the compiler then cannot hoist the addresses made from them out of the unit
    loop, where they would be spilled and reloaded behind the state's stores (a reload
    that waits for the stores to drain)."""
    var zero = Int(
        inlined_assembly["mov.u32 $0, 0;", UInt32, constraints="=r", has_side_effect=True]()
    )
    var place = place_of[COLUMN_TILE, TILES](block_column + zero, group_size)
    var tid = Int(thread_idx.x) + zero
    var lane = remainder[REDUCTION_LANES](tid)
    var tile_column = quotient[REDUCTION_LANES](tid) * COLUMN_VECTOR
    var column = place.tile_start + tile_column
    return UnitThread(place, tid, lane, tile_column, column, column_slot(lane))


@always_inline
def request_of(unit: Int, block_columns: Int) -> Int:
    """The request of unit `unit` (window_gpu_staging.mojo: request u // block_columns)."""
    return divide(unit, block_columns)[0]


@always_inline
def place_of_unit[
    COLUMN_TILE: Int, TILES: Int
](unit: Int, block_columns: Int, group_size: Int) -> UnitPlace:
    """The place of unit `unit`'s column block (u % block_columns)."""
    return place_of[COLUMN_TILE, TILES](divide(unit, block_columns)[1], group_size)


@always_inline
def read_unit_ids[
    RECORD: Bool, FOLD_PREVIOUS: Bool
](
    field: Int,
    unit: Int,
    units: Int,
    block_columns: Int,
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    offsets: Pointer[UInt32, ImmutAnyOrigin],
    previous_ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    previous_accepted: Pointer[UInt32, ImmutAnyOrigin],
) -> UInt32:
    """This thread's field (plan_field_reader) of the ids of `unit`'s request; 0 when it
    reads none."""
    if field >= 0 and unit < units:
        return read_plan_field[RECORD, FOLD_PREVIOUS](
            field, request_of(unit, block_columns), row_ids, ring_row_ids, offsets,
            previous_ring_row_ids, previous_accepted,
        )
    return 0


@always_inline
def claim_after(
    claims: Bool, grid_blocks: Int, unit_counter: Pointer[UInt32, MutAnyOrigin], previous: Int
) -> UInt32:
    """The block's unit after its second: claimed from the counter, or without one (a
    launch whose blocks run at most two units each) the unit a grid after `previous`."""
    if claims:
        return UInt32(2 * grid_blocks) + claim_unit(unit_counter)
    return UInt32(previous + grid_blocks)


struct ThroughputShared[
    state_dtype: DType, K: Int, COLUMN_TILE: Int, FOLD_PREVIOUS: Bool, CHANNEL: Bool
](ImplicitlyCopyable):
    """The throughput kernel's shared memory, per block. Records and tokens have two
    buffers: one being computed on, one being filled for the next unit (the records' keys
    have one, see below; a unit that folds its records in chunks uses both record
    buffers, folds_in_chunks). The state tile has one, in dynamic shared memory
    (window_tile_bytes): it is moved to registers, and a folded state has left it, before
    the next unit's tile is copied in.

    Records and tokens land as they are, 16 bytes per copy; q and k, and the records'
    keys, are then put in lane-major order once per unit (stage_lane_major), where the
    norms also turn q into q / |q| / sqrt(K).

    Per-channel gates (CHANNEL) add K decays per token and per record, each buffer of
    them right after the keys' buffer it goes with (channel_decays): a token's as they
    arrive after its chunk's q and k pairs, lane-major after the lane-major keys; a
    record's as they arrive after the arrived record keys (record_channel_decays),
    lane-major after the lane-major record keys (lane_major_decays). Each decay address
    is then a constant offset from a key address the kernel holds anyway: a register of
    its own for them made the verify spill. Without CHANNEL, MULTIPLE is 1 and the
    buffers are as they were."""

    comptime CHUNK = WINDOW_CHUNK
    comptime NATURAL = natural_pitch[Self.K]()
    comptime LANE_MAJOR = lane_major_floats[Self.K]()
    comptime ARRIVED_RECORD_KEYS = Self.CHUNK * Self.NATURAL if Self.FOLD_PREVIOUS else 0
    comptime RECORD_DELTAS = Self.CHUNK * Self.COLUMN_TILE if Self.FOLD_PREVIOUS else 0
    comptime RECORD_DECAYS = Self.CHUNK if Self.FOLD_PREVIOUS else 0
    comptime MULTIPLE = 2 if Self.CHANNEL else 1
    # Rows per token in a buffer of arriving tokens: q and k, and per-channel the decays.
    comptime PAIR_ROWS = 3 if Self.CHANNEL else 2
    comptime OUTBOX_FLOATS = OUTBOX_ROWS_PER_TOKEN * Self.CHUNK * Self.COLUMN_TILE
    comptime OUTBOX_SHARED = outbox_in_record_keys[Self.K, Self.COLUMN_TILE, Self.FOLD_PREVIOUS]()
    comptime StateTile = Pointer[
        Scalar[Self.state_dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ]

    var state_tile: Self.StateTile
    # One buffer of record keys as they arrive: a unit's are put in lane-major order
    # before the next unit's are copied in (see start_copies).
    var arrived_record_keys: SharedFloats
    var record_keys: SharedFloats
    var record_deltas: SharedFloats
    var record_decays: SharedFloats
    var token_pairs: SharedFloats
    var queries: SharedFloats
    var keys: SharedFloats
    var token_values: SharedFloats
    var token_scalars: SharedFloats
    # A chunk's readout rows and delta rows (token c's at rows 2c and 2c + 1) wait here
    # until the chunk's tokens are done, then leave as 16-byte stores: the token loop
    # then holds no global addresses (registers go to the state). In a fold on load
    # they share the lane-major record keys' buffer, which the window does not use.
    var outbox: SharedFloats
    var plan_ids: SharedUInts
    # unit_ids[k % 2] holds the block's k-th unit from the moment it is known.
    var unit_ids: SharedUInts
    var tile_arrived: SharedBarrier

    @always_inline
    def __init__(out self):
        """Allocates the block's shared memory."""
        var state_tile = external_memory[
            Scalar[Self.state_dtype], address_space=AddressSpace.SHARED, alignment=16
        ]()
        comptime if tile_in_boxes[Self.state_dtype, Self.COLUMN_TILE]():
            # Swizzled boxes start on the swizzle's alignment.
            state_tile = state_tile.unsafe_offset(
                (SWIZZLE_ALIGNMENT - Int(state_tile) % SWIZZLE_ALIGNMENT)
                % SWIZZLE_ALIGNMENT
                // size_of[Self.state_dtype]()
            )
        self.state_tile = state_tile
        self.arrived_record_keys = shared_floats[Self.MULTIPLE * Self.ARRIVED_RECORD_KEYS + 4]()
        self.record_keys = shared_floats[
            (Self.MULTIPLE * Self.CHUNK * Self.LANE_MAJOR if Self.FOLD_PREVIOUS else 0) + 4
        ]()
        self.record_deltas = shared_floats[2 * Self.RECORD_DELTAS + 4]()
        self.record_decays = shared_floats[2 * Self.RECORD_DECAYS + 4]()
        self.token_pairs = shared_floats[2 * Self.CHUNK * Self.PAIR_ROWS * Self.NATURAL]()
        self.queries = shared_floats[Self.CHUNK * Self.LANE_MAJOR]()
        self.keys = shared_floats[Self.MULTIPLE * Self.CHUNK * Self.LANE_MAJOR]()
        self.token_values = shared_floats[2 * Self.CHUNK * Self.COLUMN_TILE]()
        self.token_scalars = shared_floats[2 * Self.CHUNK * TOKEN_SCALARS]()
        self.outbox = shared_floats[(0 if Self.OUTBOX_SHARED else Self.OUTBOX_FLOATS) + 4]()
        comptime if Self.OUTBOX_SHARED:
            self.outbox = self.record_keys
        self.plan_ids = stack_allocation[
            PLAN_FIELDS * PLAN_SLOTS, DType.uint32, alignment=16, address_space=AddressSpace.SHARED
        ]()
        self.unit_ids = stack_allocation[
            PLAN_SLOTS, DType.uint32, alignment=8, address_space=AddressSpace.SHARED
        ]()
        self.tile_arrived = stack_allocation[
            1, DType.uint64, alignment=8, address_space=AddressSpace.SHARED
        ]()


@always_inline
def hint_first_tile[
    state_dtype: DType, K: Int, COLUMN_TILE: Int, TILES: Int
](
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    unit: Int,
    block_columns: Int,
    group_size: Int,
    num_rows: Int,
    num_value_heads: Int,
    state_map_at: UInt64,
):
    """Asks L2 for the state tile of the block's first unit at the row the ids name now
    (one thread, before the wait for the kernel before)."""
    var hinted_row = Int(load_hint(row_ids.unsafe_offset(request_of(unit, block_columns))))
    if hinted_row < num_rows:
        var first_place = place_of_unit[COLUMN_TILE, TILES](unit, block_columns, group_size)
        prefetch_state_tile_boxes[state_dtype, K, COLUMN_TILE](
            state_map_at,
            (hinted_row * num_value_heads + first_place.value_head) * K,
            first_place.tile_start,
        )


@always_inline
def stores_through_tile[
    state_dtype: DType, COLUMN_TILE: Int, FOLD_PREVIOUS: Bool
](plan: RequestPlan) -> Bool:
    """Whether the request's folded state leaves through the staged tile as tensor boxes:
    the next unit's tile then comes in once they have read it."""
    comptime if FOLD_PREVIOUS and tile_in_boxes[state_dtype, COLUMN_TILE]():
        return plan.runs and plan.accepted > 0 and not plan.commit
    return False


@always_inline
def folds_in_chunks[FOLD_PREVIOUS: Bool](plan: RequestPlan) -> Bool:
    """Whether a unit folds its records in more than one chunk: those chunks pass through
    the keys' one buffer and both units' delta and decay buffers (a later chunk is copied
    into the other buffer while the chunk before is folded), so the next unit's records
    are copied after its fold."""
    comptime if FOLD_PREVIOUS:
        return plan.runs and plan.accepted > WINDOW_CHUNK
    return False


@always_inline
def wait_for_unit[
    state_dtype: DType, COLUMN_TILE: Int
](plan: RequestPlan, tile_arrived: SharedBarrier, mut tile_phase: Int):
    """1. The unit's copies have landed, for every thread (the tensor boxes of its state
    tile too: `tile_phase` is the phase of `tile_arrived` they complete); the block is
    done with the previous unit."""
    async_copy_wait_all()
    comptime if tile_in_boxes[state_dtype, COLUMN_TILE]():
        if plan.runs:
            wait_phase(tile_arrived, tile_phase)
            tile_phase ^= 1
    barrier()


@always_inline
def stage_first_chunk[
    K: Int, COLUMN_TILE: Int, FOLD_PREVIOUS: Bool, CHANNEL: Bool
](
    plan: RequestPlan,
    pairs: SharedFloats,
    scalars: SharedFloats,
    queries: SharedFloats,
    keys: SharedFloats,
    arrived_record_keys: SharedFloats,
    record_keys: SharedFloats,
    first_count: Int,
    tid: Int,
):
    """Puts a unit's first chunk of tokens (`first_count`, copied by start_copies) and,
    in a fold on load, its first chunk of records in lane-major order, with the tokens'
    norms (stage_lane_major). The block's threads call it together."""
    comptime THREADS = window_block_threads[COLUMN_TILE]()
    var first_records = 0
    comptime if FOLD_PREVIOUS:
        first_records = min(WINDOW_CHUNK, plan.accepted)
    if first_count > 0 or first_records > 0:
        stage_lane_major[K, THREADS, FOLD_PREVIOUS, CHANNEL](
            pairs, queries, keys, first_count, scalars,
            arrived_record_keys, record_keys, first_records, tid,
            channel_decays[K](pairs), lane_major_decays[K](keys),
            record_channel_decays[K](arrived_record_keys), lane_major_decays[K](record_keys),
        )


@always_inline
def load_staged_tile[
    ROWS: Int, //, state_dtype: DType, K: Int, COLUMN_TILE: Int
](
    mut held: Array[Columns, ROWS],
    state_tile: Pointer[
        Scalar[state_dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    lane: Int,
    tile_column: Int,
):
    """Moves this thread's rows of the staged state tile to `held`, widened to fp32:
    held[m] is state row m * 8 + lane of the thread's four columns."""
    comptime for m in range(ROWS):
        held[m] = state_tile.unsafe_load[
            width=COLUMN_VECTOR, alignment=COLUMN_VECTOR * size_of[state_dtype]()
        ](
            staged_at[state_dtype, K, COLUMN_TILE](m * REDUCTION_LANES + lane, tile_column)
        ).cast[DType.float32]()


@always_inline
def poison_readout[
    V: Int
](
    readout: Pointer[Float32, MutAnyOrigin],
    plan: RequestPlan,
    readout_width: Int,
    value_head: Int,
    column: Int,
    slot: Int,
    lane: Int,
):
    """Makes a request's readout loudly invalid (NaN) where an id is out of bounds: one
    lane of each column writes it."""
    for t in range(plan.start, plan.end):
        if (lane & 1) == 0:
            readout[unsafe_offset=t * readout_width + value_head * V + column + slot] = nan[
                DType.float32
            ]()


@always_inline
def copy_record_chunk[
    K: Int, V: Int, COLUMN_TILE: Int, CHANNEL: Bool
](
    arrived_keys: SharedFloats,
    deltas: SharedFloats,
    decays: SharedFloats,
    ring: Pointer[Float32, MutAnyOrigin],
    first: Int,
    count: Int,
    record_stride: Int,
    group_size: Int,
    group_slot: Int,
    tile_start: Int,
    tid: Int,
):
    """Starts the copies of `count` of a fold on load's records, from the one at `first`
    in the ring: keys as they are into `arrived_keys`, the tile's deltas into `deltas`,
    and the decays (into `decays`; per-channel K of each, after the keys,
    record_channel_decays, and `decays` is unused)."""
    comptime THREADS = window_block_threads[COLUMN_TILE]()
    comptime if CHANNEL:
        copy_channel_records_async[K, V, COLUMN_TILE, THREADS](
            arrived_keys, deltas, record_channel_decays[K](arrived_keys), ring, first, count,
            record_stride, group_size, group_slot, tile_start, tid,
        )
    else:
        copy_records_async[K, V, COLUMN_TILE, THREADS](
            arrived_keys, deltas, decays, ring, first, count, record_stride, group_size,
            group_slot, tile_start, tid,
        )


@always_inline
def stage_record_keys[
    K: Int, COLUMN_TILE: Int, FOLD_PREVIOUS: Bool, CHANNEL: Bool
](
    pairs: SharedFloats,
    scalars: SharedFloats,
    queries: SharedFloats,
    keys: SharedFloats,
    arrived_keys: SharedFloats,
    record_keys: SharedFloats,
    count: Int,
    tid: Int,
):
    """Puts a later chunk of `count` records' keys (per-channel, also their decays) in
    lane-major order; no tokens (the window's first chunk stays staged)."""
    comptime THREADS = window_block_threads[COLUMN_TILE]()
    stage_lane_major[K, THREADS, FOLD_PREVIOUS, CHANNEL](
        pairs, queries, keys, 0, scalars, arrived_keys, record_keys, count, tid,
        channel_decays[K](pairs), lane_major_decays[K](keys),
        record_channel_decays[K](arrived_keys), lane_major_decays[K](record_keys),
    )


@always_inline
def stage_folded_tile[
    ROWS: Int, //, state_dtype: DType, K: Int, COLUMN_TILE: Int
](
    state_tile: Pointer[
        Scalar[state_dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    stored: Array[SIMD[state_dtype, COLUMN_VECTOR], ROWS],
    lane: Int,
    tile_column: Int,
):
    """Puts the folded state back where it was staged from, for the copy engine to take
    out as tensor boxes; the block's threads call it together."""
    comptime for m in range(ROWS):
        state_tile.unsafe_store[alignment=COLUMN_VECTOR * size_of[state_dtype]()](
            staged_at[state_dtype, K, COLUMN_TILE](m * REDUCTION_LANES + lane, tile_column),
            stored[m],
        )
    shared_writes_visible_to_bulk_copies()
    barrier()


@always_inline
def store_state_rows[
    ROWS: Int, //, state_dtype: DType, V: Int
](
    state_rows: Pointer[Scalar[state_dtype], MutAnyOrigin],
    values: Array[SIMD[state_dtype, COLUMN_VECTOR], ROWS],
):
    """Writes the held state, already in the pool's dtype, from this thread's first state
    row (`state_rows`); its other rows are constant offsets from it."""
    comptime for m in range(ROWS):
        state_rows.unsafe_store[alignment=COLUMN_VECTOR * size_of[state_dtype]()](
            m * REDUCTION_LANES * V, values[m]
        )


@always_inline
def post[
    COLUMN_TILE: Int
](outbox: SharedFloats, row: Int, value: Float32, lane: Int, tile_column: Int, slot: Int):
    """One lane of each column leaves its value in outbox row `row` (token c's readout at
    row 2c, its delta at 2c + 1)."""
    if (lane & 1) == 0:
        outbox[unsafe_offset=row * COLUMN_TILE + tile_column + slot] = value


@always_inline
def window_chunk_tokens[
    ROWS: Int, //, K: Int, COLUMN_TILE: Int, RECORD: Bool, CHANNEL: Bool
](
    mut held: Array[Columns, ROWS],
    outbox: SharedFloats,
    scalars: SharedFloats,
    keys: SharedFloats,
    queries: SharedFloats,
    values: SharedFloats,
    count: Int,
    lane: Int,
    tile_column: Int,
    slot: Int,
):
    """The window's `count` staged tokens on the held tile (tile_token), their readouts
    and, for a verify, their deltas left in the outbox for send_outbox."""
    # The readout sums of token c are finished while token c + 1 computes: their
    # shuffles then overlap its arithmetic instead of stalling the warp.
    var pending_out = Columns(0.0)
    for c in range(count):
        var readout_and_delta = tile_token[K, CHANNEL](
            held, pending_out, scalars, keys, queries, values, c,
            c * COLUMN_TILE + tile_column + slot, lane, lane_major_decays[K](keys),
        )
        var previous_o = readout_and_delta[0]
        var u = readout_and_delta[1]
        if c > 0:
            post[COLUMN_TILE](outbox, 2 * (c - 1), previous_o, lane, tile_column, slot)
        comptime if RECORD:
            post[COLUMN_TILE](outbox, 2 * c + 1, u, lane, tile_column, slot)
    if count > 0:
        post[COLUMN_TILE](
            outbox, 2 * (count - 1), column_sum(pending_out, lane), lane, tile_column, slot
        )


@always_inline
def send_outbox[
    K: Int, V: Int, COLUMN_TILE: Int, THREADS: Int, RECORD: Bool, CHANNEL: Bool
](
    outbox: SharedFloats,
    readout: Pointer[Float32, MutAnyOrigin],
    ring: Pointer[Float32, MutAnyOrigin],
    plan: RequestPlan,
    chunk_start: Int,
    count: Int,
    record_row_base: Int,
    tid: Int,
    value_head: Int,
    tile_start: Int,
    group_slot: Int,
    tile: Int,
    readout_width: Int,
    record_stride: Int,
    group_size: Int,
    pairs: SharedFloats,
    scalars: SharedFloats,
):
    """Sends a chunk's outbox (`count` tokens from `chunk_start`: readouts at rows 2c,
    deltas at 2c + 1) on to the readout and, for a verify, the ring: each warp the
    columns it wrote, so that it waits for itself alone. The records' raw keys and
    decays come from the staged tokens (`pairs`, `scalars`; write_chunk_records)."""
    # The block is whole warps, or one warp at most (whole_warps).
    comptime WARP_LANES = min(WARP_THREADS, THREADS)
    comptime WARP_COLUMNS = WARP_LANES // REDUCTION_LANES * COLUMN_VECTOR
    comptime ROW_VECTORS = WARP_COLUMNS // COPY_FLOATS
    var records = RECORD and not plan.commit
    # Every row, or only the readout rows where nothing is recorded.
    var row_step = 1 if records else 2
    var warp_lane = remainder[WARP_LANES](tid)
    var warp_column = quotient[WARP_LANES](tid) * WARP_COLUMNS
    syncwarp()  # the warp's own readouts and deltas are in the outbox
    for i in range(warp_lane, count * (2 // row_step) * ROW_VECTORS, WARP_LANES):
        var row = quotient[ROW_VECTORS](i) * row_step
        var in_tile = warp_column + remainder[ROW_VECTORS](i) * COPY_FLOATS
        var c = row >> 1
        var vector = outbox.unsafe_load[width=COPY_FLOATS, alignment=16](
            row * COLUMN_TILE + in_tile
        )
        if (row & 1) == 0:
            readout.unsafe_store[alignment=16](
                (chunk_start + c) * readout_width + value_head * V + tile_start + in_tile,
                vector,
            )
        else:
            var record = (record_row_base + chunk_start + c - plan.start) * record_stride
            ring.unsafe_store[alignment=16](
                record + delta_offset[K, V](group_slot) + tile_start + in_tile, vector
            )
    comptime if RECORD:
        if records and tile == 0:
            write_chunk_records[K, V, THREADS, CHANNEL](
                ring, (record_row_base + chunk_start - plan.start) * record_stride,
                record_stride, count, pairs, scalars, group_size, group_slot, tid,
                channel_decays[K](pairs),
            )


@fieldwise_init
struct WindowViews(ImplicitlyCopyable):
    """The shared memory the window reads and writes: the unit's token buffer (q and k
    pairs as they arrived, values, scalars), the lane-major q and k, the record keys'
    buffer (restaged through) and the outbox."""

    var pairs: SharedFloats
    var values: SharedFloats
    var scalars: SharedFloats
    var queries: SharedFloats
    var keys: SharedFloats
    var record_keys: SharedFloats
    var outbox: SharedFloats


@always_inline
def run_window[
    ROWS: Int, //,
    K: Int,
    V: Int,
    COLUMN_TILE: Int,
    RECORD: Bool,
    FOLD_PREVIOUS: Bool,
    CHANNEL: Bool,
](
    mut held: Array[Columns, ROWS],
    readout: Pointer[Float32, MutAnyOrigin],
    ring: Pointer[Float32, MutAnyOrigin],
    qkv: Pointer[Float32, ImmutAnyOrigin],
    decay: Pointer[Float32, ImmutAnyOrigin],
    beta: Pointer[Float32, ImmutAnyOrigin],
    views: WindowViews,
    plan: RequestPlan,
    record_row_base: Int,
    num_key_heads: Int,
    num_value_heads: Int,
    readout_width: Int,
    record_stride: Int,
    group_size: Int,
    place: UnitPlace,
    tid: Int,
    lane: Int,
    tile_column: Int,
    slot: Int,
):
    """4. The window on the held tile, WINDOW_CHUNK tokens at a time: the first chunk as
    the unit staged it (1.), each later one staged here into the same buffers. A chunk's
    readouts and deltas leave through the outbox (send_outbox) once its tokens are done.
    The block's threads call it together."""
    comptime THREADS = window_block_threads[COLUMN_TILE]()
    var pairs = views.pairs
    var values = views.values
    var scalars = views.scalars
    var queries = views.queries
    var keys = views.keys
    var record_keys = views.record_keys
    var outbox = views.outbox
    for chunk_start in range(plan.start, plan.end, WINDOW_CHUNK):
        var count = min(WINDOW_CHUNK, plan.end - chunk_start)
        if chunk_start > plan.start:
            barrier()  # done with the previous chunk of tokens and its norms
            stage_tokens[K, V, COLUMN_TILE, FOLD_PREVIOUS, CHANNEL](
                pairs, values, scalars, queries, keys, record_keys, qkv, decay, beta,
                chunk_start, count, num_key_heads, place.key_head, num_value_heads,
                place.value_head, place.tile_start, tid, channel_decays[K](pairs),
                lane_major_decays[K](keys),
            )
            barrier()
        window_chunk_tokens[K, COLUMN_TILE, RECORD, CHANNEL](
            held, outbox, scalars, keys, queries, values, count, lane, tile_column, slot
        )
        send_outbox[K, V, COLUMN_TILE, THREADS, RECORD, CHANNEL](
            outbox, readout, ring, plan, chunk_start, count, record_row_base, tid,
            place.value_head, place.tile_start, place.group_slot, place.tile, readout_width,
            record_stride, group_size, pairs, scalars,
        )


# Tell the register allocator how many blocks an SM should hold (window_blocks_per_sm),
# so that it leaves them room: unbounded, it takes over 200 registers per thread.
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](
        Int32(window_block_threads[COLUMN_TILE]())
    ),
    `nvvm.minctasm`=SIMDLength(
        window_blocks_per_sm[
            state_dtype,
            K,
            COLUMN_TILE,
            FOLD_PREVIOUS,
            window_block_threads[COLUMN_TILE](),
            CHANNEL,
        ]()
    ),
)
# The tensor map is read by the copy engine from the kernel's parameters.
@__llvm_arg_metadata(state_map, `nvvm.grid_constant`)
def windows_gpu_kernel[
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
    RECORD: Bool,
    FOLD_PREVIOUS: Bool,
    COLUMN_TILE: Int,
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
    unit_counter: Pointer[UInt32, MutAnyOrigin],
    state_map: TMADescriptor,
    claims_i32: Int32,
    batch_i32: Int32,
    num_tokens_i32: Int32,
    num_rows_i32: Int32,
    num_ring_rows_i32: Int32,
    num_value_heads_i32: Int32,
    num_key_heads_i32: Int32,
    record_stride_i32: Int32,
    dependent_i32: Int32,
):
    """A block's units, one after another, in the steps of the module's docstring: the
    driver of the phase functions above. What stays inline here either holds the unit
    loop's state or, moved into a function, compiled to other machine code."""
    comptime TILES = V // COLUMN_TILE
    comptime ROWS = K // REDUCTION_LANES
    comptime THREADS = window_block_threads[COLUMN_TILE]()
    comptime CHUNK = WINDOW_CHUNK
    comptime LANE_MAJOR = lane_major_floats[K]()
    comptime assert (
        window_static_bytes[K, COLUMN_TILE, FOLD_PREVIOUS, CHANNEL]() <= BLOCK_SHARED_LIMIT
        and window_static_bytes[K, COLUMN_TILE, FOLD_PREVIOUS, CHANNEL]()
        + window_tile_bytes[state_dtype, K, COLUMN_TILE]() <= BLOCK_SHARED_MAX
    ), "the window kernel's shared memory exceeds an SM's: use a smaller COLUMN_TILE"
    var num_value_heads = Int(num_value_heads_i32)
    var num_key_heads = Int(num_key_heads_i32)
    var record_stride = Int(record_stride_i32)
    var num_tokens = Int(num_tokens_i32)
    var num_rows = Int(num_rows_i32)
    var num_ring_rows = Int(num_ring_rows_i32)
    var group_size = num_value_heads // num_key_heads
    var readout_width = num_value_heads * V
    var row_elements = num_value_heads * K * V

    var tile = 0
    var value_head = 0
    var key_head = 0
    var group_slot = 0
    var tid = Int(thread_idx.x)
    # This thread holds reduction lane `lane` of columns `column .. column + 3`, and
    # ends each column sum with the whole sum of column `column + slot`.
    var lane = 0
    var tile_column = 0
    var tile_start = 0
    var column = 0
    var slot = 0

    # The coordinates are set again at the start of every unit (locate). Through this
    # closure, as before: assigned in the loop itself they compile to other machine code
    # (the window's chunk loop exits through another branch).
    @always_inline
    def relocate(block_column: Int) {mut}:
        var at = locate[COLUMN_TILE, TILES](block_column, group_size)
        tid = at.tid
        tile = at.place.tile
        value_head = at.place.value_head
        key_head = at.place.key_head
        group_slot = at.place.group_slot
        lane = at.lane
        tile_column = at.tile_column
        tile_start = at.place.tile_start
        column = at.column
        slot = at.slot

    comptime Shared = ThroughputShared[state_dtype, K, COLUMN_TILE, FOLD_PREVIOUS, CHANNEL]
    comptime BOXED_TILE = tile_in_boxes[state_dtype, COLUMN_TILE]()
    comptime NATURAL = Shared.NATURAL
    comptime RECORD_DELTAS = Shared.RECORD_DELTAS
    comptime RECORD_DECAYS = Shared.RECORD_DECAYS
    comptime PAIR_ROWS = Shared.PAIR_ROWS
    comptime OUTBOX_SHARED = Shared.OUTBOX_SHARED
    var shared = Shared()
    var state_tile = shared.state_tile
    # The generic address of the pool's tensor map, for tensor-box copies.
    var state_map_at = UInt64(Int(Pointer(to=state_map)))
    var arrived_record_keys = shared.arrived_record_keys
    var record_keys = shared.record_keys
    var record_deltas = shared.record_deltas
    var record_decays = shared.record_decays
    var token_pairs = shared.token_pairs
    var queries = shared.queries
    var keys = shared.keys
    var token_values = shared.token_values
    var token_scalars = shared.token_scalars
    var outbox = shared.outbox
    var plan_ids = shared.plan_ids
    var unit_ids = shared.unit_ids
    var tile_arrived = shared.tile_arrived
    # The phase of `tile_arrived` the next staged tile completes.
    var tile_phase = 0

    # Units of work (window_gpu_staging.mojo): unit u is request u // block_columns on
    # column block u % block_columns.
    var block_columns = num_value_heads * TILES
    var units = Int(batch_i32) * block_columns
    var unit = Int(block_idx.x)
    if unit >= units:
        return
    # A block's first two units are the unit of its index and the one a grid further on;
    # the units after the first two grids' are claimed, where blocks claim at all.
    var grid_blocks = Int(grid_dim.x)
    var claims = claims_i32 != 0
    var field = plan_field_reader[THREADS](tid)

    # The closures below stay closures over the kernel's variables: written as functions
    # with those passed as arguments (head_row, head_state_at, previous_records_at,
    # start_tile_copy, start_record_copies, write_ids, each tried), the kernels compile to
    # other machine code; in the fold on load, head_row's arithmetic moves out of the
    # branch that uses it.
    @always_inline
    def write_ids(slot: Int, value: UInt32) {imm}:
        if field >= 0:
            plan_ids[unsafe_offset=field * PLAN_SLOTS + slot] = value

    @always_inline
    def plan_of(slot: Int) {imm} -> RequestPlan:
        return plan_request[RING_LEN, RECORD, FOLD_PREVIOUS](
            plan_ids, slot, num_tokens, num_rows, num_ring_rows
        )

    # Where the request's previous records for the unit's key head start in the ring.
    @always_inline
    def previous_records_at(plan: RequestPlan, place: UnitPlace) {imm} -> Int:
        return first_record_at[RING_LEN](
            plan.previous_row, num_key_heads, place.key_head, record_stride
        )

    # The first row of the request's head in the pool's [rows * heads * K, V] view.
    @always_inline
    def head_row(plan: RequestPlan, place: UnitPlace) {imm} -> Int:
        return (plan.row * num_value_heads + place.value_head) * K

    # Where the unit's state tile starts in the pool.
    @always_inline
    def head_state_at(plan: RequestPlan, place: UnitPlace) {imm} -> Int:
        return plan.row * row_elements + place.value_head * K * V + place.tile_start

    # Starts copying a unit's state tile into the staged tile.
    @always_inline
    def start_tile_copy(plan: RequestPlan, place: UnitPlace) {imm}:
        if plan.runs:
            comptime if BOXED_TILE:
                if tid == 0:
                    arrive_expecting_bytes(
                        tile_arrived, K * COLUMN_TILE * size_of[state_dtype]()
                    )
                    copy_state_tile_boxes[state_dtype, K, COLUMN_TILE](
                        state_tile, state_map_at, head_row(plan, place), place.tile_start,
                        tile_arrived,
                    )
            else:
                copy_state_tile_async[state_dtype, K, V, COLUMN_TILE, THREADS](
                    state_tile, state, head_state_at(plan, place), tid
                )

    # Starts copying a unit's first records: keys into their one buffer, deltas and
    # decays into buffer `buffer`.
    @always_inline
    def start_record_copies(plan: RequestPlan, place: UnitPlace, buffer: Int) {imm}:
        comptime if FOLD_PREVIOUS:
            if plan.runs and plan.accepted > 0:
                copy_record_chunk[K, V, COLUMN_TILE, CHANNEL](
                    arrived_record_keys, record_deltas.unsafe_offset(buffer * RECORD_DELTAS),
                    record_decays.unsafe_offset(buffer * RECORD_DECAYS), ring,
                    previous_records_at(plan, place), min(CHUNK, plan.accepted),
                    record_stride, group_size, place.group_slot, place.tile_start, tid,
                )

    # Starts every copy a unit needs first, into buffer `buffer`; the state tile's only
    # when `with_tile`, the records' only when `with_records`.
    @always_inline
    def start_copies(
        plan: RequestPlan, place: UnitPlace, buffer: Int, with_tile: Bool, with_records: Bool
    ) {imm}:
        if plan.runs:
            if with_tile:
                start_tile_copy(plan, place)
            if with_records:
                start_record_copies(plan, place, buffer)
            copy_unit_tokens[K, V, COLUMN_TILE, THREADS, CHANNEL](
                token_pairs.unsafe_offset(buffer * CHUNK * PAIR_ROWS * NATURAL),
                token_values.unsafe_offset(buffer * CHUNK * COLUMN_TILE),
                token_scalars.unsafe_offset(buffer * CHUNK * TOKEN_SCALARS),
                qkv, decay, beta, plan.start, min(CHUNK, plan.end - plan.start),
                num_key_heads, place.key_head, num_value_heads, place.value_head,
                place.tile_start, tid,
            )
        async_copy_commit_group()

    # Launched as a programmatic dependent (`dependent`, window_launch.mojo: launches of
    # one block per SM at most), the block may start while the kernel before it on the
    # stream still runs, possibly writing the pool, the ring or the tables. Until it
    # waits it only asks L2 for its first unit's state tile at the row the ids name now:
    # a hint that saves a trip to memory when right and costs nothing else when wrong.
    if dependent_i32 != 0:
        comptime if BOXED_TILE:
            if tid == 0:
                hint_first_tile[state_dtype, K, COLUMN_TILE, TILES](
                    row_ids, unit, block_columns, group_size, num_rows, num_value_heads,
                    state_map_at,
                )
        wait_for_previous_grid()
        # Every block of this kernel has started: the next kernel's blocks may take the
        # SM room left and give their own hints.
        release_next_grid()

    # The first unit's ids, and the second unit, which no block has to wait to claim.
    write_ids(
        0,
        read_unit_ids[RECORD, FOLD_PREVIOUS](
            field, unit, units, block_columns, row_ids, ring_row_ids, offsets,
            previous_ring_row_ids, previous_accepted,
        ),
    )
    if tid == unit_claimer[THREADS]():
        unit_ids[unsafe_offset=1] = UInt32(unit + grid_blocks)
    comptime if BOXED_TILE:
        if tid == 0:
            init_barrier(tile_arrived)
    barrier()
    start_copies(
        plan_of(0), place_of_unit[COLUMN_TILE, TILES](unit, block_columns, group_size), 0,
        True, True,
    )
    var step = 0  # the block's units so far
    while unit < units:
        relocate(divide(unit, block_columns)[1])
        var here = UnitPlace(value_head, key_head, group_slot, tile, tile_start)
        var buffer = step % 2
        var plan = plan_of(buffer)
        var next = Int(unit_ids[unsafe_offset=1 - buffer])
        unit = next
        step += 1
        # The next unit's ids, and the claim of the one after it, are read now and
        # written to shared memory at the end of 1., once they have arrived.
        var next_ids = read_unit_ids[RECORD, FOLD_PREVIOUS](
            field, next, units, block_columns, row_ids, ring_row_ids, offsets,
            previous_ring_row_ids, previous_accepted,
        )
        var after_next = UInt32(units)
        if tid == unit_claimer[THREADS]() and next < units:
            after_next = claim_after(claims, grid_blocks, unit_counter, next)
        var pairs = token_pairs.unsafe_offset(buffer * CHUNK * PAIR_ROWS * NATURAL)
        var values = token_values.unsafe_offset(buffer * CHUNK * COLUMN_TILE)
        var scalars = token_scalars.unsafe_offset(buffer * CHUNK * TOKEN_SCALARS)
        var first_count = min(CHUNK, plan.end - plan.start)

        # 1. This unit's copies have landed, for every thread; the block is done
        #    with the previous unit.
        wait_for_unit[state_dtype, COLUMN_TILE](plan, tile_arrived, tile_phase)
        # held[m] is state row m * 8 + lane of the thread's four columns.
        var held = Array[Columns, ROWS](fill=0.0)
        if plan.runs:
            stage_first_chunk[K, COLUMN_TILE, FOLD_PREVIOUS, CHANNEL](
                plan, pairs, scalars, queries, keys, arrived_record_keys, record_keys,
                first_count, tid,
            )
            load_staged_tile[state_dtype, K, COLUMN_TILE](held, state_tile, lane, tile_column)
        write_ids(1 - buffer, next_ids)  # every thread has read that slot's last plan
        if tid == unit_claimer[THREADS]():
            unit_ids[unsafe_offset=buffer] = after_next  # every thread has read this unit's id
        barrier()  # the state tile is free, the norms are written, the ids are in

        # 2. The next unit's copies run while this one computes. Its state tile waits
        #    until this unit's folded state has left the staged tile (3.).
        var next_place = place_of_unit[COLUMN_TILE, TILES](next, block_columns, group_size)
        if next < units:
            var next_plan = plan_of(1 - buffer)
            start_copies(
                next_plan,
                next_place,
                1 - buffer,
                not stores_through_tile[state_dtype, COLUMN_TILE, FOLD_PREVIOUS](plan),
                not folds_in_chunks[FOLD_PREVIOUS](plan),
            )
            # Its tile is copied in only after the fold (3.), but L2 can fetch it now,
            # while the block folds and stores: the copy then finds it there (4.5% off
            # a layer at batch 64). Fetching the tile after it instead is slower than
            # no fetch at all: L2 then seems to drop tiles before their copies come.
            comptime if BOXED_TILE:
                if (
                    tid == 0
                    and next_plan.runs
                    and stores_through_tile[state_dtype, COLUMN_TILE, FOLD_PREVIOUS](plan)
                ):
                    prefetch_state_tile_boxes[state_dtype, K, COLUMN_TILE](
                        state_map_at, head_row(next_plan, next_place), next_place.tile_start
                    )

        if plan.poisoned:
            # Never follow an id out of bounds; make the request's readout loudly invalid.
            poison_readout[V](readout, plan, readout_width, value_head, column, slot, lane)
        if not plan.runs:
            continue
        # This thread's first state row; the others are constant offsets from it.
        var state_rows = state.unsafe_offset(head_state_at(plan, here) + lane * V + tile_column)
        var changed = plan.end > plan.start

        # 3. Fold on load: apply the previous step's accepted records, as the fold would.
        comptime if FOLD_PREVIOUS:
            if plan.accepted > 0:
                changed = True
                var record_row = previous_records_at(plan, here)
                var arrived_keys = arrived_record_keys
                var rdeltas = record_deltas.unsafe_offset(buffer * RECORD_DELTAS)
                var rdecays = record_decays.unsafe_offset(buffer * RECORD_DECAYS)
                # A later chunk is copied while the one before it is folded: its deltas
                # and decays into the other unit's buffers, which a unit that folds in
                # chunks leaves to it (the next unit's records are copied after the fold,
                # folds_in_chunks), its keys into the arrived keys' buffer, free once the
                # chunk before is in lane-major order.
                var later_deltas = record_deltas.unsafe_offset((1 - buffer) * RECORD_DELTAS)
                var later_decays = record_decays.unsafe_offset((1 - buffer) * RECORD_DECAYS)
                for chunk_start in range(0, plan.accepted, CHUNK):
                    var count = min(CHUNK, plan.accepted - chunk_start)
                    var later_start = chunk_start + CHUNK
                    var later_count = min(CHUNK, plan.accepted - later_start)
                    if later_count > 0:
                        copy_record_chunk[K, V, COLUMN_TILE, CHANNEL](
                            arrived_keys, later_deltas, later_decays, ring,
                            record_row + later_start * record_stride, later_count,
                            record_stride, group_size, group_slot, tile_start, tid,
                        )
                        async_copy_commit_group()
                    fold_staged_records[K, COLUMN_TILE, CHANNEL](
                        held, record_keys, rdeltas, rdecays, count, tile_column, lane,
                        lane_major_decays[K](record_keys),
                    )
                    if later_count > 0:
                        async_copy_wait_all()
                        barrier()  # the later chunk has landed; the staged keys are free
                        stage_record_keys[K, COLUMN_TILE, FOLD_PREVIOUS, CHANNEL](
                            pairs, scalars, queries, keys, arrived_keys, record_keys,
                            later_count, tid,
                        )
                        barrier()  # the later chunk's keys are in lane-major order
                        var folded_deltas = rdeltas
                        var folded_decays = rdecays
                        rdeltas = later_deltas
                        rdecays = later_decays
                        later_deltas = folded_deltas
                        later_decays = folded_decays
                if folds_in_chunks[FOLD_PREVIOUS](plan) and next < units:
                    # The last chunk's keys are in lane-major order: the keys' buffer is
                    # free for the next unit's. Its deltas may be in the next unit's
                    # buffer, which every thread must be done with first.
                    barrier()
                    start_record_copies(plan_of(1 - buffer), next_place, 1 - buffer)
                    async_copy_commit_group()
                # What a separate fold leaves in the pool, and what a verify reads back.
                var stored = folded_state_rounded[state_dtype](held)
                if not plan.commit:
                    comptime if BOXED_TILE:
                        # Back where it was staged from, then out as tensor boxes.
                        stage_folded_tile[state_dtype, K, COLUMN_TILE](
                            state_tile, stored, lane, tile_column
                        )
                        # One thread moves the whole tile out, then the next one in
                        # as soon as the copy engine has read it. After the block's
                        # last unit nothing needs the tile: the thread goes on to the
                        # tokens and waits at the end of the kernel instead (0.6 us of
                        # warp 0's fold at batch 1, in phase counters).
                        if tid == 0:
                            store_state_tile_boxes[state_dtype, K, COLUMN_TILE](
                                state_map_at, head_row(plan, here), tile_start, state_tile
                            )
                            if next < units:
                                wait_bulk_copies_read()
                                start_tile_copy(plan_of(1 - buffer), next_place)
                    else:
                        store_state_rows[state_dtype, V](state_rows, stored)
                comptime if OUTBOX_SHARED:
                    if not stores_through_tile[state_dtype, COLUMN_TILE, FOLD_PREVIOUS](plan):
                        barrier()  # every thread is done with the record keys

        # 4. The window, WINDOW_CHUNK tokens at a time.
        var record_row_base = (plan.ring_row * num_key_heads + key_head) * RING_LEN
        run_window[K, V, COLUMN_TILE, RECORD, FOLD_PREVIOUS, CHANNEL](
            held, readout, ring, qkv, decay, beta,
            WindowViews(pairs, values, scalars, queries, keys, record_keys, outbox), plan,
            record_row_base, num_key_heads, num_value_heads, readout_width, record_stride,
            group_size, here, tid, lane, tile_column, slot,
        )

        # 5. A forward, or a window too long for the ring, commits the state.
        if plan.commit and changed:
            store_state_rows[state_dtype, V](state_rows, rounded_to[state_dtype](held))

    # The last folded tile may still be leaving shared memory as tensor boxes (3.): the
    # block keeps its shared memory until the copy engine has read the tile.
    comptime if FOLD_PREVIOUS and BOXED_TILE:
        if tid == 0:
            wait_bulk_copies_read()
