"""Prints the sm_90a PTX of every GPU kernel family at Qwen3-Next's shapes (K = V = 128,
RING_LEN 4), each after a `// kernel:` line: the fold (head and per-channel gates; along a
chain and, last, along a token tree's accepted path), the latency kernel (verify, verify
with fold on load and forward; head and per-channel gates; four columns a thread, and
two), the throughput kernel (each op; head and per-channel gates) and, last, the latency
kernel's tree verify (with and without fold on load; head and per-channel gates; four
columns a thread, and two with head gates), in fp32 and bf16 pools; then the fold at K = V =
256 and the tree verify with fold on load at RING_LEN 32 (32-node trees); then the tree
verify with its leaves shared among four warps (small launches), at four columns a thread
and, with head gates, two; then the tree verify on the throughput kernel's blocks (64- and
16-column tiles). same_ptx.sh compares it between two versions of mojo/: a change that leaves it
identical leaves those kernels' bits and speed as they were.

`_compile_code` is MAX 26.7's own (underscored) entry to the GPU compiler.
"""

from max.gpu.host.compile import _compile_code, get_gpu_target
from mojo.fold_gpu import fold_gpu_kernel, fold_path_gpu_kernel
from mojo.window_gpu import windows_gpu_kernel
from mojo.window_gpu_latency import windows_gpu_latency_kernel, windows_gpu_latency_tree_kernel
from mojo.window_gpu_tree import windows_gpu_tree_kernel


def op_name(record: Bool, fold_previous: Bool) -> String:
    return "fold on load" if fold_previous else ("verify" if record else "forward")


def fold[dtype: DType, tile: Int, rows: Int, channel: Bool]():
    print("// kernel: fold,", dtype, "tile", tile, "x", rows, "channel" if channel else "head")
    print(_compile_code[fold_gpu_kernel[dtype, 128, 128, 4, tile, rows, channel], target=get_gpu_target["sm_90a"]()]().asm)


def fold_path[dtype: DType, tile: Int, rows: Int, channel: Bool]():
    print("// kernel: fold along a path,", dtype, "tile", tile, "x", rows, "channel" if channel else "head")
    print(_compile_code[fold_path_gpu_kernel[dtype, 128, 128, 4, tile, rows, channel], target=get_gpu_target["sm_90a"]()]().asm)


def fold_ring32[dtype: DType, tile: Int, rows: Int, channel: Bool]():
    """The fold at the longest ring and head dims, K = V = 256 and RING_LEN 32, at the tile
    ops/fold.py's fold_tiling picks there (its staged records fit 48 KiB)."""
    print("// kernel: fold, K = V = 256, RING_LEN 32,", dtype, "tile", tile, "x", rows, "channel" if channel else "head")
    print(_compile_code[fold_gpu_kernel[dtype, 256, 256, 32, tile, rows, channel], target=get_gpu_target["sm_90a"]()]().asm)


def latency_tree_ring32[dtype: DType, channel: Bool]():
    print("// kernel: latency tree, RING_LEN 32,", dtype, "fold on load 4 columns,", "channel" if channel else "head")
    print(_compile_code[
        windows_gpu_latency_tree_kernel[dtype, 128, 128, 32, True, 4, channel],
        target=get_gpu_target["sm_90a"](),
    ]().asm)


def latency[dtype: DType, record: Bool, fold_previous: Bool, cv: Int, channel: Bool]():
    # "1 slabs" ends the label as it did while a warp could take several slabs (the walking
    # kernel, removed), so that same_ptx.sh pairs these kernels with those of earlier
    # revisions.
    print("// kernel: latency,", dtype, op_name(record, fold_previous), cv, "columns,",
          "channel" if channel else "head", "1 slabs")
    print(_compile_code[
        windows_gpu_latency_kernel[dtype, 128, 128, 4, record, fold_previous, cv, channel],
        target=get_gpu_target["sm_90a"](),
    ]().asm)


def latency_tree[dtype: DType, fold_previous: Bool, cv: Int, channel: Bool]():
    print("// kernel: latency tree,", dtype, "fold on load" if fold_previous else "verify", cv,
          "columns,", "channel" if channel else "head")
    print(_compile_code[
        windows_gpu_latency_tree_kernel[dtype, 128, 128, 4, fold_previous, cv, channel],
        target=get_gpu_target["sm_90a"](),
    ]().asm)


def latency_tree_shared_leaves[dtype: DType, fold_previous: Bool, channel: Bool, cv: Int = 4]():
    print("// kernel: latency tree, leaves shared by 4 warps,", dtype, "fold on load" if fold_previous else "verify",
          cv, "columns,", "channel" if channel else "head")
    print(_compile_code[
        windows_gpu_latency_tree_kernel[dtype, 128, 128, 4, fold_previous, cv, channel, 4],
        target=get_gpu_target["sm_90a"](),
    ]().asm)


def throughput[dtype: DType, record: Bool, fold_previous: Bool, tile: Int, channel: Bool = False]():
    # Head-gate labels end as they did before the kernel took per-channel gates, so that
    # same_ptx.sh pairs them with earlier revisions'; per-channel ones end in "channel".
    print("// kernel: throughput,", dtype, op_name(record, fold_previous), "tile", tile,
          end=", channel\n" if channel else "\n")
    print(_compile_code[
        windows_gpu_kernel[dtype, 128, 128, 4, record, fold_previous, tile, channel],
        target=get_gpu_target["sm_90a"](),
    ]().asm)


def throughput_tree[dtype: DType, fold_previous: Bool, tile: Int, channel: Bool]():
    print("// kernel: throughput tree,", dtype, "fold on load" if fold_previous else "verify", "tile", tile,
          "channel" if channel else "head")
    print(_compile_code[
        windows_gpu_tree_kernel[dtype, 128, 128, 4, fold_previous, tile, channel],
        target=get_gpu_target["sm_90a"](),
    ]().asm)


def main():
    fold[DType.float32, 64, 8, False]()
    fold[DType.bfloat16, 128, 16, False]()
    fold[DType.float32, 64, 8, True]()
    fold[DType.bfloat16, 128, 16, True]()
    comptime for d in range(2):
        comptime dtype = DType.float32 if d == 0 else DType.bfloat16
        comptime for op in range(3):
            comptime record = op < 2
            comptime fold_previous = op == 0
            throughput[dtype, record, fold_previous, 64]()
            latency[dtype, record, fold_previous, 4, False]()
            latency[dtype, record, fold_previous, 4, True]()
            latency[dtype, record, fold_previous, 2, False]()
    # The throughput kernel with per-channel gates, after every kernel above: each
    # instantiation that stages dynamic shared memory numbers its `extern_ptr_syml`
    # symbol in the order compiled, so that kernels placed among the others would
    # renumber theirs.
    comptime for d in range(2):
        comptime dtype = DType.float32 if d == 0 else DType.bfloat16
        comptime for op in range(3):
            throughput[dtype, op < 2, op == 0, 64, True]()
    # The fold along a token tree's accepted path, last for the same reason.
    fold_path[DType.float32, 64, 8, False]()
    fold_path[DType.bfloat16, 128, 16, False]()
    fold_path[DType.float32, 64, 8, True]()
    fold_path[DType.bfloat16, 128, 16, True]()
    # The tree verify on the latency kernel, last: the kernels added after a revision
    # leave every earlier kernel's label and position as they were.
    comptime for d in range(2):
        comptime dtype = DType.float32 if d == 0 else DType.bfloat16
        comptime for fold_previous in range(2):
            latency_tree[dtype, fold_previous == 1, 4, False]()
            latency_tree[dtype, fold_previous == 1, 4, True]()
            latency_tree[dtype, fold_previous == 1, 2, False]()
    # RING_LEN 32 (32-node trees), last.
    comptime for d in range(2):
        comptime dtype = DType.float32 if d == 0 else DType.bfloat16
        comptime rows = 8 if d == 0 else 16
        fold_ring32[dtype, 64, rows, False]()
        fold_ring32[dtype, 64, rows, True]()
        latency_tree_ring32[dtype, False]()
        latency_tree_ring32[dtype, True]()
    # The tree verify with its leaves shared among warps, last.
    comptime for d in range(2):
        comptime dtype = DType.float32 if d == 0 else DType.bfloat16
        comptime for fold_previous in range(2):
            latency_tree_shared_leaves[dtype, fold_previous == 1, False]()
            latency_tree_shared_leaves[dtype, fold_previous == 1, True]()
    # And at two columns a thread (a V that is not a multiple of 16, or a K past 128).
    comptime for d in range(2):
        comptime dtype = DType.float32 if d == 0 else DType.bfloat16
        comptime for fold_previous in range(2):
            latency_tree_shared_leaves[dtype, fold_previous == 1, False, 2]()
    # The tree verify on the throughput kernel's blocks, last: a 64-column tile (two
    # tiles a head) and a 16-column one (one warp a block).
    comptime for d in range(2):
        comptime dtype = DType.float32 if d == 0 else DType.bfloat16
        comptime for fold_previous in range(2):
            throughput_tree[dtype, fold_previous == 1, 64, False]()
            throughput_tree[dtype, fold_previous == 1, 64, True]()
            throughput_tree[dtype, fold_previous == 1, 16, False]()
