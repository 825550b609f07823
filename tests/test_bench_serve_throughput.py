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
    for flag, value in (("--state-pool-dtype", "float32"), ("--max-batch-size", "128"), ("--port", "9000"),
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
    sized = bench["parse_args"](["--concurrency", "1", "8", "--max-batch-size", "12"])
    argv, _ = bench["serve_command"]("fused", "float32", folder, 9000, sized)
    assert argv[argv.index("--max-batch-size") + 1] == "12"
    with pytest.raises(SystemExit):
        bench["parse_args"](["--concurrency", "1", "8", "--max-batch-size", "7"])


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


def test_a_wave_of_token_0_is_named_as_no_served_step(bench: dict) -> None:
    """Greedy sampling answers NaN logits with token 0, and a server that does so accepts
    every draft: the benchmark counts each answer's token 0s and names the measurements
    that are mostly token 0 under the table."""
    assert bench["zero_tokens"]({"token_ids": [0, 9, 0, 0, 5]}) == 3
    assert bench["zero_tokens"]({"token_ids": []}) == 0
    with pytest.raises(SystemExit, match="no token_ids"):
        bench["zero_tokens"]({"text": "x"})
    results = [fake("max", "bfloat16", 1, 700.0) | {"zero_share": 1.0},
               fake("fused", "bfloat16", 1, 650.0) | {"zero_share": 0.49},
               fake("fused", "float32", 64, 5000.0) | {"zero_share": None}]
    assert bench["degenerate"](results) == ["max, bfloat16 pools, 1 concurrent: 100% of the output is token 0"]


def test_the_checkpoint_s_gated_deltanet_layers_are_an_argument(bench: dict, tmp_path: Path) -> None:
    """``--linear-layers`` sets the checkpoint's Gated DeltaNet layers (one full-attention
    layer follows), and a checkpoint reused from ``--folder`` must have them."""
    assert bench["parse_args"]([]).linear_layers == 3
    assert bench["parse_args"](["--linear-layers", "12"]).linear_layers == 12
    with pytest.raises(SystemExit):
        bench["parse_args"](["--linear-layers", "0"])
    example = runpy.run_path(str(ROOT / "examples" / "max_qwen3_5_pipeline.py"))
    example["write_checkpoint"](tmp_path, example["Shapes"](layers=3))
    assert bench["checkpoint_layers"](tmp_path) == 3
    with pytest.raises(SystemExit, match="its checkpoint has 3 layers, --linear-layers 3 asks for 4"):
        bench["main"](["--folder", str(tmp_path), "--linear-layers", "3", "--logs", str(tmp_path / "logs")])


def test_rounds_take_turns_in_both_orders_and_the_median_round_counts(bench: dict) -> None:
    assert bench["round_order"](2, 4) == [[0, 1], [1, 0], [0, 1], [1, 0]]
    assert bench["round_order"](1, 2) == [[0], [0]]
    runs = [fake("fused", "bfloat16", 8, rate) for rate in (300.0, 100.0, 200.0)]
    median = bench["median_round"](runs)
    assert median["tokens_per_s"] == 200.0 and median["seconds"] == pytest.approx(5.0)
    assert median["rounds"] == [300.0, 100.0, 200.0]
    assert bench["median_round"](runs[:2])["tokens_per_s"] == 100.0  # the lower middle of an even count
    assert bench["parse_args"](["--rounds", "5"]).rounds == 5 and bench["parse_args"]([]).rounds == 3
    with pytest.raises(SystemExit):
        bench["parse_args"](["--rounds", "0"])


def test_print_commands_needs_no_gpu(bench: dict, capsys: pytest.CaptureFixture[str]) -> None:
    bench["main"](["--print-commands", "--routes", "max", "fused", "--pools", "bfloat16"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert "--custom-architectures" not in lines[0] and lines[1].startswith("GDFOLD_MAX_QWEN3_5=fused ")


@pytest.mark.parametrize("which", ["tiny", "next-shapes"])
def test_max_s_rotary_embedding_takes_the_checkpoint_s_mrope_sections(bench: dict, which: str) -> None:
    """MAX's Qwen3.5 rotary embedding, built from the config the example writes as MAX's
    ``Qwen3_5`` builds it (``qwen3_5/qwen3_5.py:381``), accepts its mrope sections for
    the tiny checkpoint and for the benchmark's full-attention heads of 256 (they must sum
    to half the rotary dimension: ``qwen3_5/layers/text_rotary.py``)."""
    from max.pipelines.architectures.qwen3_5.layers.text_rotary import Qwen3_5TextRotaryEmbedding

    example = runpy.run_path(str(bench["EXAMPLE"]))
    shapes = example["TINY"] if which == "tiny" else example["Shapes"](**bench["SHAPES"])
    config = example["hf_config"](shapes)
    text = config.get("text_config", config)
    rope = text["rope_parameters"]
    rotary_dim = int(text["head_dim"] * rope["partial_rotary_factor"])
    embedding = Qwen3_5TextRotaryEmbedding(dim=text["hidden_size"], n_heads=text["num_attention_heads"],
                                           theta=rope["rope_theta"], max_seq_len=text["max_position_embeddings"],
                                           mrope_section=rope["mrope_section"], head_dim=rotary_dim)
    assert sum(embedding.mrope_section) == rotary_dim // 2


def test_step_stats_read_max_s_batch_lines_with_and_without_overlap(bench: dict) -> None:
    """With --step-stats every server logs every batch, and a wave's step and batch
    creation come from the lines of token-generation batches at its concurrency (the
    lines' formats as MAX 26.7's scheduler writes them, max/serve/scheduler/utils.py)."""
    args = bench["parse_args"](["--step-stats"])
    _, env = bench["serve_command"]("fused", "bfloat16", Path("/ckpt"), 9000, args, environ={})
    assert env["MAX_SERVE_SCHEDULER_STATS_LOG_INTERVAL_S"] == "0"
    _, env = bench["serve_command"]("fused", "bfloat16", Path("/ckpt"), 9000, bench["parse_args"]([]), environ={})
    assert "MAX_SERVE_SCHEDULER_STATS_LOG_INTERVAL_S" not in env
    log = "\n".join([
        # Overlap: the enqueued batch's creation, the completed batch's execution.
        "00:50:45.837 INFO: Enqueued TG batch with 8 reqs | Pending: 0 reqs | Input Tokens: 8/8192 toks | Batch"
        " creation: 424.06us | Completed TG batch with 8 reqs | Terminated: 0 reqs | Execution: 7.11ms | x",
        "00:50:46.000 INFO: Enqueued TG batch with 8 reqs | Batch creation: 1.20ms | Completed TG batch with 7 reqs"
        " | Execution: 9.00ms | x",
        # Without overlap one clause holds both.
        "00:50:47.000 INFO: Executed TG batch with 8 reqs | Terminated: 0 reqs, Pending: 0 reqs | Batch creation:"
        " 2.00ms, Execution: 1.05s | x",
        # A context-encoding batch and another concurrency count for nothing.
        "00:50:48.000 INFO: Executed CE batch with 8 reqs | Batch creation: 9.00ms, Execution: 90.00ms | x",
        "00:50:49.000 INFO: Enqueued TG batch with 3 reqs | Batch creation: 5.00ms | x",
    ])
    assert bench["step_stats"](log, 8) == {"step_ms": 528.555, "creation_ms": 1.2, "steps": 2}
    assert bench["step_stats"](log, 64) == {"step_ms": None, "creation_ms": None, "steps": 0}
