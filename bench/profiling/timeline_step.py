"""Lists the GPU kernels of one decoding step, with their times and the gaps between
them, for MAX's verify + fold, ours, and our fused verify, at Qwen3-Next shapes:

    python bench/profiling/timeline_step.py [--batch N] [--dtype float32|bfloat16] [--variants ...]
                                            [--gpu-paths auto|latency|throughput ...]

bench-step gives a step's time; this shows what it is made of: how long each kernel
runs on the GPU, which kernels besides the verify and fold a step launches, and how
much of the step the GPU spends between kernels. Kernel records come from CUPTI
through PyTorch's profiler, which sees every kernel of the process, MAX's included;
PyTorch is needed for this script only.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable

import torch
from max.driver import Accelerator, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from torch.profiler import ProfilerActivity, profile

from gdfold_max.bench.harness import FoldShape
from gdfold_max.bench.step import VARIANTS, StepGraphs, make_step_operands


def run_once(model: Model, device: Device, operands: list[Buffer]) -> None:
    model.execute(*operands)
    device.synchronize()


def kernel_records(run: Callable[[], None]) -> list[dict]:
    """The kernels that `run()` launched, in start order (CUPTI's records, times in us)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        with open(trace.name) as exported:
            events = json.load(exported)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return sorted(kernels, key=lambda e: e["ts"])


def summarise(variant: str, kernels: list[dict]) -> None:
    if not kernels:
        print(f"{variant}: no kernel records (CUPTI did not see MAX's context)")
        return
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy = sum(k["dur"] for k in kernels)
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in itertools.pairwise(kernels)]
    print(f"\n{variant}: {len(kernels)} kernels, first start to last end {span:.1f} us, "
          f"kernels {busy:.1f} us, between kernels {span - busy:.1f} us")
    if gaps:
        print(f"  gaps: median {statistics.median(gaps):.2f} us, max {max(gaps):.2f} us, "
              f"min {min(gaps):.2f} us")
    by_name: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        by_name[k["name"]].append(k["dur"])
    for name, durations in sorted(by_name.items(), key=lambda item: -sum(item[1])):
        print(f"  {len(durations):4d} x {statistics.median(durations):9.2f} us median "
              f"(min {min(durations):.2f}, max {max(durations):.2f}, total {sum(durations):.1f})  {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--layers", type=int, default=FoldShape().num_layers)
    parser.add_argument("--gpu-paths", nargs="+", default=["auto"], choices=["auto", "latency", "throughput"],
                        help="our window kernel: each path given is listed in turn")
    args = parser.parse_args()
    torch.cuda.init()
    state_dtype = getattr(DType, args.dtype)
    shape = FoldShape(num_layers=args.layers)
    device = Accelerator()
    session = InferenceSession(devices=[device])
    by_path = {path: StepGraphs(session, device, shape, 2, {"gpu_path": path}) for path in args.gpu_paths}
    for graphs in by_path.values():
        graphs.compile_all(args.variants, [state_dtype], chained=False)
    operands = make_step_operands(device, shape, args.batch, state_dtype)
    print(f"one step, batch {args.batch}, {args.dtype} pool, {shape.num_layers} layers")
    for path, graphs in by_path.items():
        for variant in args.variants:
            model = graphs.model(variant, state_dtype, 1)
            run = functools.partial(run_once, model, device, operands)
            for _ in range(3):
                run()
            summarise(f"{variant} ({path} kernel)" if variant != "max" else variant, kernel_records(run))


if __name__ == "__main__":
    main()
