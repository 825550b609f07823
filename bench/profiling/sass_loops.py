"""Where a kernel's register spills sit: the loops of its SASS, with their arithmetic,
barriers and spill instructions, so that spills in a hot loop (the window kernel's
token loop) can be told from spills once per unit of work:

    nvdisasm -c kernel.cubin > kernel.sass
    python bench/profiling/sass_loops.py kernel.sass [--min-ffma N]

A loop is a backward branch and the instructions from its target to it; nested loops
are listed each with the instructions of the loops inside them. Only loops with at
least N fused multiply-adds (default 60) are listed: the rest are copies and waits.
bench/profiling/window_registers.sh runs this for every instantiation when nvdisasm is on PATH
(or in $NVDISASM).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

LABEL = re.compile(r"^\s*\.L_x_(\d+):")
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?\.L_x_(\d+)")


def read_sass(path: Path) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """The instructions (address, text) and each label's address."""
    instructions: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in path.read_text().splitlines():
        if label := LABEL.match(line):
            pending.append(label.group(1))
            continue
        if instruction := INSTRUCTION.match(line):
            address = int(instruction.group(1), 16)
            instructions.append((address, instruction.group(2)))
            labels.update((name, address) for name in pending)
            pending.clear()
    return instructions, labels


def loops(instructions: list[tuple[int, str]], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) address of every loop: a branch back to a label at or before it."""
    found = []
    for address, text in instructions:
        target = BRANCH_TARGET.search(text)
        if target and labels.get(target.group(1), address + 1) <= address:
            found.append((labels[target.group(1)], address))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass", type=Path, help="nvdisasm -c output")
    parser.add_argument("--min-ffma", type=int, default=60, help="list loops with at least this many FFMA")
    args = parser.parse_args()
    instructions, labels = read_sass(args.sass)
    for first, last in sorted(loops(instructions, labels), key=lambda span: span[1] - span[0]):
        body = [text for address, text in instructions if first <= address <= last]
        ffma = sum(bool(re.search(r"\bFFMA\b", text)) for text in body)
        if ffma < args.min_ffma:
            continue
        spills = sum(bool(re.search(r"\b(LDL|STL)\b", text)) for text in body)
        barriers = sum("BAR.SYNC" in text for text in body)
        print(f"  loop {first:#07x}-{last:#07x}: {len(body):5d} instructions, {ffma:4d} FFMA,"
              f" {barriers:2d} barriers, {spills:3d} spill loads/stores")


if __name__ == "__main__":
    main()
