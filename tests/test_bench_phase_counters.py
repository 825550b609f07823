"""bench/profiling/phase_counters.py without a GPU: its patch of the throughput kernel
applies to this checkout's kernels (every phase marked, each mark where it belongs), the
patched package builds for sm_90a, and a kernel that has moved on stops the patch with
the line it could not find. What the counters measure needs a GPU."""

from __future__ import annotations

import re
import runpy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "profiling" / "phase_counters.py"


@pytest.fixture(scope="module")
def tool() -> dict[str, Any]:
    return runpy.run_path(str(SCRIPT), run_name="phase_counters")


def test_every_phase_is_marked_where_it_belongs(tool: dict, tmp_path: Path) -> None:
    kernel = (tool["patched_kernels"](ROOT / "mojo", tmp_path) / "window_gpu.mojo").read_text()
    phases = tool["PHASES"]
    assert len(phases) <= 8  # the kernel's one SIMD[uint32, 8] of counters
    marks = [int(m) for m in re.findall(r"end_phase\((\d)\)", kernel)]
    assert sorted(set(marks)) == list(range(len(phases)))
    # The wait for a later record chunk and its staging are counted apart from the fold's
    # arithmetic: the fold's mark closes a chunk's fold, phase 7's the later chunk's staging.
    loop = kernel[kernel.index("# 3. Fold on load"):kernel.index("# 4. The window")]
    assert loop.index("fold_staged_records") < loop.index("end_phase(3)") < loop.index("stage_record_keys")
    assert loop.index("stage_record_keys") < loop.index("end_phase(7)")
    assert kernel.rstrip().endswith(tool["FINISH"].rstrip())


def test_a_kernel_that_has_moved_on_stops_the_patch(tool: dict, tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(ROOT / "mojo", moved)
    kernel = moved / "window_gpu.mojo"
    kernel.write_text(kernel.read_text().replace("# the later chunk's keys are in lane-major order", "# moved"))
    with pytest.raises(SystemExit, match="expected one line \"barrier\\(\\)  # the later chunk's keys"):
        tool["patched_kernels"](moved, tmp_path / "out")


@pytest.mark.skipif(shutil.which("mojo") is None, reason="needs the mojo compiler")
def test_the_patched_kernels_build_for_sm_90a(tool: dict, tmp_path: Path) -> None:
    """The launches of bench/profiling/launch_build.mojo (the throughput kernel's fold on
    load among them) compiled for sm_90a against the patched package."""
    tool["patched_kernels"](ROOT / "mojo", tmp_path)
    shutil.copy(ROOT / "bench" / "profiling" / "launch_build.mojo", tmp_path)
    run = subprocess.run(["mojo", "build", "--target-accelerator", "sm_90a", "-I", ".", "launch_build.mojo", "-o",
                          str(tmp_path / "launch_build")], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
