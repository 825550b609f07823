"""Bulk tensor copies between global and shared memory on NVIDIA sm_90 (the tensor
memory accelerator), written as inline PTX.

One instruction of one thread moves a whole 2-D box of a tensor, and the copy engine,
not the issuing warp, waits on memory. Copies into shared memory count their bytes on a
shared-memory barrier (mbarrier), which a thread expects and waits on; copies out of
shared memory are grouped per thread, and a thread waits for its own groups to have
read their source before that memory is written again.
"""

from std.memory import AddressSpace
from std.sys import inlined_assembly

# A shared-memory barrier: one 8-byte word.
comptime SharedBarrier = Pointer[UInt64, MutUntrackedOrigin, address_space=AddressSpace.SHARED]
# The unit of bulk copies and of the swizzle below: 16 bytes.
comptime BULK_UNIT_BYTES = 16


@always_inline
def shared_address(pointer: Pointer[_, _, address_space=AddressSpace.SHARED]) -> UInt32:
    """The 32-bit shared-memory address PTX's shared state space takes."""
    return UInt32(Int(pointer))


@always_inline
def init_barrier(barrier_: SharedBarrier):
    """One thread readies the barrier for one arrival per phase; a block barrier must
    follow before anyone uses it."""
    inlined_assembly[
        "mbarrier.init.shared::cta.b64 [$0], 1;", NoneType, constraints="r", has_side_effect=True
    ](shared_address(barrier_))
    inlined_assembly[
        "fence.mbarrier_init.release.cluster;", NoneType, constraints="", has_side_effect=True
    ]()


@always_inline
def arrive_expecting_bytes(barrier_: SharedBarrier, bytes: Int):
    """The phase's one arrival, which then also waits for `bytes` bytes of copies. The
    copies may land before or after it."""
    inlined_assembly[
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
        NoneType,
        constraints="r,r",
        has_side_effect=True,
    ](shared_address(barrier_), UInt32(bytes))


@always_inline
def wait_phase(barrier_: SharedBarrier, phase: Int):
    """Waits until phase `phase` (0 or 1) of the barrier has completed."""
    while True:
        var done = inlined_assembly[
            """{
            .reg .pred complete;
            mbarrier.try_wait.parity.shared::cta.b64 complete, [$1], $2;
            selp.u32 $0, 1, 0, complete;
            }""",
            UInt32,
            constraints="=r,r,r",
            has_side_effect=True,
        ](shared_address(barrier_), UInt32(phase))
        if done != 0:
            return


@always_inline
def shared_writes_visible_to_bulk_copies():
    """Orders this thread's shared-memory writes before bulk copies that a barrier
    later lets read them (they read through another memory proxy)."""
    inlined_assembly["fence.proxy.async.shared::cta;", NoneType, constraints="", has_side_effect=True]()


@always_inline
def commit_bulk_copies():
    """Closes this thread's open bulk group."""
    inlined_assembly["cp.async.bulk.commit_group;", NoneType, constraints="", has_side_effect=True]()


@always_inline
def wait_bulk_copies_read():
    """Waits until this thread's bulk groups have read their shared-memory source."""
    inlined_assembly[
        "cp.async.bulk.wait_group.read 0;", NoneType, constraints="", has_side_effect=True
    ]()


# Tensor copies: the copy engine walks a whole 2-D box of a tensor, described by a
# tensor map (a 128-byte descriptor the host encodes), with one instruction. A box of
# 128-byte rows lands in shared memory with the 128-byte swizzle: in each 1024-byte
# span, 16-byte unit u of row r sits at unit u ^ (r % 8), so that eight rows' units
# read at once fall on different banks. Such a box must start 1024-byte aligned.
comptime SWIZZLE_BYTES = 128
comptime SWIZZLE_ALIGNMENT = 1024


@always_inline
def tensor_box_to_shared(
    target: Pointer[_, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    tensor_map: UInt64,
    column: Int,
    row: Int,
    barrier_: SharedBarrier,
):
    """Starts copying the box at (`row`, `column`) of the 2-D tensor that `tensor_map`
    (the generic address of a kernel-parameter tensor map) describes to `target`,
    counted on `barrier_`."""
    inlined_assembly[
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [$0], [$1, {$2, $3}], [$4];",
        NoneType,
        constraints="r,l,r,r,r",
        has_side_effect=True,
    ](shared_address(target), tensor_map, Int32(column), Int32(row), shared_address(barrier_))


@always_inline
def tensor_box_to_global(
    tensor_map: UInt64,
    column: Int,
    row: Int,
    source: Pointer[_, _, address_space=AddressSpace.SHARED],
):
    """Starts writing `source` to the box at (`row`, `column`) of the tensor, in this
    thread's open bulk group."""
    inlined_assembly[
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [$0, {$1, $2}], [$3];",
        NoneType,
        constraints="l,r,r,r",
        has_side_effect=True,
    ](tensor_map, Int32(column), Int32(row), shared_address(source))


@always_inline
def tensor_box_to_l2(tensor_map: UInt64, column: Int, row: Int):
    """Asks L2 to fetch the box at (`row`, `column`) of the tensor, ahead of a copy of
    it; nothing lands in shared memory and nothing waits."""
    inlined_assembly[
        "cp.async.bulk.prefetch.tensor.2d.L2.global.tile [$0, {$1, $2}];",
        NoneType,
        constraints="l,r,r",
        has_side_effect=True,
    ](tensor_map, Int32(column), Int32(row))
