"""Builds, never runs, the host side of the window ops' GPU launches no CPU test builds.

A GPU op is compiled only where MAX finds a GPU, so without one this is what type-checks
those launches and compiles their kernels for sm_90a (every kernel's PTX alone:
kernels_ptx.mojo). No GPU needed:

    mojo build --target-accelerator sm_90a -I . bench/profiling/launch_build.mojo -o /tmp/launch_build

* the tree verify, run_windows["gpu", ..., TREE=True], fp32 and bf16 pools, with and
  without fold on load, head and per-channel gates, and at K = V = 256 with per-channel
  gates and fold on load (the throughput kernel is not compiled for a tree), and with
  LEAF_WARPS 4 (the one-warp and the four-warp kernels both compiled);
* per-channel gates on "auto" (GPU_PATH 0: both kernels compiled), and at K = V = 256
  with fold on load on the latency kernel, which ops/window.py's gpu_tiling passes for
  "auto" there (the throughput kernel's staging would not fit an SM);
* gdfold_verify_or_forward's launches (window_ops.verify_or_forward: the verify with fold
  on load, or the fold and then the forward), fp32 and bf16 pools, with Qwen3-Next's tiling.
"""

from max.gpu.host import DeviceContext
from std.sys import argv
from mojo.window_launch import run_windows
from mojo.window_operands import WindowOperands
from mojo.window_ops import verify_or_forward


def launch_tree[
    dtype: DType, fold: Bool, channel: Bool, K: Int = 128, leaf_warps: Int = 1
](operands: WindowOperands[dtype], ctx: DeviceContext) raises:
    run_windows["gpu", K, K, 4, 8, 0, 0, True, fold, channel, True, leaf_warps](operands, ctx)


def launch_channel[
    dtype: DType, fold: Bool, K: Int, GPU_PATH: Int
](operands: WindowOperands[dtype], ctx: DeviceContext) raises:
    run_windows["gpu", K, K, 4, 64, 0, GPU_PATH, True, fold, True](operands, ctx)


def every(f32: WindowOperands[DType.float32], bf16: WindowOperands[DType.bfloat16], ctx: DeviceContext) raises:
    launch_tree[DType.float32, False, False](f32, ctx)
    launch_tree[DType.float32, True, False](f32, ctx)
    launch_tree[DType.float32, False, True](f32, ctx)
    launch_tree[DType.bfloat16, True, True](bf16, ctx)
    launch_tree[DType.float32, True, True, 256](f32, ctx)
    launch_tree[DType.float32, True, False, 128, 4](f32, ctx)
    launch_tree[DType.bfloat16, False, True, 128, 4](bf16, ctx)
    launch_channel[DType.float32, True, 128, 0](f32, ctx)
    launch_channel[DType.bfloat16, False, 128, 0](bf16, ctx)
    launch_channel[DType.float32, True, 256, 1](f32, ctx)
    launch_channel[DType.bfloat16, False, 256, 0](bf16, ctx)
    # K = V = 128, RING_LEN 4, a 64-column tile, "auto"; the fold's tile and rows for
    # each pool (ops/fold.py's default_tiling at K = 128).
    verify_or_forward["gpu", 128, 128, 4, 64, 0, 0, 64, 8](f32, f32, 0, ctx)
    verify_or_forward["gpu", 128, 128, 4, 64, 0, 0, 128, 16](bf16, bf16, 1, ctx)


def main() raises:
    # Never true: the calls only make the compiler build every launch.
    if len(argv()) > 1000:
        var ctx = DeviceContext()
        var f32 = Pointer[WindowOperands[DType.float32], MutAnyOrigin](unsafe_from_address=len(argv()))
        var bf16 = Pointer[WindowOperands[DType.bfloat16], MutAnyOrigin](unsafe_from_address=len(argv()))
        every(f32[], bf16[], ctx)
    print("built")
