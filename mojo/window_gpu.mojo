"""The verify window and the forward on the GPU: one block per (value head, column
tile, run of requests) of one layer.

A head's [K, V] state splits into independent column tiles (kv[j] and the readout
only ever sum down column j). Threads come in groups of REDUCTION_LANES: thread
`lane` of a group holds key rows `lane, lane + 8, lane + 16, ...` of THREAD_COLUMNS
neighbouring columns in registers, so every reduction over K is an fma chain per thread
followed by an exchange between the eight lanes in the fixed order of
recurrence_math.mojo.

Per request, the block
1. waits for the asynchronous copies of the request's state tile, first records and
   first tokens (window_gpu_staging.mojo), computes the tokens' norms once, and
   moves the state tile to registers;
2. starts the copies for its next request, so that they land while it computes;
3. folds the previous step's accepted records into the state when asked to (fold on
   load) and writes the folded state back: a decoding step reads and writes each
   state element once;
4. runs the window token by token, writing the readout and, for a verify, the ring
   records; a forward, or a window longer than the ring, writes the state instead.

The grid holds about as many blocks as the GPU runs at once, each working through a
run of requests, so the copies of one request overlap the arithmetic of another.
"""

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, barrier, block_idx, thread_idx
from max.gpu.memory import async_copy_commit_group, async_copy_wait_all
from max.gpu.primitives.warp import shuffle_idx, shuffle_xor
from std.math import ceildiv, fma
from std.memory import AddressSpace, stack_allocation
from std.sys import size_of
from std.utils import StaticTuple
from std.utils.numerics import nan

from .record_layout import decay_offset, delta_offset, key_offset
from .recurrence_math import REDUCTION_LANES
from .window_gpu_staging import (
    BLOCK_SHARED_LIMIT,
    WINDOW_CHUNK,
    copy_records_async,
    copy_state_tile_async,
    copy_tokens_async,
    normalise_tokens,
    permuted_pitch,
    RequestPlan,
    plan_request,
    shared_floats,
    state_tile_pitch,
    window_blocks_per_sm,
    window_shared_bytes,
)

# Value columns per thread. Two, not four: a thread then holds K/4 state floats, few
# enough registers that twice the warps fit on an SM beside the shared staging,
# which is what hides the latency of the reductions.
comptime THREAD_COLUMNS = 2
# Lanes of a group that end a column sum holding the same column.
comptime LANES_PER_COLUMN = REDUCTION_LANES // THREAD_COLUMNS
comptime WARP_SIZE = 32


def window_block_threads[COLUMN_TILE: Int]() -> Int:
    return (COLUMN_TILE // THREAD_COLUMNS) * REDUCTION_LANES


@always_inline
def column_sum(x: SIMD[DType.float32, THREAD_COLUMNS], lane: Int) -> Float32:
    """Sums each column over the 8 lanes of a group; lane p returns column
    p / LANES_PER_COLUMN.

    The additions are those of adding (p, p^4), then (p, p^2), then (p, p^1) for
    every column (IEEE addition commutes), but the first step passes on only the
    column the partner keeps: 3 shuffles instead of 6.
    """
    comptime assert THREAD_COLUMNS == 2, "column_sum splits two columns"
    var high = (lane & 4) != 0
    var keep = x[1] if high else x[0]
    var send = x[0] if high else x[1]
    var pair = keep + shuffle_xor(send, UInt32(4))
    var quad = pair + shuffle_xor(pair, UInt32(2))
    return quad + shuffle_xor(quad, UInt32(1))


@always_inline
def gather_columns(own: Float32, group_first_lane: Int) -> SIMD[DType.float32, THREAD_COLUMNS]:
    """Column c of the result comes from lane LANES_PER_COLUMN * c of the group."""
    var columns = SIMD[DType.float32, THREAD_COLUMNS](0.0)
    comptime for c in range(THREAD_COLUMNS):
        columns[c] = shuffle_idx(own, UInt32(group_first_lane + LANES_PER_COLUMN * c))
    return columns


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
    comptime VEC = THREAD_COLUMNS
    comptime CHUNK = WINDOW_CHUNK
    comptime STATE_ALIGN = VEC * size_of[state_dtype]()
    comptime PITCH = state_tile_pitch[state_dtype, COLUMN_TILE]()
    comptime LANE_PITCH = permuted_pitch[K]()
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
    var lane = tid % REDUCTION_LANES
    var group_first_lane = (tid % WARP_SIZE) - lane
    var tile_column = (tid // REDUCTION_LANES) * VEC
    var tile_start = tile * COLUMN_TILE
    var column = tile_start + tile_column

    # Shared memory. Records and tokens have two buffers: one being computed on, one
    # being filled for the next request. The state tile has one: it is moved to
    # registers before the next request's copies start.
    var state_tile = stack_allocation[
        K * PITCH, state_dtype, alignment=16, address_space=AddressSpace.SHARED
    ]()
    comptime RECORD_KEYS = CHUNK * K if FOLD_PREVIOUS else 0
    comptime RECORD_DELTAS = CHUNK * COLUMN_TILE if FOLD_PREVIOUS else 0
    comptime RECORD_DECAYS = CHUNK if FOLD_PREVIOUS else 0
    var record_keys = shared_floats[2 * RECORD_KEYS + 4]()
    var record_deltas = shared_floats[2 * RECORD_DELTAS + 4]()
    var record_decays = shared_floats[2 * RECORD_DECAYS + 4]()
    var token_queries = shared_floats[2 * CHUNK * K]()
    var token_keys = shared_floats[2 * CHUNK * K]()
    var token_values = shared_floats[2 * CHUNK * COLUMN_TILE]()
    var token_decays = shared_floats[2 * CHUNK]()
    var token_betas = shared_floats[2 * CHUNK]()
    var queries_hat = shared_floats[CHUNK * REDUCTION_LANES * LANE_PITCH]()
    var keys_by_lane = shared_floats[CHUNK * REDUCTION_LANES * LANE_PITCH]()
    var inverse_key_norms = shared_floats[CHUNK]()

    var requests_per_block = Int(requests_per_block_i32)
    var first = Int(block_idx.y) * requests_per_block
    var last = min(first + requests_per_block, Int(batch_i32))
    if first >= last:
        return

    @always_inline
    def plan_of(request: Int) {imm} -> RequestPlan:
        return plan_request[RING_LEN, RECORD, FOLD_PREVIOUS](
            request, row_ids, ring_row_ids, offsets, previous_ring_row_ids,
            previous_accepted, num_tokens, num_rows, num_ring_rows,
        )

    # Where the request's previous records for this key head start in the ring.
    @always_inline
    def previous_records_at(plan: RequestPlan) {imm} -> Int:
        return (plan.previous_row * num_key_heads + key_head) * RING_LEN * record_stride

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
                token_queries.unsafe_offset(buffer * CHUNK * K),
                token_keys.unsafe_offset(buffer * CHUNK * K),
                token_values.unsafe_offset(buffer * CHUNK * COLUMN_TILE),
                token_decays.unsafe_offset(buffer * CHUNK),
                token_betas.unsafe_offset(buffer * CHUNK),
                qkv, decay, beta, plan.start, min(CHUNK, plan.end - plan.start),
                num_key_heads, key_head, num_value_heads, value_head, tile_start, tid,
            )
        async_copy_commit_group()

    var upcoming = plan_of(first)
    start_copies(upcoming, 0)
    for request in range(first, last):
        var buffer = (request - first) % 2
        var plan = upcoming
        if request + 1 < last:
            # Read the next request's ids now; their latency hides behind the wait below.
            upcoming = plan_of(request + 1)
        var queries = token_queries.unsafe_offset(buffer * CHUNK * K)
        var keys = token_keys.unsafe_offset(buffer * CHUNK * K)
        var values = token_values.unsafe_offset(buffer * CHUNK * COLUMN_TILE)
        var decays = token_decays.unsafe_offset(buffer * CHUNK)
        var betas = token_betas.unsafe_offset(buffer * CHUNK)
        var first_count = min(CHUNK, plan.end - plan.start)

        # 1. This request's copies have landed, for every thread; the block is done
        #    with the previous request.
        async_copy_wait_all()
        barrier()
        var held = Array[SIMD[DType.float32, VEC], ROWS](fill=0.0)
        if plan.runs:
            if first_count > 0:
                normalise_tokens[K, THREADS](
                    queries, keys, first_count, queries_hat, keys_by_lane, inverse_key_norms,
                    tid,
                )
            comptime for m in range(ROWS):
                held[m] = state_tile.unsafe_load[width=VEC, alignment=STATE_ALIGN](
                    (m * REDUCTION_LANES + lane) * PITCH + tile_column
                ).cast[DType.float32]()
        barrier()  # the state tile is free and the norms are written

        # 2. The next request's copies run while this one computes.
        if request + 1 < last:
            start_copies(upcoming, 1 - buffer)

        if plan.poisoned:
            # Never follow an id out of bounds; make the request's readout loudly invalid.
            if lane == 0:
                for t in range(plan.start, plan.end):
                    readout.unsafe_store[alignment=4 * VEC](
                        t * readout_width + value_head * V + column,
                        SIMD[DType.float32, VEC](nan[DType.float32]()),
                    )
        if not plan.runs:
            continue
        # This thread's first state row; the others are constant offsets from it.
        var state_rows = state.unsafe_offset(
            plan.row * row_elements + value_head * K * V + lane * V + column
        )
        var changed = plan.end > plan.start

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
                        var u = rdeltas.unsafe_load[width=VEC, alignment=4 * VEC](
                            t * COLUMN_TILE + tile_column
                        )
                        comptime for m in range(ROWS):
                            var k = rkeys[unsafe_offset=t * K + m * REDUCTION_LANES + lane]
                            held[m] = fma(SIMD[DType.float32, VEC](k), u, held[m] * d)
                # What a separate fold leaves in the pool, and what a verify reads back.
                comptime for m in range(ROWS):
                    var stored = held[m].cast[state_dtype]()
                    held[m] = stored.cast[DType.float32]()
                    if not plan.commit:
                        state_rows.unsafe_store[alignment=STATE_ALIGN](
                            m * REDUCTION_LANES * V, stored
                        )

        # 4. The window, WINDOW_CHUNK tokens at a time.
        var record_row_base = (plan.ring_row * num_key_heads + key_head) * RING_LEN
        for chunk_start in range(plan.start, plan.end, CHUNK):
            var count = min(CHUNK, plan.end - chunk_start)
            if chunk_start > plan.start:
                barrier()  # done with the previous chunk of tokens and its norms
                copy_tokens_async[K, V, COLUMN_TILE, THREADS](
                    queries, keys, values, decays, betas, qkv, decay, beta, chunk_start,
                    count, num_key_heads, key_head, num_value_heads, value_head,
                    tile_start, tid,
                )
                async_copy_commit_group()
                async_copy_wait_all()
                barrier()
                normalise_tokens[K, THREADS](
                    queries, keys, count, queries_hat, keys_by_lane, inverse_key_norms, tid
                )
                barrier()
            for c in range(count):
                var d = decays[unsafe_offset=c]
                var b = betas[unsafe_offset=c]
                var inv_k = inverse_key_norms[unsafe_offset=c]
                var lane_at = (c * REDUCTION_LANES + lane) * LANE_PITCH
                var k_lane = Array[SIMD[DType.float32, 4], LANE_VECTORS](uninitialized=True)
                var q_lane = Array[SIMD[DType.float32, 4], LANE_VECTORS](uninitialized=True)
                comptime for j in range(LANE_VECTORS):
                    k_lane[j] = keys_by_lane.unsafe_load[width=4, alignment=16](lane_at + 4 * j)
                    q_lane[j] = queries_hat.unsafe_load[width=4, alignment=16](lane_at + 4 * j)
                # kv = S^T k on the decayed state.
                var partial = SIMD[DType.float32, VEC](0.0)
                comptime for m in range(ROWS):
                    held[m] = held[m] * d
                    partial = fma(held[m], SIMD[DType.float32, VEC](k_lane[m // 4][m % 4]), partial)
                var kv = column_sum(partial, lane)
                var v = values[unsafe_offset=c * COLUMN_TILE + tile_column + lane // LANES_PER_COLUMN]
                var error = fma(-kv, inv_k, v)
                var u = gather_columns((b * error) * inv_k, group_first_lane)
                # S += k u^T, then the readout o = S^T (q / |q| / sqrt(K)).
                var out = SIMD[DType.float32, VEC](0.0)
                comptime for m in range(ROWS):
                    held[m] = fma(SIMD[DType.float32, VEC](k_lane[m // 4][m % 4]), u, held[m])
                    out = fma(held[m], SIMD[DType.float32, VEC](q_lane[m // 4][m % 4]), out)
                var o = column_sum(out, lane)
                var t = chunk_start + c
                if lane % LANES_PER_COLUMN == 0:
                    readout[unsafe_offset=
                        t * readout_width + value_head * V + column + lane // LANES_PER_COLUMN
                    ] = o
                comptime if RECORD:
                    if not plan.commit:
                        var record = (record_row_base + t - plan.start) * record_stride
                        if lane == 0:
                            ring.unsafe_store[alignment=4 * VEC](
                                record + delta_offset[K, V](group_slot) + column, u
                            )
                        if tile == 0:
                            if tid == 0:
                                ring[unsafe_offset=record + decay_offset[K, V](group_size, group_slot)] = d
                            if group_slot == 0:
                                for vector in range(tid, K // 4, THREADS):
                                    ring.unsafe_store[alignment=16](
                                        record + key_offset() + vector * 4,
                                        keys.unsafe_load[width=4, alignment=16](c * K + vector * 4),
                                    )

        # 5. A forward, or a window too long for the ring, commits the state.
        if plan.commit and changed:
            comptime for m in range(ROWS):
                state_rows.unsafe_store[alignment=STATE_ALIGN](
                    m * REDUCTION_LANES * V, held[m].cast[state_dtype]()
                )
