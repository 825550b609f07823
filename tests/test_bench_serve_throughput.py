"""The served throughput benchmark (``bench/integrations/serve_throughput.py``) without a
GPU: its arguments, the server command of each route and pool, and the table and ratios
from made-up timings. What it measures needs a GPU and is not run here."""

from __future__ import annotations

import io
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "integrations" / "serve_throughput.py"


@pytest.fixture(scope="module")
def bench() -> dict[str, Any]:
    return runpy.run_path(str(SCRIPT))


def test_help_runs_without_max_or_a_gpu() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for flag in ("--routes", "--pools", "--concurrency", "--prompt-len", "--output-len", "--json"):
        assert flag in run.stdout


def test_arguments_default_to_every_route_both_pools_and_1_8_64(bench: dict) -> None:
    args = bench["parse_args"]([])
    assert (args.routes, args.pools, args.concurrency) == (["max", "fold", "fused"], ["bfloat16", "float32"],
                                                           [1, 8, 64])
    args = bench["parse_args"](["--routes", "fused", "--pools", "float32", "--concurrency", "2", "4"])
    assert (args.routes, args.pools, args.concurrency) == (["fused"], ["float32"], [2, 4])
    for bad in (["--routes", "mine"], ["--pools", "float16"], ["--concurrency", "0"]):
        with pytest.raises(SystemExit):
            bench["parse_args"](bad)


def test_each_route_serves_the_same_checkpoint_and_flags(bench: dict) -> None:
    args = bench["parse_args"](["--output-len", "100", "--prompt-len", "20", "--drafts", "3"])
    folder = Path("/ckpt")
    commands = {route: bench["serve_command"](route, "float32", folder, 9000, args, environ={"GDFOLD_MAX_QWEN3_5": "x"})
                for route in ("max", "fold", "fused")}
    argv, env = commands["max"]
    assert "--custom-architectures" not in argv and "GDFOLD_MAX_QWEN3_5" not in env
    for flag, value in (("--state-pool-dtype", "float32"), ("--max-batch-size", "64"), ("--port", "9000"),
                        ("--speculative-method", "mtp"), ("--num-speculative-tokens", "3"),
                        ("--quantization-encoding", "bfloat16"), ("--max-length", "256")):
        assert argv[argv.index(flag) + 1] == value
    for route in ("fold", "fused"):
        ours, ours_env = commands[route]
        assert ours[:len(argv)] == argv
        assert ours[len(argv):] == ["--custom-architectures", "gdfold_max.integrations.max_qwen3_5_serve"]
        assert ours_env["GDFOLD_MAX_QWEN3_5"] == route
    with pytest.raises(ValueError):
        bench["serve_command"]("max", "float16", folder, 9000, args)


def test_servers_started_together_share_the_memory_asked_for(bench: dict) -> None:
    """Side by side every server sizes its KV cache from the whole GPU's free memory, so
    each is given its share of --memory; one at a time each has it all."""
    folder = Path("/ckpt")
    alone = bench["parse_args"](["--memory", "0.6"])
    together = bench["parse_args"](["--memory", "0.6", "--start-together"])
    shared = bench["parse_args"](["--memory", "0.6", "--start-together", "--routes", "max", "fused",
                                  "--pools", "bfloat16"])
    for args, utilization in ((alone, "0.6"), (together, "0.1"), (shared, "0.3")):
        argv, _ = bench["serve_command"]("fused", "bfloat16", folder, 9000, args)
        assert argv[argv.index("--device-memory-utilization") + 1] == utilization


def fake(route: str, pool: str, concurrency: int, tokens_per_s: float) -> dict:
    return {"route": route, "pool": pool, "concurrency": concurrency, "requests": 4 * concurrency,
            "output_tokens": 1000, "seconds": 1000 / tokens_per_s, "tokens_per_s": tokens_per_s}


def test_the_table_gives_ours_over_max_per_pool_and_concurrency(bench: dict) -> None:
    from rich.console import Console

    results = [fake("max", "float32", 8, 400.0), fake("fused", "float32", 8, 500.0), fake("fold", "float32", 8, 380.0),
               fake("max", "bfloat16", 1, 100.0), fake("fused", "bfloat16", 1, 125.0)]
    rows = bench["rows"](results)
    assert [(r["pool"], r["concurrency"]) for r in rows] == [("bfloat16", 1), ("float32", 8)]
    assert rows[0]["fused/max"] == pytest.approx(1.25) and rows[0]["fold/max"] is None and rows[0]["fold"] is None
    assert rows[1]["fused/max"] == pytest.approx(1.25) and rows[1]["fold/max"] == pytest.approx(0.95)
    out = io.StringIO()
    Console(file=out, width=200).print(bench["table"](results))
    text = out.getvalue()
    for cell in ("MAX", "fused / MAX", "1.250", "0.950", "400.0", "125.0"):
        assert cell in text
    assert bench["rate"](10, 0.0) != bench["rate"](10, 0.0)  # NaN, not a division error
    line = bench["header"](["serve_throughput.py", "--pools", "float32"], "NVIDIA H100", "2026-12-06", "abc1234")
    assert line == "# serve_throughput.py --pools float32 | GPU: NVIDIA H100 | 2026-12-06 | commit abc1234"


def test_print_commands_needs_no_gpu(bench: dict, capsys: pytest.CaptureFixture[str]) -> None:
    bench["main"](["--print-commands", "--routes", "max", "fused", "--pools", "bfloat16"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert "--custom-architectures" not in lines[0] and lines[1].startswith("GDFOLD_MAX_QWEN3_5=fused ")
