"""The arithmetic that the verify and the forward share, in one fixed order.

Every reduction over the key dimension K runs on REDUCTION_LANES lanes: lane `p`
accumulates the terms `i = p, p + 8, p + 16, ...` as a chain of fused multiply-adds
in increasing `i`, starting from +0. The eight lane sums are then added pairwise:
`(p, p + 4)`, then `(p, p + 2)`, then `(p, p + 1)`. The GPU verify gives each of four
neighbouring threads lanes j and j + 4, adds those two inside the thread and the rest
with butterfly shuffles (the norms use eight threads, one lane each); the CPU path keeps
eight accumulators. All produce the same bits, and so does the numpy reference.

The compiler contracts `a * b + c` into an fma on the GPU, so every multiply-add in
these kernels is written as an explicit `fma`, and nothing else may be contracted.
"""

from std.math import fma, sqrt
from std.sys import is_nvidia_gpu, llvm_intrinsic

comptime REDUCTION_LANES = 8

# Added to a squared norm before the square root (L2 normalisation of q and k).
comptime L2_EPS = Float32(1e-6)


@always_inline
def query_scale[K: Int]() -> Float32:
    """1 / sqrt(K), computed in float64 and rounded once to float32."""
    return Float32(1.0 / sqrt(Float64(K)))


@always_inline
def rounded_sqrt(x: Float32) -> Float32:
    """The correctly rounded square root (the GPU's default lowering approximates)."""
    comptime if is_nvidia_gpu():
        return llvm_intrinsic["llvm.nvvm.sqrt.rn.f", Float32](x)
    else:
        return sqrt(x)


@always_inline
def lane_tree[width: Int](
    lanes: Array[SIMD[DType.float32, width], REDUCTION_LANES]
) -> SIMD[DType.float32, width]:
    """Adds eight lane sums in the fixed pairwise order."""
    var a0 = lanes[0] + lanes[4]
    var a1 = lanes[1] + lanes[5]
    var a2 = lanes[2] + lanes[6]
    var a3 = lanes[3] + lanes[7]
    return (a0 + a2) + (a1 + a3)


@always_inline
def inverse_norm[K: Int](x: Pointer[Float32, ...], at: Int) -> Float32:
    """`1 / sqrt(sum(x*x) + eps)` over the K floats at `x[at:]`, in the fixed lane order."""
    var lanes = Array[Float32, REDUCTION_LANES](fill=0.0)
    for m in range(K // REDUCTION_LANES):
        comptime for p in range(REDUCTION_LANES):
            var value = x[unsafe_offset=at + m * REDUCTION_LANES + p]
            lanes[p] = fma(value, value, lanes[p])
    return Float32(1.0) / rounded_sqrt(lane_tree[1](lanes) + L2_EPS)
