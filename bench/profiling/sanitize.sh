#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck over small runs of every GPU
# kernel path (small_runs.py, which also checks each result bit for bit). Prints each
# tool's error summary; exits non-zero if any tool reports an error or a run fails.
#
#     bash bench/profiling/sanitize.sh [LOG_DIR]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
sanitizer=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
logs=${1:-.}
mkdir -p "$logs"
status=0
for tool in memcheck racecheck synccheck; do
    log="$logs/sanitizer-$tool.txt"
    "$sanitizer" --tool "$tool" --target-processes all "${PYTHON:-python3}" "$here/small_runs.py" > "$log" 2>&1
    code=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -n 1)
    echo "$tool: exit $code; ${summary:-no summary line (see $log)}"
    # Every process's summary must count zero (with --target-processes all, each prints one).
    if [ "$code" -ne 0 ] || [ -z "$summary" ] || grep -qE "SUMMARY: [1-9]" "$log"; then
        status=1
    fi
done
exit $status
