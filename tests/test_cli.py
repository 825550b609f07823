"""The command line: record a case, check it, and see a tampered one fail."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import CONFORMANCE_DIR
from gdfold_max.cases import FoldCase
from gdfold_max.cli import app

runner = CliRunner()


def test_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    # Each command's own line: its name first in the commands box, then its description.
    listed = {m.group(1): m.group(2) for m in re.finditer(r"^│ (\S+) +(\S.*?) *│$", result.output, flags=re.M)}
    assert listed.keys() >= {"demo", "check", "record", "bench", "bench-step"}
    assert listed["demo"].startswith("Fold a random verify step")
    assert listed["check"].startswith("Fold a recorded case")
    assert listed["record"].startswith("Write a recorded case")
    assert listed["bench"].startswith("Time our fold")
    assert listed["bench-step"].startswith("Time one decoding step")


def table_rows(output: str) -> list[list[str]]:
    """The body rows of the rich table ``check`` prints, cell by cell."""
    rows = []
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 7 and cells[0].isdigit():
            rows.append(cells)
    return rows


def test_record_then_check_passes(tmp_path: Path) -> None:
    path = tmp_path / "case.npz"
    result = runner.invoke(app, ["record", str(path), "--layers", "2", "--batch", "3", "--seed", "4"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 0, result.output
    assert "all rows match bit for bit" in result.output


def test_record_bf16_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "case.npz"
    assert runner.invoke(app, ["record", str(path), "--state-dtype", "bfloat16", "--k", "128", "--v", "128",
                               "--nv", "8", "--ring-len", "2", "--verify-width", "1"]).exit_code == 0
    case = FoldCase.load(path)
    assert case.state_in.dtype.name == "bfloat16"
    assert runner.invoke(app, ["check", str(path)]).exit_code == 0


def test_check_reports_a_mismatch(tmp_path: Path) -> None:
    case = FoldCase.load(CONFORMANCE_DIR / "public_case_a.npz")
    row = int(case.row_ids[1, 0])
    case.state_out[row, 0, 0, :3] = np.nextafter(case.state_out[row, 0, 0, :3], np.float32(np.inf))
    path = tmp_path / "tampered.npz"
    case.save(path)
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 1
    assert "mismatch" in result.output
    rows = table_rows(result.output)
    assert len(rows) == case.row_ids.size
    for layer, request, pool_row, _accepted, match, differing, largest in rows:
        if (int(layer), int(request)) == (1, 0):
            # The tampered row, and only it: three elements, one ulp each.
            assert (int(pool_row), match, differing) == (row, "no", "3")
            assert float(largest) > 0
        else:
            assert (match, differing, largest) == ("yes", "0", "0"), (layer, request)


def test_bench_step_says_it_needs_a_gpu() -> None:
    from max.driver import accelerator_count

    if accelerator_count() > 0:
        pytest.skip("this machine has a GPU")
    result = runner.invoke(app, ["bench-step", "--batches", "1"])
    assert result.exit_code == 2
    assert "bench-step needs a GPU" in result.output


@pytest.mark.parametrize("command", ["bench", "bench-step"])
def test_bench_refuses_an_unknown_dtype(command: str) -> None:
    result = runner.invoke(app, [command, "--dtypes", "float32,float16", "--batches", "1"])
    assert result.exit_code == 2, result.output
    assert "--dtypes" in result.output and "float16" in result.output


def test_bench_step_refuses_an_unknown_gpu_path() -> None:
    result = runner.invoke(app, ["bench-step", "--device", "cpu", "--gpu-path", "fast", "--batches", "1"])
    assert result.exit_code == 2, result.output
    assert "--gpu-path" in result.output and "fast" in result.output


@pytest.mark.parametrize("window", ["0", "33"])
def test_bench_step_refuses_a_window_outside_the_ring(window: str) -> None:
    result = runner.invoke(app, ["bench-step", "--device", "cpu", "--window", window, "--batches", "1"])
    assert result.exit_code == 2, result.output
    assert "--window" in result.output and f"{window} is not in 1 to 32" in result.output


@pytest.mark.parametrize(("tree", "message"), [
    ("33x6", "has 33 nodes;"),
    ("8x1", "has depth 1; give 2 to 8"),
    ("16-5", "is not NODESxDEPTH"),
])
def test_bench_step_refuses_a_tree_it_cannot_time(tree: str, message: str) -> None:
    result = runner.invoke(app, ["bench-step", "--device", "cpu", "--tree", tree, "--batches", "1"])
    assert result.exit_code == 2, result.output
    assert "--tree" in result.output and message in " ".join(result.output.split())


def test_bench_step_tree_refuses_the_window_kernel_options() -> None:
    result = runner.invoke(app, ["bench-step", "--device", "cpu", "--tree", "8x4", "--gpu-path", "latency",
                                 "--batches", "1"])
    assert result.exit_code == 2, result.output
    assert "--tree" in result.output and "--gpu-path" in result.output


def test_bench_step_times_max_s_verify_only_at_its_compiled_ring_lengths() -> None:
    """MAX 26.7 compiles its ring kernels for RING_LEN 2, 4 and 8; its forward (the plain
    decoding op) runs at every window; no MAX op on the CPU."""
    from gdfold_max.bench.step import step_variants

    assert step_variants("head", 4, on_gpu=True) == ("max", "max-forward", "ours", "fused", "forward")
    for window in (1, 3, 16):
        assert step_variants("head", window, on_gpu=True) == ("max-forward", "ours", "fused", "forward")
    assert step_variants("head", 8, on_gpu=False) == ("ours", "fused", "forward")
    assert step_variants("channel", 1, on_gpu=True) == ("kda", "ours", "fused", "forward")
    assert step_variants("channel", 16, on_gpu=False) == ("ours", "fused", "forward")
    with pytest.raises(ValueError, match="window: 33 is not in 1 to 32"):
        step_variants("head", 33, on_gpu=True)


def test_benchmark_shapes_per_gate() -> None:
    from gdfold_max.bench.harness import FoldShape

    kimi = FoldShape.for_gate("channel")
    assert (kimi.num_layers, kimi.num_value_heads, kimi.num_key_heads, kimi.key_dim, kimi.value_dim) == (
        20, 32, 32, 128, 128)
    assert kimi.layout.elements == 128 + 128 + 128 and FoldShape.for_gate("head") == FoldShape()


def test_importing_the_package_and_the_cli_loads_no_benchmark() -> None:
    """The benchmarks (``gdfold_max.bench``) are no part of the product: ``import gdfold_max``
    and ``gdfold_max.cli`` load none of them; the bench commands import theirs when they run."""
    code = ("import sys, gdfold_max, gdfold_max.cli; print(sorted(m for m in sys.modules"
            " if m == 'gdfold_max.bench' or m.startswith('gdfold_max.bench.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(("variants", "message"), [
    ("tree,forest", "'forest' is not one of"),
    ("chain,chain", "'chain' is given twice"),
])
def test_bench_step_refuses_tree_variants_it_does_not_have(variants: str, message: str) -> None:
    result = runner.invoke(app, ["bench-step", "--device", "cpu", "--tree", "8x4", "--tree-variants", variants,
                                 "--batches", "1"])
    assert result.exit_code == 2, result.output
    assert "--tree-variants" in result.output and message in " ".join(result.output.split())


def test_bench_step_takes_tree_variants_only_with_a_tree() -> None:
    result = runner.invoke(app, ["bench-step", "--device", "cpu", "--tree-variants", "tree", "--batches", "1"])
    assert result.exit_code == 2, result.output
    assert "--tree-variants" in result.output and "give --tree too" in " ".join(result.output.split())
