"""Times our two GPU window kernels, forced, side by side with the automatic choice and
the anchors, in one process: the decoding step's state work over all layers at
Qwen3-Next shapes (with ``--gate channel``, Kimi-Linear-48B's), per batch.

    python bench/tuning/tune_paths.py [--dtype D] [--gate head|channel] [--window W] [--rounds N]
                                      [--no-fla] [--eager] [--json FILE]
                                      [--ours fused forward] [--paths latency throughput auto]
                                      [--kernels DIR ...] [--copy-path P] [--column-tiles T ...]
                                      [BATCH ...]

For each batch it prints, in µs per step, our fused verify (fold on load) and our
forward (``--ours``) on each GPU path of ``--paths`` (default: the latency kernel and the
throughput kernel, forced), beside MAX's verify + fold (its forward at a RING_LEN its ring
kernels are not compiled for) and FLA's fused_recurrent (where torch and fla import), or
with per-channel gates beside MAX's kda_decode alone; each round times every variant in
turn and the median counts. ``--window`` sets the tokens each request verifies (RING_LEN;
default 4), as in ``gdfold-max bench-step``. The batch where the latency kernel stops
winning sets the thresholds in `mojo/window_launch.mojo`, for both gates:
`LATENCY_WARPS_PER_SM` for longer windows, `ONE_TOKEN_LATENCY_WARPS_PER_SM` at ``--window 1``. Every graph runs as a
captured device graph (as MAX's pipelines run decoding steps, and as FLA's CUDA graphs
run) unless ``--eager`` times ``execute()`` instead. ``--kernels`` adds each given copy
of ``mojo/`` (a change to try, or the kernels before one) beside the installed one, on
the path ``--copy-path`` names (default: the latency kernel). ``--column-tiles`` times each
path of ``--paths`` at each of those column tiles (``path@tile``) instead of the default
tile: at small batches a narrower tile makes more units of work for the SMs.
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

from gdfold_max.bench.harness import FoldShape, compile_together, measure_rounds
from gdfold_max.bench.step import MAX_RING_LENS, WINDOWS, StepGraphs, make_step_operands, step_host_inputs, window_shape

PATHS = ("latency", "throughput")
OURS = ("fused", "forward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("batches", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--gate", default="head", choices=["head", "channel"])
    parser.add_argument("--window", type=int, default=4, choices=list(WINDOWS), metavar="W",
                        help="tokens each request verifies, 1 to 32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--eager", action="store_true", help="time execute() instead of captured device graphs")
    parser.add_argument("--ours", nargs="+", default=list(OURS), choices=OURS,
                        help="which of our variants to time (each graph compiles for a while)")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=["auto", *PATHS],
                        help="the GPU paths of the installed kernels to time")
    parser.add_argument("--kernels", nargs="*", type=Path, default=[],
                        help="copies of mojo/ timed beside the installed one")
    parser.add_argument("--copy-path", default="latency", choices=["auto", *PATHS],
                        help="the GPU path the copies of --kernels run")
    parser.add_argument("--column-tiles", nargs="+", type=int, default=[],
                        help="time each path of --paths at each of these column tiles (default: its default tile)")
    args = parser.parse_args()
    console = Console()
    device = Accelerator()
    shape = window_shape(FoldShape.for_gate(args.gate), args.window)
    # MAX's verify and fold where its ring kernels are compiled, else its forward.
    anchor = "kda" if args.gate == "channel" else "max" if args.window in MAX_RING_LENS else "max-forward"
    state_dtype = DType.float32 if args.dtype == "float32" else DType.bfloat16
    session = InferenceSession(devices=[device])
    chain = 2
    anchors = StepGraphs(session, device, shape, chain)
    by_path = {path if tile is None else f"{path}@{tile}":
               StepGraphs(session, device, shape, chain,
                          {"gpu_path": path} | ({} if tile is None else {"column_tile": tile}))
               for path in args.paths for tile in (args.column_tiles or [None])}
    for folder in args.kernels:
        label = folder.parent.name if folder.name == "mojo" else folder.name
        by_path[f"{args.copy_path}@{label}"] = StepGraphs(session, device, shape, chain,
                                                          {"gpu_path": args.copy_path}, kernels=folder.resolve())
    replay = not args.eager
    console.print("compiling ...")
    compile_together([(anchors, anchor), *((graphs, v) for graphs in by_path.values() for v in args.ours)],
                     [state_dtype], chained=not replay)
    fla = None
    if not args.no_fla and args.gate == "head":
        from gdfold_max.bench.fla import FlaSteps, fla_missing

        missing = fla_missing()
        if missing:
            console.print(f"FLA is not timed: {missing}")
        else:
            fla = FlaSteps(shape, chain)
    names = [anchor, *(f"{v}/{p}" for v in args.ours for p in by_path), *(["fla"] if fla else [])]
    results = []
    for batch in args.batches:
        operands = make_step_operands(device, shape, batch, state_dtype)
        timers: dict[str, Callable[[], float]] = {
            anchor: partial(anchors.per_step_seconds, anchor, state_dtype, operands, args.repeats, replay)}
        for path, graphs in by_path.items():
            for variant in args.ours:
                timers[f"{variant}/{path}"] = partial(graphs.per_step_seconds, variant, state_dtype, operands,
                                                      args.repeats, replay)
        if fla is not None:
            try:
                timers["fla"] = fla.prepare(step_host_inputs(shape, batch), batch, state_dtype, args.repeats)
            except Exception as error:  # e.g. out of memory beside our graphs: FLA's row stays unmeasured
                console.print(f"FLA not timed at batch {batch}: {type(error).__name__}: {str(error)[:120]}")
        timed = [name for name in names if name in timers]
        measured = measure_rounds(timed, args.rounds, timers)
        row = {name: measured.median(name) * 1e6 if name in timers else float("nan") for name in names}
        results.append({"batch": batch, "dtype": args.dtype, "gate": args.gate, "window": args.window,
                        "step_us": row})
        fla_us = row.get("fla", float("nan"))
        line = "  ".join(f"{n} {row[n]:8.1f}" for n in names)
        console.print(f"batch {batch:4d} {args.dtype}: {line}")
        for variant in args.ours:
            best = min(by_path, key=lambda p, v=variant: row[f"{v}/{p}"])
            best_us = row[f"{variant}/{best}"]
            versus = "; ".join(f"{p} {row[f'{variant}/{p}'] / best_us:.3f}x" for p in by_path if p != best)
            console.print(f"    {variant}: best {best}, over fla {fla_us / best_us:.3f}x, over {anchor}"
                          f" {row[anchor] / best_us:.3f}x; the others' time over the best: {versus}")
        del operands, timers
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
