"""Sweeps the GPU fold's tiling (KEY_DIM_TILE, ROWS_PER_THREAD) on Qwen3-Next shapes.

Usage: python bench/tuning/tune_tiles.py [--batches 1,64] [--candidates 64x8,128x8] [--dtypes float32]
                                        [--rounds N] [--json out.json]
Every candidate is timed the way the benchmark times a fold (R chained folds against
one), on the same pool, in one process; the default tiling is the first row.
"""

from __future__ import annotations

import argparse
import json

from max.driver import Accelerator
from max.dtype import DType
from max.engine import InferenceSession

from gdfold_max.bench.fold import FoldGraphs, make_operands
from gdfold_max.bench.harness import FoldShape

CANDIDATES = [(32, 4), (32, 8), (64, 4), (64, 8), (128, 8), (16, 4), (128, 16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--json", default="")
    parser.add_argument("--chain", type=int, default=8)
    parser.add_argument("--candidates", default=",".join(f"{t}x{r}" for t, r in CANDIDATES),
                        help="comma-separated KEY_DIM_TILExROWS_PER_THREAD, e.g. 64x8,128x8")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every candidate in turn")
    args = parser.parse_args()
    candidates = [tuple(int(x) for x in c.split("x")) for c in args.candidates.split(",")]
    device = Accelerator()
    session = InferenceSession(devices=[device])
    shape = FoldShape()
    dtypes = [getattr(DType, d) for d in args.dtypes.split(",")]
    graphs = {c: FoldGraphs(session, device, shape, args.chain, {"key_dim_tile": c[0], "rows_per_thread": c[1]})
              for c in candidates}
    for g in graphs.values():
        g.compile_all(["gdfold"], dtypes)
    results = []
    for state_dtype in dtypes:
        for batch in [int(b) for b in args.batches.split(",")]:
            operands = make_operands(device, shape, batch, state_dtype)
            nbytes = shape.fold_bytes(batch, state_dtype)
            for round_ in range(args.rounds):
                for (tile, rows), g in graphs.items():
                    seconds = g.per_link_seconds("gdfold", state_dtype, operands, repeats=7)
                    row = dict(dtype=state_dtype.name, batch=batch, key_dim_tile=tile, rows_per_thread=rows,
                               round=round_, us=seconds * 1e6, tb_s=nbytes / seconds / 1e12)
                    results.append(row)
                    print(f"{row['dtype']:>9} batch {batch:>4} round {round_} tile {tile:>3} rows {rows:>2}: "
                          f"{row['us']:9.1f} us  {row['tb_s']:.3f} TB/s", flush=True)
            del operands
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
