"""The GPU test suite in named groups, each sized to finish within 10 minutes on one GPU
(most of a group's time is MAX compiling graphs on the host's cores).

    python tests/gpu_suite.py GROUP [GROUP ...] [--out DIR] [--workers N] [-k EXPR]
    python tests/gpu_suite.py --list

Each group runs ``pytest -m gpu -rA`` over its files, so every test is named with its
outcome, and writes ``DIR/gpu-tests-GROUP.txt``: the command, the card, the date and the
commit, then pytest's output, then the outcome line (with ``-k``, some of the group's
tests, in ``DIR/gpu-tests-GROUP-selected.txt``). A group that pytest did not finish
(killed at a limit) has no outcome line: it is evidence of nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: group -> (test files, pytest-xdist distribution). Files whose tests share compiled
#: graphs go to one worker (``loadfile``); where one file would hold a worker past the
#: limit, its tests spread (``load``): the window group passed 570 s unfinished as files
#: and took 123 s spread over 14 workers on an H100 (bench/results/gpu-tests-window-h100-2026-12-06.txt).
GROUPS: dict[str, tuple[list[str], str]] = {
    "fold": (["test_fold_gpu.py", "test_fold_channel.py", "test_fold_graph_tables.py", "test_fold_max_parity.py",
              "test_fold_path.py", "test_sharded.py", "test_bench_shards.py"], "loadfile"),
    "window": (["test_window_cpu_gpu.py", "test_window_channel.py", "test_window_max_parity.py",
                "test_window_channel_max_parity.py", "test_window_tree.py"], "load"),
    "range": (["test_range_fold.py", "test_range_verify.py", "test_range_forward.py", "test_range_tree.py"], "load"),
    "max-layers": (["test_integration_max_qwen3_5.py", "test_integration_max_qwen3_5_devices.py",
                    "test_max_conv_rollback.py"], "loadfile"),
    # Three of MAX's pipelines built side by side (411 s on an H200): a group of its own,
    # since with the layer tests beside it the group passed 465 s unfinished on an H100.
    "max-pipeline": (["test_integration_max_qwen3_5_pipeline.py"], "loadfile"),
    "max-decoding": (["test_integration_max_qwen3_5_decoding.py"], "loadfile"),
    # Three tests of four, three and five `max serve` processes of the tiny checkpoint, side
    # by side. Run it with nothing else on the machine: each server sizes its KV cache from a
    # tenth of the GPU, and beside other groups MAX's own MTP server found too little
    # (git show c9933ba:bench/results/gpu-tests-max-serve-h100-2026-12-06.txt); the three took
    # 761 s alone with 3 workers on an H100, and beside compute-sanitizer passed 900 s.
    "max-serve": (["test_integration_max_qwen3_5_serve.py"], "load"),
}


def card() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "no GPU seen by nvidia-smi"


def commit() -> str:
    """The commit that runs: ``GPU_SUITE_COMMIT`` where the tree was copied without its own
    git metadata (or with stale metadata), else what git says of the checkout."""
    named = os.environ.get("GPU_SUITE_COMMIT")
    if named:
        return named
    run = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()
    return (run.stdout.strip() or "unknown") + (" with uncommitted changes" if dirty else "")


def command(group: str, workers: int, select: str | None = None) -> list[str]:
    files, dist = GROUPS[group]
    chosen = ["-k", select] if select else []
    # -v writes each test's outcome as it ends, so a group stopped at its limit still shows
    # which of its tests ended and how; -rA names them all again in the summary.
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rA", "-p", "no:cacheprovider", "-o", "addopts=",
            "-n", str(workers), "--dist", dist, *chosen, *(f"tests/{name}" for name in files)]


def run_group(group: str, out: Path, workers: int, select: str | None = None) -> int:
    argv = command(group, workers, select)
    # A rerun of some of a group's tests never overwrites the whole group's results.
    log = out / f"gpu-tests-{group}{'-selected' if select else ''}.txt"
    started = time.monotonic()
    with log.open("w") as stream:
        stream.write(f"# {' '.join(argv[1:])}\n# {card()}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC;"
                     f" commit {commit()}\n\n")
        stream.flush()
        code = subprocess.run(argv, stdout=stream, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        stream.write(f"\n# Outcome: pytest exited {code} after {time.monotonic() - started:.0f} s\n")
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("groups", nargs="*", metavar="GROUP", help=f"one of: {', '.join(GROUPS)}")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("-k", dest="select", metavar="EXPR",
                        help="only the tests pytest's -k EXPR selects (results in gpu-tests-GROUP-selected.txt)")
    parser.add_argument("--list", action="store_true", help="print each group's files and exit")
    args = parser.parse_args()
    if args.list or not args.groups:
        for name, (files, dist) in GROUPS.items():
            print(f"{name} ({dist}): {' '.join(files)}")
        return 0
    unknown = [group for group in args.groups if group not in GROUPS]
    if unknown:
        parser.error(f"GROUP: {', '.join(unknown)} is not one of {', '.join(GROUPS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    return max(run_group(group, args.out, args.workers, args.select) for group in args.groups)


if __name__ == "__main__":
    raise SystemExit(main())
