"""What MAX's DFlash2 pipeline leaves in one request's state rows, step by step.

Writes the tiny bf16 Qwen3.5 checkpoint and DFlash2 drafter of
``examples/max_qwen3_5_pipeline.py``, builds the DFlash2 pipeline in process once per
route (each in a process of its own, all at once), with fp32 state pools, and decodes
three prompts greedily, each alone, through ``GenerateIterator``. After every step it
waits for the device and prints, as one JSON line: the tokens the step returned, the
request's recurrent pool rows (one per Gated DeltaNet layer: finite share and largest
magnitude), its ring rows (every layer's, both halves on the fused route), and on the
fused route the carry's table entry and the tags the step was sent.

    python bench/integrations/dflash2_state_steps.py [--routes fused fold+verify] [--new-tokens 10]

A route is ``GDFOLD_MAX_QWEN3_5``'s mode (``fused``, ``fold``, ``fold+verify``) or ``max``
(MAX's own pipeline); the fused route loads with ``GDFOLD_MAX_QWEN3_5_DFLASH2=unvalidated``.
Needs a GPU and MAX's ``max-pipelines`` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "max_qwen3_5_pipeline.py"
MODULE = "gdfold_max.integrations.max_qwen3_5_serve"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routes", nargs="+", default=["fused", "fold+verify"],
                        choices=["fused", "fold", "fold+verify", "max"])
    parser.add_argument("--new-tokens", type=int, default=10)
    parser.add_argument("--memory", type=float, default=0.1, help="each pipeline's device memory utilization")
    parser.add_argument("--overlap", choices=["on", "off"], default="on", help="MAX's overlap scheduler")
    parser.add_argument("--print-op-tables", action="store_true",
                        help="print what each layer's gdfold_verify_or_forward is given and its readout's first"
                             " columns, as the graph runs (max.graph.ops.print)")
    parser.add_argument("--child", nargs=3, metavar=("ROUTE", "TARGET", "DRAFT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        route, target, draft = args.child
        step_alone(route, Path(target), Path(draft), args)
        return
    example = runpy.run_path(str(EXAMPLE))
    root = Path(tempfile.mkdtemp())
    target = example["write_checkpoint"](root / "target", example["Shapes"](dtype="bfloat16"))
    draft = example["write_dflash2_draft"](root / "draft")
    children = {}
    for route in args.routes:
        # A folder per pipeline: MAX caches a checkpoint's config per folder.
        copy = root / f"target-{route}"
        subprocess.run(["cp", "-r", str(target), str(copy)], check=True)
        argv = [sys.executable, __file__, "--child", route, str(copy), str(draft), "--new-tokens",
                str(args.new_tokens), "--memory", str(args.memory), "--overlap", args.overlap,
                *(["--print-op-tables"] if args.print_op_tables else [])]
        children[route] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("exit status", example["echo_children"](children), flush=True)


def step_alone(route: str, target: Path, draft: Path, args: argparse.Namespace) -> None:
    """One route's pipeline, each prompt alone, a JSON line after every step."""
    if route != "max":
        os.environ["GDFOLD_MAX_QWEN3_5"] = route
    os.environ["GDFOLD_MAX_QWEN3_5_DFLASH2"] = "unvalidated"
    import numpy as np
    from max.driver import Accelerator
    from max.pipelines.architectures.unified_mtp_qwen3_5.batch_processor import UnifiedMTPQwen3_5BatchProcessor
    from max.pipelines.context import SamplingParams
    from max.pipelines.lib.generate import GenerateIterator
    from max.pipelines.lib.registry import PIPELINE_REGISTRY

    example = runpy.run_path(str(EXAMPLE))
    runtime: dict[str, Any] = {"enable_overlap_scheduler": args.overlap == "on"}
    if route != "max":
        runtime["custom_architectures"] = [MODULE]
    config = example["dflash2_pipeline_config"](target, draft, state_pool_dtype="float32", memory=args.memory,
                                                runtime=runtime)
    # The inputs each step was given: the batch processor's return value, the object the
    # pipeline executes (MAX realizes placeholder tokens on it after this returns).
    given: list[Any] = []
    processor_cls = UnifiedMTPQwen3_5BatchProcessor
    if route == "fused":
        from gdfold_max.integrations.max_qwen3_5_serve.fused import FusedMTPBatchProcessor
        processor_cls = FusedMTPBatchProcessor
    prepare = processor_cls.prepare_initial_token_inputs

    def recorded(self: Any, *a: Any, **k: Any) -> Any:
        inputs = prepare(self, *a, **k)
        given.append(inputs)
        return inputs

    processor_cls.prepare_initial_token_inputs = recorded
    if args.print_op_tables:
        print_op_tables()
    started = time.perf_counter()
    retrieved = PIPELINE_REGISTRY.retrieve_factory(config)
    pipeline = retrieved.factory()
    device = Accelerator()
    print(f"built in {time.perf_counter() - started:.0f} s: {type(pipeline).__name__}", flush=True)
    prompts = [[int(t) for t in np.random.default_rng(b).integers(0, 400, 5 + b)] for b in range(3)]
    for number, prompt in enumerate(prompts):
        contexts = asyncio.run(example["prompt_contexts"](retrieved.tokenizer, [prompt], SamplingParams(
            top_k=1, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)))
        print(json.dumps({"prompt": number, "tokens": prompt}), flush=True)
        given.clear()
        with GenerateIterator.from_contexts(pipeline, contexts) as batch:
            step = 0
            while not batch.done:
                returned = batch.step()
                step += 1
                device.synchronize()
                print(json.dumps({"step": step, "returned": str(returned)[:120], **state_of(given[-1], step == 1)}),
                      flush=True)
            print(json.dumps({"sequence": [list(map(int, s)) for s in batch.sequences]}), flush=True)


def print_op_tables() -> None:
    """Wraps the fused layer's op so that the graph prints, each time it runs, the tables
    each layer's ``gdfold_verify_or_forward`` is given, the shapes of its tensors (the op
    returns without writing where the offsets run past the tokens), the first columns of
    its input and of its readout."""
    from max.graph import ops

    from gdfold_max.integrations import max_qwen3_5

    op = max_qwen3_5.verify_or_forward
    calls = [0]

    def printed(qkv: Any, decay: Any, beta: Any, state: Any, ring: Any, row_ids: Any, ring_row_ids: Any,
                offsets: Any, previous_rows: Any, previous_counts: Any, width: Any, **kwargs: Any) -> Any:
        layer = calls[0]
        calls[0] += 1
        for name, value in (("row_ids", row_ids), ("ring_row_ids", ring_row_ids), ("offsets", offsets),
                            ("previous_ring_row_ids", previous_rows), ("previous_num_accepted", previous_counts),
                            ("width", ops.shape_to_tensor(width.shape)), ("qkv shape", ops.shape_to_tensor(qkv.shape)),
                            ("state shape", ops.shape_to_tensor(state.shape)),
                            ("ring shape", ops.shape_to_tensor(ring.shape)), ("qkv[:, :4]", qkv[:, :4])):
            ops.print(value, label=f"layer {layer} {name}")
        readout = op(qkv, decay, beta, state, ring, row_ids, ring_row_ids, offsets, previous_rows, previous_counts,
                     width, **kwargs)
        ops.print(readout[:, :4], label=f"layer {layer} readout[:, :4]")
        return readout

    max_qwen3_5.verify_or_forward = printed


def state_of(inputs: Any, shapes: bool) -> dict[str, Any]:
    """The request's rows (row 0 of the batch) in the pools of a step's inputs."""
    import numpy as np
    from max.driver import CPU

    cpu = CPU()

    def host(buffer: Any) -> np.ndarray:
        return buffer.to_numpy() if buffer.is_host else buffer.to(cpu).to_numpy()

    def row(pool: Any, index: int) -> np.ndarray:
        view = pool[(slice(index, index + 1),) + (slice(None),) * (pool.rank - 1)]
        return host(view if view.is_contiguous else view.contiguous())[0]

    def told(values: np.ndarray) -> str:
        finite = np.isfinite(values)
        largest = float(np.abs(np.where(finite, values, 0)).max())
        return f"finite {finite.mean():.3f} max {largest:.3g}"

    offsets = inputs.input_row_offsets
    offsets = offsets[0] if isinstance(offsets, list) else offsets
    recurrent_rows = host(inputs.live_recurrent_row_ids[0])[:, 0]
    ring_rows = host(inputs.ring_row_ids[0])[:, 0]
    state: dict[str, Any] = {
        "offsets": host(offsets).ravel().tolist(),
        "recurrent_rows": recurrent_rows.tolist(),
        "pool": [told(row(inputs.live_recurrent_pools[0], int(r))) for r in recurrent_rows],
        "ring_rows": ring_rows.tolist(),
        "ring": [told(row(inputs.ring_pools[0], int(r))) for r in ring_rows],
    }
    if shapes:
        state["shapes"] = {"recurrent": list(inputs.live_recurrent_pools[0].shape),
                           "ring": list(inputs.ring_pools[0].shape)}
    if hasattr(inputs, "carry_tables"):
        block = int(ring_rows[0]) // len(ring_rows)
        state["carry_entry"] = host(inputs.carry_tables[0])[block].tolist()
        state["tags"] = host(inputs.carry_tags[0]).tolist()
    return state


if __name__ == "__main__":
    main()
