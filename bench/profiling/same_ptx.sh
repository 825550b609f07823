#!/usr/bin/env bash
# Whether every GPU kernel family compiles to the same PTX at git revision REV and in
# this checkout, no GPU needed:
#
#     bash bench/profiling/same_ptx.sh REV
#
# Each side compiles its own kernels_ptx.mojo against its own mojo/ (REV's from
# `git archive`), so a change of a kernel's parameters still compiles on both sides.
# Kernels are paired by their `// kernel:` label. The symbol hashes Mojo puts in kernel
# names are masked; every other line must match. Prints one line per kernel: "same PTX",
# "N lines differ", "removed" (at REV only) or "added" (in the checkout only); exits
# non-zero if any kernel present on both sides differs.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
rev=${1:?usage: same_ptx.sh REV}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/old"
git -C "$root" archive "$rev" mojo bench/profiling/kernels_ptx.mojo | tar -x -C "$work/old"
"${MOJO:-mojo}" run -I "$work/old" "$work/old/bench/profiling/kernels_ptx.mojo" > "$work/old.ptx"
"${MOJO:-mojo}" run -I "$root" "$root/bench/profiling/kernels_ptx.mojo" > "$work/new.ptx"
"${PYTHON:-python3}" - "$work/old.ptx" "$work/new.ptx" "$rev" <<'PY'
import re
import sys


def kernels(path: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    name = None
    for line in open(path):
        if line.startswith("// kernel:"):
            name = line[len("// kernel:"):].strip()
            if name in found:
                sys.exit(f"{path}: two kernels labelled {name!r}")
            found[name] = []
        elif name is not None:
            found[name].append(re.sub(r"_[0-9a-f]{16}(?![0-9a-f])", "_HASH", line))
    return found


old, new, rev = kernels(sys.argv[1]), kernels(sys.argv[2]), sys.argv[3]
counts = {"same PTX": 0, "differ": 0, "removed": 0, "added": 0}
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
        counts["differ" if changed else "same PTX"] += 1
        print(f"{name}: {'same PTX' if not changed else f'{changed} lines differ'} ({len(lines)} lines at {rev})")
print(", ".join(f"{count} {what}" for what, count in counts.items()))
sys.exit(1 if counts["differ"] else 0)
PY
