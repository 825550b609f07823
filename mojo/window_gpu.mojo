"""The verify window and the forward on the GPU: one block per (value head, column
tile, run of requests) of one layer.

A head's [K, V] state splits into independent column tiles (kv[j] and the readout
only ever sum down column j). Each column of a tile belongs to four threads: thread j
holds the key rows of reduction lanes j and j + 4 (`j, j + 4, j + 8, j + 12, ...`) in
registers, so every reduction over K is two fma chains per thread, the first pairwise
step inside the thread and two butterfly shuffles, in the fixed order of
recurrence_math.mojo.

Per request, the block
1. waits for the asynchronous copies of the request's state tile, first records and
   first tokens (window_gpu_staging.mojo), computes the tokens' norms once, and
   moves the state tile to registers (the ids of its requests wait in shared memory,
   read a table at a time);
2. starts the copies for its next request, so that they land while it computes;
3. folds the previous step's accepted records into the state when asked to (fold on
   load) and writes the folded state back: a decoding step reads and writes each
   state element once;
4. runs the window token by token, writing the readout and, for a verify, the ring
   records; a forward, or a window longer than the ring, writes the state instead.
   A token's readout sums finish while the next token computes.

The grid holds about as many blocks as the GPU runs at once, each working through a
run of requests, so the copies of one request overlap the arithmetic of another.
"""

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, barrier, block_idx, thread_idx
from max.gpu.memory import async_copy_commit_group, async_copy_wait_all
from max.gpu.primitives.warp import shuffle_xor
from std.math import ceildiv, fma
from std.memory import AddressSpace, stack_allocation
from std.utils import StaticTuple
from std.utils.numerics import nan

from .record_layout import decay_offset, delta_offset, first_record_at, key_offset
from .recurrence_math import REDUCTION_LANES
from .window_gpu_staging import (
    BETA_AT,
    BLOCK_SHARED_LIMIT,
    DECAY_AT,
    INVERSE_KEY_NORM_AT,
    PLAN_FIELDS,
    PLAN_SLOTS,
    SharedFloats,
    TOKEN_SCALARS,
    load_plan_ids,
    WINDOW_CHUNK,
    copy_records_async,
    copy_state_tile_async,
    copy_tokens_async,
    lane_major_at,
    lane_major_floats,
    normalise_tokens,
    quotient,
    remainder,
    permuted_pitch,
    RequestPlan,
    plan_request,
    shared_floats,
    state_tile_pitch,
    window_blocks_per_sm,
    window_shared_bytes,
)

# A column's eight reduction lanes live on COLUMN_THREADS threads: thread j holds the
# key rows of lanes j and j + 4 (LANE_PAIR of them). The first pairwise step of every
# sum over K, (p, p + 4), then happens inside the thread, the other two take one
# shuffle each, and every thread of the column ends with the whole sum.
comptime LANE_PAIR = 2
comptime COLUMN_THREADS = REDUCTION_LANES // LANE_PAIR
comptime Pair = SIMD[DType.float32, LANE_PAIR]


def window_block_threads[COLUMN_TILE: Int]() -> Int:
    return COLUMN_TILE * COLUMN_THREADS


@always_inline
def column_sum(lanes: Pair) -> Float32:
    """Adds a column's eight lane sums in the fixed order: `lanes` holds lanes j and
    j + 4 of thread j. IEEE addition commutes, so every thread gets the same bits."""
    var pairs = lanes[0] + lanes[1]  # (p, p + 4)
    var quads = pairs + shuffle_xor(pairs, UInt32(2))  # (p, p + 2)
    return quads + shuffle_xor(quads, UInt32(1))  # (p, p + 1)


@always_inline
def lanes_at[
    VECTORS: Int
](lanes: Array[SIMD[DType.float32, 4], LANE_PAIR * VECTORS], m: Int) -> Pair:
    """Element m of a thread's two lanes, each held as VECTORS 16-byte vectors."""
    return Pair(lanes[m // 4][m % 4], lanes[VECTORS + m // 4][m % 4])


@always_inline
def rounded_to[
    ROWS: Int, //, dtype: DType
](held: Array[Pair, ROWS]) -> Array[SIMD[dtype, LANE_PAIR], ROWS]:
    """The held state in the pool's dtype, as the pool stores it."""
    var rounded = Array[SIMD[dtype, LANE_PAIR], ROWS](uninitialized=True)
    comptime for m in range(ROWS):
        rounded[m] = held[m].cast[dtype]()
    return rounded^


# Tell the register allocator how many blocks an SM should hold (window_blocks_per_sm),
# so that it leaves them room: unbounded, it takes over 200 registers per thread.
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](
        Int32(window_block_threads[COLUMN_TILE]())
    ),
    `nvvm.minctasm`=SIMDLength(
        window_blocks_per_sm[
            state_dtype, K, COLUMN_TILE, FOLD_PREVIOUS, window_block_threads[COLUMN_TILE]()
        ]()
    ),
)
def windows_gpu_kernel[
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
    RECORD: Bool,
    FOLD_PREVIOUS: Bool,
    COLUMN_TILE: Int,
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
    requests_per_block_i32: Int32,
    num_tokens_i32: Int32,
    num_rows_i32: Int32,
    num_ring_rows_i32: Int32,
    num_value_heads_i32: Int32,
    num_key_heads_i32: Int32,
    record_stride_i32: Int32,
):
    comptime TILES = V // COLUMN_TILE
    comptime ROWS = K // REDUCTION_LANES
    comptime THREADS = window_block_threads[COLUMN_TILE]()
    comptime CHUNK = WINDOW_CHUNK
    comptime PITCH = state_tile_pitch[state_dtype, COLUMN_TILE]()
    comptime LANE_PITCH = permuted_pitch[K]()
    comptime LANE_MAJOR = lane_major_floats[K]()
    comptime LANE_VECTORS = ceildiv(ROWS, 4)
    comptime assert (
        window_shared_bytes[state_dtype, K, COLUMN_TILE, FOLD_PREVIOUS]() <= BLOCK_SHARED_LIMIT
    ), "the window kernel's shared memory exceeds 48 KiB: use a smaller COLUMN_TILE"
    var num_value_heads = Int(num_value_heads_i32)
    var num_key_heads = Int(num_key_heads_i32)
    var record_stride = Int(record_stride_i32)
    var num_tokens = Int(num_tokens_i32)
    var num_rows = Int(num_rows_i32)
    var num_ring_rows = Int(num_ring_rows_i32)
    var group_size = num_value_heads // num_key_heads
    var readout_width = num_value_heads * V
    var row_elements = num_value_heads * K * V

    var tile = Int(block_idx.x) % TILES
    var value_head = Int(block_idx.x) // TILES
    var key_head = value_head // group_size
    var group_slot = value_head % group_size
    var tid = Int(thread_idx.x)
    # This thread holds lanes `pair` and `pair + 4` of column `tile_column`.
    var pair = remainder[COLUMN_THREADS](tid)
    var tile_column = quotient[COLUMN_THREADS](tid)
    var tile_start = tile * COLUMN_TILE
    var column = tile_start + tile_column

    # Shared memory. Records and tokens have two buffers: one being computed on, one
    # being filled for the next request. The state tile has one: it is moved to
    # registers before the next request's copies start.
    var state_tile = stack_allocation[
        K * PITCH, state_dtype, alignment=16, address_space=AddressSpace.SHARED
    ]()
    comptime RECORD_KEYS = CHUNK * LANE_MAJOR if FOLD_PREVIOUS else 0
    comptime RECORD_DELTAS = CHUNK * COLUMN_TILE if FOLD_PREVIOUS else 0
    comptime RECORD_DECAYS = CHUNK if FOLD_PREVIOUS else 0
    var record_keys = shared_floats[2 * RECORD_KEYS + 4]()
    var record_deltas = shared_floats[2 * RECORD_DELTAS + 4]()
    var record_decays = shared_floats[2 * RECORD_DECAYS + 4]()
    # q and k arrive lane-major (window_gpu_staging.copy_rows_async); the norms
    # turn q into q / |q| / sqrt(K) in place.
    var token_queries = shared_floats[2 * CHUNK * LANE_MAJOR]()
    var token_keys = shared_floats[2 * CHUNK * LANE_MAJOR]()
    var token_values = shared_floats[2 * CHUNK * COLUMN_TILE]()
    var token_scalars = shared_floats[2 * CHUNK * TOKEN_SCALARS]()
    var plan_ids = stack_allocation[
        PLAN_FIELDS * PLAN_SLOTS, DType.uint32, alignment=16, address_space=AddressSpace.SHARED
    ]()

    var requests_per_block = Int(requests_per_block_i32)
    var first = Int(block_idx.y) * requests_per_block
    var last = min(first + requests_per_block, Int(batch_i32))
    if first >= last:
        return

    # The ids of requests first + j * PLAN_SLOTS + i sit in slot i, a table at a time.
    @always_inline
    def load_plans(from_request: Int) {imm}:
        load_plan_ids[RECORD, FOLD_PREVIOUS, THREADS](
            plan_ids, from_request, last, row_ids, ring_row_ids, offsets,
            previous_ring_row_ids, previous_accepted, tid,
        )

    @always_inline
    def plan_of(request: Int) {imm} -> RequestPlan:
        return plan_request[RING_LEN, RECORD, FOLD_PREVIOUS](
            plan_ids, (request - first) % PLAN_SLOTS, num_tokens, num_rows, num_ring_rows
        )

    # Where the request's previous records for this key head start in the ring.
    @always_inline
    def previous_records_at(plan: RequestPlan) {imm} -> Int:
        return first_record_at[RING_LEN](plan.previous_row, num_key_heads, key_head, record_stride)

    # Starts every copy a request needs first, into buffer `buffer`.
    @always_inline
    def start_copies(plan: RequestPlan, buffer: Int) {imm}:
        if plan.runs:
            copy_state_tile_async[state_dtype, K, V, COLUMN_TILE, THREADS](
                state_tile, state, plan.row * row_elements + value_head * K * V + tile_start,
                tid,
            )
            comptime if FOLD_PREVIOUS:
                if plan.accepted > 0:
                    copy_records_async[K, V, COLUMN_TILE, THREADS](
                        record_keys.unsafe_offset(buffer * RECORD_KEYS),
                        record_deltas.unsafe_offset(buffer * RECORD_DELTAS),
                        record_decays.unsafe_offset(buffer * RECORD_DECAYS),
                        ring,
                        previous_records_at(plan),
                        min(CHUNK, plan.accepted), record_stride, group_size, group_slot,
                        tile_start, tid,
                    )
            copy_tokens_async[K, V, COLUMN_TILE, THREADS](
                token_queries.unsafe_offset(buffer * CHUNK * LANE_MAJOR),
                token_keys.unsafe_offset(buffer * CHUNK * LANE_MAJOR),
                token_values.unsafe_offset(buffer * CHUNK * COLUMN_TILE),
                token_scalars.unsafe_offset(buffer * CHUNK * TOKEN_SCALARS),
                qkv, decay, beta, plan.start, min(CHUNK, plan.end - plan.start),
                num_key_heads, key_head, num_value_heads, value_head, tile_start, tid,
            )
        async_copy_commit_group()

    # The thread's two lanes of vector `row` of a lane-major buffer, as 16-byte loads.
    @always_inline
    def load_lanes(buffer: SharedFloats, row: Int) {imm} -> Array[
        SIMD[DType.float32, 4], LANE_PAIR * LANE_VECTORS
    ]:
        var lanes = Array[SIMD[DType.float32, 4], LANE_PAIR * LANE_VECTORS](uninitialized=True)
        comptime for h in range(LANE_PAIR):
            var at = (row * REDUCTION_LANES + h * COLUMN_THREADS + pair) * LANE_PITCH
            comptime for j in range(LANE_VECTORS):
                lanes[h * LANE_VECTORS + j] = buffer.unsafe_load[width=4, alignment=16](at + 4 * j)
        return lanes^

    # Writes vector `row` of the lane-major `keys` to the ring in its natural order.
    @always_inline
    def store_raw_key(at: Int, keys: SharedFloats, row: Int) {imm}:
        for vector in range(tid, K // 4, THREADS):
            var four = SIMD[DType.float32, 4]()
            comptime for e in range(4):
                four[e] = keys[unsafe_offset=row * LANE_MAJOR + lane_major_at[K](vector * 4 + e)]
            ring.unsafe_store[alignment=16](at + vector * 4, four)

    load_plans(first)
    barrier()
    start_copies(plan_of(first), 0)
    for request in range(first, last):
        var buffer = (request - first) % 2
        var plan = plan_of(request)
        var queries = token_queries.unsafe_offset(buffer * CHUNK * LANE_MAJOR)
        var keys = token_keys.unsafe_offset(buffer * CHUNK * LANE_MAJOR)
        var values = token_values.unsafe_offset(buffer * CHUNK * COLUMN_TILE)
        var scalars = token_scalars.unsafe_offset(buffer * CHUNK * TOKEN_SCALARS)
        var first_count = min(CHUNK, plan.end - plan.start)

        # 1. This request's copies have landed, for every thread; the block is done
        #    with the previous request.
        async_copy_wait_all()
        barrier()
        # held[m][h] is state row m * 8 + pair + 4 * h of the thread's column.
        var held = Array[Pair, ROWS](fill=0.0)
        if plan.runs:
            if first_count > 0:
                normalise_tokens[K, THREADS](queries, keys, first_count, scalars, tid)
            comptime for m in range(ROWS):
                comptime for h in range(LANE_PAIR):
                    held[m][h] = state_tile[
                        unsafe_offset=(m * REDUCTION_LANES + h * COLUMN_THREADS + pair) * PITCH
                        + tile_column
                    ].cast[DType.float32]()
        var next = request + 1
        if next < last and (next - first) % PLAN_SLOTS == 0:
            load_plans(next)  # every thread has read this request's plan
        barrier()  # the state tile is free, the norms are written, the ids are read

        # 2. The next request's copies run while this one computes.
        if next < last:
            start_copies(plan_of(next), 1 - buffer)

        # One thread of each column writes its readout.
        @always_inline
        def store_readout(token: Int, o: Float32) {imm}:
            if pair == 0:
                readout[unsafe_offset=token * readout_width + value_head * V + column] = o

        if plan.poisoned:
            # Never follow an id out of bounds; make the request's readout loudly invalid.
            for t in range(plan.start, plan.end):
                store_readout(t, nan[DType.float32]())
        if not plan.runs:
            continue
        # This thread's first state row; the others are constant offsets from it.
        var state_rows = state.unsafe_offset(
            plan.row * row_elements + value_head * K * V + pair * V + column
        )
        var changed = plan.end > plan.start

        # Writes the held state as the pool's dtype.
        @always_inline
        def store_state(values: Array[SIMD[state_dtype, LANE_PAIR], ROWS]) {imm}:
            comptime for m in range(ROWS):
                comptime for h in range(LANE_PAIR):
                    state_rows[
                        unsafe_offset=(m * REDUCTION_LANES + h * COLUMN_THREADS) * V
                    ] = values[m][h]

        # 3. Fold on load: apply the previous step's accepted records, as the fold would.
        comptime if FOLD_PREVIOUS:
            if plan.accepted > 0:
                changed = True
                var record_row = previous_records_at(plan)
                var rkeys = record_keys.unsafe_offset(buffer * RECORD_KEYS)
                var rdeltas = record_deltas.unsafe_offset(buffer * RECORD_DELTAS)
                var rdecays = record_decays.unsafe_offset(buffer * RECORD_DECAYS)
                for chunk_start in range(0, plan.accepted, CHUNK):
                    var count = min(CHUNK, plan.accepted - chunk_start)
                    if chunk_start > 0:
                        barrier()  # done with the previous chunk of records
                        copy_records_async[K, V, COLUMN_TILE, THREADS](
                            rkeys, rdeltas, rdecays, ring,
                            record_row + chunk_start * record_stride, count, record_stride,
                            group_size, group_slot, tile_start, tid,
                        )
                        async_copy_commit_group()
                        async_copy_wait_all()
                        barrier()
                    for t in range(count):
                        var d = rdecays[unsafe_offset=t]
                        var u = Pair(rdeltas[unsafe_offset=t * COLUMN_TILE + tile_column])
                        var k_lanes = load_lanes(rkeys, t)
                        comptime for m in range(ROWS):
                            held[m] = fma(lanes_at[LANE_VECTORS](k_lanes, m), u, held[m] * d)
                # What a separate fold leaves in the pool, and what a verify reads back.
                var stored = rounded_to[state_dtype](held)
                comptime for m in range(ROWS):
                    held[m] = stored[m].cast[DType.float32]()
                if not plan.commit:
                    store_state(stored)

        # 4. The window, WINDOW_CHUNK tokens at a time.
        var record_row_base = (plan.ring_row * num_key_heads + key_head) * RING_LEN
        for chunk_start in range(plan.start, plan.end, CHUNK):
            var count = min(CHUNK, plan.end - chunk_start)
            if chunk_start > plan.start:
                barrier()  # done with the previous chunk of tokens and its norms
                copy_tokens_async[K, V, COLUMN_TILE, THREADS](
                    queries, keys, values, scalars, qkv, decay, beta, chunk_start,
                    count, num_key_heads, key_head, num_value_heads, value_head,
                    tile_start, tid,
                )
                async_copy_commit_group()
                async_copy_wait_all()
                barrier()
                normalise_tokens[K, THREADS](queries, keys, count, scalars, tid)
                barrier()
            # The readout sums of token c are finished while token c + 1 computes: their
            # shuffles then overlap its arithmetic instead of stalling the warp.
            var pending_out = Pair(0.0)
            for c in range(count):
                var token_scalars_c = scalars.unsafe_load[width=TOKEN_SCALARS, alignment=16](
                    c * TOKEN_SCALARS
                )
                var d = token_scalars_c[DECAY_AT]
                var b = token_scalars_c[BETA_AT]
                var inv_k = token_scalars_c[INVERSE_KEY_NORM_AT]
                var k_lanes = load_lanes(keys, c)
                var previous_o = column_sum(pending_out)
                # kv = S^T k on the decayed state.
                var partial = Pair(0.0)
                comptime for m in range(ROWS):
                    held[m] = held[m] * d
                    partial = fma(held[m], lanes_at[LANE_VECTORS](k_lanes, m), partial)
                var kv = column_sum(partial)
                var v = values[unsafe_offset=c * COLUMN_TILE + tile_column]
                # q only now: fewer registers are live during the sum above.
                var q_lanes = load_lanes(queries, c)
                var error = fma(-kv, inv_k, v)
                var u = (b * error) * inv_k
                # S += k u^T, then the readout o = S^T (q / |q| / sqrt(K)).
                var out = Pair(0.0)
                comptime for m in range(ROWS):
                    held[m] = fma(lanes_at[LANE_VECTORS](k_lanes, m), Pair(u), held[m])
                    out = fma(held[m], lanes_at[LANE_VECTORS](q_lanes, m), out)
                pending_out = out
                var t = chunk_start + c
                if c > 0:
                    store_readout(t - 1, previous_o)
                comptime if RECORD:
                    if not plan.commit:
                        var record = (record_row_base + t - plan.start) * record_stride
                        if pair == 0:
                            ring[unsafe_offset=record + delta_offset[K, V](group_slot) + column] = u
                        if tile == 0:
                            if tid == 0:
                                ring[unsafe_offset=record + decay_offset[K, V](group_size, group_slot)] = d
                            if group_slot == 0:
                                store_raw_key(record + key_offset(), keys, c)
            if count > 0:
                store_readout(chunk_start + count - 1, column_sum(pending_out))

        # 5. A forward, or a window too long for the ring, commits the state.
        if plan.commit and changed:
            store_state(rounded_to[state_dtype](held))
