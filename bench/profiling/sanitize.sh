#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck over small runs of every GPU
# kernel path (small_runs.py, which also checks each result bit for bit). Every tool
# runs every group of small_runs.py in its own process, all side by side (most of a run
# is compiling the graphs on the host). Prints each run's summary; exits non-zero if any
# tool reports an error or a run fails.
#
#     bash bench/profiling/sanitize.sh [LOG_DIR]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
sanitizer=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
logs=${1:-.}
mkdir -p "$logs"
tools=(memcheck racecheck synccheck)
groups=(${SANITIZE_GROUPS:-fold path latency throughput claimed channel chunks skips shared-row tree})
runs=()
for tool in "${tools[@]}"; do
    for group in "${groups[@]}"; do
        # Two requests on one row race by contract: memcheck only.
        if [ "$group" = shared-row ] && [ "$tool" != memcheck ]; then continue; fi
        "$sanitizer" --tool "$tool" --target-processes all "${PYTHON:-python3}" "$here/small_runs.py" "$group" \
            > "$logs/sanitizer-$tool-$group.txt" 2>&1 &
        runs+=("$tool-$group")
    done
done
codes=()
for job in $(jobs -p); do wait "$job"; codes+=($?); done
status=0
for i in "${!runs[@]}"; do
    log="$logs/sanitizer-${runs[$i]}.txt"
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -n 1)
    checked=$(grep -c "bit-exact" "$log")
    echo "${runs[$i]}: exit ${codes[$i]}; $checked results bit-exact; ${summary:-no summary line (see $log)}"
    # Every process's summary must count zero (with --target-processes all, each prints one).
    if [ "${codes[$i]}" -ne 0 ] || [ -z "$summary" ] || grep -qE "SUMMARY: [1-9]" "$log"; then
        status=1
    fi
done
exit $status
