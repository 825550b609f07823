"""The Python count of a GPU window block's shared memory against the kernel's own
(``window_static_bytes``, ``window_tile_bytes`` in mojo/window_gpu_staging.mojo), run by
the Mojo compiler on the host, so that the two cannot drift apart."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from max.dtype import DType

from gdfold_max.ops.kernels import kernel_sources, mojo_compiler
from gdfold_max.ops.shared_memory import BLOCK_SHARED_MAX, BLOCK_STATIC_LIMIT, static_bytes, tile_bytes

# (state dtype, K, column tile, fold on load): the tiles the ops default to, the widest
# they take, the padded (not boxed) tiles, and both kinds of verify.
CASES = [
    ("float32", 128, 64, True),
    ("float32", 128, 64, False),
    ("bfloat16", 128, 64, True),
    ("float32", 256, 128, True),
    ("bfloat16", 256, 256, True),
    ("float32", 64, 4, True),
    ("bfloat16", 96, 24, False),
    ("float32", 192, 256, True),
]


def _mojo() -> str:
    found = mojo_compiler()
    if found is None:
        pytest.skip("no mojo compiler on this machine")
    return found


def test_shared_memory_count_matches_the_kernels(tmp_path: Path) -> None:
    (tmp_path / "gdfold").symlink_to(kernel_sources(), target_is_directory=True)
    lines = [
        "from gdfold.window_gpu_staging import (",
        "    BLOCK_SHARED_LIMIT, BLOCK_SHARED_MAX, window_static_bytes, window_tile_bytes,",
        ")",
        "",
        "def main():",
        "    print(BLOCK_SHARED_LIMIT, BLOCK_SHARED_MAX)",
    ]
    for dtype, k, tile, fold in CASES:
        lines.append(f"    print(window_static_bytes[{k}, {tile}, {fold}](),"
                     f" window_tile_bytes[DType.{dtype}, {k}, {tile}]())")
    program = tmp_path / "sizes.mojo"
    program.write_text("\n".join(lines) + "\n")
    # Pass the environment as Python holds it, not the process's own: once MAX has run,
    # the latter can hold PYTHONEXECUTABLE and PYTHONPATH set for MAX's embedded
    # interpreter (seen under `python -m pytest` from a venv that is not activated), and
    # the compiler's launcher, a Python script, would then run outside this venv.
    run = subprocess.run([_mojo(), "run", "-I", str(tmp_path), str(program)], env=dict(os.environ),
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    printed = [tuple(int(x) for x in line.split()) for line in run.stdout.splitlines() if line.strip()]
    assert printed[0] == (BLOCK_STATIC_LIMIT, BLOCK_SHARED_MAX)
    ours = [(static_bytes(k, tile, fold_on_load=fold), tile_bytes(DType[dtype].size_in_bytes, k, tile))
            for dtype, k, tile, fold in CASES]
    assert printed[1:] == ours
