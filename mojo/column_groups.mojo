"""The column groups of the GPU window kernels: eight neighbouring threads, one
reduction lane each, that hold the same COLUMN_VECTOR columns. Shared by the
throughput and latency kernels.
"""

from max.gpu.primitives.warp import shuffle_xor

# A thread holds COLUMN_VECTOR neighbouring columns of one reduction lane: lane p's
# key rows p, p + 8, p + 16, ... of four columns, as 16-byte vectors (8-byte in bf16).
# The eight lanes of a column group are eight neighbouring threads, so each sum over K
# is one fma chain per column inside the thread, then three butterfly steps across the
# group, in the fixed order of recurrence_math.mojo.
comptime COLUMN_VECTOR = 4
comptime Columns = SIMD[DType.float32, COLUMN_VECTOR]


@always_inline
def column_slot(lane: Int) -> Int:
    """The column of its group whose whole sum lane `lane` ends with (see column_sum):
    bit 2 of the lane picks the half, bit 1 the column in it; lanes p and p ^ 1 agree."""
    return ((lane >> 2) & 1) * 2 + ((lane >> 1) & 1)


@always_inline
def column_sum(partial: Columns, lane: Int) -> Float32:
    """The group's four column sums, scattered: each lane passes on the half of its
    partial sums that its partner keeps, so three butterfly steps add eight lanes of
    four columns in the fixed order (p, p + 4), (p, p + 2), (p, p + 1), and lane p ends
    with the whole sum of column `column_slot(p)`. IEEE addition commutes, so the lanes
    that share a column get the same bits."""
    var high = (lane & 4) != 0
    var keep0 = partial[2] if high else partial[0]
    var keep1 = partial[3] if high else partial[1]
    var send0 = partial[0] if high else partial[2]
    var send1 = partial[1] if high else partial[3]
    var half0 = keep0 + shuffle_xor(send0, UInt32(4))  # (p, p + 4)
    var half1 = keep1 + shuffle_xor(send1, UInt32(4))
    var odd = (lane & 2) != 0
    var keep = half1 if odd else half0
    var send = half0 if odd else half1
    var quad = keep + shuffle_xor(send, UInt32(2))  # (p, p + 2)
    return quad + shuffle_xor(quad, UInt32(1))  # (p, p + 1)


@always_inline
def gather_columns(mine: Float32, lane: Int) -> Columns:
    """The four columns' values of the group, from the lanes that hold one each
    (lane p holds column `column_slot(p)`)."""
    var odd = (lane & 2) != 0
    var other = shuffle_xor(mine, UInt32(2))
    var near0 = other if odd else mine
    var near1 = mine if odd else other
    var far0 = shuffle_xor(near0, UInt32(4))
    var far1 = shuffle_xor(near1, UInt32(4))
    if (lane & 4) != 0:
        return Columns(far0, far1, near0, near1)
    return Columns(near0, near1, far0, far1)
