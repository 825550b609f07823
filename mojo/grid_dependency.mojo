"""Programmatic dependent launch on NVIDIA sm_90: a kernel launched as a programmatic
dependent of the kernel before it on the stream may start while that kernel still runs.

Until it waits (`wait_for_previous_grid`), such a kernel may not rely on anything the
kernel before it writes: it may only give hints (`prefetch_l2`, fed by `load_hint`),
which cost time if wrong but never change a result. After the wait every write of the
previous kernel is visible. A kernel launched without the attribute passes the wait at
once, so the same code runs correctly under either launch.
"""

from std.sys import inlined_assembly


@always_inline
def wait_for_previous_grid():
    """Waits until the kernel before this one on the stream has ended and its memory
    operations are visible (`griddepcontrol.wait`)."""
    inlined_assembly["griddepcontrol.wait;", NoneType, constraints="", has_side_effect=True]()


@always_inline
def release_next_grid():
    """Lets the next kernel on the stream, if launched as a programmatic dependent, start
    its blocks now (`griddepcontrol.launch_dependents`); they still wait for this one
    before they read what it writes."""
    inlined_assembly[
        "griddepcontrol.launch_dependents;", NoneType, constraints="", has_side_effect=True
    ]()


@always_inline
def load_hint(pointer: Pointer[UInt32, ImmutAnyOrigin]) -> UInt32:
    """A word read through L2 only (`ld.global.cg`), for a hint made before the wait: it
    leaves no line in this SM's L1 that a read after the wait could find stale."""
    return inlined_assembly[
        "ld.global.cg.u32 $0, [$1];", UInt32, constraints="=r,l,~{memory}", has_side_effect=True
    ](pointer)


@always_inline
def prefetch_l2[T: DType](pointer: Pointer[Scalar[T], _]):
    """Asks L2 for the line at `pointer` (`prefetch.global.L2`): a hint, never a read."""
    inlined_assembly["prefetch.global.L2 [$0];", NoneType, constraints="l", has_side_effect=True](
        pointer
    )
