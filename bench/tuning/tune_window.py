"""Times one layer of our fused verify (fold on load) beside MAX's verify and fold for
the same layer, at Qwen3-Next shapes and an fp32 pool (``--dtype bfloat16``: a bf16 one),
in one process:

    python bench/tuning/tune_window.py [--kernels DIR [DIR ...]] [--column-tiles T [T ...]] [--rounds N]
                                [--layers N] [--heads NV NK] [--dims K V] [--dtype D] [--cpu]
                                [BATCH ...]

``--kernels`` names Mojo package folders (copies of ``mojo/`` with a change to try);
their graphs share one session and are timed in turn, round after round, with the
anchor's between them, so that versions are compared under the same conditions rather
than across processes, whose times differ by up to 10% on a GPU and more on a shared
CPU. The anchor is MAX's verify + fold on the GPU and, with ``--cpu`` (MAX's ops have no
CPU path), our own verify + fold from the installed package. Each round takes the best of 5 runs;
the table shows the median and the best round. Tiling keywords come from the
environment (GDFOLD_COLUMN_TILE, GDFOLD_REQUESTS_PER_BLOCK); ``--column-tiles`` gives each
folder of ``--kernels`` its own column tile instead, so that kernels whose best tiles
differ (or one kernel at several tiles) are still timed in one process. ``--layers`` runs that many
layers per step (default 1), so that the pool outgrows the caches as a whole model's does;
times are still per layer. ``--heads`` and ``--dims`` change the head counts and the head
dimensions (default: Qwen3-Next's 32 value heads, 16 key heads, K = V = 128); where MAX's
ops do not compile for a shape, the table shows ours alone. Each compile and each round
also prints a line on stderr, so a run that is cut short still shows what it measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from max.driver import CPU, Accelerator
from max.dtype import DType
from max.engine import InferenceSession

from gdfold_max.bench.harness import FoldShape
from gdfold_max.bench.step import StepGraphs, make_step_operands


def label(kernels: Path | None) -> str:
    if kernels is None:
        return "installed"
    return kernels.resolve().parent.name if kernels.name == "mojo" else kernels.name


def progress(message: str, since: float) -> None:
    """A line on stderr as each stage ends, so that a run cut short still shows how far
    it came and what it measured."""
    print(f"[{time.perf_counter() - since:6.0f} s] {message}", file=sys.stderr, flush=True)


def refusal(error: Exception) -> str:
    """Why MAX's ops refused a shape: the line of the error that says so, or its first."""
    lines = str(error).splitlines() or [type(error).__name__]
    return next((line for line in lines if "unsupported" in line), lines[0])[:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("batches", nargs="*", type=int, default=[64])
    parser.add_argument("--kernels", nargs="+", type=Path, help="Mojo package folders (default: the installed one)")
    parser.add_argument("--column-tiles", nargs="+", type=int,
                        help="a column tile per folder of --kernels (default: GDFOLD_COLUMN_TILE or the op's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=1, help="layers per step (times are per layer)")
    parser.add_argument("--heads", nargs=2, type=int, metavar=("NV", "NK"), help="value heads and key heads")
    parser.add_argument("--dims", nargs=2, type=int, metavar=("K", "V"), help="key and value head dimensions")
    parser.add_argument("--cpu", action="store_true", help="time on the CPU against our verify + fold")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the pool's dtype")
    args = parser.parse_args()
    tiling = {key: int(os.environ[name]) for key, name in
              (("column_tile", "GDFOLD_COLUMN_TILE"), ("requests_per_block", "GDFOLD_REQUESTS_PER_BLOCK"))
              if name in os.environ}
    shape = FoldShape(num_layers=args.layers)
    if args.heads:
        shape = replace(shape, num_value_heads=args.heads[0], num_key_heads=args.heads[1])
    if args.dims:
        shape = replace(shape, key_dim=args.dims[0], value_dim=args.dims[1])
    device = CPU() if args.cpu else Accelerator()
    session = InferenceSession(devices=[device])
    pool_dtype = getattr(DType, args.dtype)
    anchor_variant, anchor_name = ("ours", "ours verify+fold") if args.cpu else ("max", "MAX verify+fold")
    started = time.perf_counter()
    anchor: StepGraphs | None = None
    try:
        anchor = StepGraphs(session, device, shape, 3, tiling)
        anchor.compile_all([anchor_variant], [pool_dtype])
        progress(f"compiled {anchor_name}", started)
    except Exception as error:  # MAX's kernels do not take every shape
        progress(f"{anchor_name} does not compile for this shape ({refusal(error)}): timing ours alone", started)
        anchor = None
    folders = args.kernels or [None]
    tiles: list[int | None] = [None] * len(folders)
    if args.column_tiles is not None:
        if len(args.column_tiles) != len(folders):
            parser.error(f"--column-tiles: give one per folder of --kernels ({len(folders)}),"
                         f" got {len(args.column_tiles)}")
        tiles = list(args.column_tiles)
    names = [label(k) if t is None else f"{label(k)} tile {t}" for k, t in zip(folders, tiles, strict=True)]
    if len(set(names)) < len(names):
        parser.error(f"--kernels: folders need distinct names, got {names}")
    ours = {name: StepGraphs(session, device, shape, 3, tiling if t is None else {**tiling, "column_tile": t},
                             kernels=folder)
            for name, folder, t in zip(names, folders, tiles, strict=True)}
    for name, graphs in ours.items():
        graphs.compile_all(["fused"], [pool_dtype])
        progress(f"compiled {name}", started)
    per_layer = 1e6 / args.layers  # seconds per step to microseconds per layer
    for batch in args.batches:
        operands = make_step_operands(device, shape, batch, pool_dtype)
        timed = [anchor_name, *ours] if anchor is not None else list(ours)
        times: dict[str, list[float]] = {name: [] for name in timed}
        for round_ in range(args.rounds):
            for name, graphs in ours.items():
                times[name].append(graphs.per_step_seconds("fused", pool_dtype, operands, 5))
            if anchor is not None:
                try:
                    times[anchor_name].append(anchor.per_step_seconds(anchor_variant, pool_dtype, operands, 5))
                except Exception as error:  # MAX's kernels refuse some shapes only when run
                    progress(f"{anchor_name} does not run for this shape ({refusal(error)}): timing ours alone",
                             started)
                    anchor = None
                    del times[anchor_name]
            progress(f"batch {batch}, round {round_ + 1}: " + ", ".join(
                f"{name} {values[-1] * per_layer:.1f}" for name, values in times.items()) + " us per layer",
                started)
        first = statistics.median(times[next(iter(ours))])
        theirs = statistics.median(times[anchor_name]) if anchor is not None else None
        print(f"batch {batch}: microseconds per layer over {args.rounds} rounds", flush=True)
        print(f"  {'variant':24s} {'median':>8s} {'best':>8s} {'vs anchor':>9s} {'vs first':>9s}")
        for name, values in times.items():
            median = statistics.median(values)
            # Without an anchor (MAX refused the shape) there is no ratio to show.
            vs_anchor = f"{theirs / median:8.2f}x" if theirs is not None else f"{'-':>9s}"
            print(f"  {name:24s} {median * per_layer:8.1f} {min(values) * per_layer:8.1f} {vs_anchor}"
                  f" {first / median:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
