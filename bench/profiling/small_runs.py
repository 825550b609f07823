"""Small eager runs of every GPU kernel path, each checked bit for bit against the numpy
reference: the fold (fp32 and bf16 pools), the verify, the verify with fold on load and
the forward (fp32 and bf16 pools, a ragged batch with a window past RING_LEN and an empty
one), on the three GPU window kernels (the latency, throughput and walking kernels, each
forced), the throughput kernel with claimed units (more units than resident blocks
at a narrow column tile), and per-channel gates (the fold, and the latency kernel's
verify, fold on load and forward; the walking kernel's too). Small enough to run under compute-sanitizer
(sanitize.sh), which runs the groups side by side:

    python bench/profiling/small_runs.py [GROUP ...]    # fold latency throughput claimed channel walk
"""

from __future__ import annotations

import sys

import numpy as np

from gdfold_max import WindowRunner, fold, reference
from gdfold_max.cases import random_fold_case, random_window_case
from gdfold_max.layout import Gate


def same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    view = np.uint16 if got.dtype.itemsize == 2 else np.uint32
    differ = int(np.count_nonzero(got.view(view) != want.view(view)))
    print(f"{what}: {'bit-exact' if differ == 0 else f'{differ} elements differ'}", flush=True)
    if differ:
        raise SystemExit(1)


def run_folds(gate: Gate) -> None:
    for dtype in ("float32", "bfloat16"):
        case = random_fold_case(1, layers=2, batch=4, state_dtype=dtype, num_accepted=[0, 1, 4, 5],
                                gate=gate)
        state = case.state_in.copy()
        fold(state, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted, device="gpu",
             gate=gate)
        same_bits(state, case.state_out, f"fold, {dtype} pool, {gate} gates")


def run_windows(label: str, runner: WindowRunner, gate: Gate = "head") -> None:
    for dtype in ("float32", "bfloat16"):
        case = random_window_case(2, state_dtype=dtype, gate=gate)
        for previous in (False, True):
            got = case.run_verify(runner.verify_ring, fold_on_load=previous)
            want = case.run_verify(reference.verify_ring, fold_on_load=previous)
            what = f"{'verify with fold on load' if previous else 'verify'}, {dtype} pool, {label}"
            for name, a, b in zip(("readout", "pool", "ring"), got, want, strict=True):
                same_bits(a, b, f"{what}: {name}")
        pool = case.state.copy()
        out = runner.recurrence(*case.tokens(), pool, case.row_ids, case.input_row_offsets)
        want_pool = case.state.copy()
        want = reference.recurrence_fwd(*case.tokens(), want_pool, case.row_ids, case.input_row_offsets,
                                        num_key_heads=case.num_key_heads)
        same_bits(out, want, f"forward, {dtype} pool, {label}: readout")
        same_bits(pool, want_pool, f"forward, {dtype} pool, {label}: pool")


def run_channel() -> None:
    run_folds("channel")
    run_windows("per-channel gates", WindowRunner("gpu"), "channel")


def run_walk() -> None:
    runner = WindowRunner("gpu", gpu_path="walk")
    run_windows("walking kernel", runner)
    run_windows("walking kernel, per-channel gates", runner, "channel")


GROUPS = {
    "fold": lambda: run_folds("head"),
    "latency": lambda: run_windows("latency kernel", WindowRunner("gpu", gpu_path="latency")),
    "throughput": lambda: run_windows("throughput kernel", WindowRunner("gpu", gpu_path="throughput")),
    "claimed": lambda: run_windows("claimed units", WindowRunner("gpu", column_tile=8, requests_per_block=3,
                                                                 gpu_path="throughput")),
    "channel": run_channel,
    "walk": run_walk,
}


def main() -> None:
    names = sys.argv[1:] or list(GROUPS)
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise SystemExit(f"unknown groups {unknown}: choose from {list(GROUPS)}")
    for name in names:
        GROUPS[name]()


if __name__ == "__main__":
    main()
