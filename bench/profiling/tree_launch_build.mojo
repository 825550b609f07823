"""Builds, never runs, the host side of the tree verify's GPU launch.

That is run_windows["gpu", ..., TREE=True] for fp32 and bf16 pools, with and without fold
on load, head and per-channel gates: a GPU op is compiled only where MAX finds a GPU, so
without one this is what type-checks the launch (the kernels themselves:
kernels_ptx.mojo). No GPU needed:

    mojo build --target-accelerator sm_90a -I . bench/profiling/tree_launch_build.mojo -o /tmp/tree_launch
"""

from max.gpu.host import DeviceContext
from std.sys import argv
from mojo.window_launch import run_windows
from mojo.window_operands import WindowOperands


def launch_tree[
    dtype: DType, fold: Bool, channel: Bool
](operands: WindowOperands[dtype], ctx: DeviceContext) raises:
    run_windows["gpu", 128, 128, 4, 8, 0, 0, True, fold, channel, True](operands, ctx)


def every(f32: WindowOperands[DType.float32], bf16: WindowOperands[DType.bfloat16], ctx: DeviceContext) raises:
    launch_tree[DType.float32, False, False](f32, ctx)
    launch_tree[DType.float32, True, False](f32, ctx)
    launch_tree[DType.float32, False, True](f32, ctx)
    launch_tree[DType.bfloat16, True, True](bf16, ctx)


def main() raises:
    # Never true: the calls only make the compiler build every launch.
    if len(argv()) > 1000:
        var ctx = DeviceContext()
        var f32 = Pointer[WindowOperands[DType.float32], MutAnyOrigin](unsafe_from_address=len(argv()))
        var bf16 = Pointer[WindowOperands[DType.bfloat16], MutAnyOrigin](unsafe_from_address=len(argv()))
        every(f32[], bf16[], ctx)
    print("built")
