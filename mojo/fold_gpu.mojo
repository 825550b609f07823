"""The fold on the GPU: one launch for every layer, request and value head.

Grid: x = (value head, key tile), y = request, z = layer. A block owns a tile of
KEY_DIM_TILE key rows of one value head's [K, V] state block. Each thread holds
ROWS_PER_THREAD rows of one 16-byte column vector in registers. A thread first issues
all its state loads, then the block stages the accepted records' slices (keys of the
tile, the head's delta rows and decays) in shared memory once, with 16-byte loads
unrolled at compile time so none waits on another. Then each thread applies the
records in order and stores each vector once.

With `CHANNEL` (per-channel gates) a record holds K decays per value head; the block
stages the tile's KEY_DIM_TILE of them, and row i of the tile decays by its own.

With `PATH` (fold_path_gpu_kernel, the fold along an accepted path of a token tree) the
t-th record folded is record `accepted_nodes[request, t]` rather than record t. A path
in topological order names nodes of the ring in increasing order; a request whose path
does not (a node past RING_LEN, or one not after the node before it) is skipped as a
whole, its rows not read or written, so no bad node is followed to another record.
Both kernels are fold_block with PATH fixed, so the chain's kernel is what it was.
"""

from max.gpu import barrier, block_idx, thread_idx
from std.math import ceildiv, fma
from std.memory import AddressSpace, stack_allocation
from std.sys import size_of

from .record_layout import RECORD_VEC, channel_decay_offset, decay_offset, delta_offset, first_record_at, key_offset



def state_vector_width[state_dtype: DType]() -> Int:
    """Elements in one 16-byte state access."""
    return 16 // size_of[state_dtype]()


def fold_block_threads[
    state_dtype: DType, V: Int, KEY_DIM_TILE: Int, ROWS_PER_THREAD: Int
]() -> Int:
    """Threads of one block: the column vectors of a row times the row groups."""
    return (V // state_vector_width[state_dtype]()) * (
        KEY_DIM_TILE // ROWS_PER_THREAD
    )


@always_inline
def record_of[
    PATH: Bool
](nodes: Pointer[UInt32, ImmutAnyOrigin], nodes_at: Int, t: Int) -> Int:
    """The record folded t-th: t along a chain, or the path's t-th node (`nodes` at
    `nodes_at` is the request's row of accepted_nodes, checked by the caller). Without
    PATH `nodes` is not read."""
    comptime if PATH:
        return Int(nodes[unsafe_offset=nodes_at + t])
    else:
        return t


@always_inline
def path_is_valid[
    RING_LEN: Int
](nodes: Pointer[UInt32, ImmutAnyOrigin], nodes_at: Int, accepted: Int) -> Bool:
    """Whether the first `accepted` nodes at `nodes_at` are nodes of the ring in
    increasing order: a path's nodes in topological order, so no record is folded twice
    or out of order and none lies past the ring."""
    var previous = -1
    for t in range(accepted):
        var node = Int(nodes[unsafe_offset=nodes_at + t])
        if node <= previous or node >= RING_LEN:
            return False
        previous = node
    return True


@always_inline
def stage_vectors[
    COUNT: Int, THREADS: Int, PATH: Bool = False
](
    dst: Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    ring: Pointer[Float32, ImmutAnyOrigin],
    record_base: Int,
    record_stride: Int,
    field_at: Int,
    field_len: Int,
    accepted: Int,
    tid: Int,
    nodes: Pointer[UInt32, ImmutAnyOrigin],
    nodes_at: Int,
):
    """Copies `field_len` floats at `field_at` of each of the first `accepted` records
    to fold (record_of: `nodes` at `nodes_at` with PATH) to shared memory, in the order
    folded.

    COUNT bounds the 16-byte vectors over every possible row; the loop is unrolled
    so that every load a thread makes is in flight at once.
    """
    var vectors_per_record = field_len // RECORD_VEC
    comptime for s in range(ceildiv(COUNT, THREADS)):
        var v = tid + s * THREADS
        if v < accepted * vectors_per_record:
            var t = v // vectors_per_record
            var within = (v % vectors_per_record) * RECORD_VEC
            var record = record_of[PATH](nodes, nodes_at, t)
            var value = ring.unsafe_load[width=RECORD_VEC, alignment=16](
                record_base + record * record_stride + field_at + within
            )
            dst.unsafe_store[alignment=16](t * field_len + within, value)


@always_inline
def fold_block[
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
    KEY_DIM_TILE: Int,
    ROWS_PER_THREAD: Int,
    CHANNEL: Bool,
    PATH: Bool,
](
    state: Pointer[Scalar[state_dtype], MutAnyOrigin],
    ring: Pointer[Float32, ImmutAnyOrigin],
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    num_accepted: Pointer[UInt32, ImmutAnyOrigin],
    accepted_nodes: Pointer[UInt32, ImmutAnyOrigin],
    batch_i32: Int32,
    num_rows_i32: Int32,
    num_ring_rows_i32: Int32,
    num_value_heads_i32: Int32,
    num_key_heads_i32: Int32,
    record_stride_i32: Int32,
):
    """One block of the fold (the module docstring). `accepted_nodes` is read only with
    PATH."""
    # Sizes cross to the device as Int32; offsets are computed in Int (64-bit).
    var batch = Int(batch_i32)
    var num_value_heads = Int(num_value_heads_i32)
    var num_key_heads = Int(num_key_heads_i32)
    var record_stride = Int(record_stride_i32)
    comptime VEC = state_vector_width[state_dtype]()
    comptime COLUMN_THREADS = V // VEC
    comptime ROW_THREADS = KEY_DIM_TILE // ROWS_PER_THREAD
    comptime THREADS = COLUMN_THREADS * ROW_THREADS
    comptime KEY_TILES = K // KEY_DIM_TILE

    var key_tile = Int(block_idx.x) % KEY_TILES
    var value_head = Int(block_idx.x) // KEY_TILES
    var request = Int(block_idx.y)
    var pair = Int(block_idx.z) * batch + request

    # Every test below depends on the block alone, so the block leaves as a whole.
    var accepted = Int(num_accepted[unsafe_offset=request])
    if accepted == 0 or accepted > RING_LEN:
        return
    var row = Int(row_ids[unsafe_offset=pair])
    var ring_row = Int(ring_row_ids[unsafe_offset=pair])
    # Ids inside a graph are trusted for speed but never followed out of bounds.
    if row >= Int(num_rows_i32) or ring_row >= Int(num_ring_rows_i32):
        return
    # The request's row of accepted_nodes ([batch, RING_LEN]); every thread reads the
    # same nodes, so a bad path sends the whole block away before any load or barrier.
    var nodes_at = request * RING_LEN
    comptime if PATH:
        if not path_is_valid[RING_LEN](accepted_nodes, nodes_at, accepted):
            return

    var tid = Int(thread_idx.x)
    var column = (tid % COLUMN_THREADS) * VEC
    var row_group = tid // COLUMN_THREADS
    var tile_base = key_tile * KEY_DIM_TILE

    # 1. Issue every state load of this thread before anything waits.
    var state_base = (row * num_value_heads + value_head) * K * V
    var held = Array[SIMD[DType.float32, VEC], ROWS_PER_THREAD](
        uninitialized=True
    )
    comptime for m in range(ROWS_PER_THREAD):
        var at = state_base + (tile_base + row_group + m * ROW_THREADS) * V + column
        held[m] = state.unsafe_load[width=VEC, alignment=16](at).cast[
            DType.float32
        ]()

    # 2. Stage the accepted records' slices once per block.
    var group_size = num_value_heads // num_key_heads
    var key_head = value_head // group_size
    var group_slot = value_head % group_size
    var record_base = first_record_at[RING_LEN](ring_row, num_key_heads, key_head, record_stride)
    var keys = stack_allocation[
        RING_LEN * KEY_DIM_TILE,
        DType.float32,
        alignment=16,
        address_space=AddressSpace.SHARED,
    ]()
    var deltas = stack_allocation[
        RING_LEN * V,
        DType.float32,
        alignment=16,
        address_space=AddressSpace.SHARED,
    ]()
    # One decay per record, or (per-channel gates) the tile's KEY_DIM_TILE of them.
    comptime DECAYS = KEY_DIM_TILE if CHANNEL else 1
    # ops/fold.py's fold_tiling picks a tile that fits (fold_shared_bytes).
    comptime assert (
        4 * RING_LEN * (KEY_DIM_TILE + V + DECAYS) <= 48 * 1024
    ), "the fold's staged records pass 48 KiB of static shared memory: lower KEY_DIM_TILE"
    # (Staged by 16-byte vectors in the per-channel case only.)
    var decays = stack_allocation[
        RING_LEN * DECAYS,
        DType.float32,
        alignment = 16 if CHANNEL else 4,
        address_space=AddressSpace.SHARED,
    ]()
    stage_vectors[RING_LEN * KEY_DIM_TILE // RECORD_VEC, THREADS, PATH](
        keys, ring, record_base, record_stride, key_offset() + tile_base,
        KEY_DIM_TILE, accepted, tid, accepted_nodes, nodes_at,
    )
    stage_vectors[RING_LEN * V // RECORD_VEC, THREADS, PATH](
        deltas, ring, record_base, record_stride, delta_offset[K, V](group_slot),
        V, accepted, tid, accepted_nodes, nodes_at,
    )
    comptime if CHANNEL:
        stage_vectors[RING_LEN * KEY_DIM_TILE // RECORD_VEC, THREADS, PATH](
            decays, ring, record_base, record_stride,
            channel_decay_offset[K, V](group_size, group_slot) + tile_base,
            KEY_DIM_TILE, accepted, tid, accepted_nodes, nodes_at,
        )
    else:
        # A block of a small head can hold fewer threads than records (K = V = 8 in bf16
        # has one), so the threads stride over the records, unrolled like the vectors.
        comptime for s in range(ceildiv(RING_LEN, THREADS)):
            var t = tid + s * THREADS
            if t < accepted:
                decays[unsafe_offset=t] = ring[unsafe_offset=
                    record_base + record_of[PATH](accepted_nodes, nodes_at, t) * record_stride
                    + decay_offset[K, V](group_size, group_slot)
                ]
    barrier()

    # 3. Apply the records in order, in registers: decay (rounded), then one fma.
    for t in range(accepted):
        var head_decay = decays[unsafe_offset=t * DECAYS]  # read where the gate is the head's
        var delta = deltas.unsafe_load[width=VEC, alignment=16](t * V + column)
        comptime for m in range(ROWS_PER_THREAD):
            var tile_row = row_group + m * ROW_THREADS
            var key = keys[unsafe_offset=t * KEY_DIM_TILE + tile_row]
            var decay = head_decay
            comptime if CHANNEL:
                decay = decays[unsafe_offset=t * DECAYS + tile_row]
            held[m] = fma(SIMD[DType.float32, VEC](key), delta, held[m] * decay)

    # 4. Store each vector once, rounded to the pool's dtype.
    comptime for m in range(ROWS_PER_THREAD):
        var at = state_base + (tile_base + row_group + m * ROW_THREADS) * V + column
        state.unsafe_store[alignment=16](at, held[m].cast[state_dtype]())


def fold_gpu_kernel[
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
    KEY_DIM_TILE: Int,
    ROWS_PER_THREAD: Int,
    CHANNEL: Bool = False,
](
    state: Pointer[Scalar[state_dtype], MutAnyOrigin],
    ring: Pointer[Float32, ImmutAnyOrigin],
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    num_accepted: Pointer[UInt32, ImmutAnyOrigin],
    batch_i32: Int32,
    num_rows_i32: Int32,
    num_ring_rows_i32: Int32,
    num_value_heads_i32: Int32,
    num_key_heads_i32: Int32,
    record_stride_i32: Int32,
):
    """The fold of the first num_accepted[b] records (a chain)."""
    # num_accepted stands in for the node table, which a chain's block does not read.
    fold_block[state_dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD, CHANNEL, False](
        state, ring, row_ids, ring_row_ids, num_accepted, num_accepted, batch_i32,
        num_rows_i32, num_ring_rows_i32, num_value_heads_i32, num_key_heads_i32,
        record_stride_i32,
    )


def fold_path_gpu_kernel[
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
    KEY_DIM_TILE: Int,
    ROWS_PER_THREAD: Int,
    CHANNEL: Bool = False,
](
    state: Pointer[Scalar[state_dtype], MutAnyOrigin],
    ring: Pointer[Float32, ImmutAnyOrigin],
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    num_accepted: Pointer[UInt32, ImmutAnyOrigin],
    accepted_nodes: Pointer[UInt32, ImmutAnyOrigin],
    batch_i32: Int32,
    num_rows_i32: Int32,
    num_ring_rows_i32: Int32,
    num_value_heads_i32: Int32,
    num_key_heads_i32: Int32,
    record_stride_i32: Int32,
):
    """The fold of the records `accepted_nodes[b, :num_accepted[b]]`, in that order."""
    fold_block[state_dtype, K, V, RING_LEN, KEY_DIM_TILE, ROWS_PER_THREAD, CHANNEL, True](
        state, ring, row_ids, ring_row_ids, num_accepted, accepted_nodes, batch_i32,
        num_rows_i32, num_ring_rows_i32, num_value_heads_i32, num_key_heads_i32,
        record_stride_i32,
    )
