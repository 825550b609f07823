"""bench/profiling/sass_loops.py: loops found from backward branches, and a loop's
instructions outside its innermost loops counted by kind."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "profiling" / "sass_loops.py"
spec = importlib.util.spec_from_file_location("sass_loops", SCRIPT)
assert spec is not None and spec.loader is not None
sass_loops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_loops)

#: An outer loop (0x0010-0x0080) around an inner one (0x0030-0x0050).
SASS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IMAD R2, R3, 0x4, R4 ;
        /*0020*/                   LDS R5, [R2] ;
.L_x_2:
        /*0030*/                   FFMA R6, R5, R7, R6 ;
        /*0040*/                   SHFL.BFLY PT, R8, R6, 0x1, 0x1f ;
        /*0050*/               @P0 BRA `(.L_x_2) ;
        /*0060*/                   F2FP.BF16.F32.PACK_AB R9, R6, R6 ;
        /*0070*/                   STS [R2], R9 ;
        /*0080*/               @P1 BRA `(.L_x_1) ;
        /*0090*/                   EXIT ;
"""


def test_loops_and_their_kinds_outside_the_inner_loop(tmp_path: Path) -> None:
    path = tmp_path / "kernel.sass"
    path.write_text(SASS)
    instructions, labels = sass_loops.read_sass(path)
    found = sorted(sass_loops.loops(instructions, labels))
    assert found == [(0x10, 0x80), (0x30, 0x50)]
    outer = sass_loops.kinds_outside_inner(instructions, (0x10, 0x80), found)
    assert outer == {"integer, index, predicate": 1, "shared ld/st": 2, "convert, pack": 1, "control": 1}
    inner = sass_loops.kinds_outside_inner(instructions, (0x30, 0x50), found)
    assert inner == {"fp32": 1, "shuffles": 1, "control": 1}


def test_the_outer_loop_s_instructions_by_source_line(tmp_path: Path) -> None:
    """Line comments (nvdisasm -g) name the source line of the instructions after them;
    the inner loop's instructions are left out."""
    path = tmp_path / "kernel.sass"
    lines = SASS.splitlines()
    lines.insert(2, '\t//## File "./mojo/window_gpu.mojo", line 7')
    lines.insert(5, '\t//## File "./mojo/window_gpu.mojo", line 9')
    lines.insert(10, '\t//## File "./mojo/state_cast.mojo", line 3')
    path.write_text("\n".join(lines) + "\n")
    instructions, labels = sass_loops.read_sass(path)
    found = sorted(sass_loops.loops(instructions, labels))
    sources = sass_loops.source_lines(path)
    assert sources[0x10] == "window_gpu.mojo:7" and sources[0x30] == "window_gpu.mojo:9"
    rows = sass_loops.lines_outside_inner(instructions, sources, (0x10, 0x80), found)
    assert rows == [("state_cast.mojo:3", 3, 0), ("window_gpu.mojo:7", 2, 1)]
