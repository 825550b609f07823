"""Output tokens per second of ``max serve`` on Qwen3.5 with MTP: MAX's own pipeline, our
fold-only route and our fused route, with bf16 and fp32 state pools, at 1, 8 and 64
concurrent requests.

Writes a random-weight Qwen3.5-with-MTP checkpoint with Qwen3-Next-80B's Gated DeltaNet
shapes (nv 32, nk 16, K = V = 128, hidden 2048; ``--linear-layers`` Gated DeltaNet layers,
three by default, and one full-attention layer, a small MLP and vocabulary, so it builds
quickly) with the writer of
``examples/max_qwen3_5_pipeline.py``, then serves it once per route and pool, one server
at a time, each timed alone (with ``--start-together`` every server starts at once, so
their graphs compile side by side, and each is timed alone while the others idle):

* ``max``: ``max serve --speculative-method mtp`` (MAX's ``unified_mtp_qwen3_5``);
* ``fold``: the same with ``--custom-architectures gdfold_max.integrations.max_qwen3_5_serve``
  and ``GDFOLD_MAX_QWEN3_5=fold`` (MAX's pipeline, its rollback folding with our fold);
* ``fused``: ``GDFOLD_MAX_QWEN3_5=fused`` (our verify with fold on load, no rollback fold).

The state pool dtype: MAX 26.7 stores Qwen3.5's conv and recurrent pools at
``Qwen3_5Config.state_dtype``: ``--state-pool-dtype`` (``KVCacheConfig.state_pool_dtype``)
when given, else the dtype the checkpoint's config declares, else bf16
(``qwen3_5/model_config.py``, ``declared_state_dtype`` and ``state_dtype``). The checkpoint
here is bf16, and each server is given ``--state-pool-dtype`` explicitly. The verify ring
is fp32 either way (``state_cache.RING_DTYPE``).

Each server: started, ``/health`` awaited, then for each concurrency one untimed wave of
that many requests, then ``--waves`` waves timed: every request greedy (``temperature
0``), ``ignore_eos``, the same prompt length and ``max_tokens``, at most ``concurrency``
in flight. Tokens per second is the output tokens the server reports (``usage``) over
the wall time from the first request sent to the last answer. Each server is timed in
``--rounds`` rounds; servers started together take their turns in each round, the order
reversed every other round (so that no route is always timed first). Each figure is the
median round's; the JSON keeps every round's rate. The weights are random, so
the drafts are almost never accepted: the table compares the cost of a served step, not
a speculative speed-up. Every answer's token ids are read back, and each wave reports the
share of its output tokens that are token 0 (``zero_share``): greedy sampling gives token 0
for NaN logits, and a server that answers with it throughout accepts every draft (token 0
again), so each of its steps keeps every draft and its rate is not a served step's. Such rows are
named under the table.

More Gated DeltaNet layers make the state ops a larger share of a served step (each layer
runs them once a step; the rest of the step, attention, the MTP head, the sampler and the
scheduler, stays).

With ``--step-stats`` each server logs every batch (MAX's scheduler statistics at an
interval of 0 s, ``MAX_SERVE_SCHEDULER_STATS_LOG_INTERVAL_S``), and each timed wave also
reports, from the lines its server logged meanwhile, the median ``Execution`` of its
token-generation batches at the full concurrency (a served step: the time MAX's scheduler
measures from a batch's launch to its results) and the median ``Batch creation`` (the
scheduler's host work for a batch), so that a difference in throughput can be placed on
the device's step or on the host's. The logging costs every server alike.

Prints a header line (command, GPU, date, commit) and one table, the ratio ours / MAX
per route, and writes the same as JSON. Needs a GPU; ``--print-commands`` prints the
server commands and stops.

    python bench/integrations/serve_throughput.py [--concurrency 1 8 64] [--pools bfloat16 float32]
        [--routes max fold fused] [--linear-layers 3] [--prompt-len 128] [--output-len 256] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import runpy
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "max_qwen3_5_pipeline.py"
MODULE = "gdfold_max.integrations.max_qwen3_5_serve"
ROUTES = ("max", "fold", "fused")
OURS = ("fold", "fused")
POOLS = ("bfloat16", "float32")
#: The checkpoint's sizes (``Shapes`` of the example): Qwen3-Next-80B's Gated DeltaNet and
#: full-attention heads, the rest small.
SHAPES = {"hidden": 2048, "layers": 4, "vocab": 2048, "key_heads": 16, "value_heads": 32, "head_dim": 128,
          "ffn": 1024, "attention_heads": 16, "kv_heads": 2, "attention_head_dim": 256, "dtype": "bfloat16"}
SERVED_NAME = "qwen3_5-next-shapes"
#: MAX's scheduler logs its batch statistics at most this often (seconds; default 3).
STATS_INTERVAL = "MAX_SERVE_SCHEDULER_STATS_LOG_INTERVAL_S"
#: A token-generation batch's execution (``Executed`` without overlap, ``Completed`` with
#: it) and its creation (``Executed`` or ``Enqueued``), as MAX's scheduler logs them
#: (``max/serve/scheduler/utils.py``, ``to_human_readable_latency``'s units).
EXECUTION = re.compile(r"(?:Executed|Completed) TG batch with (\d+) reqs.*?Execution: ([\d.]+)(ns|us|ms|s)\b")
CREATION = re.compile(r"(?:Executed|Enqueued) TG batch with (\d+) reqs.*?Batch creation: ([\d.]+)(ns|us|ms|s)\b")
MS_PER = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    parser.add_argument("--pools", nargs="+", choices=POOLS, default=list(POOLS), help="state pool dtypes")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--linear-layers", type=int, default=SHAPES["layers"] - 1,
                        help="the checkpoint's Gated DeltaNet layers (then one full-attention layer)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--waves", type=int, default=4, help="timed requests per concurrency = waves * concurrency")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times each server is timed (in turn with the others); the median counts")
    parser.add_argument("--drafts", type=int, default=3, help="--num-speculative-tokens")
    parser.add_argument("--memory", type=float, default=0.8, help="--device-memory-utilization")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="the servers' --max-batch-size (default: twice the largest --concurrency: MAX 26.7"
                             " sizes the cache for this many requests but then builds it with the draft's attention"
                             " cache too, and servers sized for exactly 64 preempted requests at 64)")
    parser.add_argument("--folder", type=Path, help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--logs", type=Path, default=Path("serve-throughput-logs"),
                        help="where the servers' logs go (default: serve-throughput-logs here)")
    parser.add_argument("--json", type=Path, help="JSON output (default: serve-throughput-DATE.json here)")
    parser.add_argument("--ready-s", type=float, default=1800.0, help="how long a server may take to start")
    parser.add_argument("--print-commands", action="store_true", help="print the server commands and stop")
    parser.add_argument("--step-stats", action="store_true",
                        help="servers log every batch; each wave reports its median step and batch creation")
    parser.add_argument("--start-together", action="store_true",
                        help="start every server at once (their graphs compile side by side on the host's cores),"
                             " each with --memory shared out among them, then time them one at a time while the"
                             " others idle")
    args = parser.parse_args(argv)
    if (min(args.concurrency) < 1 or args.waves < 1 or args.prompt_len < 1 or args.output_len < 1 or args.rounds < 1
            or args.linear_layers < 1):
        parser.error("--concurrency, --waves, --rounds, --linear-layers, --prompt-len and --output-len must be"
                     " positive")
    if args.max_batch_size is None:
        args.max_batch_size = 2 * max(args.concurrency)
    elif args.max_batch_size < max(args.concurrency):
        parser.error(f"--max-batch-size: {args.max_batch_size} is below the largest --concurrency,"
                     f" {max(args.concurrency)}")
    return args


def max_length(args: argparse.Namespace) -> int:
    """The servers' ``--max-length``: a prompt, its output and two verify windows of slack,
    rounded up to a multiple of 256."""
    needed = args.prompt_len + args.output_len + 2 * (args.drafts + 1)
    return -(-needed // 256) * 256


def server_memory(args: argparse.Namespace) -> float:
    """Each server's ``--device-memory-utilization``: ``--memory``, or with
    ``--start-together`` its share among the servers (each sizes its KV cache from the free
    memory it sees when it starts, and side by side they all see the whole GPU)."""
    servers = len(args.routes) * len(args.pools) if args.start_together else 1
    return round(args.memory / servers, 3)


def serve_command(route: str, pool: str, folder: Path, port: int, args: argparse.Namespace,
                  environ: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The ``max serve`` command line and environment of one server."""
    from gdfold_max.integrations.max_qwen3_5_serve.server import max_command

    if route not in ROUTES or pool not in POOLS:
        raise ValueError(f"route {route!r}, pool {pool!r}")
    argv = [*max_command(), "serve", "--model-path", str(folder), "--weight-path", str(folder / "model.safetensors"),
            "--quantization-encoding", "bfloat16", "--state-pool-dtype", pool,
            "--max-length", str(max_length(args)),
            "--max-batch-size", str(args.max_batch_size), "--device-memory-utilization", str(server_memory(args)),
            "--no-device-graph-capture", "--speculative-method", "mtp", "--num-speculative-tokens", str(args.drafts),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME]
    env = dict(os.environ if environ is None else environ)
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MAX_SERVE_DISABLE_TELEMETRY": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))}
    env.pop("GDFOLD_MAX_QWEN3_5", None)
    if args.step_stats:
        env[STATS_INTERVAL] = "0"
    if route in OURS:
        argv += ["--custom-architectures", MODULE]
        env["GDFOLD_MAX_QWEN3_5"] = route
    return argv, env


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Fixed token-id prompts (ordinary tokens only: below the special ones)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, length)] for _ in range(count)]


def rate(output_tokens: int, seconds: float) -> float:
    return output_tokens / seconds if seconds > 0 else float("nan")


def step_stats(log_text: str, concurrency: int) -> dict[str, Any]:
    """The median execution and creation, in ms to the µs, of the token-generation
    batches of ``concurrency`` requests among a server's log lines, and how many there were.

    >>> lines = ("Enqueued TG batch with 8 reqs | Batch creation: 424.06us | Completed TG batch with 8 reqs"
    ...          " | Execution: 7.11ms | x\\nExecuted TG batch with 8 reqs | Batch creation: 1.50ms, Execution: 6.90ms"
    ...          " | x\\nEnqueued TG batch with 3 reqs | Batch creation: 2.00ms | x")
    >>> step_stats(lines, 8)
    {'step_ms': 7.005, 'creation_ms': 0.962, 'steps': 2}
    """
    def medians(pattern: re.Pattern[str]) -> list[float]:
        return [float(m[2]) * MS_PER[m[3]] for m in pattern.finditer(log_text) if int(m[1]) == concurrency]

    steps, created = medians(EXECUTION), medians(CREATION)
    return {"step_ms": round(statistics.median(steps), 3) if steps else None,
            "creation_ms": round(statistics.median(created), 3) if created else None, "steps": len(steps)}


def round_order(servers: int, rounds: int) -> list[list[int]]:
    """The order servers are timed in each round: in turn, reversed every other round.

    >>> round_order(3, 3)
    [[0, 1, 2], [2, 1, 0], [0, 1, 2]]
    """
    return [list(range(servers))[::-1 if r % 2 else 1] for r in range(rounds)]


def median_round(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One concurrency's measurements over the rounds: the median round's (the lower of
    the two middle ones for an even count), with every round's rate kept in ``rounds``."""
    rates = [r["tokens_per_s"] for r in runs]
    middle = statistics.median_low(rates)
    return {**runs[rates.index(middle)], "rounds": rates}


def rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (pool, concurrency): each route's tokens per second and ours / MAX."""
    by_key: dict[tuple[str, int], dict[str, float]] = {}
    for r in results:
        by_key.setdefault((r["pool"], r["concurrency"]), {})[r["route"]] = r["tokens_per_s"]
    out = []
    for (pool, concurrency), rates in sorted(by_key.items(), key=lambda kv: (POOLS.index(kv[0][0]), kv[0][1])):
        row: dict[str, Any] = {"pool": pool, "concurrency": concurrency}
        for route in ROUTES:
            row[route] = rates.get(route)
        for route in OURS:
            mine, theirs = rates.get(route), rates.get("max")
            row[f"{route}/max"] = mine / theirs if mine is not None and theirs else None
        out.append(row)
    return out


def table(results: Sequence[dict[str, Any]], title: str = "output tokens per second") -> Any:
    """The rich table of :func:`rows`."""
    from rich.table import Table

    t = Table(title=title)
    t.add_column("pool")
    t.add_column("concurrent", justify="right")
    for name in ("MAX", "fold", "fold / MAX", "fused", "fused / MAX"):
        t.add_column(name, justify="right")

    def tps(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    for row in rows(results):
        t.add_row(row["pool"], str(row["concurrency"]), tps(row["max"]), tps(row["fold"]), ratio(row["fold/max"]),
                  tps(row["fused"]), ratio(row["fused/max"]))
    return t


def degenerate(results: Sequence[dict[str, Any]], share: float = 0.5) -> list[str]:
    """The measurements whose output is mostly token 0 (:func:`zero_tokens`), one line each.

    >>> degenerate([{"route": "max", "pool": "bfloat16", "concurrency": 8, "zero_share": 0.97},
    ...             {"route": "fused", "pool": "float32", "concurrency": 8, "zero_share": 0.0}])
    ['max, bfloat16 pools, 8 concurrent: 97% of the output is token 0']
    """
    return [f"{r['route']}, {r['pool']} pools, {r['concurrency']} concurrent: {r['zero_share']:.0%} of the output"
            " is token 0" for r in results if (r.get("zero_share") or 0) >= share]


def header(argv: Sequence[str], gpu: str, date: str, commit: str) -> str:
    return f"# {shlex.join(argv)} | GPU: {gpu} | {date} | commit {commit}"


def gpu_name() -> str:
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
        names = [line.strip() for line in run.stdout.splitlines() if line.strip()]
        return names[0] if names else "unknown GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"


def commit() -> str:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


def zero_tokens(choice: dict[str, Any]) -> int:
    """How many of an answer's output tokens are token 0 (``return_token_ids``: MAX's
    ``token_ids`` are the ids the sampler committed, ``max/serve/schemas/openai.py``).

    >>> zero_tokens({"token_ids": [5, 0, 7, 0]})
    2
    """
    ids = choice.get("token_ids")
    if ids is None:
        raise SystemExit(f"no token_ids in the answer: {str(choice)[:500]}")
    return sum(int(t) == 0 for t in ids)


async def wave(client: Any, url: str, batch: list[list[int]], output_len: int,
               concurrency: int) -> tuple[int, int, float]:
    """Sends ``batch``, at most ``concurrency`` in flight; returns the output tokens the
    server reports, how many of them are token 0, and the seconds from the first send to
    the last answer."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> tuple[int, int]:
        async with gate:
            reply = await client.post(url + "/v1/completions", json={
                "model": SERVED_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
        if reply.status_code != 200:
            raise SystemExit(f"completion failed ({reply.status_code}): {reply.text[:2000]}")
        answer = reply.json()
        tokens = int(answer["usage"]["completion_tokens"])
        if tokens != output_len:
            print(f"warning: {tokens} output tokens, {output_len} asked", file=sys.stderr)
        return tokens, zero_tokens(answer["choices"][0])

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in batch))
    return sum(c[0] for c in counts), sum(c[1] for c in counts), time.perf_counter() - started


async def measure_server(url: str, args: argparse.Namespace, vocab: int, log: Path) -> list[dict[str, Any]]:
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        for concurrency in args.concurrency:
            await wave(client, url, prompts(concurrency, args.prompt_len, vocab, seed=1000 + concurrency),
                       args.output_len, concurrency)
            timed = prompts(args.waves * concurrency, args.prompt_len, vocab, seed=concurrency)
            logged = log.stat().st_size
            tokens, zeros, seconds = await wave(client, url, timed, args.output_len, concurrency)
            result = {"concurrency": concurrency, "requests": len(timed), "output_tokens": tokens,
                      "seconds": seconds, "tokens_per_s": rate(tokens, seconds),
                      "zero_share": zeros / tokens if tokens else None}
            line = (f"  {concurrency:>3} concurrent: {tokens} tokens in {seconds:.2f} s,"
                    f" {rate(tokens, seconds):,.1f} tokens/s, {result['zero_share'] or 0:.0%} token 0")
            if args.step_stats:
                await asyncio.sleep(0.5)  # the last batch's line
                with log.open("rb") as stream:
                    stream.seek(logged)
                    stats = step_stats(stream.read().decode(errors="replace"), concurrency)
                result |= stats
                if stats["steps"]:
                    line += (f"; {stats['steps']} steps of {concurrency}: {stats['step_ms']:.2f} ms a step,"
                             f" {stats['creation_ms']:.2f} ms batch creation (medians)")
            out.append(result)
            print(line, flush=True)
    return out


def serve_and_measure(pairs: Sequence[tuple[str, str]], folder: Path, copies: Path, logs: Path,
                      args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """The servers of these (route, pool) pairs started at once, awaited together, then
    timed one at a time while the others idle. A lone server serves ``folder``; side by
    side each serves its own copy under ``copies`` (MAX caches a checkpoint's config per
    folder)."""
    from gdfold_max.integrations.max_qwen3_5_serve.server import free_port, running, wait_ready

    with contextlib.ExitStack() as stack:
        servers, ports = [], set()
        for route, pool in pairs:
            served = folder
            if len(pairs) > 1:
                served = copies / f"{folder.name}-{route}-{pool}"
                if not served.exists():
                    shutil.copytree(folder, served)
            port = free_port()
            while port in ports:
                port = free_port()
            ports.add(port)
            argv, env = serve_command(route, pool, served, port, args)
            log = logs / f"{route}-{pool}.log"
            proc = stack.enter_context(running(argv, env, log))
            servers.append((route, pool, f"http://127.0.0.1:{port}", proc, log))
        started = time.perf_counter()

        async def all_ready() -> None:
            await asyncio.gather(*(wait_ready(url, proc, log, args.ready_s) for _, _, url, proc, log in servers))

        asyncio.run(all_ready())
        names = "; ".join(f"{route}, {pool} pools" for route, pool in pairs)
        print(f"{names}: ready in {time.perf_counter() - started:.0f} s", flush=True)
        # Rounds in turn, so that a drift in the machine's speed falls on every route alike.
        rounds = round_order(len(servers), args.rounds)
        measured: list[list[list[dict[str, Any]]]] = [[] for _ in servers]
        for number, order in enumerate(rounds, 1):
            for i in order:
                route, pool, url, _, log = servers[i]
                print(f"round {number} of {len(rounds)}: {route}, {pool} pools", flush=True)
                measured[i].append(asyncio.run(measure_server(url, args, vocab, log)))
        results: list[dict[str, Any]] = []
        for (route, pool, _, _, _), per_round in zip(servers, measured, strict=True):
            for runs in zip(*per_round, strict=True):
                results.append({"route": route, "pool": pool, **median_round(runs)})
    return results


def checkpoint_layers(folder: Path) -> int:
    """The layers of the checkpoint written in ``folder`` (its text config's)."""
    config = json.loads((folder / "config.json").read_text())
    return int(config.get("text_config", config)["num_hidden_layers"])


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    example = runpy.run_path(str(EXAMPLE))
    sizes = SHAPES | {"layers": args.linear_layers + 1}
    shapes = example["Shapes"](**sizes)
    vocab = shapes.vocab - len(example["SPECIAL_TOKENS"])
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder or Path(scratch) / "qwen3_5-next-shapes"
        if args.print_commands:
            for pool in args.pools:
                for route in args.routes:
                    command, env = serve_command(route, pool, folder, 8000, args)
                    mode = f"GDFOLD_MAX_QWEN3_5={env['GDFOLD_MAX_QWEN3_5']} " if route in OURS else ""
                    print(mode + shlex.join(command))
            return
        if not (folder / "model.safetensors").exists():
            example["write_checkpoint"](folder, shapes)
        elif checkpoint_layers(folder) != shapes.layers:
            raise SystemExit(f"--folder {folder}: its checkpoint has {checkpoint_layers(folder)} layers,"
                             f" --linear-layers {args.linear_layers} asks for {shapes.layers}")
        logs = args.logs
        logs.mkdir(parents=True, exist_ok=True)
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        head = header([sys.executable, *sys.argv] if argv is None else ["serve_throughput.py", *argv], gpu_name(),
                      date, commit())
        print(head, flush=True)
        results: list[dict[str, Any]] = []
        pairs = [(route, pool) for pool in args.pools for route in args.routes]
        for group in [pairs] if args.start_together else [[pair] for pair in pairs]:
            results += serve_and_measure(group, folder, Path(scratch), logs, args, vocab)
    from rich.console import Console

    print(head)
    Console().print(table(results))
    for line in degenerate(results):
        print(f"not a served step's rate: {line}")
    out = args.json or Path(f"serve-throughput-{date[:10]}.json")
    out.write_text(json.dumps({"header": head, "shapes": sizes, "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "results": results,
        "rows": rows(results)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
