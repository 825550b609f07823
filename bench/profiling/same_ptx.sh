#!/usr/bin/env bash
# Whether every GPU kernel family compiles to the same PTX at git revision REV and in
# this checkout (kernels_ptx.mojo), no GPU needed:
#
#     bash bench/profiling/same_ptx.sh REV
#
# The symbol hashes Mojo puts in kernel names are masked; every other line must match.
# Prints one line per kernel; exits non-zero if any differs.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
rev=${1:?usage: same_ptx.sh REV}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/old"
git -C "$root" archive "$rev" mojo | tar -x -C "$work/old"
"${MOJO:-mojo}" run -I "$work/old" "$root/bench/profiling/kernels_ptx.mojo" > "$work/old.ptx"
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
            found[name] = []
        elif name is not None:
            found[name].append(re.sub(r"_[0-9a-f]{16}(?![0-9a-f])", "_HASH", line))
    return found


old, new, rev = kernels(sys.argv[1]), kernels(sys.argv[2]), sys.argv[3]
differ = 0
for name, lines in old.items():
    changed = sum(a != b for a, b in zip(lines, new.get(name, []))) + abs(len(lines) - len(new.get(name, [])))
    differ += changed > 0
    print(f"{name}: {'same PTX' if not changed else f'{changed} lines differ'} ({len(lines)} lines at {rev})")
sys.exit(1 if differ else 0)
PY
