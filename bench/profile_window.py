"""Runs one layer's fused verify (fold on load) at Qwen3-Next shapes, for a profiler."""
import sys
from max.driver import Accelerator
from max.dtype import DType
from max.engine import InferenceSession
from gdfold_max.bench import FoldShape
from gdfold_max.bench_step import StepGraphs, make_step_operands
tile, requests, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
shape = FoldShape(num_layers=1)
device = Accelerator()
graphs = StepGraphs(InferenceSession(devices=[device]), device, shape, 2, {"column_tile": tile, "requests_per_block": requests})
graphs.compile_all(["fused"], [DType.float32])
ops = make_step_operands(device, shape, batch, DType.float32)
model = graphs._models[("fused", DType.float32, 1)]
for _ in range(3):
    model.execute(*ops)
device.synchronize()
