"""Small eager runs of every GPU kernel path, each checked bit for bit against the numpy
reference: the fold (fp32 and bf16 pools), the verify, the verify with fold on load and
the forward (fp32 and bf16 pools, a ragged batch with a window past RING_LEN and an empty
one), on both GPU window kernels (the latency kernel and the throughput kernel, each
forced), and the throughput kernel with claimed units (more units than resident blocks
at a narrow column tile). Small enough to run under compute-sanitizer (sanitize.sh):

    python bench/profiling/small_runs.py
"""

from __future__ import annotations

import numpy as np

from gdfold_max import WindowRunner, fold, reference
from gdfold_max.cases import random_fold_case, random_window_case


def same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    view = np.uint16 if got.dtype.itemsize == 2 else np.uint32
    differ = int(np.count_nonzero(got.view(view) != want.view(view)))
    print(f"{what}: {'bit-exact' if differ == 0 else f'{differ} elements differ'}", flush=True)
    if differ:
        raise SystemExit(1)


def main() -> None:
    for dtype in ("float32", "bfloat16"):
        case = random_fold_case(1, layers=2, batch=4, state_dtype=dtype, num_accepted=[0, 1, 4, 5])
        state = case.state_in.copy()
        fold(state, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted, device="gpu")
        same_bits(state, case.state_out, f"fold, {dtype} pool")
    runners = {"latency kernel": WindowRunner("gpu", gpu_path="latency"),
               "throughput kernel": WindowRunner("gpu", gpu_path="throughput"),
               "claimed units": WindowRunner("gpu", column_tile=8, requests_per_block=3, gpu_path="throughput")}
    for label, runner in runners.items():
        for dtype in ("float32", "bfloat16"):
            case = random_window_case(2, state_dtype=dtype)
            for previous in (False, True):
                extra = ({"previous_ring_row_ids": case.previous_ring_row_ids,
                          "previous_num_accepted": case.previous_num_accepted} if previous else {})
                pool, ring = case.fresh()
                out = runner.verify_ring(*case.tokens(), pool, ring, case.row_ids, case.ring_row_ids,
                                         case.input_row_offsets, **extra)
                want_pool, want_ring = case.fresh()
                want = reference.verify_ring(*case.tokens(), want_pool, want_ring, case.row_ids, case.ring_row_ids,
                                             case.input_row_offsets, **extra)
                what = f"{'verify with fold on load' if previous else 'verify'}, {dtype} pool, {label}"
                for name, a, b in (("readout", out, want), ("pool", pool, want_pool), ("ring", ring, want_ring)):
                    same_bits(a, b, f"{what}: {name}")
            pool = case.state.copy()
            out = runner.recurrence(*case.tokens(), pool, case.row_ids, case.input_row_offsets)
            want_pool = case.state.copy()
            want = reference.recurrence_fwd(*case.tokens(), want_pool, case.row_ids, case.input_row_offsets,
                                            num_key_heads=case.num_key_heads)
            same_bits(out, want, f"forward, {dtype} pool, {label}: readout")
            same_bits(pool, want_pool, f"forward, {dtype} pool, {label}: pool")


if __name__ == "__main__":
    main()
