"""Runs one layer's fused verify (fold on load) or forward at Qwen3-Next shapes, three
times, so a profiler can attach to it:

    ncu --launch-skip 2 --launch-count 1 --set full \\
        python bench/profiling/profile_window.py COLUMN_TILE REQUESTS_PER_BLOCK BATCH [DTYPE [VARIANT [GPU_PATH]]]

REQUESTS_PER_BLOCK 0 leaves the grid to the op (its default). DTYPE is the pool's,
float32 (the default) or bfloat16. VARIANT is `fused` (the default) or `forward`: the
same kernel without records, whose counts beside the fused one's say what the records
cost. GPU_PATH is the window kernel, as `gpu_path` of the ops: auto (the default),
latency or throughput (COLUMN_TILE and REQUESTS_PER_BLOCK shape the throughput
kernel only). VARIANT `tree:NODESxDEPTH` (e.g. `tree:16x5`) runs the tree verify with
fold on load of the spine instead, over the tree `bench-step --tree` times (the
latency kernel's tree unit; COLUMN_TILE, REQUESTS_PER_BLOCK and GPU_PATH unused);
`tree-shared-leaves:NODESxDEPTH` the same with `leaf_warps=4` (a unit's leaves stepped by
three more warps from its parent's state in shared memory, where the launch is small
enough) and `tree-throughput:NODESxDEPTH` on the throughput kernel's blocks
(`gpu_path="throughput"`), as `bench-step --tree` times them.
"""

from __future__ import annotations

import sys

from max.driver import Accelerator, Buffer
from max.dtype import DType
from max.engine import InferenceSession

from gdfold_max.bench.harness import ChainedGraphs, FoldShape
from gdfold_max.bench.step import StepGraphs, make_step_operands
from gdfold_max.bench.tree import TREE_VERIFIES, TreeShape, TreeStepGraphs
from gdfold_max.ops.window import GPU_PATHS


def main() -> None:
    tile, requests, batch = (int(arg) for arg in sys.argv[1:4])
    dtype_name = sys.argv[4] if len(sys.argv) > 4 else "float32"
    if dtype_name not in ("float32", "bfloat16"):
        sys.exit(f"DTYPE: float32 or bfloat16, got {dtype_name!r}")
    variant = sys.argv[5] if len(sys.argv) > 5 else "fused"
    tree_variant, _, tree_shape = variant.partition(":")
    if tree_variant in TREE_VERIFIES and tree_shape:
        run_tree(TreeShape.parse(tree_shape), tree_variant, batch, getattr(DType, dtype_name))
        return
    if variant not in ("fused", "forward"):
        sys.exit(f"VARIANT: fused, forward or {' or '.join(f'{v}:NODESxDEPTH' for v in TREE_VERIFIES)}, got"
                 f" {variant!r}")
    gpu_path = sys.argv[6] if len(sys.argv) > 6 else "auto"
    if gpu_path not in GPU_PATHS:
        sys.exit(f"GPU_PATH: one of {', '.join(GPU_PATHS)}, got {gpu_path!r}")
    state_dtype = getattr(DType, dtype_name)
    shape = FoldShape(num_layers=1)
    device = Accelerator()
    graphs = StepGraphs(InferenceSession(devices=[device]), device, shape, 2,
                        {"column_tile": tile, "requests_per_block": requests or None, "gpu_path": gpu_path})
    graphs.compile_all([variant], [state_dtype], chained=False)
    run_three_times(graphs, variant, state_dtype, make_step_operands(device, shape, batch, state_dtype))


def run_tree(tree: TreeShape, variant: str, batch: int, state_dtype: DType) -> None:
    """One layer's tree verify with fold on load (`variant`: a TreeStepGraphs variant),
    three times."""
    device = Accelerator()
    graphs = TreeStepGraphs(InferenceSession(devices=[device]), device, FoldShape(num_layers=1), tree, 2)
    graphs.compile_all([variant], [state_dtype], chained=False)
    run_three_times(graphs, variant, state_dtype, graphs.operands(variant, batch, state_dtype))


def run_three_times(graphs: ChainedGraphs, variant: str, state_dtype: DType, operands: list[Buffer]) -> None:
    """The compiled graph of one link of ``variant``, run three times (a profiler skips
    the first two launches), then waited for."""
    model = graphs.model(variant, state_dtype, 1)
    for _ in range(3):
        model.execute(*operands)
    graphs.synchronize(variant)


if __name__ == "__main__":
    main()
