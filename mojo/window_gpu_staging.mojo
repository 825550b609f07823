"""What the GPU window kernel stages in shared memory, and how.

A block works through its units (requests on column tiles) one after another. While it
computes one, the asynchronous copies for the next are already in flight: that unit's
state tile, its first WINDOW_CHUNK previous records and its first WINDOW_CHUNK tokens.
The copies go straight from global to shared memory, so they hold no registers while
they wait; registers stay free for the state being computed on. Records and tokens
come by cp.async; the state tile, where its rows are whole 128-byte swizzle rows, as
tensor boxes (cp.async.bulk.tensor, one instruction per box), as does a folded state
on its way back to the pool; other tiles by cp.async.

Everything a request needs is decided from its ids and offsets alone (`RequestPlan`),
so every thread of a block takes the same branches and meets the same barriers.
"""

from max.gpu.memory import async_copy
from max.gpu.primitives.warp import shuffle_xor
from std.math import ceildiv, fma
from std.memory import AddressSpace, stack_allocation
from std.sys import inlined_assembly, size_of

from .bulk_copy import (
    BULK_UNIT_BYTES,
    SWIZZLE_ALIGNMENT,
    SWIZZLE_BYTES,
    SharedBarrier,
    commit_bulk_copies,
    tensor_box_to_global,
    tensor_box_to_l2,
    tensor_box_to_shared,
)
from .recurrence_math import L2_EPS, REDUCTION_LANES, query_scale, rounded_sqrt
from .record_layout import channel_decay_offset, decay_offset, delta_offset, key_offset

# Records, and tokens, staged at a time. A longer fold or window stages the rest
# chunk by chunk without overlap; verify windows are rarely longer.
comptime WINDOW_CHUNK = 4
# A token's scalars sit together, so that one 16-byte load brings them all.
comptime TOKEN_SCALARS = 4
comptime DECAY_AT = 0
comptime BETA_AT = 1
comptime INVERSE_KEY_NORM_AT = 2
comptime WARP_THREADS = 32
# Floats per 16-byte copy.
comptime COPY_FLOATS = 4
# Static shared memory a block may use.
comptime BLOCK_SHARED_LIMIT = 48 * 1024
# Shared memory of one SM of an H100/H200, and what each resident block costs on top.
comptime SM_SHARED_BYTES = 228 * 1024
# Shared memory one block may use, static and dynamic together.
comptime BLOCK_SHARED_MAX = 227 * 1024
comptime BLOCK_SHARED_RESERVED = 1024
# Registers of one SM, and the most a thread of the window kernel gets: 168, so 3
# blocks per SM. At 128 (4 blocks) ptxas spills 64 to 110 bytes per thread, and four
# blocks measured 24% to 48% slower on an H200 (docs/tuning-log.md).
comptime SM_REGISTERS = 65536
comptime THREAD_REGISTERS = 168

comptime SharedFloats = Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@always_inline
def shared_floats[count: Int]() -> SharedFloats:
    return stack_allocation[
        count, DType.float32, alignment=16, address_space=AddressSpace.SHARED
    ]()


def state_tile_pitch[state_dtype: DType, COLUMN_TILE: Int]() -> Int:
    """Elements per staged state row: the tile plus 16 bytes, so that the eight rows of
    a column group's lanes, read at once, fall on different banks."""
    return COLUMN_TILE + 16 // size_of[state_dtype]()


def permuted_pitch[K: Int]() -> Int:
    """Floats per lane in the lane-major q/k layout: the lane's K/8 values rounded up to
    whole 16-byte vectors, and an odd number of vectors so that eight lanes' vector
    loads fall on different banks."""
    var vectors = ceildiv(K // REDUCTION_LANES, COPY_FLOATS)
    if vectors % 2 == 0:
        vectors += 1
    return vectors * COPY_FLOATS


def lane_major_floats[K: Int]() -> Int:
    """Floats of one K-vector in the lane-major layout: lane p's elements p, p + 8, ...
    together, in the order the lane sums them, `permuted_pitch` floats per lane."""
    return REDUCTION_LANES * permuted_pitch[K]()


def natural_pitch[K: Int]() -> Int:
    """Floats per staged K-vector as it arrives, in its own order: K plus 8, so that
    the rows that the eight lanes of neighbouring vectors read at once fall on
    different banks."""
    return K + 2 * COPY_FLOATS


def window_static_bytes[
    K: Int, COLUMN_TILE: Int, FOLD_PREVIOUS: Bool, CHANNEL: Bool = False
]() -> Int:
    """Static shared memory of one block of the window kernel: tokens, records, ids."""
    comptime LANE_MAJOR = lane_major_floats[K]()
    comptime NATURAL = natural_pitch[K]()
    var floats = 5 * 4  # the five record and outbox buffers' minimum size
    if FOLD_PREVIOUS:
        # Records as they arrive: one buffer of keys, two of deltas and decays; the
        # keys lane-major once.
        floats += WINDOW_CHUNK * NATURAL + 2 * WINDOW_CHUNK * (COLUMN_TILE + 1)
        floats += WINDOW_CHUNK * LANE_MAJOR
    if CHANNEL:
        # Per-channel gates: a token's K decays, as they arrive (two buffers, as the
        # tokens) and lane-major once; with a fold on load also the records' K decays,
        # as the records' keys (one buffer as they arrive, one lane-major). The two
        # buffers of one decay per record stay, unused.
        floats += 2 * WINDOW_CHUNK * NATURAL + WINDOW_CHUNK * LANE_MAJOR
        if FOLD_PREVIOUS:
            floats += WINDOW_CHUNK * NATURAL + WINDOW_CHUNK * LANE_MAJOR
    if not outbox_in_record_keys[K, COLUMN_TILE, FOLD_PREVIOUS]():
        floats += OUTBOX_ROWS_PER_TOKEN * WINDOW_CHUNK * COLUMN_TILE
    # Two buffers of tokens as they arrive (q and k, the tile's values, the scalars),
    # q and k lane-major once.
    floats += 2 * WINDOW_CHUNK * (2 * NATURAL + COLUMN_TILE + TOKEN_SCALARS)
    floats += WINDOW_CHUNK * 2 * LANE_MAJOR
    floats += PLAN_FIELDS * PLAN_SLOTS + PLAN_SLOTS  # the units' ids and requests' ids
    return 4 * floats


# Rows a token leaves in the window kernel's outbox: its readout and its delta row.
comptime OUTBOX_ROWS_PER_TOKEN = 2


def outbox_in_record_keys[K: Int, COLUMN_TILE: Int, FOLD_PREVIOUS: Bool]() -> Bool:
    """Whether the window's outbox fits in the lane-major record keys' buffer, which
    only the fold uses."""
    return FOLD_PREVIOUS and (
        WINDOW_CHUNK * lane_major_floats[K]()
        >= OUTBOX_ROWS_PER_TOKEN * WINDOW_CHUNK * COLUMN_TILE
    )


def window_tile_bytes[state_dtype: DType, K: Int, COLUMN_TILE: Int]() -> Int:
    """Dynamic shared memory of one block: the staged state tile (wider tiles than
    static shared memory's 48 KiB allow). A tile of tensor boxes is dense, with room to
    start it on the swizzle's alignment."""
    comptime if tile_in_boxes[state_dtype, COLUMN_TILE]():
        return K * COLUMN_TILE * size_of[state_dtype]() + SWIZZLE_ALIGNMENT
    return K * state_tile_pitch[state_dtype, COLUMN_TILE]() * size_of[state_dtype]()


def tile_in_boxes[state_dtype: DType, COLUMN_TILE: Int]() -> Bool:
    """Whether the state tile moves as tensor boxes (bulk_copy.mojo) of 128-byte rows:
    a tile row is a whole number of them."""
    return (COLUMN_TILE * size_of[state_dtype]()) % SWIZZLE_BYTES == 0


def box_columns[state_dtype: DType]() -> Int:
    """Columns of one tensor box: one 128-byte swizzle row."""
    return SWIZZLE_BYTES // size_of[state_dtype]()


@always_inline
def staged_at[state_dtype: DType, K: Int, COLUMN_TILE: Int](row: Int, column: Int) -> Int:
    """Where element (`row`, `column`) of the state tile sits in the staged tile. Tensor
    boxes of K x box_columns lie one after another, each swizzled (bulk_copy.mojo);
    otherwise rows are `state_tile_pitch` elements apart."""
    comptime if tile_in_boxes[state_dtype, COLUMN_TILE]():
        comptime BOX_COLUMNS = box_columns[state_dtype]()
        comptime UNIT = BULK_UNIT_BYTES // size_of[state_dtype]()  # elements per 16 bytes
        comptime SPAN_ROWS = SWIZZLE_ALIGNMENT // SWIZZLE_BYTES
        var box = quotient[BOX_COLUMNS](column)
        var in_row = remainder[BOX_COLUMNS](column)
        var unit = quotient[UNIT](in_row) ^ remainder[SPAN_ROWS](row)
        return (box * K + row) * BOX_COLUMNS + unit * UNIT + remainder[UNIT](in_row)
    return row * state_tile_pitch[state_dtype, COLUMN_TILE]() + column


def whole_warps[THREADS: Int]() -> Bool:
    """Whether a block of THREADS threads is whole warps, or one warp at most: the
    staging then hands each warp one kind of unit (stage_lane_major), and the outbox
    is sent a warp at a time (window_gpu.mojo). A block of 48 threads hung."""
    return THREADS % WARP_THREADS == 0 or WARP_THREADS % THREADS == 0


def window_blocks_per_sm[
    state_dtype: DType,
    K: Int,
    COLUMN_TILE: Int,
    FOLD_PREVIOUS: Bool,
    THREADS: Int,
    CHANNEL: Bool = False,
]() -> Int:
    """Blocks an H100/H200 SM holds at once, as its shared memory and THREAD_REGISTERS
    registers per thread allow."""
    var bytes = window_static_bytes[K, COLUMN_TILE, FOLD_PREVIOUS, CHANNEL]() + window_tile_bytes[
        state_dtype, K, COLUMN_TILE
    ]()
    var by_shared = SM_SHARED_BYTES // (bytes + BLOCK_SHARED_RESERVED)
    var by_registers = SM_REGISTERS // (THREADS * THREAD_REGISTERS)
    return max(1, min(by_shared, by_registers, 2048 // THREADS))


# A block works through units of work, one (request, column block) each: a column block
# is one column tile of one value head. Units go out in request-major order, so the
# units running at once share their requests' tokens in L2. A block's first two units
# are its own index and that plus the grid's size; where blocks run more than two, each
# later one comes from a counter that the blocks add to as they go, so a block that runs
# fast takes more units and the layer ends with the GPU evenly busy (window_launch.mojo).
#
# The ids of a block's current unit and of its next wait in shared memory, one slot
# each, so that deciding a unit's plan never waits on memory: the next unit's ids are
# read, and the unit after it claimed, while the block stages the current one.
comptime PLAN_SLOTS = 2
# The ids of one request: its offsets, pool row, ring row, previous ring row and
# previous accepted count, each read by a thread of its own.
comptime PLAN_FIELDS = 6

comptime SharedUInts = Pointer[UInt32, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@fieldwise_init
struct RequestPlan(ImplicitlyCopyable):
    """What one request asks of a block, from its ids and offsets."""

    var start: Int
    var end: Int
    var row: Int
    var ring_row: Int
    var previous_row: Int
    # Previous records to fold first (0 if none or more than the ring holds).
    var accepted: Int
    # The request writes the pool itself: a forward, or a window longer than the ring.
    var commit: Bool
    # The offsets are in range and every id it follows is too.
    var runs: Bool
    # The offsets are in range but an id is not: its readout becomes NaN.
    var poisoned: Bool


@fieldwise_init
struct UnitPlace(ImplicitlyCopyable):
    """Where a unit's column block sits: its value head, the key head that head reads,
    its place in that key head's group, and its first value column."""

    var value_head: Int
    var key_head: Int
    var group_slot: Int
    var tile: Int
    var tile_start: Int


@always_inline
def divide(index: Int, divisor: Int) -> Tuple[Int, Int]:
    """`index // divisor` and `index % divisor` for a non-negative index and a positive
    divisor below 2**32, in 32-bit unsigned arithmetic: 64-bit division costs the
    kernel several times the instructions, once per unit."""
    var whole = Int(UInt32(index) // UInt32(divisor))
    return (whole, index - whole * divisor)


@always_inline
def place_of[
    COLUMN_TILE: Int, TILES: Int
](block_column: Int, group_size: Int) -> UnitPlace:
    """The place of column block `block_column` (value head * TILES + tile)."""
    var tile = remainder[TILES](block_column)
    var value_head = quotient[TILES](block_column)
    var key_head, group_slot = divide(value_head, group_size)
    return UnitPlace(value_head, key_head, group_slot, tile, tile * COLUMN_TILE)


@always_inline
def plan_field_reader[THREADS: Int](tid: Int) -> Int:
    """The field of a request's ids that thread `tid` reads, or -1: the block's last
    PLAN_FIELDS threads read one each (warp 0 already issues the tile's copies)."""
    comptime assert THREADS > PLAN_FIELDS, "a block needs a thread per id and a claimer"
    return THREADS - 1 - tid if tid >= THREADS - PLAN_FIELDS else -1


@always_inline
def unit_claimer[THREADS: Int]() -> Int:
    """The thread that claims the block's units from the counter."""
    return THREADS - 1 - PLAN_FIELDS


@always_inline
def read_plan_field[
    RECORD: Bool, FOLD_PREVIOUS: Bool
](
    field: Int,
    request: Int,
    row_ids: Pointer[UInt32, ImmutAnyOrigin],
    ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    offsets: Pointer[UInt32, ImmutAnyOrigin],
    previous_ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    previous_accepted: Pointer[UInt32, ImmutAnyOrigin],
) -> UInt32:
    """Field `field` of request `request`'s ids (see PLAN_FIELDS); 0 for a field the
    op does not have."""
    if field == 0:
        return offsets[unsafe_offset=request]
    if field == 1:
        return offsets[unsafe_offset=request + 1]
    if field == 2:
        return row_ids[unsafe_offset=request]
    comptime if RECORD:
        if field == 3:
            return ring_row_ids[unsafe_offset=request]
    comptime if FOLD_PREVIOUS:
        if field == 4:
            return previous_ring_row_ids[unsafe_offset=request]
        if field == 5:
            return previous_accepted[unsafe_offset=request]
    return 0


@always_inline
def claim_unit(counter: Pointer[UInt32, MutAnyOrigin]) -> UInt32:
    """The counter's value before this claim added one to it."""
    return inlined_assembly[
        "atom.relaxed.gpu.global.add.u32 $0, [$1], 1;",
        UInt32,
        constraints="=r,l,~{memory}",
        has_side_effect=True,
    ](counter)


@always_inline
def plan_request[
    RING_LEN: Int, RECORD: Bool, FOLD_PREVIOUS: Bool
](
    table: SharedUInts, slot: Int, num_tokens: Int, num_rows: Int, num_ring_rows: Int
) -> RequestPlan:
    """The plan of the request whose ids sit in `slot` of the table (field f of slot
    s at `f * PLAN_SLOTS + s`)."""
    var start = Int(table[unsafe_offset=slot])
    var end = Int(table[unsafe_offset=PLAN_SLOTS + slot])
    var in_range = start <= end and end <= num_tokens
    var commit = not RECORD or end - start > RING_LEN
    var row = Int(table[unsafe_offset=2 * PLAN_SLOTS + slot])
    var bad_id = row >= num_rows
    var ring_row = 0
    comptime if RECORD:
        ring_row = Int(table[unsafe_offset=3 * PLAN_SLOTS + slot])
        bad_id = bad_id or (not commit and ring_row >= num_ring_rows)
    var accepted = 0
    var previous_row = 0
    comptime if FOLD_PREVIOUS:
        accepted = Int(table[unsafe_offset=5 * PLAN_SLOTS + slot])
        if accepted > RING_LEN:
            accepted = 0
        previous_row = Int(table[unsafe_offset=4 * PLAN_SLOTS + slot])
        bad_id = bad_id or (accepted > 0 and previous_row >= num_ring_rows)
    return RequestPlan(
        start, end, row, ring_row, previous_row, accepted, commit,
        in_range and not bad_id, in_range and bad_id,
    )


@always_inline
def quotient[DIVISOR: Int](index: Int) -> Int:
    """`index // DIVISOR` for a thread index (never negative) in 32-bit unsigned
    arithmetic, which is a shift where 64-bit signed division needs sign fixes."""
    return Int(UInt32(index) // UInt32(DIVISOR))


@always_inline
def remainder[DIVISOR: Int](index: Int) -> Int:
    """`index % DIVISOR` for a thread index, as `quotient` computes it."""
    return Int(UInt32(index) % UInt32(DIVISOR))


@always_inline
def copy_rows_async[
    ROW_LEN: Int, MAX_ROWS: Int, THREADS: Int, DST_PITCH: Int = ROW_LEN
](
    dst: SharedFloats,
    src: Pointer[Float32, ImmutAnyOrigin],
    base: Int,
    stride: Int,
    rows: Int,
    tid: Int,
):
    """Starts copying rows `t < rows` of ROW_LEN floats at `base + t * stride` to rows
    DST_PITCH floats apart in `dst`, 16 bytes per copy, spread over the block's threads."""
    comptime PIECES = ROW_LEN // COPY_FLOATS

    comptime if THREADS % PIECES == 0:
        # Whole rows per pass: one source and one target per thread, stepped a row
        # group at a time (offsets hoisted per pass would cost a 64-bit register each).
        comptime ROWS_PER_PASS = THREADS // PIECES
        var t = quotient[PIECES](tid)
        var i = remainder[PIECES](tid) * COPY_FLOATS
        var source = src.unsafe_offset(base + t * stride + i)
        var target = dst.unsafe_offset(t * DST_PITCH + i)
        comptime for s in range(ceildiv(MAX_ROWS, ROWS_PER_PASS)):
            if t + s * ROWS_PER_PASS < rows:
                async_copy[4 * COPY_FLOATS](
                    source.unsafe_address_space_cast[AddressSpace.GLOBAL](),
                    target.unsafe_offset(s * ROWS_PER_PASS * DST_PITCH),
                )
            source = source.unsafe_offset(ROWS_PER_PASS * stride)
    else:
        comptime for s in range(ceildiv(MAX_ROWS * PIECES, THREADS)):
            var v = tid + s * THREADS
            var t = quotient[PIECES](v)
            var i = remainder[PIECES](v) * COPY_FLOATS
            if t < rows:
                async_copy[4 * COPY_FLOATS](
                    src.unsafe_offset(base + t * stride + i).unsafe_address_space_cast[
                        AddressSpace.GLOBAL
                    ](),
                    dst.unsafe_offset(t * DST_PITCH + i),
                )


@always_inline
def copy_scalars_async(
    dst: SharedFloats,
    src: Pointer[Float32, ImmutAnyOrigin],
    base: Int,
    stride: Int,
    count: Int,
    tid: Int,
    dst_stride: Int = 1,
):
    """Starts copying the floats at `base + t * stride` to `dst[t * dst_stride]`, for
    t < count (count <= threads)."""
    if tid < count:
        async_copy[4](
            src.unsafe_offset(base + tid * stride).unsafe_address_space_cast[AddressSpace.GLOBAL](),
            dst.unsafe_offset(tid * dst_stride),
        )


# The three copy functions below stay out of line: inlined, their addresses are
# hoisted out of the kernel's request loop and held in registers for its whole life.
@no_inline
def copy_state_tile_async[
    state_dtype: DType, K: Int, V: Int, COLUMN_TILE: Int, THREADS: Int
](
    dst: Pointer[Scalar[state_dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    state: Pointer[Scalar[state_dtype], ImmutAnyOrigin],
    base: Int,
    tid: Int,
):
    """Starts copying the K x COLUMN_TILE state tile at `base` (row stride V) to rows of
    `state_tile_pitch` elements."""
    comptime SIZE = size_of[state_dtype]()
    comptime COPY_BYTES = 16 if (COLUMN_TILE * SIZE) % 16 == 0 else 8
    comptime PER_COPY = COPY_BYTES // SIZE
    comptime PER_ROW = COLUMN_TILE // PER_COPY
    comptime PITCH = state_tile_pitch[state_dtype, COLUMN_TILE]()
    comptime assert THREADS % PER_ROW == 0, "a pass of the block copies whole tile rows"
    comptime ROWS_PER_PASS = THREADS // PER_ROW
    # Per thread one source row and column; each pass is a constant offset from it.
    var r = quotient[PER_ROW](tid)
    var c = remainder[PER_ROW](tid) * PER_COPY
    var source = state.unsafe_offset(base + r * V + c)
    var target = dst.unsafe_offset(r * PITCH + c)
    comptime for s in range(ceildiv(K, ROWS_PER_PASS)):
        if K % ROWS_PER_PASS == 0 or r + s * ROWS_PER_PASS < K:
            async_copy[COPY_BYTES](
                source.unsafe_offset(s * ROWS_PER_PASS * V).unsafe_address_space_cast[
                    AddressSpace.GLOBAL
                ](),
                target.unsafe_offset(s * ROWS_PER_PASS * PITCH),
            )


@no_inline
def copy_records_async[
    K: Int, V: Int, COLUMN_TILE: Int, THREADS: Int
](
    keys: SharedFloats,
    deltas: SharedFloats,
    decays: SharedFloats,
    ring: Pointer[Float32, ImmutAnyOrigin],
    first_record: Int,
    count: Int,
    record_stride: Int,
    group_size: Int,
    group_slot: Int,
    column: Int,
    tid: Int,
):
    """Starts copying `count` records from `first_record`: the raw keys (rows
    `natural_pitch` apart), this tile's delta columns and this head's decays."""
    copy_rows_async[K, WINDOW_CHUNK, THREADS, natural_pitch[K]()](
        keys, ring, first_record + key_offset(), record_stride, count, tid
    )
    copy_rows_async[COLUMN_TILE, WINDOW_CHUNK, THREADS](
        deltas, ring, first_record + delta_offset[K, V](group_slot) + column,
        record_stride, count, tid,
    )
    copy_scalars_async(
        decays, ring, first_record + decay_offset[K, V](group_size, group_slot),
        record_stride, count, tid,
    )


@no_inline
def copy_tokens_async[
    K: Int, V: Int, COLUMN_TILE: Int, THREADS: Int
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
    """Starts copying `count` tokens from `first_token`: q and k of the key head as
    token pairs (q, then k, rows `natural_pitch` apart), this tile's value columns, and
    this head's decay and beta into the token's scalars."""
    comptime NATURAL = natural_pitch[K]()
    var qkv_width = 2 * num_key_heads * K + num_value_heads * V
    var token = first_token * qkv_width
    copy_rows_async[K, WINDOW_CHUNK, THREADS, 2 * NATURAL](
        pairs, qkv, token + key_head * K, qkv_width, count, tid
    )
    copy_rows_async[K, WINDOW_CHUNK, THREADS, 2 * NATURAL](
        pairs.unsafe_offset(NATURAL), qkv, token + (num_key_heads + key_head) * K, qkv_width,
        count, tid,
    )
    copy_rows_async[COLUMN_TILE, WINDOW_CHUNK, THREADS](
        values, qkv, token + 2 * num_key_heads * K + value_head * V + column,
        qkv_width, count, tid,
    )
    var at = first_token * num_value_heads + value_head
    copy_scalars_async(
        scalars.unsafe_offset(DECAY_AT), decay, at, num_value_heads, count, tid, TOKEN_SCALARS
    )
    copy_scalars_async(
        scalars.unsafe_offset(BETA_AT), beta, at, num_value_heads, count, tid, TOKEN_SCALARS
    )


# Per-channel gates (Kimi Delta Attention): a token brings K decays per value head and a
# record keeps them (record_layout.channel_decay_offset). They are copied as rows of K
# floats, `natural_pitch` apart as the keys are, and put in lane-major order beside the
# keys (stage_lane_major), so that each lane reads the decays of its own key rows four
# at a time. Separate functions, not a parameter of the two above: an argument added to
# those out-of-line functions would change the head-gate kernels' code.


@no_inline
def copy_channel_records_async[
    K: Int, V: Int, COLUMN_TILE: Int, THREADS: Int
](
    keys: SharedFloats,
    deltas: SharedFloats,
    decays: SharedFloats,
    ring: Pointer[Float32, ImmutAnyOrigin],
    first_record: Int,
    count: Int,
    record_stride: Int,
    group_size: Int,
    group_slot: Int,
    column: Int,
    tid: Int,
):
    """As copy_records_async, with per-channel gates: the raw keys, this tile's delta
    columns, and this head's K decays of each record (rows `natural_pitch` apart)."""
    comptime NATURAL = natural_pitch[K]()
    copy_rows_async[K, WINDOW_CHUNK, THREADS, NATURAL](
        keys, ring, first_record + key_offset(), record_stride, count, tid
    )
    copy_rows_async[COLUMN_TILE, WINDOW_CHUNK, THREADS](
        deltas, ring, first_record + delta_offset[K, V](group_slot) + column,
        record_stride, count, tid,
    )
    copy_rows_async[K, WINDOW_CHUNK, THREADS, NATURAL](
        decays, ring, first_record + channel_decay_offset[K, V](group_size, group_slot),
        record_stride, count, tid,
    )


@no_inline
def copy_channel_tokens_async[
    K: Int, V: Int, COLUMN_TILE: Int, THREADS: Int
](
    pairs: SharedFloats,
    values: SharedFloats,
    scalars: SharedFloats,
    decays: SharedFloats,
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
    """As copy_tokens_async, with per-channel gates: q and k, this tile's value columns,
    this head's beta into the token's scalars and its K decays (a `[T, nv, K]` decay)
    into `decays`, rows `natural_pitch` apart."""
    comptime NATURAL = natural_pitch[K]()
    var qkv_width = 2 * num_key_heads * K + num_value_heads * V
    var token = first_token * qkv_width
    copy_rows_async[K, WINDOW_CHUNK, THREADS, 2 * NATURAL](
        pairs, qkv, token + key_head * K, qkv_width, count, tid
    )
    copy_rows_async[K, WINDOW_CHUNK, THREADS, 2 * NATURAL](
        pairs.unsafe_offset(NATURAL), qkv, token + (num_key_heads + key_head) * K, qkv_width,
        count, tid,
    )
    copy_rows_async[COLUMN_TILE, WINDOW_CHUNK, THREADS](
        values, qkv, token + 2 * num_key_heads * K + value_head * V + column,
        qkv_width, count, tid,
    )
    var at = first_token * num_value_heads + value_head
    copy_rows_async[K, WINDOW_CHUNK, THREADS, NATURAL](
        decays, decay, at * K, num_value_heads * K, count, tid
    )
    copy_scalars_async(
        scalars.unsafe_offset(BETA_AT), beta, at, num_value_heads, count, tid, TOKEN_SCALARS
    )


@always_inline
def lane_sum(value: Float32) -> Float32:
    """Adds the value over the 8 lanes of a group: (p, p^4), then (p, p^2), then (p, p^1).

    IEEE addition commutes, so every lane of the group ends with the same bits.
    """
    var total = value
    comptime for offset in [4, 2, 1]:
        total += shuffle_xor(total, UInt32(offset))
    return total


@always_inline
def stage_lane_major[
    K: Int, THREADS: Int, FOLD_PREVIOUS: Bool, CHANNEL: Bool = False
](
    pairs: SharedFloats,
    queries: SharedFloats,
    keys: SharedFloats,
    count: Int,
    scalars: SharedFloats,
    arrived_record_keys: SharedFloats,
    record_keys: SharedFloats,
    record_count: Int,
    tid: Int,
    token_decays: SharedFloats,
    decay_rows: SharedFloats,
    arrived_record_decays: SharedFloats,
    record_decay_rows: SharedFloats,
):
    """Puts the staged tokens' q and k, and the records' keys, in lane-major order for
    the token loop and the fold, and computes the tokens' norms, once per block.

    A unit of work is one reduction lane of one vector: thread `lane` of a unit group
    reads elements `lane, lane + 8, ...` as they arrived (`pairs`, `arrived_record_keys`)
    and writes them together. For q and k it also sums their squares in the fixed order,
    then the group adds its lanes: q is written as q / |q| / sqrt(K), and 1 / |k| goes
    into the token's scalars. Warps holding no unit skip the work, as do the token
    warps when `count` is 0; otherwise every thread of a warp that holds a token unit
    runs the shuffles, and only tokens below `count` and records below `record_count`
    are written.

    With per-channel gates (`CHANNEL`) the tokens' K decays (`token_decays`, as they
    arrive) go to `decay_rows` and the records' (`arrived_record_decays`) to
    `record_decay_rows`, in the keys' lane-major order: units of their own after the
    token units, which run no shuffles. The last four arguments are unused without it.
    """
    comptime ROWS = K // REDUCTION_LANES
    comptime VECTORS = ceildiv(ROWS, COPY_FLOATS)
    comptime NATURAL = natural_pitch[K]()
    comptime LANE_PITCH = permuted_pitch[K]()
    comptime TOKEN_UNITS = WINDOW_CHUNK * 2 * REDUCTION_LANES
    comptime RECORD_UNITS = WINDOW_CHUNK * REDUCTION_LANES if FOLD_PREVIOUS else 0
    # Per-channel gates: a unit per lane of each token's decays, then of each record's
    # keys and decays (CHANNEL_UNITS replaces RECORD_UNITS).
    comptime DECAY_UNITS = WINDOW_CHUNK * REDUCTION_LANES
    comptime CHANNEL_UNITS = DECAY_UNITS * (3 if FOLD_PREVIOUS else 1)
    comptime UNITS = TOKEN_UNITS + (CHANNEL_UNITS if CHANNEL else RECORD_UNITS)
    comptime assert TOKEN_UNITS % WARP_THREADS == 0, "a warp holds token units or none"
    # A pass of the block then starts on a warp boundary, so each warp's units are of
    # one kind and its shuffles run on every lane.
    comptime assert whole_warps[THREADS](), "a block is whole warps, or one warp at most"
    comptime scale = query_scale[K]()

    @always_inline
    def gather(source: SharedFloats, lane: Int) -> Array[SIMD[DType.float32, COPY_FLOATS], VECTORS]:
        var x = Array[SIMD[DType.float32, COPY_FLOATS], VECTORS](fill=0.0)
        comptime for m in range(ROWS):
            x[m // COPY_FLOATS][m % COPY_FLOATS] = source[unsafe_offset=m * REDUCTION_LANES + lane]
        return x^

    @always_inline
    def place(target: SharedFloats, x: Array[SIMD[DType.float32, COPY_FLOATS], VECTORS]):
        comptime for j in range(VECTORS):
            target.unsafe_store[alignment=16](j * COPY_FLOATS, x[j])

    comptime for s in range(ceildiv(UNITS, THREADS)):
        var unit = tid + s * THREADS
        var token_warp = unit - unit % WARP_THREADS < TOKEN_UNITS  # the same for the whole warp
        # Without tokens (a later chunk of records) there are no norms to compute.
        if token_warp and count > 0:
            var lane = remainder[REDUCTION_LANES](unit)
            var vector = quotient[REDUCTION_LANES](unit)  # token * 2 + (0 for q, 1 for k)
            var is_key = remainder[2](vector) == 1
            var token = min(quotient[2](vector), WINDOW_CHUNK - 1)
            var x = gather(pairs.unsafe_offset(vector * NATURAL), lane)
            var squares = Float32(0.0)
            comptime for m in range(ROWS):
                var value = x[m // COPY_FLOATS][m % COPY_FLOATS]
                squares = fma(value, value, squares)
            var inverse = Float32(1.0) / rounded_sqrt(lane_sum(squares) + L2_EPS)
            if quotient[2](vector) < count:
                var at = (token * REDUCTION_LANES + lane) * LANE_PITCH
                if is_key:
                    place(keys.unsafe_offset(at), x)
                    if lane == 0:
                        scalars[
                            unsafe_offset=token * TOKEN_SCALARS + INVERSE_KEY_NORM_AT
                        ] = inverse
                else:
                    var q_scale = inverse * scale
                    comptime for j in range(VECTORS):
                        x[j] = x[j] * q_scale
                    place(queries.unsafe_offset(at), x)
        elif not token_warp and unit < UNITS:
            comptime if CHANNEL:
                # Which vectors (0: tokens' decays, 1: records' keys, 2: records'
                # decays), which entry of the chunk, which lane.
                var channel_unit = unit - TOKEN_UNITS
                var kind = quotient[DECAY_UNITS](channel_unit)
                var lane = remainder[REDUCTION_LANES](channel_unit)
                var entry = quotient[REDUCTION_LANES](remainder[DECAY_UNITS](channel_unit))
                var at = (entry * REDUCTION_LANES + lane) * LANE_PITCH
                if kind == 0:
                    if entry < count:
                        place(
                            decay_rows.unsafe_offset(at),
                            gather(token_decays.unsafe_offset(entry * NATURAL), lane),
                        )
                elif entry < record_count:
                    var source = arrived_record_keys if kind == 1 else arrived_record_decays
                    var target = record_keys if kind == 1 else record_decay_rows
                    place(
                        target.unsafe_offset(at), gather(source.unsafe_offset(entry * NATURAL), lane)
                    )
            else:
                var record_unit = unit - TOKEN_UNITS
                var lane = remainder[REDUCTION_LANES](record_unit)
                var record = quotient[REDUCTION_LANES](record_unit)
                if record < record_count:
                    var x = gather(arrived_record_keys.unsafe_offset(record * NATURAL), lane)
                    place(record_keys.unsafe_offset((record * REDUCTION_LANES + lane) * LANE_PITCH), x)


# A state tile whose rows are whole 128-byte swizzle rows arrives as tensor boxes
# (bulk_copy.mojo), one instruction of one thread per box, and a folded state leaves the
# staged tile the same way.


@always_inline
def copy_state_tile_boxes[
    state_dtype: DType, K: Int, COLUMN_TILE: Int
](
    dst: Pointer[Scalar[state_dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    state_map: UInt64,
    head_row: Int,
    tile_start: Int,
    barrier_: SharedBarrier,
):
    """Starts copying the K x COLUMN_TILE state tile whose first row is row `head_row`
    of the pool's [rows * heads * K, V] view (`state_map`) into the staged tile, one
    tensor box per box_columns columns, counted on `barrier_`. One thread calls it."""
    comptime BOX_COLUMNS = box_columns[state_dtype]()
    comptime assert K <= 256, "a tensor box holds at most 256 rows"
    comptime for box in range(COLUMN_TILE // BOX_COLUMNS):
        tensor_box_to_shared(
            dst.unsafe_offset(box * K * BOX_COLUMNS),
            state_map,
            tile_start + box * BOX_COLUMNS,
            head_row,
            barrier_,
        )


@always_inline
def prefetch_state_tile_boxes[
    state_dtype: DType, K: Int, COLUMN_TILE: Int
](state_map: UInt64, head_row: Int, tile_start: Int):
    """Asks L2 for the boxes that copy_state_tile_boxes will copy for the same tile, so
    that DRAM serves them before the copy starts. One thread calls it."""
    comptime BOX_COLUMNS = box_columns[state_dtype]()
    comptime for box in range(COLUMN_TILE // BOX_COLUMNS):
        tensor_box_to_l2(state_map, tile_start + box * BOX_COLUMNS, head_row)


@always_inline
def store_state_tile_boxes[
    state_dtype: DType, K: Int, COLUMN_TILE: Int
](
    state_map: UInt64,
    head_row: Int,
    tile_start: Int,
    tile: Pointer[Scalar[state_dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
):
    """Starts writing the staged tile back to the pool, the boxes of
    copy_state_tile_boxes, closed as one bulk group of the calling thread."""
    comptime BOX_COLUMNS = box_columns[state_dtype]()
    comptime for box in range(COLUMN_TILE // BOX_COLUMNS):
        tensor_box_to_global(
            state_map,
            tile_start + box * BOX_COLUMNS,
            head_row,
            tile.unsafe_offset(box * K * BOX_COLUMNS),
        )
    commit_bulk_copies()
