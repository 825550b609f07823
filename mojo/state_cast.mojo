"""Widening a pool's elements to fp32 and rounding them back, on the CPU.

bf16 is the top half of an fp32, so widening is a shift, and rounding to nearest even
is an integer add on the fp32 bits. Done with vector integer ops, both are exact and
far faster on the CPU than a generic conversion. NaN stays NaN (made quiet).
"""

from std.memory import bitcast


@always_inline
def widen[
    dtype: DType, width: Int
](values: SIMD[dtype, width]) -> SIMD[DType.float32, width]:
    comptime if dtype == DType.bfloat16:
        var bits = bitcast[DType.uint16, width](values).cast[DType.uint32]()
        return bitcast[DType.float32, width](bits << 16)
    else:
        return values.cast[DType.float32]()


@always_inline
def narrow[
    dtype: DType, width: Int
](values: SIMD[DType.float32, width]) -> SIMD[dtype, width]:
    comptime if dtype == DType.bfloat16:
        var bits = bitcast[DType.uint32, width](values)
        var lsb = (bits >> 16) & 1
        var rounded = (bits + 0x7FFF + lsb) >> 16
        var quiet_nan = (bits >> 16) | 0x40
        var is_nan = values.ne(values)
        var result = is_nan.select(quiet_nan, rounded).cast[DType.uint16]()
        return bitcast[dtype, width](result)
    else:
        return values.cast[dtype]()
