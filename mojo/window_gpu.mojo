"""The verify window and the forward on the GPU: one block per (value head, column
tile, group of REQUESTS_PER_BLOCK requests) of one layer.

A head's [K, V] state splits into independent column tiles (kv[j] and the readout
only ever sum down column j). Threads come in groups of REDUCTION_LANES: thread
`lane` of a group holds key rows `lane, lane + 8, lane + 16, ...` of one 4-column
vector, so every reduction over K is an fma chain per thread followed by three
butterfly shuffles: exactly the fixed lane order of recurrence_math.mojo.

For each of its requests in turn, the block issues the next request's state loads,
folds the previous step's accepted records into the current state when asked to (fold
on load: the state is then read and written once per decoding step), and runs the
window in chunks of TOKEN_CHUNK tokens staged in shared memory. Each lane group
computes the squared norms of q and k itself, in the same lane order.

Measured on an H200 (bench/window-tuning-h200-2026-11-29.txt), this kernel uses about
246 registers per thread, so only two 128-thread blocks fit on an SM: it is bound by
latency, not by memory bandwidth.
"""

from max.gpu import barrier, block_idx, thread_idx
from max.gpu.primitives.warp import shuffle_xor
from std.math import fma
from std.memory import AddressSpace, stack_allocation
from std.sys import size_of
from std.utils.numerics import nan

from .fold_gpu import RECORD_VEC, stage_vectors
from .recurrence_math import L2_EPS, REDUCTION_LANES, query_scale, rounded_sqrt
from .record_layout import decay_offset, delta_offset, key_offset

# Value columns per thread: one 16-byte fp32 vector.
comptime THREAD_COLUMNS = 4
# Tokens staged in shared memory at a time.
comptime TOKEN_CHUNK = 4


def window_block_threads[COLUMN_TILE: Int]() -> Int:
    return (COLUMN_TILE // THREAD_COLUMNS) * REDUCTION_LANES


@always_inline
def lane_sum[width: Int](value: SIMD[DType.float32, width]) -> SIMD[DType.float32, width]:
    """Adds the value over the 8 lanes of a group: (p, p^4), then (p, p^2), then (p, p^1).

    IEEE addition commutes, so every lane of the group ends with the same bits.
    """
    var total = value
    comptime for offset in [4, 2, 1]:
        comptime for e in range(width):
            total[e] = total[e] + shuffle_xor(total[e], UInt32(offset))
    return total


@always_inline
def load_state[
    state_dtype: DType, K: Int, V: Int
](
    state: Pointer[Scalar[state_dtype], MutAnyOrigin],
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    request: Int,
    num_rows: Int,
    row_elements: Int,
    head_offset: Int,
    lane: Int,
) -> Array[SIMD[DType.float32, THREAD_COLUMNS], K // REDUCTION_LANES]:
    """Issues a request's state loads for one thread (zeros for an out-of-range row)."""
    comptime VEC = THREAD_COLUMNS
    var held = Array[SIMD[DType.float32, VEC], K // REDUCTION_LANES](fill=0.0)
    var row = Int(row_ids[unsafe_offset=request])
    if row < num_rows:
        var base = row * row_elements + head_offset
        comptime for m in range(K // REDUCTION_LANES):
            held[m] = state.unsafe_load[
                width=VEC, alignment=VEC * size_of[state_dtype]()
            ](base + (m * REDUCTION_LANES + lane) * V).cast[DType.float32]()
    return held^


comptime SharedFloats = Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@always_inline
def shared_floats[count: Int]() -> SharedFloats:
    return stack_allocation[
        count, DType.float32, alignment=16, address_space=AddressSpace.SHARED
    ]()


def windows_gpu_kernel[
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
    RECORD: Bool,
    FOLD_PREVIOUS: Bool,
    COLUMN_TILE: Int,
    REQUESTS_PER_BLOCK: Int,
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
):
    comptime TILES = V // COLUMN_TILE
    comptime ROWS = K // REDUCTION_LANES
    comptime THREADS = window_block_threads[COLUMN_TILE]()
    comptime VEC = THREAD_COLUMNS
    comptime STATE_ALIGN = VEC * size_of[state_dtype]()
    var num_value_heads = Int(num_value_heads_i32)
    var num_key_heads = Int(num_key_heads_i32)
    var record_stride = Int(record_stride_i32)
    var group_size = num_value_heads // num_key_heads
    var qkv_width = 2 * num_key_heads * K + num_value_heads * V
    var readout_width = num_value_heads * V

    var tile = Int(block_idx.x) % TILES
    var value_head = Int(block_idx.x) // TILES
    var key_head = value_head // group_size
    var group_slot = value_head % group_size
    var tid = Int(thread_idx.x)
    var lane = tid % REDUCTION_LANES
    var tile_column = (tid // REDUCTION_LANES) * VEC
    var column = tile * COLUMN_TILE + tile_column
    var head_offset = value_head * K * V + column

    # Shared staging, allocated once and reused by every request of the block.
    var keys = shared_floats[RING_LEN * K]()
    var deltas = shared_floats[RING_LEN * COLUMN_TILE]()
    var decays = shared_floats[RING_LEN]()
    var queries = shared_floats[TOKEN_CHUNK * K]()
    var token_keys = shared_floats[TOKEN_CHUNK * K]()
    var values = shared_floats[TOKEN_CHUNK * COLUMN_TILE]()
    var token_decays = shared_floats[TOKEN_CHUNK]()
    var betas = shared_floats[TOKEN_CHUNK]()
    comptime scale = query_scale[K]()

    # A block runs REQUESTS_PER_BLOCK requests in turn; the next request's state loads
    # are issued before the current one computes, so loads and arithmetic overlap.
    var first = Int(block_idx.y) * REQUESTS_PER_BLOCK
    var last = min(first + REQUESTS_PER_BLOCK, Int(batch_i32))
    var row_elements = num_value_heads * K * V
    var num_rows = Int(num_rows_i32)
    var held = load_state[state_dtype, K, V](state, row_ids, first, num_rows, row_elements, head_offset, lane)
    for request in range(first, last):
        var upcoming = held.copy()
        if request + 1 < last:
            upcoming = load_state[state_dtype, K, V](
                state, row_ids, request + 1, num_rows, row_elements, head_offset, lane
            )
        barrier()  # the previous request is done with shared memory

        # Every test below depends on the request alone, so the block acts as a whole.
        var start = Int(offsets[unsafe_offset=request])
        var end = Int(offsets[unsafe_offset=request + 1])
        var in_range = start <= end and end <= Int(num_tokens_i32)
        var commit = not RECORD or end - start > RING_LEN
        var row = Int(row_ids[unsafe_offset=request])
        var bad_id = row >= Int(num_rows_i32)
        var ring_row = 0
        comptime if RECORD:
            ring_row = Int(ring_row_ids[unsafe_offset=request])
            bad_id = bad_id or (not commit and ring_row >= Int(num_ring_rows_i32))
        var accepted = 0
        var previous_row = 0
        comptime if FOLD_PREVIOUS:
            accepted = Int(previous_accepted[unsafe_offset=request])
            if accepted > RING_LEN:
                accepted = 0
            previous_row = Int(previous_ring_row_ids[unsafe_offset=request])
            bad_id = bad_id or (accepted > 0 and previous_row >= Int(num_ring_rows_i32))
        if in_range and bad_id:
            # Never follow an id out of bounds; make the request's readout loudly invalid.
            if lane == 0:
                for t in range(start, end):
                    readout.unsafe_store[alignment=16](
                        t * readout_width + value_head * V + column,
                        SIMD[DType.float32, VEC](nan[DType.float32]()),
                    )
        if in_range and not bad_id:
            var state_base = row * num_value_heads * K * V + head_offset
            var changed = end > start

            # Fold on load: apply the previous step's accepted records, as the fold would.
            comptime if FOLD_PREVIOUS:
                if accepted > 0:
                    changed = True
                    var record_base = (
                        (previous_row * num_key_heads + key_head) * RING_LEN * record_stride
                    )
                    stage_vectors[RING_LEN * K // RECORD_VEC, THREADS](
                        keys, ring, record_base, record_stride, key_offset(), K, accepted, tid
                    )
                    stage_vectors[RING_LEN * COLUMN_TILE // RECORD_VEC, THREADS](
                        deltas, ring, record_base, record_stride,
                        delta_offset[K, V](group_slot) + tile * COLUMN_TILE, COLUMN_TILE,
                        accepted, tid,
                    )
                    if tid < accepted:
                        decays[unsafe_offset=tid] = ring[unsafe_offset=
                            record_base + tid * record_stride
                            + decay_offset[K, V](group_size, group_slot)
                        ]
                    barrier()
                    for t in range(accepted):
                        var d = decays[unsafe_offset=t]
                        var u = deltas.unsafe_load[width=VEC, alignment=16](
                            t * COLUMN_TILE + tile_column
                        )
                        comptime for m in range(ROWS):
                            var k = keys[unsafe_offset=t * K + m * REDUCTION_LANES + lane]
                            held[m] = fma(SIMD[DType.float32, VEC](k), u, held[m] * d)
                    # What a separate fold leaves in the pool, and what a verify reads back.
                    comptime for m in range(ROWS):
                        var stored = held[m].cast[state_dtype]()
                        held[m] = stored.cast[DType.float32]()
                        if not commit:
                            state.unsafe_store[alignment=STATE_ALIGN](
                                state_base + (m * REDUCTION_LANES + lane) * V, stored
                            )

            # 3. The window, TOKEN_CHUNK tokens at a time.
            var record_row_base = (ring_row * num_key_heads + key_head) * RING_LEN
            for chunk_start in range(start, end, TOKEN_CHUNK):
                var count = min(TOKEN_CHUNK, end - chunk_start)
                var token_base = chunk_start * qkv_width
                barrier()  # the previous chunk is done with shared memory
                stage_vectors[TOKEN_CHUNK * K // RECORD_VEC, THREADS](
                    queries, qkv, token_base, qkv_width, key_head * K, K, count, tid
                )
                stage_vectors[TOKEN_CHUNK * K // RECORD_VEC, THREADS](
                    token_keys, qkv, token_base, qkv_width, (num_key_heads + key_head) * K, K,
                    count, tid,
                )
                stage_vectors[TOKEN_CHUNK * COLUMN_TILE // RECORD_VEC, THREADS](
                    values, qkv, token_base, qkv_width,
                    2 * num_key_heads * K + value_head * V + tile * COLUMN_TILE, COLUMN_TILE,
                    count, tid,
                )
                if tid < count:
                    var at = (chunk_start + tid) * num_value_heads + value_head
                    token_decays[unsafe_offset=tid] = decay[unsafe_offset=at]
                    betas[unsafe_offset=tid] = beta[unsafe_offset=at]
                barrier()
                for c in range(count):
                    var d = token_decays[unsafe_offset=c]
                    var b = betas[unsafe_offset=c]
                    # kv = S^T k on the decayed state; each lane group also sums |k|^2 and
                    # |q|^2 over its rows, in the same lane order as every other reduction.
                    var partial = SIMD[DType.float32, VEC](0.0)
                    var k_squares = Float32(0.0)
                    var q_squares = Float32(0.0)
                    comptime for m in range(ROWS):
                        var i = c * K + m * REDUCTION_LANES + lane
                        var k = token_keys[unsafe_offset=i]
                        var q = queries[unsafe_offset=i]
                        k_squares = fma(k, k, k_squares)
                        q_squares = fma(q, q, q_squares)
                        held[m] = held[m] * d
                        partial = fma(held[m], SIMD[DType.float32, VEC](k), partial)
                    var kv = lane_sum[VEC](partial)
                    var inv_k = Float32(1.0) / rounded_sqrt(lane_sum[1](k_squares) + L2_EPS)
                    var q_scale = (Float32(1.0) / rounded_sqrt(lane_sum[1](q_squares) + L2_EPS)) * scale
                    var v = values.unsafe_load[width=VEC, alignment=16](c * COLUMN_TILE + tile_column)
                    var error = fma(-kv, SIMD[DType.float32, VEC](inv_k), v)
                    var u = (b * error) * inv_k
                    # S += k u^T, then the readout o = S^T (q / ||q|| / sqrt(K)).
                    var out = SIMD[DType.float32, VEC](0.0)
                    comptime for m in range(ROWS):
                        var i = m * REDUCTION_LANES + lane
                        var k = token_keys[unsafe_offset=c * K + i]
                        held[m] = fma(SIMD[DType.float32, VEC](k), u, held[m])
                        var q_hat = queries[unsafe_offset=c * K + i] * q_scale
                        out = fma(held[m], SIMD[DType.float32, VEC](q_hat), out)
                    out = lane_sum[VEC](out)
                    var t = chunk_start + c
                    if lane == 0:
                        readout.unsafe_store[alignment=16](
                            t * readout_width + value_head * V + column, out
                        )
                    comptime if RECORD:
                        if not commit:
                            var record = (record_row_base + t - start) * record_stride
                            if lane == 0:
                                ring.unsafe_store[alignment=16](
                                    record + delta_offset[K, V](group_slot) + column, u
                                )
                            if tile == 0:
                                if tid == 0:
                                    ring[unsafe_offset=record + decay_offset[K, V](group_size, group_slot)] = d
                                if group_slot == 0:
                                    for vector in range(tid, K // VEC, THREADS):
                                        ring.unsafe_store[alignment=16](
                                            record + key_offset() + vector * VEC,
                                            token_keys.unsafe_load[width=VEC, alignment=16](
                                                c * K + vector * VEC
                                            ),
                                        )

            # 4. A forward, or a window too long for the ring, commits the state.
            if commit and changed:
                comptime for m in range(ROWS):
                    state.unsafe_store[alignment=STATE_ALIGN](
                        state_base + (m * REDUCTION_LANES + lane) * V,
                        held[m].cast[state_dtype](),
                    )
        held = upcoming^
