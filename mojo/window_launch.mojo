"""Checks and launches the window kernels behind `gdfold_verify_ring`,
`gdfold_verify_ring_fold_on_load` and `gdfold_recurrence`, and of the tree verify
(`gdfold_verify_tree`, `TREE`: the CPU path, or on a GPU the latency kernel's TREE twin or
the throughput kernel's blocks, window_gpu_tree.mojo).

Shape checks run for both targets before anything is launched. On the CPU the row
tables and offsets are host memory, so they are checked too before the first store.
On the GPU they are trusted for speed, but the kernel never follows an id out of
bounds: it skips that request and fills its readout with NaN.
"""

from max.gpu.host import DeviceAttribute, DeviceBuffer, DeviceContext, FuncAttribute
from max.gpu.host.launch_attribute import LaunchAttribute, LaunchAttributeID, LaunchAttributeValue
from max.gpu.host.nvidia.tma import TMADescriptor, TensorMapSwizzle, create_tma_descriptor
from std.math import ceildiv
from std.utils import IndexList

from .fold_launch import check_paths
from .operand_checks import (
    check_channel_record_stride,
    check_head_dims,
    check_ids,
    check_pool,
    check_pool_and_ring,
)
from .window_cpu import windows_cpu
from .window_operands import WindowOperands
from .window_gpu import window_block_threads, windows_gpu_kernel
from .window_gpu_tree import windows_gpu_tree_kernel
from .window_gpu_latency import (
    latency_column_vector,
    latency_slab_columns,
    windows_gpu_latency_kernel,
    windows_gpu_latency_tree_kernel,
)
from .window_gpu_staging import (
    COPY_FLOATS,
    WARP_THREADS,
    box_columns,
    tile_in_boxes,
    whole_warps,
    window_blocks_per_sm,
    window_tile_bytes,
)


# The window kernel's tensor-box copies, bulk copies and mbarriers are sm_90 (Hopper)
# instructions, and it was tuned and tested on an H200 only.
comptime WINDOW_GPU_API = "cuda"
comptime WINDOW_GPU_CAPABILITY_MAJOR = 9


# Which GPU kernel runs a launch: GPU_PATH_AUTO picks at run time from the units of work
# the launch has; the others force one kernel (tests, benchmarks).
comptime GPU_PATH_AUTO = 0
comptime GPU_PATH_LATENCY = 1
comptime GPU_PATH_THROUGHPUT = 2
# The latency kernel (one warp per request on one column slab) runs automatic launches
# of at most this many of its warps per SM; larger ones go to the throughput kernel,
# whose resident blocks overlap one unit's copies with another's arithmetic. Zero: on an
# H200 the latency kernel as it stands was slower at every batch from 1 to 256 (fp32,
# 1.20x the throughput kernel's fused step at batch 1, 2.1x at 256;
# bench/results/paths-h200-2026-12-01.txt), so "auto" runs windows of more than one
# token on the throughput kernel until the latency kernel wins there (docs/tuning-log.md
# says where its time may go).
comptime LATENCY_WARPS_PER_SM = 0
# Launches of one-token windows (plain decoding: no more tokens than requests) run on the
# latency kernel up to this many of its warps per SM: a request alone, at Qwen3-Next's
# and Kimi-Linear's heads (256 warps on 132 SMs). On an H100 it led there in all eight
# comparisons (fp32 and bf16 pools, head and per-channel gates, forward and fused step),
# by 1.02x to 1.16x; from two requests on, neither kernel led at every batch, and the
# throughput kernel led at 8 and 64 by 1.20x to 1.54x in bf16 (docs/performance.md, "Both
# kernels at a window of 1"). The bound was fitted to 132 SMs: on fewer (an H100 PCIe's
# 114) a request of 256 warps stays on the throughput kernel.
comptime ONE_TOKEN_LATENCY_WARPS_PER_SM = 2


def uses_latency_kernel[GPU_PATH: Int](latency_units: Int, sms: Int, one_token_windows: Bool) -> Bool:
    comptime if GPU_PATH == GPU_PATH_LATENCY:
        return True
    elif GPU_PATH == GPU_PATH_THROUGHPUT:
        return False
    else:
        comptime assert GPU_PATH == GPU_PATH_AUTO, "GPU_PATH must be 0 (auto), 1 or 2"
        if one_token_windows:
            return latency_units <= sms * max(LATENCY_WARPS_PER_SM, ONE_TOKEN_LATENCY_WARPS_PER_SM)
        return latency_units <= sms * LATENCY_WARPS_PER_SM


# Launches small enough to start as programmatic dependents of the kernel before them
# (dependent_launch). On an H200 under replay (bench/results/paths-small-batch-h200-
# 2026-12-02.txt, pdl-h200-2026-12-02.txt), the throughput kernel's fused step took
# 210.0 against 264.1 us at batch 1 (64 blocks) and 239.4 against 294.8 at batch 2
# (128), but 400.7 against 377.5 at batch 4 (256 blocks) and 663.1 against 600.8 at 8:
# once a layer has more blocks than SMs, the next layer's blocks, placed early wherever
# room frees, crowd the SMs still running this one. The latency kernel's one-warp blocks
# gained up to batch 8 (2048 warps, 15.5 per SM: 839.0 against 887.7 us) and lost 2% at
# 16 (31 per SM).
comptime DEPENDENT_BLOCKS_PER_SM = 1
comptime DEPENDENT_LATENCY_WARPS_PER_SM = 16

# A tree verify asked for LEAF_WARPS > 1 (the op's parameter; 1 by default) runs each
# unit as that many warps (window_gpu_latency.mojo: one steps the inner nodes, the others
# the leaves, from each parent's state in shared memory) where that many warps of every
# unit are resident at once: the tree kernels take up to 255 registers a thread, so an SM
# holds TREE_WARPS_PER_SM of their warps. Then a unit's chain of steps is its inner nodes;
# in a larger launch the units would wait for SM room instead, and the warps of one unit
# for each other at its barriers, so it runs one warp a unit.
comptime TREE_WARPS_PER_SM = 8


def tree_leaves_shared(latency_units: Int, sms: Int, leaf_warps: Int) -> Bool:
    """Whether a tree verify's units of `leaf_warps` warps are all resident at once in a
    launch of `latency_units` units."""
    return latency_units * leaf_warps <= sms * TREE_WARPS_PER_SM


def dependent_launch(dependent: Bool) -> List[LaunchAttribute]:
    """The launch attributes of a window kernel: with `dependent`, a programmatic
    dependent launch, whose blocks may start while the kernel before it on the stream
    ends and until they wait for it only give L2 hints (grid_dependency.mojo); this
    hides the launch and the first trip to memory behind the previous kernel."""
    var attributes = List[LaunchAttribute]()
    if dependent:
        attributes.append(
            LaunchAttribute(
                LaunchAttributeID.PROGRAMMATIC_STREAM_SERIALIZATION, LaunchAttributeValue(True)
            )
        )
    return attributes^


def check_window_gpu(ctx: DeviceContext) raises:
    """Refuses, before anything is enqueued, a GPU the window kernel does not run on."""
    var api = ctx.api()
    var capability = ctx.compute_capability()
    if api != WINDOW_GPU_API or capability // 10 != WINDOW_GPU_CAPABILITY_MAJOR:
        raise Error(
            t"gdfold verify and forward: the GPU path needs an NVIDIA Hopper GPU (CUDA"
            t" compute capability 9.x, e.g. H100, H200); this device is {api} with compute"
            t" capability {capability}. Run the op on the CPU instead."
        )


def key_heads_of_qkv[K: Int, V: Int](qkv_width: Int, num_value_heads: Int) raises -> Int:
    """The key head count nk from the width of qkv, `2*nk*K + nv*V`, when no ring tells it."""
    var rest = qkv_width - num_value_heads * V
    if rest <= 0 or rest % (2 * K) != 0:
        raise Error(
            t"qkv: width {qkv_width} is not 2*nk*{K} + nv*{V} for nv={num_value_heads}"
        )
    var num_key_heads = rest // (2 * K)
    if num_value_heads % num_key_heads != 0:
        raise Error(
            t"qkv: key heads nk={num_key_heads} must divide the state's value heads"
            t" nv={num_value_heads}"
        )
    return num_key_heads


def check_length(name: StaticString, length: Int, expected: Int, what: StaticString) raises:
    if length != expected:
        raise Error(t"{name}: length {length} differs from {what} ({expected})")


def check_offsets(
    offsets: Pointer[UInt32, ImmutAnyOrigin], batch: Int, num_tokens: Int
) raises:
    """Raises unless the offsets start at 0, never decrease and end at the token count."""
    if Int(offsets[unsafe_offset=0]) != 0:
        raise Error(
            t"input_row_offsets: must start at 0, got {Int(offsets[unsafe_offset=0])}"
        )
    for b in range(batch):
        var start = Int(offsets[unsafe_offset=b])
        var end = Int(offsets[unsafe_offset=b + 1])
        if end < start:
            raise Error(
                t"input_row_offsets: decreases at index {b + 1} ({start} then {end})"
            )
    var last = Int(offsets[unsafe_offset=batch])
    if last != num_tokens:
        raise Error(
            t"input_row_offsets: ends at {last}, but qkv has {num_tokens} tokens"
        )


def check_no_ring_overlap[
    RING_LEN: Int
](
    ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    offsets: Pointer[UInt32, ImmutAnyOrigin],
    previous_ring_row_ids: Pointer[UInt32, ImmutAnyOrigin],
    previous_accepted: Pointer[UInt32, ImmutAnyOrigin],
    batch: Int,
) raises:
    """Raises if a ring row that receives new records is also one the fold reads."""
    for writer in range(batch):
        var window = Int(offsets[unsafe_offset=writer + 1]) - Int(offsets[unsafe_offset=writer])
        if window == 0 or window > RING_LEN:
            continue
        var written = Int(ring_row_ids[unsafe_offset=writer])
        for reader in range(batch):
            var accepted = Int(previous_accepted[unsafe_offset=reader])
            if accepted == 0 or accepted > RING_LEN:
                continue
            if Int(previous_ring_row_ids[unsafe_offset=reader]) == written:
                raise Error(
                    t"ring_row_ids: request {writer} records into ring row {written},"
                    t" which request {reader} folds from (previous_ring_row_ids);"
                    t" alternate between two ring rows per request"
                )


def check_parents[
    RING_LEN: Int
](
    parents: Pointer[Int32, ImmutAnyOrigin],
    offsets: Pointer[UInt32, ImmutAnyOrigin],
    batch: Int,
) raises:
    """Raises on the first request whose window is longer than the ring (a tree has no
    one path to commit instead) or whose node has a parent that is neither -1 (the
    committed state) nor an earlier node of its window (host tables only)."""
    for request in range(batch):
        var window = Int(offsets[unsafe_offset=request + 1]) - Int(offsets[unsafe_offset=request])
        if window > RING_LEN:
            raise Error(
                t"input_row_offsets: request {request} has a window of {window} tokens,"
                t" past RING_LEN {RING_LEN}; a tree window must fit the ring"
            )
        for node in range(window):
            var parent = Int(parents[unsafe_offset=request * RING_LEN + node])
            if parent < -1 or parent >= node:
                raise Error(
                    t"parents: request {request} node {node} has parent {parent}; a parent"
                    t" is -1 (the committed state) or an earlier node of the window (0 to"
                    t" {node - 1})"
                )


def check_tree_table(name: StaticString, dims: IndexList[2], batch: Int, ring_len: Int) raises:
    """Raises unless a tree verify's table is [batch, RING_LEN]."""
    if dims[0] != batch or dims[1] != ring_len:
        raise Error(
            t"{name}: shape [{dims[0]}, {dims[1]}] is not [{batch}, {ring_len}]"
            t" ([batch, RING_LEN])"
        )


def check_window_operands[
    state_dtype: DType,
    //,
    K: Int,
    V: Int,
    RING_LEN: Int,
    RECORD: Bool,
    FOLD_PREVIOUS: Bool,
    CHANNEL: Bool,
    TREE: Bool,
](operands: WindowOperands[state_dtype]) raises -> Int:
    """Raises unless the operands' shapes and lengths agree; returns the key heads nk.
    The ids and offsets are read on the CPU alone (run_windows)."""
    var batch = operands.batch
    var decay_dims = operands.decay_dims
    var readout_dims = operands.readout_dims
    var num_value_heads = operands.state_dims[1]
    var num_key_heads: Int
    comptime if RECORD:
        check_pool_and_ring[K, V, RING_LEN](operands.state_dims, operands.ring_dims)
        num_key_heads = operands.ring_dims[1]
        var expected = 2 * num_key_heads * K + num_value_heads * V
        if operands.qkv_dims[1] != expected:
            raise Error(
                t"qkv: width {operands.qkv_dims[1]} differs from 2*nk*K + nv*V = {expected}"
            )
    else:
        check_pool[K, V](operands.state_dims)
        num_key_heads = key_heads_of_qkv[K, V](operands.qkv_dims[1], num_value_heads)
    var num_tokens = operands.qkv_dims[0]
    comptime DECAYS = K if CHANNEL else 1
    if (
        decay_dims[0] != num_tokens
        or decay_dims[1] != num_value_heads
        or decay_dims[2] != DECAYS
    ):
        comptime if CHANNEL:
            raise Error(
                t"decay: expected [{num_tokens}, {num_value_heads}, {K}], got"
                t" [{decay_dims[0]}, {decay_dims[1]}, {decay_dims[2]}]"
            )
        else:
            raise Error(
                t"decay: expected [{num_tokens}, {num_value_heads}], got"
                t" [{decay_dims[0]}, {decay_dims[1]}]"
            )
    comptime if CHANNEL and RECORD:
        check_channel_record_stride[K, V](
            num_value_heads, num_key_heads, operands.ring_dims[3]
        )
    if operands.beta_dims[0] != num_tokens or operands.beta_dims[1] != num_value_heads:
        raise Error(
            t"beta: expected [{num_tokens}, {num_value_heads}], got"
            t" [{operands.beta_dims[0]}, {operands.beta_dims[1]}]"
        )
    if readout_dims[0] != num_tokens or readout_dims[1] != num_value_heads * V:
        raise Error(
            t"readout: expected [{num_tokens}, {num_value_heads * V}], got"
            t" [{readout_dims[0]}, {readout_dims[1]}]"
        )
    check_length("input_row_offsets", operands.offsets_len, batch + 1, "batch + 1")
    comptime if RECORD:
        check_length(
            "ring_row_ids", operands.ring_row_ids_len, batch, "the batch of row_ids"
        )
    comptime if FOLD_PREVIOUS:
        check_length(
            "previous_ring_row_ids", operands.previous_ring_row_ids_len, batch,
            "the batch of row_ids",
        )
        check_length(
            "previous_num_accepted", operands.previous_accepted_len, batch,
            "the batch of row_ids",
        )
    comptime if TREE:
        check_tree_table("parents", operands.parents_dims, batch, RING_LEN)
        comptime if FOLD_PREVIOUS:
            check_tree_table(
                "previous_accepted_nodes", operands.previous_nodes_dims, batch, RING_LEN
            )
    return num_key_heads


def run_windows[
    state_dtype: DType,
    //,
    target: StaticString,
    K: Int,
    V: Int,
    RING_LEN: Int,
    COLUMN_TILE: Int,
    REQUESTS_PER_BLOCK: Int,
    GPU_PATH: Int,
    RECORD: Bool,
    FOLD_PREVIOUS: Bool,
    CHANNEL: Bool = False,
    TREE: Bool = False,
    LEAF_WARPS: Int = 1,
](operands: WindowOperands[state_dtype], ctx: DeviceContext) raises:
    """Checks every operand, then runs each request's window (see window_cpu/gpu).

    `CHANNEL` (a decay of [T, nv, K]) runs on either GPU kernel, and GPU_PATH_AUTO picks
    between them as for one decay per head (uses_latency_kernel): on an H100 the
    throughput kernel was faster with them at every batch from 1 to 256
    (bench/results/paths-channel-w4-bf16-h100-2026-12-06.txt). Where its staging does
    not fit an SM the op passes GPU_PATH_LATENCY instead (ops/window.py gpu_tiling). `TREE` (a tree verify:
    RECORD, with the parents table, and with FOLD_PREVIOUS the previous accepted paths)
    runs on the CPU and, on a GPU, on the latency kernel (GPU_PATH_AUTO or _LATENCY) or
    on the throughput kernel's blocks (GPU_PATH_THROUGHPUT: windows_gpu_tree_kernel, a
    block of COLUMN_TILE columns a unit); both check the parents and previous paths
    themselves (they are device memory there). On the latency kernel `LEAF_WARPS` (1 or
    4) > 1 shares each unit's leaves among that many warps where the launch is small
    enough (tree_leaves_shared); the CPU ignores it."""
    comptime assert not TREE or RECORD, "a tree verify records"
    comptime assert LEAF_WARPS == 1 or (TREE and LEAF_WARPS == 4), "LEAF_WARPS: 1, or 4 for a tree"
    comptime assert LEAF_WARPS == 1 or GPU_PATH != GPU_PATH_THROUGHPUT, "leaves are shared on the latency kernel"
    check_head_dims[K, V, RING_LEN]()
    # The GPU kernel copies a tile's value and delta columns 16 bytes (4 floats) at a
    # time, and its blocks (two threads per column) are whole warps or one warp at most.
    comptime assert (
        COLUMN_TILE >= COPY_FLOATS
        and COLUMN_TILE % COPY_FLOATS == 0
        and V % COLUMN_TILE == 0
        and whole_warps[window_block_threads[COLUMN_TILE]()]()
    ), "COLUMN_TILE must be 4, 8, 16 or a multiple of 16 that divides V"
    comptime assert REQUESTS_PER_BLOCK >= 0, "REQUESTS_PER_BLOCK must be 0 (automatic) or more"
    var num_key_heads = check_window_operands[
        K, V, RING_LEN, RECORD, FOLD_PREVIOUS, CHANNEL, TREE
    ](operands)
    comptime if target == "gpu":
        check_window_gpu(ctx)
    var batch = operands.batch
    var num_value_heads = operands.state_dims[1]
    if batch == 0 or num_value_heads == 0:
        return
    var num_tokens = operands.qkv_dims[0]
    var num_rows = operands.state_dims[0]
    var num_ring_rows = operands.ring_dims[0]
    var record_stride = operands.ring_dims[3]

    comptime if target == "cpu":
        check_offsets(operands.offsets, batch, num_tokens)
        check_ids(operands.row_ids, batch, num_rows, "row_ids")
        comptime if RECORD:
            check_ids(operands.ring_row_ids, batch, num_ring_rows, "ring_row_ids")
        comptime if FOLD_PREVIOUS:
            check_ids(
                operands.previous_ring_row_ids, batch, num_ring_rows, "previous_ring_row_ids"
            )
            check_no_ring_overlap[RING_LEN](
                operands.ring_row_ids, operands.offsets, operands.previous_ring_row_ids,
                operands.previous_accepted, batch,
            )
        comptime if TREE:
            check_parents[RING_LEN](operands.parents, operands.offsets, batch)
            comptime if FOLD_PREVIOUS:
                check_paths[RING_LEN](
                    operands.previous_nodes, operands.previous_accepted, batch,
                    "previous_accepted_nodes",
                )
        windows_cpu[K, V, RING_LEN, RECORD, FOLD_PREVIOUS, CHANNEL, TREE](
            operands, num_value_heads, num_key_heads, record_stride
        )
    elif target == "gpu":
        # The SMs, read once: they size the grid and pick the kernel and the launch.
        var sms = ctx.get_attribute(DeviceAttribute.MULTIPROCESSOR_COUNT)
        comptime LATENCY_CV = latency_column_vector[K, V]()
        var latency_units = batch * num_value_heads * (V // latency_slab_columns[LATENCY_CV]())
        var dependent = latency_units <= sms * DEPENDENT_LATENCY_WARPS_PER_SM
        comptime if TREE and GPU_PATH == GPU_PATH_THROUGHPUT:
            # The tree on the throughput kernel's blocks (window_gpu_tree.mojo): a block
            # a unit, one request's column tile of one value head. It checks the parents
            # and previous paths as the latency kernel does.
            comptime tree_kernel = windows_gpu_tree_kernel[
                state_dtype, K, V, RING_LEN, FOLD_PREVIOUS, COLUMN_TILE, CHANNEL
            ]
            ctx.enqueue_function[tree_kernel](
                operands.readout, operands.state, operands.ring, operands.qkv,
                operands.decay, operands.beta, operands.row_ids, operands.ring_row_ids,
                operands.offsets, operands.previous_ring_row_ids, operands.previous_accepted,
                Int32(batch), Int32(num_tokens), Int32(num_rows), Int32(num_ring_rows),
                Int32(num_value_heads), Int32(num_key_heads), Int32(record_stride),
                operands.parents, operands.previous_nodes,
                grid_dim=batch * num_value_heads * (V // COLUMN_TILE),
                block_dim=window_block_threads[COLUMN_TILE](),
            )
            return
        elif TREE:
            # A tree verify on "auto" or "latency" runs on the latency kernel. Its
            # parents and previous paths are device memory: the kernel checks them
            # before any load and skips a request whose tables are bad.
            # One warp a unit, or LEAF_WARPS that share its leaves (tree_leaves_shared).
            def launch_tree[leaf_warps: Int]() raises {imm}:
                comptime tree_kernel = windows_gpu_latency_tree_kernel[
                    state_dtype, K, V, RING_LEN, FOLD_PREVIOUS, LATENCY_CV, CHANNEL, leaf_warps
                ]
                ctx.enqueue_function[tree_kernel](
                    operands.readout, operands.state, operands.ring, operands.qkv,
                    operands.decay, operands.beta, operands.row_ids, operands.ring_row_ids,
                    operands.offsets, operands.previous_ring_row_ids, operands.previous_accepted,
                    Int32(batch), Int32(num_tokens), Int32(num_rows), Int32(num_ring_rows),
                    Int32(num_value_heads), Int32(num_key_heads), Int32(record_stride),
                    Int32(1 if dependent else 0), operands.parents, operands.previous_nodes,
                    grid_dim=latency_units,
                    block_dim=WARP_THREADS * leaf_warps,
                    attributes=dependent_launch(dependent),
                )

            comptime if LEAF_WARPS > 1:
                if tree_leaves_shared(latency_units, sms, LEAF_WARPS):
                    launch_tree[LEAF_WARPS]()
                    return
            launch_tree[1]()
            return
        comptime if not TREE:  # a tree launched above; its builds never elaborate the chain kernels
            # No more tokens than requests: plain decoding (padding rows and empty windows
            # count as requests, which only moves time).
            if uses_latency_kernel[GPU_PATH](latency_units, sms, num_tokens <= batch):
                # One warp a unit: a request on one slab of a value head.
                comptime warp_kernel = windows_gpu_latency_kernel[
                    state_dtype, K, V, RING_LEN, RECORD, FOLD_PREVIOUS, LATENCY_CV, CHANNEL
                ]
                ctx.enqueue_function[warp_kernel](
                    operands.readout, operands.state, operands.ring, operands.qkv, operands.decay,
                    operands.beta, operands.row_ids, operands.ring_row_ids, operands.offsets,
                    operands.previous_ring_row_ids, operands.previous_accepted, Int32(batch),
                    Int32(num_tokens),
                    Int32(num_rows), Int32(num_ring_rows), Int32(num_value_heads),
                    Int32(num_key_heads), Int32(record_stride), Int32(1 if dependent else 0),
                    grid_dim=latency_units,
                    block_dim=WARP_THREADS,
                    attributes=dependent_launch(dependent),
                )
                return
        # Neither a tree verify (it never reaches this branch) nor per-channel gates forced
        # onto the latency kernel compile the throughput kernel: at K = 256 its fold on
        # load with per-channel gates would not fit an SM's static shared memory, and the
        # op would not build even where it never runs.
        comptime if not TREE and (not CHANNEL or GPU_PATH != GPU_PATH_LATENCY):
            comptime kernel = windows_gpu_kernel[
                state_dtype, K, V, RING_LEN, RECORD, FOLD_PREVIOUS, COLUMN_TILE, CHANNEL
            ]
            comptime THREADS = window_block_threads[COLUMN_TILE]()
            comptime TILE_BYTES = window_tile_bytes[state_dtype, K, COLUMN_TILE]()
            # Units of work: one request on one column block (a column tile of one head).
            var units = batch * num_value_heads * (V // COLUMN_TILE)
            var blocks = ceildiv(units, REQUESTS_PER_BLOCK) if REQUESTS_PER_BLOCK > 0 else units
            comptime if REQUESTS_PER_BLOCK == 0:
                # As many blocks as the GPU holds at once: one unit's copies then overlap
                # another's arithmetic.
                blocks = min(
                    units,
                    sms * window_blocks_per_sm[
                        state_dtype, K, COLUMN_TILE, FOLD_PREVIOUS, THREADS, CHANNEL
                    ](),
                )
            # Blocks that run more than two units each claim them from a counter, zeroed for
            # the launch, so that the blocks that run faster take more and all end together
            # (2.0 us off a fused layer at batch 64 on an H200, 4.2 at 256). At two units or
            # fewer per block there is little to even out, and allocating and zeroing the
            # counter alone costs 1.5 us at batch 1 (docs/tuning-log.md):
            # the units are then shared out evenly, each block running those a grid apart.
            var per_block = ceildiv(units, blocks)
            var claims = per_block > 2
            if not claims:
                blocks = ceildiv(units, per_block)
            var counter = Optional[DeviceBuffer[DType.uint32]]()
            var counter_at = Int(operands.readout)  # never read when the blocks do not claim
            if claims:
                counter = ctx.enqueue_create_buffer[DType.uint32](1)
                ctx.enqueue_memset(counter.value(), UInt32(0))
                counter_at = Int(counter.value().unsafe_ptr())
            var unit_counter = Pointer[UInt32, MutAnyOrigin](unsafe_from_address=counter_at)
            # The pool as [rows * heads * K, V], for tiles that move as tensor boxes.
            var state_map = TMADescriptor()
            comptime if tile_in_boxes[state_dtype, COLUMN_TILE]():
                var head_rows = num_rows * num_value_heads * K
                if head_rows > 0:
                    state_map = create_tma_descriptor[
                        state_dtype, 2, TensorMapSwizzle.SWIZZLE_128B
                    ](
                        DeviceBuffer[state_dtype](ctx, operands.state, head_rows * V, owning=False),
                        IndexList[2](head_rows, V),
                        IndexList[2](V, 1),
                        IndexList[2](K, box_columns[state_dtype]()),
                    )
            # A launch of at most one block per SM may start while the kernel before it ends
            # (with claims the counter's zeroing would come between them anyway).
            dependent = not claims and blocks <= sms * DEPENDENT_BLOCKS_PER_SM
            ctx.enqueue_function[kernel](
                operands.readout, operands.state, operands.ring, operands.qkv, operands.decay,
                operands.beta, operands.row_ids, operands.ring_row_ids, operands.offsets,
                operands.previous_ring_row_ids, operands.previous_accepted, unit_counter, state_map,
                Int32(1 if claims else 0), Int32(batch), Int32(num_tokens), Int32(num_rows),
                Int32(num_ring_rows), Int32(num_value_heads), Int32(num_key_heads),
                Int32(record_stride), Int32(1 if dependent else 0),
                grid_dim=blocks,
                block_dim=THREADS,
                shared_mem_bytes=TILE_BYTES,
                func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(TILE_BYTES)),
                attributes=dependent_launch(dependent),
            )
            _ = counter^  # freed in stream order, after the kernel
        else:
            # Never reached: a tree verify took its own branch above, and a launch forced
            # onto the latency kernel returned from it.
            raise Error("gdfold window op: no throughput kernel is compiled for this launch")
    else:
        raise Error(t"unsupported target {target}")
