"""Where a kernel's register spills sit: the loops of its SASS, with their arithmetic,
barriers and spill instructions, so that spills in a hot loop (the window kernel's
token loop) can be told from spills once per unit of work:

    nvdisasm -c kernel.cubin > kernel.sass
    python bench/profiling/sass_loops.py kernel.sass [--min-ffma N] [--kinds] [--lines N]

A loop is a backward branch and the instructions from its target to it; nested loops
are listed each with the instructions of the loops inside them. Only loops with at
least N fused multiply-adds (default 60) are listed: the rest are copies and waits.
With --kinds each loop's instructions outside the innermost listed loops within it are
also counted by kind (integer, fp32, shared memory, conversions, ...): what a unit of
work spends besides its arithmetic loops. With --lines N (SASS from `nvdisasm -c -g` of a
cubin built with `ptxas -lineinfo`) the outermost loop's instructions outside its inner
loops are also summed by the source line they come from, the N lines with most first, so
that the integer work can be told apart by where it is written.
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
OPCODE = re.compile(r"^(?:@!?U?P[0-9T]\s+)?([A-Z0-9_]+)")
SOURCE_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
#: Instruction kinds by base opcode; anything else is integer, index or predicate work.
KINDS = {
    "fp32": {"FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "FSETP", "FSEL"},
    "shared ld/st": {"LDS", "STS", "LDSM"},
    "global, constants, copies": {"LDG", "STG", "LDGSTS", "UBLKCP", "UTMALDG", "UTMASTG", "UTMACCTL", "LDGDEPBAR",
                                  "DEPBAR", "ULDC", "LDC"},
    "shuffles": {"SHFL"},
    "convert, pack": {"F2F", "F2FP", "PRMT", "I2F", "F2I"},
    "barriers, sync": {"BAR", "SYNCS", "MEMBAR", "WARPSYNC", "BSSY", "BSYNC", "NANOSLEEP", "ERRBAR", "CCTL", "FENCE"},
    "control": {"BRA", "EXIT", "RET", "CALL", "BPT", "NOP", "YIELD", "ELECT", "VOTE", "VOTEU", "R2UR", "S2R", "S2UR",
                "CS2R"},
}


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


def kind_of(text: str) -> str:
    match = OPCODE.match(text)
    base = match.group(1) if match else ""
    return next((kind for kind, opcodes in KINDS.items() if base in opcodes), "integer, index, predicate")


def outside_inner(instructions: list[tuple[int, str]], span: tuple[int, int],
                  listed: list[tuple[int, int]]) -> list[tuple[int, str]]:
    """The instructions of loop ``span`` outside the innermost listed loops within it
    (those that hold no other listed loop)."""
    def within(inner: tuple[int, int], outer: tuple[int, int]) -> bool:
        return inner != outer and outer[0] <= inner[0] and inner[1] <= outer[1]

    innermost = [loop for loop in listed if within(loop, span) and not any(within(o, loop) for o in listed)]
    return [(address, text) for address, text in instructions
            if span[0] <= address <= span[1] and not any(a <= address <= b for a, b in innermost)]


def kinds_outside_inner(instructions: list[tuple[int, str]], span: tuple[int, int],
                        listed: list[tuple[int, int]]) -> dict[str, int]:
    """The kinds of loop ``span``'s instructions outside its innermost listed loops."""
    counts: dict[str, int] = {}
    for _, text in outside_inner(instructions, span, listed):
        kind = kind_of(text)
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def source_lines(path: Path) -> dict[int, str]:
    """Each instruction's source line ("file:line", the file's name only) from the line
    comments `nvdisasm -g` writes before the instructions they cover."""
    sources: dict[int, str] = {}
    current = "?"
    for line in path.read_text().splitlines():
        if source := SOURCE_LINE.search(line):
            current = f"{Path(source.group(1)).name}:{source.group(2)}"
        elif instruction := INSTRUCTION.match(line):
            sources[int(instruction.group(1), 16)] = current
    return sources


def lines_outside_inner(instructions: list[tuple[int, str]], sources: dict[int, str], span: tuple[int, int],
                        listed: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
    """(source line, instructions, of them integer, index or predicate) of loop ``span``'s
    instructions outside its innermost listed loops, most instructions first."""
    totals: dict[str, list[int]] = {}
    for address, text in outside_inner(instructions, span, listed):
        entry = totals.setdefault(sources.get(address, "?"), [0, 0])
        entry[0] += 1
        entry[1] += kind_of(text) == "integer, index, predicate"
    return sorted(((line, total, integer) for line, (total, integer) in totals.items()), key=lambda row: -row[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass", type=Path, help="nvdisasm -c output")
    parser.add_argument("--min-ffma", type=int, default=60, help="list loops with at least this many FFMA")
    parser.add_argument("--kinds", action="store_true",
                        help="count each loop's instructions outside its innermost loops by kind")
    parser.add_argument("--lines", type=int, default=0,
                        help="sum the outermost loop's instructions outside its inner loops by source line "
                             "(SASS with line comments), this many lines")
    args = parser.parse_args()
    instructions, labels = read_sass(args.sass)
    listed = []
    for first, last in sorted(loops(instructions, labels), key=lambda span: span[1] - span[0]):
        body = [text for address, text in instructions if first <= address <= last]
        ffma = sum(bool(re.search(r"\bFFMA\b", text)) for text in body)
        if ffma >= args.min_ffma:
            listed.append((first, last, body, ffma))
    spans = [(first, last) for first, last, _, _ in listed]
    for first, last, body, ffma in listed:
        spills = sum(bool(re.search(r"\b(LDL|STL)\b", text)) for text in body)
        barriers = sum("BAR.SYNC" in text for text in body)
        print(f"  loop {first:#07x}-{last:#07x}: {len(body):5d} instructions, {ffma:4d} FFMA,"
              f" {barriers:2d} barriers, {spills:3d} spill loads/stores")
        if args.kinds:
            counts = kinds_outside_inner(instructions, (first, last), spans)
            print(f"    outside its inner loops, {sum(counts.values())}: "
                  + ", ".join(f"{kind} {count}" for kind, count in counts.items()))
    if args.lines and listed:
        outermost = max(spans, key=lambda span: span[1] - span[0])
        rows = lines_outside_inner(instructions, source_lines(args.sass), outermost, spans)
        print(f"  loop {outermost[0]:#07x}-{outermost[1]:#07x} outside its inner loops, by source line"
              " (instructions, of them integer, index, predicate):")
        for line, total, integer in rows[:args.lines]:
            print(f"    {line:32s} {total:5d} {integer:5d}")


if __name__ == "__main__":
    main()
