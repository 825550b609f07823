#!/usr/bin/env bash
# Registers and spills of the GPU window kernel, without a GPU:
#
#     bash bench/profiling/window_registers.sh [MOJO_PACKAGE_DIR]
#
# MOJO_PACKAGE_DIR is a folder that holds a copy of mojo/ to check (default: this
# checkout). Needs the `mojo` of the installed MAX on PATH (or in $MOJO) and ptxas from a
# CUDA toolkit (or in $PTXAS). With nvdisasm on PATH (or in $NVDISASM) it also lists the
# kernel's arithmetic loops and the spill instructions in each (bench/profiling/sass_loops.py);
# with SASS_KINDS=1 also each loop's instructions outside its inner loops, by kind; with
# SASS_LINES=N also the N source lines that hold most of the unit loop's instructions outside
# its inner loops (ptxas -lineinfo, nvdisasm -g).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
package_dir=$(cd "${1:-$root}" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"${MOJO:-mojo}" run ${SASS_LINES:+--debug-level line-tables} -I "$package_dir" "$root/bench/profiling/window_ptx.mojo" > "$work/all.ptx"
# One file per instantiation, cut at the marker lines window_ptx.mojo prints.
awk -v dir="$work" '/^\/\/ window kernel:/ { n++; print > (dir "/" n ".title"); next }
                    n { print > (dir "/" n ".ptx") }' "$work/all.ptx"
for title in "$work"/*.title; do
    ptx=${title%.title}.ptx
    echo "$(sed 's#^// ##' "$title")"
    # The entry function comes first in ptxas's report: its spill line, then its registers.
    "${PTXAS:-ptxas}" -arch=sm_90a -v ${SASS_LINES:+-lineinfo} "$ptx" -o "$work/kernel.cubin" 2>&1 | awk '
        /spill stores/ && !spills { spills = $0; sub(/^ +/, "", spills) }
        /Used [0-9]+ registers/ && !used { used = $0; sub(/.*Used/, "Used", used) }
        END { print "  " used; print "  " spills }'
    # Where the spills sit, loop by loop, where nvdisasm is at hand (bench/profiling/sass_loops.py).
    nvdisasm=${NVDISASM:-$(command -v nvdisasm || true)}
    if [ -n "$nvdisasm" ]; then
        "$nvdisasm" -c ${SASS_LINES:+-g} "$work/kernel.cubin" > "$work/kernel.sass"
        "${PYTHON:-python3}" "$root/bench/profiling/sass_loops.py" "$work/kernel.sass" ${SASS_KINDS:+--kinds} \
            ${SASS_LINES:+--lines "$SASS_LINES"}
    fi
done
