#!/usr/bin/env bash
# Whether every GPU kernel family compiles to the same PTX at git revision REV and in
# this checkout, no GPU needed:
#
#     bash bench/profiling/same_ptx.sh REV
#
# Each side compiles its own kernels_ptx.mojo against its own mojo/ (REV's from
# `git archive`), so a change of a kernel's parameters still compiles on both sides.
# Kernels are paired by their `// kernel:` label. The symbol hashes Mojo puts in kernel
# names are masked, and so is the number of a kernel's `extern_ptr_syml` (the name of its
# dynamic shared memory): Mojo numbers those across the whole program, so adding a
# kernel to kernels_ptx.mojo renumbers the others' without changing their code. Every
# other line must match. A kernel whose PTX differs passes as "same SASS" if ptxas (on
# PATH, or $PTXAS) makes the same machine code of both sides (the cubins' .text sections):
# PTX that differs only in the names of its virtual registers runs as before. Prints one
# line per kernel: "same PTX", "same SASS", "N lines differ", "removed" (at REV only) or
# "added" (in the checkout only); exits non-zero if any kernel present on both sides
# differs in its machine code (or in its PTX, without ptxas).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
rev=${1:?usage: same_ptx.sh REV}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/old"
git -C "$root" archive "$rev" mojo bench/profiling/kernels_ptx.mojo | tar -x -C "$work/old"
"${MOJO:-mojo}" run -I "$work/old" "$work/old/bench/profiling/kernels_ptx.mojo" > "$work/old.ptx"
"${MOJO:-mojo}" run -I "$root" "$root/bench/profiling/kernels_ptx.mojo" > "$work/new.ptx"
"${PYTHON:-python3}" - "$work/old.ptx" "$work/new.ptx" "$rev" "$work" <<'PY'
import os
import re
import shutil
import struct
import subprocess
import sys

HASH = re.compile(r"_[0-9a-f]{16}(?![0-9a-f])")
SYMBOL = re.compile(r"\bextern_ptr_syml(_[0-9]+)?\b")


def kernels(path: str) -> dict[str, list[str]]:
    """Each kernel's PTX lines, as printed (the symbol hashes unmasked)."""
    found: dict[str, list[str]] = {}
    name = None
    for line in open(path):
        if line.startswith("// kernel:"):
            name = line[len("// kernel:"):].strip()
            if name in found:
                sys.exit(f"{path}: two kernels labelled {name!r}")
            found[name] = []
        elif name is not None:
            found[name].append(line)
    return found


def masked(lines: list[str]) -> list[str]:
    return [SYMBOL.sub("extern_ptr_syml_N", HASH.sub("_HASH", line)) for line in lines]


def sass(lines: list[str], where: str) -> tuple[list[tuple[str, bytes]], str] | None:
    """The machine code ptxas makes of a kernel's PTX module (every ``.text.*`` section,
    names masked, in order) and its register line; None without ptxas. Where two PTX
    texts differ only in the names of virtual registers, ptxas makes the same code: what
    runs on the GPU is unchanged."""
    ptxas = os.environ.get("PTXAS") or shutil.which("ptxas")
    if ptxas is None:
        return None
    with open(where + ".ptx", "w") as out:
        out.writelines(lines)
    run = subprocess.run([ptxas, "-arch=sm_90a", "-v", where + ".ptx", "-o", where + ".cubin"],
                         capture_output=True, text=True, check=True)
    used = next((m.group(0) for m in re.finditer(r"Used \d+ registers.*", run.stderr)), "")
    blob = open(where + ".cubin", "rb").read()
    # ELF64: the section headers, then each section's name from the section-name table.
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(header: tuple) -> str:
        start = names_at + header[0]
        return blob[start:blob.index(b"\0", start)].decode()

    code = [(HASH.sub("_HASH", name(h)), blob[h[4]:h[4] + h[5]]) for h in headers if name(h).startswith(".text.")]
    return code, used


old_raw, new_raw, rev, work = kernels(sys.argv[1]), kernels(sys.argv[2]), sys.argv[3], sys.argv[4]
old = {name: masked(lines) for name, lines in old_raw.items()}
new = {name: masked(lines) for name, lines in new_raw.items()}
counts = {"same PTX": 0, "same SASS": 0, "differ": 0, "removed": 0, "added": 0}
for name in [*old, *(name for name in new if name not in old)]:
    if name not in new:
        counts["removed"] += 1
        print(f"{name}: removed ({len(old[name])} lines at {rev})")
    elif name not in old:
        counts["added"] += 1
        print(f"{name}: added ({len(new[name])} lines)")
    else:
        lines, now = old[name], new[name]
        changed = sum(a != b for a, b in zip(lines, now)) + abs(len(lines) - len(now))
        if not changed:
            counts["same PTX"] += 1
            print(f"{name}: same PTX ({len(lines)} lines at {rev})")
            continue
        before, after = sass(old_raw[name], f"{work}/old_kernel"), sass(new_raw[name], f"{work}/new_kernel")
        if before is not None and before == after:
            counts["same SASS"] += 1
            print(f"{name}: same SASS, {before[1]} ({changed} PTX lines differ of {len(lines)} at {rev})")
        else:
            counts["differ"] += 1
            why = "no ptxas to compare the machine code" if before is None else "the machine code differs"
            print(f"{name}: {changed} PTX lines differ ({len(lines)} lines at {rev}); {why}")
print(", ".join(f"{count} {what}" for what, count in counts.items()))
sys.exit(1 if counts["differ"] else 0)
PY
