"""Times our two GPU window kernels, forced, side by side with the automatic choice and
the anchors, in one process: the decoding step's state work over all layers at
Qwen3-Next shapes, per batch.

    python bench/tuning/tune_paths.py [--dtype D] [--rounds N] [--no-fla] [--eager] [--json FILE]
                                      [--kernels DIR ...] [BATCH ...]

For each batch it prints, in µs per step, our fused verify (fold on load) and our
forward on the latency kernel and on the throughput kernel, beside MAX's verify + fold
and FLA's fused_recurrent (where torch and fla import); each round times every variant
in turn and the median counts. The batch where the latency kernel stops winning sets
the threshold `LATENCY_WARPS_PER_SM` in `mojo/window_launch.mojo`. Every graph runs as a
captured device graph (as MAX's pipelines run decoding steps, and as FLA's CUDA graphs
run) unless ``--eager`` times ``execute()`` instead. ``--kernels`` adds the latency
kernel of each given copy of ``mojo/`` (a change to try) beside the installed one.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

from max.driver import Accelerator
from max.dtype import DType
from max.engine import InferenceSession
from rich.console import Console

from gdfold_max.bench_harness import FoldShape, measure_rounds
from gdfold_max.bench_step import StepGraphs, make_step_operands, step_host_inputs

PATHS = ("latency", "throughput")
OURS = ("fused", "forward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("batches", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--eager", action="store_true", help="time execute() instead of captured device graphs")
    parser.add_argument("--kernels", nargs="*", type=Path, default=[],
                        help="copies of mojo/ whose latency kernel is timed beside the installed one")
    args = parser.parse_args()
    console = Console()
    device = Accelerator()
    shape = FoldShape()
    state_dtype = DType.float32 if args.dtype == "float32" else DType.bfloat16
    session = InferenceSession(devices=[device])
    chain = 2
    anchors = StepGraphs(session, device, shape, chain)
    by_path = {path: StepGraphs(session, device, shape, chain, {"gpu_path": path}) for path in PATHS}
    for folder in args.kernels:
        label = folder.parent.name if folder.name == "mojo" else folder.name
        by_path[f"latency@{label}"] = StepGraphs(session, device, shape, chain, {"gpu_path": "latency"},
                                                       kernels=folder.resolve())
    replay = not args.eager
    console.print("compiling ...")
    anchors.compile_all(["max"], [state_dtype])
    for graphs in by_path.values():
        graphs.compile_all(OURS, [state_dtype])
    fla = None
    if not args.no_fla:
        from gdfold_max.fla_anchor import FlaSteps, fla_missing

        missing = fla_missing()
        if missing:
            console.print(f"FLA is not timed: {missing}")
        else:
            fla = FlaSteps(shape, chain)
    names = ["max", *(f"{v}/{p}" for v in OURS for p in by_path), *(["fla"] if fla else [])]
    results = []
    for batch in args.batches:
        operands = make_step_operands(device, shape, batch, state_dtype)
        timers: dict[str, Callable[[], float]] = {
            "max": partial(anchors.per_step_seconds, "max", state_dtype, operands, args.repeats, replay)}
        for path, graphs in by_path.items():
            for variant in OURS:
                timers[f"{variant}/{path}"] = partial(graphs.per_step_seconds, variant, state_dtype, operands,
                                                      args.repeats, replay)
        if fla is not None:
            timers["fla"] = fla.prepare(step_host_inputs(shape, batch), batch, state_dtype, args.repeats)
        measured = measure_rounds(names, args.rounds, timers)
        row = {name: measured.median(name) * 1e6 for name in names}
        results.append({"batch": batch, "dtype": args.dtype, "step_us": row})
        fla_us = row.get("fla", float("nan"))
        line = "  ".join(f"{n} {row[n]:8.1f}" for n in names)
        console.print(f"batch {batch:4d} {args.dtype}: {line}")
        for variant in OURS:
            best = min(PATHS[:2], key=lambda p, v=variant: row[f"{v}/{p}"])
            speedup = row[f"{variant}/throughput"] / row[f"{variant}/latency"]
            best_us = row[f"{variant}/{best}"]
            console.print(f"    {variant}: latency {speedup:.3f}x faster than throughput; best {best};"
                          f" best over fla {fla_us / best_us:.3f}x; best over max {row['max'] / best_us:.3f}x")
        del operands, timers
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
