"""Where the warps of one kernel spend their time, from Nsight Compute's sampled warp
states, instruction by instruction:

    ncu --launch-skip 2 --launch-count 1 --set full --import-source no -k regex:mojo_pkg \\
        --page source --print-source sass --csv \\
        python bench/profiling/profile_window.py 64 0 64 > samples.csv
    python bench/profiling/sass_samples.py samples.csv [--top N]

It prints the share of the samples and of the executed instructions by opcode, the
share by stall reason, the N most sampled instructions with their two main reasons, and
the kernel cut into spans at each block barrier, call, copy and wait, with each span's
share of the samples and how many times warps ran its last instruction. Which span
is which phase of the kernel is for the reader to tell from the instructions: ncu
attributes a sample to the instruction a warp is about to issue, so the time a warp
waits at a barrier shows on the instruction after it.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
# Instructions that end a span: block barriers, calls and returns, copies and waits.
SPAN_ENDS = ("BAR.SYNC", "CALL", "RET", "EXIT", "UTMA", "LDGSTS", "SYNCS", "DEPBAR", "WARPSYNC")


def read_listing(path: Path) -> tuple[list[str], list[list[str]]]:
    """The header and the instruction rows of ncu's CSV source page (it starts with
    ncu's own log lines, and a kernel-name line, before the header)."""
    rows = list(csv.reader(path.open()))
    start = next((i for i, row in enumerate(rows) if row[:2] == ["Address", "Source"]), None)
    if start is None:
        raise SystemExit(f"{path}: no 'Address,Source' header; was ncu run with --page source --csv?")
    header = rows[start]
    return header, [row for row in rows[start + 1:] if len(row) == len(header)]


def opcode(source: str) -> str:
    """The opcode without its predicate and modifiers: `@!P3 BRA 0x..` gives BRA."""
    text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    return text.split()[0].split(".")[0] if text else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    header, rows = read_listing(args.csv)
    column = {name: i for i, name in enumerate(header)}
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]

    def count(row: list[str], name: str) -> int:
        return int(row[column[name]] or 0)

    samples = [count(row, SAMPLES) for row in rows]
    total = sum(samples) or 1
    executed = sum(count(row, EXECUTED) for row in rows) or 1
    print(f"{len(rows)} instructions in the kernel, {executed} executed by warps, {total} samples")

    by_samples: Counter[str] = Counter()
    by_executed: Counter[str] = Counter()
    for row, sampled in zip(rows, samples, strict=True):
        name = opcode(row[column["Source"]])
        by_samples[name] += sampled
        by_executed[name] += count(row, EXECUTED)
    print("\nopcode         executed   samples")
    for name, _ in by_samples.most_common(args.top):
        print(f"  {name:10s} {100 * by_executed[name] / executed:7.1f}% {100 * by_samples[name] / total:8.1f}%")

    print("\nstall reason")
    by_reason = Counter({name[len("stall_"):]: sum(count(row, name) for row in rows) for name in reasons})
    for name, sampled in by_reason.most_common():
        if sampled:
            print(f"  {name:18s} {100 * sampled / total:5.1f}%")

    print(f"\nthe {args.top} most sampled instructions (index, share of samples, times warps ran it, source,"
          " main stall reasons)")
    for i in sorted(range(len(rows)), key=lambda i: -samples[i])[: args.top]:
        row = rows[i]
        main_reasons = sorted(((count(row, name), name[len("stall_"):]) for name in reasons), reverse=True)[:2]
        print(f"  {i:5d} {100 * samples[i] / total:5.1f}% {count(row, EXECUTED):8d}  "
              f"{row[column['Source']].strip()[:56]:56s} {', '.join(f'{r} {n}' for n, r in main_reasons if n)}")

    print("\nspans (first-last index, share of samples, times warps ran the last instruction, that"
          " instruction; spans under 0.5% left out)")
    first = 0
    for i, row in enumerate(rows):
        source = row[column["Source"]].strip()
        if any(mark in source for mark in SPAN_ENDS) or i == len(rows) - 1:
            share = 100 * sum(samples[first:i + 1]) / total
            if share >= 0.5:
                print(f"  {first:5d}-{i:5d} {share:5.1f}% {count(row, EXECUTED):8d}  {source[:60]}")
            first = i + 1


if __name__ == "__main__":
    main()
