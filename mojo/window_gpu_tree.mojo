"""The tree verify on the throughput kernel's blocks: a block is one unit, a request's
column tile of one value head, its state in the block's registers (window_gpu.mojo's
layout: a thread holds reduction lane `lane` of four neighbouring columns).

Where the latency kernel (window_gpu_latency.mojo) gives a unit one warp and 16 columns,
here the warps of a block share one staging of each node's q, k, values and norms, and a
leaf's inputs come from shared memory like any node's. Per unit, the block
1. checks the request's ids and tables (tree_is_valid) before any load, and skips a
   request whose tables are bad: its readout NaN, its pool and ring rows unwritten;
2. loads its state tile into registers and, with a fold on load, folds the previous
   step's accepted path into it record by record from the ring (fold_ring_record), in
   path order, and stores the folded state: what a separate fold leaves in the pool;
3. lists its visits (plan_visits): first the leaves of the committed state, then each
   node that is some node's parent in the window's order, each followed by its own
   leaves. An inner node whose parent is not the inner node visited last reloads the
   committed state from the pool and folds its parent's root path in, root first
   (fold_root_path), as the latency kernel does;
4. steps the visits WINDOW_CHUNK at a time: their tokens are copied by node into the
   chunk's slots and put in lane-major order with their norms (stage_lane_major), each
   steps on the held state with the chain's arithmetic (tile_token), an inner node
   keeping its state and a leaf leaving the state as it came (KEEP off), and the chunk's
   readouts and delta rows leave through the outbox by node (send_tree_outbox), with the
   records' raw keys and decays. A reload starts a chunk of its own, so the root path's
   delta rows it reads are in the ring.

Every node steps from its parent's state by the same products and sums as the chain
verify's token from the token before: the same bits as the latency kernel and the CPU
(docs/design.md, "Token trees").
"""

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, barrier, block_idx, thread_idx
from max.gpu.memory import async_copy_commit_group, async_copy_wait_all
from max.gpu.sync import syncwarp
from std.math import ceildiv
from std.memory import AddressSpace, stack_allocation
from std.sys import size_of
from std.utils import StaticTuple
from std.utils.numerics import nan

from .column_groups import COLUMN_VECTOR, Columns, column_slot, column_sum
from .record_layout import delta_offset, first_record_at
from .recurrence_math import REDUCTION_LANES
from .window_gpu import (
    channel_decays,
    lane_major_decays,
    post,
    tile_token,
    window_block_threads,
    write_chunk_records,
)
from .window_gpu_latency import fold_ring_record, fold_root_path, tree_inner_nodes, tree_is_valid
from .window_gpu_staging import (
    COPY_FLOATS,
    OUTBOX_ROWS_PER_TOKEN,
    SharedFloats,
    SharedUInts,
    TOKEN_SCALARS,
    WARP_THREADS,
    WINDOW_CHUNK,
    copy_channel_tokens_async,
    copy_tokens_async,
    lane_major_floats,
    natural_pitch,
    quotient,
    remainder,
    shared_floats,
    stage_lane_major,
)

# A visit is a node (its low bits), whether it keeps its state (a node some node steps
# from) and whether it starts from the committed state with its parent's root path.
comptime VISIT_NODE_MASK: UInt32 = 0xFF
comptime VISIT_KEEPS: UInt32 = 0x100
comptime VISIT_RELOADS: UInt32 = 0x200
# Warps of these kernels an SM holds at once: they take up to 255 registers a thread
# (the held tile, K / 8 rows of four columns, and a node's sums), as the latency tree
# kernel's one-warp units do (window_launch.TREE_WARPS_PER_SM).
comptime TREE_BLOCK_WARPS_PER_SM = 8


def tree_blocks_per_sm[THREADS: Int]() -> Int:
    """Blocks of THREADS threads an SM holds at once: TREE_BLOCK_WARPS_PER_SM warps, a
    block of less than a warp counting as a whole one (its registers are a warp's)."""
    return max(1, TREE_BLOCK_WARPS_PER_SM // ceildiv(THREADS, WARP_THREADS))


@always_inline
def tree_parent[
    space: AddressSpace
](parents: Pointer[Int32, MutUntrackedOrigin, address_space=space], node: Int) -> Int:
    """Node `node`'s parent from the staged table (-1: the committed state)."""
    return Int(parents[unsafe_offset=node])


@always_inline
def inner_visit_at[
    space: AddressSpace
](
    parents: Pointer[Int32, MutUntrackedOrigin, address_space=space],
    inner: Int,
    window: Int,
    node: Int,
) -> Int:
    """Where inner node `node` comes in the visiting order: after the committed state's
    leaves, the inner nodes before it and their leaves."""
    var at = 0
    for j in range(window):
        var parent = tree_parent(parents, j)
        if (inner >> j) & 1 != 0:
            if j < node:
                at += 1
        elif parent < node:  # a leaf of the committed state (-1) or of an earlier node
            at += 1
    return at


@always_inline
def plan_visits[
    THREADS: Int, space: AddressSpace
](
    visits: Pointer[UInt32, MutUntrackedOrigin, address_space=space],
    parents: Pointer[Int32, MutUntrackedOrigin, address_space=space],
    inner: Int,
    window: Int,
    tid: Int,
):
    """Lists the unit's visits in `visits` (one entry per node of the window): first the
    leaves of the committed state in the window's order, then each inner node in the
    window's order followed by its leaves, in the window's order. An inner node whose
    parent is not the inner node listed before it (-1 before the first) reloads. Each
    thread places its own nodes; the block's threads call it together and meet at a
    barrier before reading the list. (Generic in the address space, so that a host
    program can check the order: tests/test_window_tree_plan.py.)"""
    for node in range(tid, window, THREADS):
        var parent = tree_parent(parents, node)
        var entry = UInt32(node)
        var at: Int
        if (inner >> node) & 1 != 0:
            at = inner_visit_at(parents, inner, window, node)
            entry |= VISIT_KEEPS
            var inner_before = -1
            for j in range(node):
                if (inner >> j) & 1 != 0:
                    inner_before = j
            if parent != inner_before:
                entry |= VISIT_RELOADS
        else:
            at = 0 if parent < 0 else inner_visit_at(parents, inner, window, parent) + 1
            for j in range(parent + 1, node):
                if (inner >> j) & 1 == 0 and tree_parent(parents, j) == parent:
                    at += 1
        visits[unsafe_offset=at] = entry


@always_inline
def visit_node(entry: UInt32) -> Int:
    return Int(entry & VISIT_NODE_MASK)


@always_inline
def chunk_of_visits(visits: SharedUInts, first: Int, window: Int) -> Int:
    """How many visits from `first` step as one chunk: up to WINDOW_CHUNK, ending before
    a visit that reloads (its root path's delta rows must be in the ring first)."""
    var count = 1
    while (
        count < WINDOW_CHUNK
        and first + count < window
        and (visits[unsafe_offset=first + count] & VISIT_RELOADS) == 0
    ):
        count += 1
    return count


@always_inline
def copy_visit_tokens[
    K: Int, V: Int, COLUMN_TILE: Int, THREADS: Int, CHANNEL: Bool
](
    visits: SharedUInts,
    first: Int,
    count: Int,
    pairs: SharedFloats,
    values: SharedFloats,
    scalars: SharedFloats,
    qkv: Pointer[Float32, ImmutAnyOrigin],
    decay: Pointer[Float32, ImmutAnyOrigin],
    beta: Pointer[Float32, ImmutAnyOrigin],
    start: Int,
    num_key_heads: Int,
    key_head: Int,
    num_value_heads: Int,
    value_head: Int,
    tile_start: Int,
    tid: Int,
):
    """Starts copying the tokens of visits `first .. first + count - 1` into the chunk's
    slots 0 .. count - 1, by node: slot c as a one-token chunk would hold token c (q and
    k at pair rows 2c and 2c + 1, values and scalars at slot c, per-channel decays at row
    c after the pairs)."""
    comptime NATURAL = natural_pitch[K]()
    for c in range(count):
        var token = start + visit_node(visits[unsafe_offset=first + c])
        comptime if CHANNEL:
            copy_channel_tokens_async[K, V, COLUMN_TILE, THREADS](
                pairs.unsafe_offset(2 * c * NATURAL), values.unsafe_offset(c * COLUMN_TILE),
                scalars.unsafe_offset(c * TOKEN_SCALARS),
                channel_decays[K](pairs).unsafe_offset(c * NATURAL), qkv, decay, beta, token, 1,
                num_key_heads, key_head, num_value_heads, value_head, tile_start, tid,
            )
        else:
            copy_tokens_async[K, V, COLUMN_TILE, THREADS](
                pairs.unsafe_offset(2 * c * NATURAL), values.unsafe_offset(c * COLUMN_TILE),
                scalars.unsafe_offset(c * TOKEN_SCALARS), qkv, decay, beta, token, 1,
                num_key_heads, key_head, num_value_heads, value_head, tile_start, tid,
            )


@always_inline
def step_visits[
    ROWS: Int, //, K: Int, COLUMN_TILE: Int, CHANNEL: Bool
](
    mut held: Array[Columns, ROWS],
    visits: SharedUInts,
    first: Int,
    count: Int,
    outbox: SharedFloats,
    scalars: SharedFloats,
    keys: SharedFloats,
    queries: SharedFloats,
    values: SharedFloats,
    lane: Int,
    tile_column: Int,
    slot: Int,
):
    """The chunk's staged visits on the held tile (tile_token), an inner node keeping its
    state, a leaf not: their readouts and deltas left in the outbox (visit c's at rows 2c
    and 2c + 1), as the chain's window_chunk_tokens leaves a chunk's."""
    var pending_out = Columns(0.0)
    for c in range(count):
        var value_at = c * COLUMN_TILE + tile_column + slot
        var readout_and_delta: Tuple[Float32, Float32]
        # The whole block reads the same entry: its warps branch as one.
        if (visits[unsafe_offset=first + c] & VISIT_KEEPS) != 0:
            readout_and_delta = tile_token[K, CHANNEL, True](
                held, pending_out, scalars, keys, queries, values, c, value_at, lane,
                lane_major_decays[K](keys),
            )
        else:
            readout_and_delta = tile_token[K, CHANNEL, False](
                held, pending_out, scalars, keys, queries, values, c, value_at, lane,
                lane_major_decays[K](keys),
            )
        if c > 0:
            post[COLUMN_TILE](outbox, 2 * (c - 1), readout_and_delta[0], lane, tile_column, slot)
        post[COLUMN_TILE](outbox, 2 * c + 1, readout_and_delta[1], lane, tile_column, slot)
    post[COLUMN_TILE](
        outbox, 2 * (count - 1), column_sum(pending_out, lane), lane, tile_column, slot
    )


@always_inline
def send_tree_outbox[
    K: Int, V: Int, COLUMN_TILE: Int, THREADS: Int, CHANNEL: Bool
](
    outbox: SharedFloats,
    visits: SharedUInts,
    first: Int,
    count: Int,
    readout: Pointer[Float32, MutAnyOrigin],
    ring: Pointer[Float32, MutAnyOrigin],
    start: Int,
    record_row_base: Int,
    record_stride: Int,
    readout_width: Int,
    value_head: Int,
    tile_start: Int,
    tile: Int,
    group_size: Int,
    group_slot: Int,
    pairs: SharedFloats,
    scalars: SharedFloats,
    tid: Int,
):
    """Sends the chunk's outbox on by node: visit c's readout row to its token's readout,
    its delta row to its record, each warp the columns it wrote (send_outbox's order);
    the first tile's block also writes each record's raw key (the key head's first value
    head) and decays, from the staged tokens (write_chunk_records, one token a slot)."""
    comptime NATURAL = natural_pitch[K]()
    comptime WARP_LANES = min(WARP_THREADS, THREADS)
    comptime WARP_COLUMNS = WARP_LANES // REDUCTION_LANES * COLUMN_VECTOR
    comptime ROW_VECTORS = WARP_COLUMNS // COPY_FLOATS
    var warp_lane = remainder[WARP_LANES](tid)
    var warp_column = quotient[WARP_LANES](tid) * WARP_COLUMNS
    syncwarp()  # the warp's own readouts and deltas are in the outbox
    for i in range(warp_lane, count * OUTBOX_ROWS_PER_TOKEN * ROW_VECTORS, WARP_LANES):
        var row = quotient[ROW_VECTORS](i)
        var in_tile = warp_column + remainder[ROW_VECTORS](i) * COPY_FLOATS
        var node = visit_node(visits[unsafe_offset=first + (row >> 1)])
        var vector = outbox.unsafe_load[width=COPY_FLOATS, alignment=16](
            row * COLUMN_TILE + in_tile
        )
        if (row & 1) == 0:
            readout.unsafe_store[alignment=16](
                (start + node) * readout_width + value_head * V + tile_start + in_tile, vector
            )
        else:
            ring.unsafe_store[alignment=16](
                (record_row_base + node) * record_stride + delta_offset[K, V](group_slot)
                + tile_start + in_tile,
                vector,
            )
    if tile == 0:
        for c in range(count):
            var node = visit_node(visits[unsafe_offset=first + c])
            write_chunk_records[K, V, THREADS, CHANNEL](
                ring, (record_row_base + node) * record_stride, record_stride, 1,
                pairs.unsafe_offset(2 * c * NATURAL), scalars.unsafe_offset(c * TOKEN_SCALARS),
                group_size, group_slot, tid, channel_decays[K](pairs).unsafe_offset(c * NATURAL),
            )


# Bound the registers so that tree_blocks_per_sm blocks fit an SM.
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](
        Int32(window_block_threads[COLUMN_TILE]())
    ),
    `nvvm.minctasm`=SIMDLength(tree_blocks_per_sm[window_block_threads[COLUMN_TILE]()]()),
)
def windows_gpu_tree_kernel[
    state_dtype: DType,
    K: Int,
    V: Int,
    RING_LEN: Int,
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
    batch_i32: Int32,
    num_tokens_i32: Int32,
    num_rows_i32: Int32,
    num_ring_rows_i32: Int32,
    num_value_heads_i32: Int32,
    num_key_heads_i32: Int32,
    record_stride_i32: Int32,
    parents: Pointer[Int32, ImmutAnyOrigin],
    previous_nodes: Pointer[UInt32, ImmutAnyOrigin],
):
    """One unit a block, in the steps of the module's docstring: request u // (nv *
    TILES) on column tile u % TILES of value head (u // TILES) % nv. It records, as a
    chain verify does, and never commits (a tree window fits the ring)."""
    comptime TILES = V // COLUMN_TILE
    comptime ROWS = K // REDUCTION_LANES
    comptime THREADS = window_block_threads[COLUMN_TILE]()
    comptime CHUNK = WINDOW_CHUNK
    comptime NATURAL = natural_pitch[K]()
    comptime LANE_MAJOR = lane_major_floats[K]()
    comptime PAIR_ROWS = 3 if CHANNEL else 2
    comptime MULTIPLE = 2 if CHANNEL else 1
    comptime ROW_BYTES = COLUMN_VECTOR * size_of[state_dtype]()
    comptime assert RING_LEN <= 32, "a tree holds at most 32 nodes"
    comptime assert RING_LEN <= Int(VISIT_NODE_MASK) + 1, "a visit's node fits its low bits"
    var num_value_heads = Int(num_value_heads_i32)
    var num_key_heads = Int(num_key_heads_i32)
    var record_stride = Int(record_stride_i32)
    var num_tokens = Int(num_tokens_i32)
    var num_rows = Int(num_rows_i32)
    var num_ring_rows = Int(num_ring_rows_i32)
    var group_size = num_value_heads // num_key_heads
    var readout_width = num_value_heads * V

    var unit = Int(block_idx.x)
    var tile = unit % TILES
    var value_head = (unit // TILES) % num_value_heads
    var request = unit // (TILES * num_value_heads)
    if request >= Int(batch_i32):
        return
    var key_head = value_head // group_size
    var group_slot = value_head - key_head * group_size
    var tile_start = tile * COLUMN_TILE
    var tid = Int(thread_idx.x)
    # This thread holds reduction lane `lane` of columns `column .. column + 3`, and
    # ends each column sum with the whole sum of column `column + slot`.
    var lane = remainder[REDUCTION_LANES](tid)
    var tile_column = quotient[REDUCTION_LANES](tid) * COLUMN_VECTOR
    var column = tile_start + tile_column
    var slot = column_slot(lane)

    # 1. The request's ids and tables, read by every thread (the loads broadcast).
    var start = Int(offsets[unsafe_offset=request])
    var end = Int(offsets[unsafe_offset=request + 1])
    if not (start <= end and end <= num_tokens):
        return  # offsets out of range: nothing to read, nothing written
    var window = end - start
    var row = Int(row_ids[unsafe_offset=request])
    var ring_row = Int(ring_row_ids[unsafe_offset=request])
    var accepted = 0
    var previous_row = 0
    comptime if FOLD_PREVIOUS:
        accepted = Int(previous_accepted[unsafe_offset=request])
        previous_row = Int(previous_ring_row_ids[unsafe_offset=request])
        if accepted > RING_LEN:
            accepted = 0  # that verify committed the state itself
    var nodes_at = request * RING_LEN
    var bad = row >= num_rows or ring_row >= num_ring_rows
    bad = bad or (accepted > 0 and previous_row >= num_ring_rows)
    # A window past the ring, a parent that is neither -1 nor an earlier node, or a
    # previous path out of order or past the ring sends the request away before any
    # load of the state or the ring.
    bad = bad or not tree_is_valid[RING_LEN](parents, previous_nodes, nodes_at, window, accepted)
    if bad:
        # Never follow an id out of bounds; make the request's readout loudly invalid.
        if (lane & 1) == 0:
            for t in range(start, end):
                readout[unsafe_offset=t * readout_width + value_head * V + column + slot] = nan[
                    DType.float32
                ]()
        return

    var pairs = shared_floats[CHUNK * PAIR_ROWS * NATURAL]()
    var queries = shared_floats[CHUNK * LANE_MAJOR]()
    var keys = shared_floats[MULTIPLE * CHUNK * LANE_MAJOR]()
    var values = shared_floats[CHUNK * COLUMN_TILE]()
    var scalars = shared_floats[CHUNK * TOKEN_SCALARS]()
    var outbox = shared_floats[OUTBOX_ROWS_PER_TOKEN * CHUNK * COLUMN_TILE]()
    var tree_parents = stack_allocation[
        RING_LEN, DType.int32, alignment=16, address_space=AddressSpace.SHARED
    ]()
    var visits = stack_allocation[
        RING_LEN, DType.uint32, alignment=16, address_space=AddressSpace.SHARED
    ]()

    # 3. (first half) The visiting order, while the state loads.
    for node in range(tid, window, THREADS):
        tree_parents[unsafe_offset=node] = parents[unsafe_offset=nodes_at + node]
    var inner = tree_inner_nodes(parents, nodes_at, window)

    # 2. The state tile, straight into registers: held[m] is state row m * 8 + lane of
    #    the thread's four columns.
    var state_rows = state.unsafe_offset(
        row * (num_value_heads * K * V) + value_head * K * V + lane * V + column
    )
    var held = Array[Columns, ROWS](uninitialized=True)
    comptime for m in range(ROWS):
        held[m] = state_rows.unsafe_load[width=COLUMN_VECTOR, alignment=ROW_BYTES](
            m * REDUCTION_LANES * V
        ).cast[DType.float32]()
    comptime if FOLD_PREVIOUS:
        if accepted > 0:
            # The previous step's accepted path, node by node from the ring, as the
            # path fold applies it.
            var records_at = first_record_at[RING_LEN](
                previous_row, num_key_heads, key_head, record_stride
            )
            for t in range(accepted):
                var node = Int(previous_nodes[unsafe_offset=nodes_at + t])
                fold_ring_record[ROWS=ROWS, CV=COLUMN_VECTOR, K=K, V=V, CHANNEL=CHANNEL](
                    held, ring, records_at + node * record_stride, group_size, group_slot,
                    column, lane,
                )
            # What a separate fold leaves in the pool, and what the tree reads back.
            comptime for m in range(ROWS):
                held[m] = held[m].cast[state_dtype]().cast[DType.float32]()
                state_rows.unsafe_store[alignment=ROW_BYTES](
                    m * REDUCTION_LANES * V, held[m].cast[state_dtype]()
                )

    barrier()  # the staged parents are in
    plan_visits[THREADS](visits, tree_parents, inner, window, tid)
    var record_row_base = (ring_row * num_key_heads + key_head) * RING_LEN

    # 4. The visits, a chunk at a time.
    var first = 0
    while first < window:
        barrier()  # the list is in; the chunk before has left the outbox and the staging
        var count = chunk_of_visits(visits, first, window)
        copy_visit_tokens[K, V, COLUMN_TILE, THREADS, CHANNEL](
            visits, first, count, pairs, values, scalars, qkv, decay, beta, start,
            num_key_heads, key_head, num_value_heads, value_head, tile_start, tid,
        )
        async_copy_commit_group()
        var entry = visits[unsafe_offset=first]
        if (entry & VISIT_RELOADS) != 0:
            # The committed state: the pool, which a tree verify never writes but for a
            # fold on load's result, stored above by this very thread (the same
            # addresses: program order), with the parent's root path folded in. Its
            # delta rows left the outbox in earlier chunks, before the barrier above.
            comptime for m in range(ROWS):
                held[m] = state_rows.unsafe_load[width=COLUMN_VECTOR, alignment=ROW_BYTES](
                    m * REDUCTION_LANES * V
                ).cast[DType.float32]()
            var node = visit_node(entry)
            fold_root_path[ROWS=ROWS, CV=COLUMN_VECTOR, K=K, V=V, RING_LEN=RING_LEN, CHANNEL=CHANNEL](
                held, ring, qkv, decay, parents, request, Int(parents[unsafe_offset=nodes_at + node]),
                record_row_base * record_stride, record_stride, start, num_key_heads, key_head,
                num_value_heads, value_head, group_slot, column, lane,
            )
        async_copy_wait_all()
        barrier()  # every thread's copies have landed
        stage_lane_major[K, THREADS, False, CHANNEL](
            pairs, queries, keys, count, scalars, pairs, keys, 0, tid,
            channel_decays[K](pairs), lane_major_decays[K](keys), pairs, keys,
        )
        barrier()  # q, k (and decays) are in lane-major order, the norms written
        step_visits[K, COLUMN_TILE, CHANNEL](
            held, visits, first, count, outbox, scalars, keys, queries, values, lane,
            tile_column, slot,
        )
        send_tree_outbox[K, V, COLUMN_TILE, THREADS, CHANNEL](
            outbox, visits, first, count, readout, ring, start, record_row_base,
            record_stride, readout_width, value_head, tile_start, tile, group_size,
            group_slot, pairs, scalars, tid,
        )
        first += count
