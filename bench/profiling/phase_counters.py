"""Where a block of the fused verify spends its time, phase by phase, measured inside the
kernel with the SM's cycle counter:

    python bench/profiling/phase_counters.py [--batch N] [--layers N] [--dtype float32|bfloat16]
                                   [--window W] [--variant fused|forward] [--gate head|channel]
                                   [--kernels DIR] [--column-tile T] [--requests-per-block R]
                                   [--clock-ghz F] [--raw CSV]

A copy of the kernel package (``--kernels``, default this checkout's ``mojo/``) is patched
in a temporary folder: at the end of each phase of a unit (the numbered steps of
``window_gpu.mojo``) every thread adds the cycles since the last mark to that phase's
total (the first unit's ids and the issue of its copies apart from the wait for them, and
in a fold on load of more than WINDOW_CHUNK records the wait for each later chunk and its
staging apart from the fold's arithmetic), and
at the end threads 0 and 64 write their totals over the readout of the block's
first unit's first token (so the readout is wrong; the pool and ring are not touched). One
step of ``--layers`` layers of the fused verify (or ``--variant forward``: our forward, what
a plain decoding step runs at ``--window 1``) runs over windows of ``--window`` tokens
(default 4, as the step benchmark: W - 1 previous records folded on load) at Qwen3-Next
shapes (``--gate channel``: Kimi-Linear-48B's) with an fp32 pool (or ``--dtype bfloat16``);
the last layer's blocks are read. Thread 0 issues the tile's
tensor copies and the L2 prefetch, thread 64 does not: the two columns show what that
costs warp 0. The counters cost the
kernel registers (ptxas: about 50 bytes of spills more than the kernel's own), so the
whole is a little slower than the kernel timed alone; compare its parts, not its total,
with the step benchmark.

The patch looks for lines of the kernel by their text and stops with an error naming
the one it cannot find, so a kernel that has moved on fails loudly instead of measuring
the wrong spans.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from max.driver import CPU, Accelerator
from max.dtype import DType
from max.engine import InferenceSession

from gdfold_max.bench.harness import FoldShape
from gdfold_max.bench.step import WINDOWS, StepGraphs, make_step_operands, window_shape

PHASES = (
    "copies waited for, barrier 1 (and next ids)",
    "state tile to registers, norms, barrier 2",
    "next unit's copies issued, L2 prefetch",
    "fold on load: arithmetic, the folded tile's store",
    "tokens",
    "before the first unit: L2 hint, previous kernel",
    "first unit: its ids read, its copies issued",
    "fold on load: later chunks waited for, staged",
)
# Where thread 0's and thread 64's counters land among the block's first readout columns.
WRITERS = {"thread 0": 0, "thread 64": 16}
TOTAL_AT, UNITS_AT, SM_AT = len(PHASES), len(PHASES) + 1, len(PHASES) + 2
# The kernel keeps the phases' cycles in one SIMD[uint32, 8] (START).
assert len(PHASES) <= 8, "more phases than the kernel's counter vector holds"
# Thread 64 writes the grid's size where thread 0 writes its SM: block 0's is read back,
# so the report needs no copy of the launch's grid arithmetic.
GRID_AT = WRITERS["thread 64"] + SM_AT

CLOCK = '''

@always_inline
def clock_cycles() -> UInt32:
    return inlined_assembly["mov.u32 $0, %clock;", UInt32, constraints="=r", has_side_effect=True]()
'''
START = '''    var phase_cycles = SIMD[DType.uint32, 8](0)
    var kernel_start = clock_cycles()
    var phase_mark = kernel_start
    var first_unit = unit

    @always_inline
    def end_phase(phase: Int) {mut}:
        var now = clock_cycles()
        phase_cycles[phase] += now - phase_mark
        phase_mark = now

'''
FINISH = f'''

    if tid == 0 or tid == 64:
        var request, block_column = divide(first_unit, block_columns)
        var at = Int(offsets[unsafe_offset=request]) * readout_width + block_column * COLUMN_TILE
        at += 0 if tid == 0 else 16
        for phase in range({len(PHASES)}):
            readout[unsafe_offset=at + phase] = Float32(phase_cycles[phase])
        readout[unsafe_offset=at + {TOTAL_AT}] = Float32(clock_cycles() - kernel_start)
        readout[unsafe_offset=at + {UNITS_AT}] = Float32(step)
        var sm = inlined_assembly["mov.u32 $0, %smid;", UInt32, constraints="=r", has_side_effect=True]()
        readout[unsafe_offset=at + {SM_AT}] = Float32(sm) if tid == 0 else Float32(grid_dim.x)
'''
# (text to find, text to put before it, text to put after it)
EDITS = (
    ("\ndef window_block_threads[", CLOCK, ""),
    ("    if dependent_i32 != 0:\n", START, ""),
    ("    # The first unit's ids, and the second unit, which no block has to wait to claim.\n",
     "    end_phase(5)\n", ""),
    ("    var step = 0  # the block's units so far\n", "    end_phase(6)\n", ""),
    ("        # held[m] is state row m * 8 + lane of the thread's four columns.\n", "        end_phase(0)\n", ""),
    ("        barrier()  # the state tile is free, the norms are written, the ids are in\n", "",
     "        end_phase(1)\n"),
    ("        if plan.poisoned:\n", "        end_phase(2)\n", ""),
    # A fold on load of more than WINDOW_CHUNK records copies each later chunk while the
    # chunk before it is folded, then waits for it and puts its keys in lane-major order:
    # that wait and staging apart from the fold's arithmetic.
    ("                        async_copy_wait_all()\n"
     "                        barrier()  # the later chunk has landed; the staged keys are free\n",
     "                        end_phase(3)\n", ""),
    ("                        barrier()  # the later chunk's keys are in lane-major order\n", "",
     "                        end_phase(7)\n"),
    ("        # 4. The window, WINDOW_CHUNK tokens at a time.\n", "        end_phase(3)\n", ""),
    ("        # 5. A forward, or a window too long for the ring, commits the state.\n",
     "        end_phase(4)\n", ""),
)


def patched_kernels(source: Path, into: Path) -> Path:
    """A copy of the package at ``source`` whose window kernel counts its phases."""
    target = into / "mojo"
    shutil.copytree(source, target)
    kernel = target / "window_gpu.mojo"
    text = kernel.read_text()
    for find, before, after in EDITS:
        if text.count(find) != 1:
            raise SystemExit(f"window_gpu.mojo: expected one line {find.strip()!r}, found {text.count(find)}")
        text = text.replace(find, before + find + after)
    if not text.rstrip().endswith("wait_bulk_copies_read()"):
        raise SystemExit("window_gpu.mojo: the kernel no longer ends with its wait for the last tile's store;"
                         " cannot append the counters")
    kernel.write_text(text.rstrip() + "\n" + FINISH)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the pool's dtype")
    parser.add_argument("--window", type=int, default=4, help="tokens a request (1: plain decoding)")
    parser.add_argument("--variant", choices=["fused", "forward"], default="fused",
                        help="the fused verify, or our forward (which records nothing and folds nothing)")
    parser.add_argument("--gate", choices=["head", "channel"], default="head")
    parser.add_argument("--kernels", type=Path, default=Path(__file__).resolve().parents[2] / "mojo")
    parser.add_argument("--column-tile", type=int, default=64)
    parser.add_argument("--requests-per-block", type=int, default=None,
                        help="default: as the op chooses on an H200 (132 SMs, 3 blocks each)")
    parser.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock, to turn cycles into us")
    parser.add_argument("--raw", type=Path, help="also write every block's counters here, as CSV")
    args = parser.parse_args()
    if args.column_tile < 64:
        parser.error(f"--column-tile: thread 64 and 16 counter columns need 64 or more, got {args.column_tile}")
    if args.window not in WINDOWS:
        parser.error(f"--window: {args.window} is not in 1 to {WINDOWS[-1]}")

    shape = window_shape(replace(FoldShape.for_gate(args.gate), num_layers=args.layers), args.window)
    state_dtype = getattr(DType, args.dtype)
    block_columns = shape.num_value_heads * (shape.value_dim // args.column_tile)
    tiling = {"column_tile": args.column_tile, "requests_per_block": args.requests_per_block}
    device = Accelerator()
    with tempfile.TemporaryDirectory() as scratch:
        graphs = StepGraphs(InferenceSession(devices=[device]), device, shape, 2, tiling,
                            kernels=patched_kernels(args.kernels, Path(scratch)))
        graphs.compile_all([args.variant], [state_dtype], chained=False)
    operands = make_step_operands(device, shape, args.batch, state_dtype)
    model = graphs.model(args.variant, state_dtype, 1)
    for _ in range(3):  # the last run's counters are read
        (readout,) = model.execute(*operands)
    report(np.asarray(readout.to(CPU()).to_numpy()), shape, block_columns, args)


def report(counters: np.ndarray, shape: FoldShape, block_columns: int, args: argparse.Namespace) -> None:
    """Prints the phases' means, the spread of the blocks' times and how the blocks sharing
    an SM fared, from the readout the patched kernel wrote over."""
    tokens_per_request = counters.shape[0] // args.batch
    grid = int(counters[0, GRID_AT])  # block 0 wrote at unit 0: request 0, columns 0..

    # Block b's first unit is unit b: request b // block_columns on column block
    # b % block_columns, whose readout starts at column (b % block_columns) * tile.
    blocks = [((b % block_columns) * args.column_tile, (b // block_columns) * tokens_per_request)
              for b in range(grid)]
    us = 1e-3 / args.clock_ghz
    print(f"{args.variant}, {args.gate} gates, window {args.window}, {args.dtype} pool,"
          f" batch {args.batch}, {args.layers} layers (the last one's blocks), tile {args.column_tile},"
          f" {len(blocks)} blocks; us per block, mean over blocks"
          f" (cycles at {args.clock_ghz} GHz)")
    print(f"  {'phase':46s}" + "".join(f" {name:>10s}" for name in WRITERS))
    for phase, name in [*enumerate(PHASES), (TOTAL_AT, "whole block")]:
        means = [statistics.fmean(float(counters[row, column + offset + phase]) * us for column, row in blocks)
                 for offset in WRITERS.values()]
        print(f"  {name:46s}" + "".join(f" {mean:10.2f}" for mean in means))
    # Thread 0's counters, one row per block.
    table = np.array([counters[row, column:column + SM_AT + 1] for column, row in blocks], dtype=np.float64)
    if args.raw:
        # Quoted: the phases' names hold commas.
        names = ["value_column", "first_token", *PHASES, "whole block", "units", "sm"]
        header = ",".join(f'"{name}"' for name in names)
        rows = np.column_stack([np.array(blocks, dtype=np.float64), table[:, :TOTAL_AT + 1] * us,
                                table[:, UNITS_AT:]])
        np.savetxt(args.raw, rows, delimiter=",", header=header, comments="", fmt="%.3f")
    whole = table[:, TOTAL_AT] * us
    for count in sorted(set(table[:, UNITS_AT])):
        mine = np.sort(whole[table[:, UNITS_AT] == count])
        print(f"blocks of {count:.0f} units: {len(mine)}, whole block us: min {mine[0]:.1f}, median"
              f" {np.median(mine):.1f}, 90th percentile {np.percentile(mine, 90):.1f}, max {mine[-1]:.1f}")
    # Blocks are launched in the order of their first units, request by request.
    firsts = np.array([row for _, row in blocks]) // tokens_per_request
    print("whole block us by the request of its first unit (launch order): " + ", ".join(
        f"{first}: {np.median(whole[firsts == first]):.1f}" for first in sorted(set(firsts.tolist()))))
    # Blocks that shared an SM: did the SM's load set their time?
    per_sm: dict[int, list[int]] = {}
    for index, sm in enumerate(table[:, SM_AT].astype(int)):
        per_sm.setdefault(int(sm), []).append(index)
    for resident in sorted({len(v) for v in per_sm.values()}):
        members = [i for v in per_sm.values() if len(v) == resident for i in v]
        per_unit = whole[members] / table[members, UNITS_AT]
        print(f"SMs holding {resident} of these blocks: {sum(len(v) == resident for v in per_sm.values())},"
              f" us per unit: median {np.median(per_unit):.2f}, max {per_unit.max():.2f}")


if __name__ == "__main__":
    main()
