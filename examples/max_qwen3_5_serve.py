"""``max serve`` with gdfold_max's fused Qwen3.5 MTP step, on a tiny checkpoint written here.

Writes the random-weight checkpoint of ``examples/max_qwen3_5_pipeline.py`` into a folder,
starts

    GDFOLD_MAX_QWEN3_5=MODE max serve --model-path DIR --speculative-method mtp \\
        --custom-architectures gdfold_max.integrations.max_qwen3_5_serve ...

on localhost, waits for ``/health``, sends a few greedy ``/v1/completions`` with token-id
prompts side by side, prints the new token ids and stops the server. ``--mode max`` serves
MAX's own MTP pipeline instead (no ``--custom-architectures``). ``--dflash2`` serves
DFlash2 instead of MTP: the checkpoint in bf16 and the example's tiny drafter, with
``--speculative-method dflash2 --draft-model-path DRAFT`` (7 drafts, the drafter's) and
fp32 state pools; its ``fused`` mode is not validated and refuses to load unless
``GDFOLD_MAX_QWEN3_5_DFLASH2=unvalidated`` is set (docs/integrations.md, "DFlash2").
MAX builds Qwen3.5 pipelines on GPUs only: without one the script writes the checkpoint,
prints the command and stops there.

    python examples/max_qwen3_5_serve.py [--mode fused|fold|fold+verify|max] [--dflash2] [--folder DIR]
        [--new-tokens 12]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import runpy
import tempfile
import time
from pathlib import Path

from gdfold_max.integrations.max_qwen3_5_serve.server import free_port, max_command, running, wait_ready

HERE = Path(__file__).resolve().parent
MODULE = "gdfold_max.integrations.max_qwen3_5_serve"
PROMPTS = [[1, 2, 3], [7, 5, 9, 11], [40, 41, 42, 43, 44, 45], [300]]


def command(folder: Path, port: int, mode: str, draft: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The ``max serve`` command line and its environment: MTP, or DFlash2 with the
    drafter in ``draft`` (a bf16 target: MAX 26.7 runs the drafter in bf16) and fp32 state
    pools (with MAX's default bf16 pools its own DFlash2 answered token 0 on this
    checkpoint: docs/integrations.md, "DFlash2")."""
    if draft is None:
        speculative = ["--quantization-encoding", "float32", "--speculative-method", "mtp",
                       "--num-speculative-tokens", "3"]
    else:
        speculative = ["--quantization-encoding", "bfloat16", "--speculative-method", "dflash2",
                       "--draft-model-path", str(draft), "--draft-quantization-encoding", "bfloat16",
                       "--state-pool-dtype", "float32"]
    argv = [*max_command(), "serve", "--model-path", str(folder),
            "--weight-path", str(folder / "model.safetensors"), *speculative,
            "--max-length", "256", "--max-batch-size", "8", "--device-memory-utilization", "0.1",
            "--no-device-graph-capture", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MAX_SERVE_DISABLE_TELEMETRY": "1"}
    if mode != "max":
        argv += ["--custom-architectures", MODULE]
        env["GDFOLD_MAX_QWEN3_5"] = mode
    return argv, env


async def ask(url: str, new_tokens: int) -> list[list[int]]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:

        async def one(prompt: list[int]) -> list[int]:
            reply = await client.post(url + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            reply.raise_for_status()
            return [int(t) for t in reply.json()["choices"][0]["token_ids"]][-new_tokens:]

        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="fused", choices=["fused", "fold", "fold+verify", "max"])
    parser.add_argument("--dflash2", action="store_true", help="serve DFlash2 (a bf16 target and a tiny drafter)")
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--ready-s", type=float, default=1200.0, help="how long to wait for /health")
    args = parser.parse_args()
    if args.new_tokens < 1:
        parser.error(f"--new-tokens: expected at least 1, got {args.new_tokens}")

    checkpoint = runpy.run_path(str(HERE / "max_qwen3_5_pipeline.py"))
    where = args.folder or Path(tempfile.mkdtemp()) / "tiny-qwen3_5"
    draft = None
    if args.dflash2:
        shapes = checkpoint["Shapes"](dtype="bfloat16")
        folder = checkpoint["write_checkpoint"](where, shapes)
        draft = checkpoint["write_dflash2_draft"](where.with_name(where.name + "-dflash2-draft"), shapes)
    else:
        folder = checkpoint["write_checkpoint"](where)
    port = free_port()
    argv, env = command(folder, port, args.mode, draft)
    shown = ("" if args.mode == "max" else f"GDFOLD_MAX_QWEN3_5={args.mode} ") + " ".join(argv)
    print(f"checkpoint in {folder}\n{shown}", flush=True)

    from max.driver import accelerator_count

    if accelerator_count() == 0:
        print("no GPU here: MAX builds Qwen3.5 pipelines on GPUs only; stopping before the server")
        return
    log = folder.parent / f"max-serve-{args.mode}.log"
    url = f"http://127.0.0.1:{port}"
    with running(argv, env, log) as server:
        started = time.monotonic()
        asyncio.run(wait_ready(url, server, log, args.ready_s))
        rows = asyncio.run(ask(url, args.new_tokens))
        print(f"served in {time.monotonic() - started:.0f} s (server log: {log})")
        for prompt, row in zip(PROMPTS, rows, strict=True):
            print(f"{prompt} -> {row}")


if __name__ == "__main__":
    main()
