"""Times one layer of our fused verify (fold on load) beside MAX's verify and fold for
the same layer, at Qwen3-Next shapes and an fp32 pool, in one process:

    python bench/tune_window.py BATCH [BATCH ...]

It prints microseconds per layer and the ratio; tiling keywords come from the
environment (GDFOLD_COLUMN_TILE, GDFOLD_REQUESTS_PER_BLOCK), for tuning runs.
"""

from __future__ import annotations

import os
import sys

from max.driver import Accelerator
from max.dtype import DType
from max.engine import InferenceSession

from gdfold_max.bench import FoldShape
from gdfold_max.bench_step import StepGraphs, make_step_operands


def main() -> None:
    batches = [int(arg) for arg in sys.argv[1:]] or [64]
    tiling = {key: int(os.environ[name]) for key, name in
              (("column_tile", "GDFOLD_COLUMN_TILE"), ("requests_per_block", "GDFOLD_REQUESTS_PER_BLOCK"))
              if name in os.environ}
    shape = FoldShape(num_layers=1)
    device = Accelerator()
    graphs = StepGraphs(InferenceSession(devices=[device]), device, shape, 3, tiling)
    graphs.compile_all(["max", "fused"], [DType.float32])
    for batch in batches:
        operands = make_step_operands(device, shape, batch, DType.float32)
        ours = graphs.per_step_seconds("fused", DType.float32, operands, 5)
        theirs = graphs.per_step_seconds("max", DType.float32, operands, 5)
        print(f"batch {batch}: fused {ours * 1e6:.1f} us/layer, MAX verify+fold {theirs * 1e6:.1f} us/layer,"
              f" ratio {theirs / ours:.2f}x", flush=True)


if __name__ == "__main__":
    main()
