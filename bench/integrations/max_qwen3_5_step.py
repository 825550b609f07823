"""A stack of MAX's own Gated DeltaNet layers (``qwen3_5.layers.gated_deltanet``) through
one speculative step, verify of every layer and MAX's rollback fold
(``unified_mtp_qwen3_5.state_rollback.fold_state_pools``), four ways in one process:

* ``max``: as MAX 26.7 ships it;
* ``patched``: under ``gdfold_max.integrations.max_qwen3_5.patched()`` (our fold);
* ``ours``: under ``patched(verify=True)`` (our verify and our fold);
* ``fused``: ``FusedGatedDeltaNet`` layers, whose verify folds the previous step's
  records as it loads the state; the rollback folds nothing.

Qwen3-Next-80B's layer shapes (hidden 2048, nk 16, nv 32, K = V = 128, conv 4), random
weights, a window of 4 tokens per request with 3 records accepted, the model dtype bf16
(so bf16 pools) unless ``--dtype float32``. The conv rollback is MAX's in every variant
and is left out of the step. A step is one call of a compiled graph, best of
``--repeats``; the projections, conv and norms are the same in every variant, so the
differences are the state ops'.

    python bench/integrations/max_qwen3_5_step.py [--layers 8] [--batches 1,8,64] [--dtype bfloat16]
        [--lock FILE] [--symbolic-width] [--queued N]

``--symbolic-width``: the verify width is a graph input (``[K]`` int64 on the host), as in
MAX's served graph, where one graph runs prefill (no drafts) and verify steps; the fused
layers then choose between their forward and their verify as the graph runs (an
``ops.cond`` per layer), where with the width fixed at build time they do not branch, and
MAX's layer on a GPU below SM100 runs its verify with no branch either
(``qwen3_5/layers/gated_deltanet.py:717-733``). ``--queued N``: a step is also timed as a
server runs steps, N calls queued before one synchronize (the host launching the next step
while the device runs one), per step.

With ``--lock FILE`` the timing waits for an exclusive lock on FILE, so that runs for
several dtypes (or other benchmarks holding the same lock) compile side by side but time
one at a time on a quiet GPU.
"""

from __future__ import annotations

import argparse
import fcntl
import time
from contextlib import nullcontext

import ml_dtypes
import numpy as np
from max.driver import Accelerator, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops
from max.nn import LayerList, Module
from max.nn.state_space import verify_width_operand
from max.pipelines.architectures.qwen3_5.layers.gated_deltanet import GatedDeltaNet
from max.pipelines.architectures.qwen3_5.state_cache import GatedDeltaRingAccess
from max.pipelines.architectures.unified_mtp_qwen3_5 import state_rollback

from gdfold_max import kernels_path
from gdfold_max.bench.harness import best_seconds
from gdfold_max.eager.base import host_buffer
from gdfold_max.integrations import max_qwen3_5
from gdfold_max.layout import RecordLayout

HIDDEN, NK, NV, HEAD, CONV, WINDOW, ACCEPTED = 2048, 16, 32, 128, 4, 4, 3
VARIANTS = ("max", "patched", "ours", "fused")


class Stack(Module):
    def __init__(self, layers: int, dtype: DType, fused: bool) -> None:
        super().__init__()
        cls = max_qwen3_5.FusedGatedDeltaNet if fused else GatedDeltaNet
        self.layers = LayerList([cls(HIDDEN, NK, NV, HEAD, HEAD, CONV, dtype, DeviceRef.GPU()) for _ in range(layers)])

    def __call__(self, *args: object) -> None:
        raise TypeError("the layers are called one by one (step_graph)")


def random_weights(stack: Stack, seed: int = 0) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    weights: dict[str, object] = {}
    for name, weight in stack.raw_state_dict().items():
        values = (0.02 * rng.standard_normal([int(d) for d in weight.shape])).astype(np.float32)
        weights[name] = values if weight.dtype == DType.float32 else host_buffer(values.astype(ml_dtypes.bfloat16))
    return weights


def step_graph(variant: str, layers: int, dtype: DType, stride: int, weights: dict[str, object] | None = None,
               symbolic_width: bool = False) -> tuple[Graph, Stack]:
    """The step's graph, and the stack whose weights (random unless given) it names;
    with ``symbolic_width`` the verify width is its last input."""
    stack = Stack(layers, dtype, variant == "fused")
    # Loading names every weight by its path in the stack, which the graph then uses.
    stack.load_state_dict(weights if weights is not None else random_weights(stack))
    where, u32 = DeviceRef.GPU(), DType.uint32
    conv_dim = 2 * NK * HEAD + NV * HEAD
    inputs = [TensorType(dtype, ["T", HIDDEN], where), BufferType(dtype, ["crows", conv_dim, CONV - 1], where),
              BufferType(dtype, ["rows", NV, HEAD, HEAD], where),
              BufferType(DType.float32, ["ring_rows", NK, WINDOW, stride], where),
              TensorType(u32, [layers, "B"], where), TensorType(u32, [layers, "B"], where),
              TensorType(u32, [layers, "B"], where), TensorType(u32, ["B1"], where), TensorType(u32, ["B"], where)]
    if symbolic_width:
        inputs.append(TensorType(DType.int64, ["K"], DeviceRef.CPU()))
    routes = {"max": None, "patched": {}, "ours": {"verify": True}, "fused": {}}[variant]
    with Graph(f"gdn_stack_{variant}_{dtype.name}", input_types=inputs,
               custom_extensions=[kernels_path()]) as graph, \
            (max_qwen3_5.patched(**routes) if routes is not None else nullcontext()):
        x, conv, pool, ring, rows, ring_rows, previous_rows, offsets, accepted, *width_input = graph.inputs
        width = width_input[0].tensor if symbolic_width else verify_width_operand(WINDOW - 1)
        hidden = x.tensor
        for index, layer in enumerate(stack.layers):
            extra = ({"previous_ring_row_id": previous_rows.tensor[index], "previous_num_accepted": accepted.tensor}
                     if variant == "fused" else {})
            hidden = layer(hidden, conv.buffer, rows.tensor[index], pool.buffer, rows.tensor[index], offsets.tensor,
                           ring=GatedDeltaRingAccess(pool=ring.buffer, row_id=ring_rows.tensor[index]),
                           verify_width=width, **extra)
        if variant != "fused":
            state_rollback.fold_state_pools([pool.buffer], [rows.tensor], [ring.buffer], [ring_rows.tensor],
                                            accepted.tensor, [], width)
        graph.output(ops.cast(hidden, DType.float32))
    return graph, stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--lock", help="time only while holding an exclusive lock on this file")
    parser.add_argument("--symbolic-width", action="store_true",
                        help="the verify width as a graph input, as in MAX's served graph")
    parser.add_argument("--queued", type=int, default=0, metavar="N",
                        help="also time N calls queued before one synchronize, per step")
    args = parser.parse_args()
    dtype = getattr(DType, args.dtype)
    np_dtype = ml_dtypes.bfloat16 if dtype == DType.bfloat16 else np.float32
    gpu = Accelerator()
    session = InferenceSession(devices=[gpu])
    stride = RecordLayout(HEAD, HEAD, NV // NK).min_stride
    started = time.perf_counter()
    models = {}
    weights = random_weights(Stack(args.layers, dtype, fused=False))
    for variant in VARIANTS:
        graph, stack = step_graph(variant, args.layers, dtype, stride, weights, args.symbolic_width)
        models[variant] = session.load(graph, weights_registry=stack.state_dict())
        print(f"[{time.perf_counter() - started:5.0f} s] compiled {variant}", flush=True)
    if args.lock:
        # Held until the process exits: the timing below is this process's last work.
        lock = open(args.lock, "a")  # noqa: SIM115
        fcntl.flock(lock, fcntl.LOCK_EX)
        print(f"[{time.perf_counter() - started:5.0f} s] timing", flush=True)
    rng = np.random.default_rng(1)
    conv_dim = 2 * NK * HEAD + NV * HEAD
    print(f"{args.layers} Gated DeltaNet layers, Qwen3-Next shapes, {dtype.name} model and pools, window {WINDOW},"
          f" {ACCEPTED} records accepted; us per step (best of {args.repeats}), one process")
    print(f"{'batch':>5} " + " ".join(f"{v:>9}" for v in VARIANTS) + "  patched/max  ours/max  fused/max")
    for batch in (int(b) for b in args.batches.split(",")):
        tokens = batch * WINDOW
        rows = np.arange(args.layers * batch, dtype=np.uint32).reshape(args.layers, batch)
        host = [rng.standard_normal((tokens, HIDDEN)).astype(np_dtype),
                (0.1 * rng.standard_normal((args.layers * batch, conv_dim, CONV - 1))).astype(np_dtype),
                (0.01 * rng.standard_normal((args.layers * batch, NV, HEAD, HEAD))).astype(np_dtype)]
        buffers = [host_buffer(a).to(gpu) for a in host]
        buffers.append(Buffer.zeros([2 * args.layers * batch, NK, WINDOW, stride], DType.float32, gpu))
        tables = [rows, rows, rows + np.uint32(args.layers * batch), np.arange(0, tokens + 1, WINDOW, dtype=np.uint32),
                  np.full(batch, ACCEPTED, np.uint32)]
        buffers += [Buffer.from_numpy(t).to(gpu) for t in tables]
        if args.symbolic_width:
            buffers.append(Buffer.from_numpy(np.arange(WINDOW - 1, dtype=np.int64)))
        for label, calls in (("", 1), (f" queued {args.queued}", args.queued)):
            if calls == 0:
                continue
            seconds = {}
            for variant, model in models.items():
                def run(model: object = model, buffers: list[Buffer] = buffers, calls: int = calls) -> None:
                    for _ in range(calls):
                        model.execute(*buffers)  # type: ignore[attr-defined]
                    gpu.synchronize()

                seconds[variant] = best_seconds(run, args.repeats) / calls
            us = {v: 1e6 * s for v, s in seconds.items()}
            print(f"{batch:>5} " + " ".join(f"{us[v]:9.1f}" for v in VARIANTS) +
                  f"  {seconds['max'] / seconds['patched']:10.2f}x {seconds['max'] / seconds['ours']:8.2f}x"
                  f" {seconds['max'] / seconds['fused']:9.2f}x{label}", flush=True)


if __name__ == "__main__":
    main()
