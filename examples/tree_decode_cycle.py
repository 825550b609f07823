"""A speculative-decoding loop over token trees on gdfold_max's own ops.

Each step every request drafts a random tree of up to RING_LEN tokens (a ``parents``
table: each node's parent inside its window, -1 for the committed state), and one MAX
graph runs, for every layer, ``gdfold_max.verify_tree`` with fold on load: it first folds
the previous step's accepted path into the state as it loads it, then runs every node
from its parent's state and records one entry per node into the request's ring row. The
sampler then accepts a path of the tree per request (a root-to-node chain of parent
links, cut at a random length: some requests keep nothing), and the next step folds it.
Two ring rows per (layer, request) alternate, so the records being folded are never the
ones being written.

Two witnesses, bit for bit, every step: the readout of every accepted node equals the
numpy reference forward over the accepted path's tokens alone, and the pool equals that
forward up to the previous step (this step's path is still pending). At the end a fold
along the last accepted paths (``gdfold_max.state_fold`` with ``accepted_nodes``, a
second graph compiled in the same module) flushes it, and the pool equals the forward.
Runs on the GPU where there is one, else on the CPU.

    python examples/tree_decode_cycle.py [--steps 4] [--cpu]
"""

from __future__ import annotations

import argparse

import numpy as np
from max.driver import CPU, Accelerator, Buffer, Device, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType
from max.graph import Module as GraphModule

import gdfold_max
from gdfold_max import reference, trees
from gdfold_max.cases import random_parents
from gdfold_max.layout import RecordLayout

LAYERS, NV, NK, DIM, RING_LEN, BATCH = 2, 4, 2, 32, 8, 3
HEADS = reference.HeadShape(NK, NV, DIM, DIM)
STRIDE = RecordLayout(DIM, DIM, NV // NK).min_stride


def graphs(device: DeviceRef, module: GraphModule) -> tuple[str, str]:
    """The step (a tree verify with fold on load for every layer) and the flush (a fold
    along the accepted paths, all layers), built into one module; returns their names."""
    u32, f32 = DType.uint32, DType.float32
    pool_type = BufferType(f32, ["rows", NV, DIM, DIM], device)
    ring_type = BufferType(f32, ["ring_rows", NK, RING_LEN, STRIDE], device)
    inputs = [
        pool_type, ring_type,
        TensorType(f32, [LAYERS, "tokens", HEADS.qkv_width], device),
        TensorType(f32, [LAYERS, "tokens", NV], device),
        TensorType(f32, [LAYERS, "tokens", NV], device),
        TensorType(u32, [LAYERS, "batch"], device),  # pool rows
        TensorType(u32, [LAYERS, "batch"], device),  # ring rows to record into
        TensorType(u32, [LAYERS, "batch"], device),  # ring rows of the previous step
        TensorType(u32, ["batch"], device),  # nodes the previous step accepted
        TensorType(u32, ["batch", RING_LEN], device),  # which nodes, root first
        TensorType(u32, ["offsets"], device),
        TensorType(DType.int32, ["batch", RING_LEN], device),  # this step's parents
    ]
    with Graph("tree_decode_step", input_types=inputs, custom_extensions=[gdfold_max.kernels_path()],
               module=module) as step:
        pool, ring = step.inputs[0].buffer, step.inputs[1].buffer
        qkv, decay, beta, rows, ring_rows, previous_rows, accepted, nodes, offsets, parents = (
            x.tensor for x in step.inputs[2:])
        step.output(*[
            gdfold_max.verify_tree(qkv[layer], decay[layer], beta[layer], pool, ring, rows[layer], ring_rows[layer],
                                   offsets, parents, previous_ring_row_ids=previous_rows[layer],
                                   previous_num_accepted=accepted, previous_accepted_nodes=nodes)
            for layer in range(LAYERS)])
    with Graph("tree_decode_flush", input_types=inputs[:2] + inputs[5:6] + inputs[7:10],
               custom_extensions=[gdfold_max.kernels_path()], module=module) as flush:
        pool, ring = flush.inputs[0].buffer, flush.inputs[1].buffer
        rows, previous_rows, accepted, nodes = (x.tensor for x in flush.inputs[2:])
        gdfold_max.state_fold(pool, ring, rows, previous_rows, accepted, accepted_nodes=nodes)
        flush.output()
    return step.name, flush.name


def upload(device: Device, *arrays: np.ndarray) -> list[Buffer]:
    return [Buffer.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]


def accepted_path(rng: np.random.Generator, parents: np.ndarray, window: int) -> list[int]:
    """The sampler: the root path of a random node, cut at a random length (maybe 0)."""
    if window == 0:
        return []
    path = trees.root_path(parents, int(rng.integers(0, window)))
    return path[: int(rng.integers(0, len(path) + 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where there is a GPU")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    device = CPU() if args.cpu or accelerator_count() == 0 else Accelerator()
    module = GraphModule()
    step_name, flush_name = graphs(DeviceRef.from_device(device), module)
    models = InferenceSession(devices=[device]).load_all(module, custom_extensions=[gdfold_max.kernels_path()])
    print(f"decoding token trees on {device.label}; {LAYERS} layers, nv {NV}, nk {NK}, K = V = {DIM}, "
          f"up to {RING_LEN} nodes per tree")

    row_ids = np.arange(1, 1 + LAYERS * BATCH, dtype=np.uint32).reshape(LAYERS, BATCH)
    expected = np.zeros((1 + LAYERS * BATCH, NV, DIM, DIM), np.float32)  # the forward over accepted paths
    pool = Buffer.from_numpy(expected.copy()).to(device)
    ring_banks = np.arange(2 * LAYERS * BATCH, dtype=np.uint32).reshape(2, LAYERS, BATCH)
    ring = Buffer.from_numpy(np.full((2 * LAYERS * BATCH, NK, RING_LEN, STRIDE), np.nan, np.float32)).to(device)
    previous_accepted = np.zeros(BATCH, np.uint32)
    previous_nodes = np.zeros((BATCH, RING_LEN), np.uint32)

    for step in range(args.steps):
        windows = rng.integers(1, RING_LEN + 1, BATCH)
        windows[step % BATCH] = RING_LEN  # one full tree every step
        parents = random_parents(args.seed + step, windows.tolist(), RING_LEN)
        offsets = np.concatenate([[0], np.cumsum(windows)]).astype(np.uint32)
        tokens = int(offsets[-1])
        qkv = rng.standard_normal((LAYERS, tokens, HEADS.qkv_width)).astype(np.float32)
        decay = rng.uniform(0.7, 1.0, (LAYERS, tokens, NV)).astype(np.float32)
        beta = rng.uniform(0.0, 1.0, (LAYERS, tokens, NV)).astype(np.float32)
        record_rows, pending_rows = ring_banks[step % 2], ring_banks[(step + 1) % 2]
        outputs = models[step_name].execute(pool, ring, *upload(
            device, qkv, decay, beta, row_ids, record_rows, pending_rows, previous_accepted, previous_nodes, offsets,
            parents))
        readouts = [np.asarray(out.to(CPU()).to_numpy()) for out in outputs if isinstance(out, Buffer)]
        lagging = int(np.count_nonzero(pool.to(CPU()).to_numpy().view(np.uint32) != expected.view(np.uint32)))

        # The sampler keeps one path per request; the witness is the forward over its tokens.
        paths = [accepted_path(rng, parents[b], int(windows[b])) for b in range(BATCH)]
        kept = np.array([int(offsets[b]) + node for b, path in enumerate(paths) for node in path], np.int64)
        kept_offsets = np.concatenate([[0], np.cumsum([len(p) for p in paths])]).astype(np.uint32)
        wants = reference.recurrence_layers(qkv[:, kept], decay[:, kept], beta[:, kept], expected, row_ids,
                                            kept_offsets, num_key_heads=NK)
        differ = lagging + sum(int(np.count_nonzero(readout[kept].view(np.uint32) != want.view(np.uint32)))
                               for readout, want in zip(readouts, wants, strict=True))
        print(f"step {step}: trees of {windows.tolist()} nodes, accepted paths {paths}, "
              + ("bit-exact" if differ == 0 else f"{differ} elements DIFFER"))
        if differ:
            raise SystemExit(1)
        previous_accepted = np.array([len(p) for p in paths], np.uint32)
        previous_nodes = np.zeros((BATCH, RING_LEN), np.uint32)
        for b, path in enumerate(paths):
            previous_nodes[b, : len(path)] = path

    # Flush the last step's accepted paths with the fold along them.
    models[flush_name].execute(pool, ring, *upload(device, row_ids, ring_banks[(args.steps - 1) % 2],
                                                   previous_accepted, previous_nodes))
    if not np.array_equal(pool.to(CPU()).to_numpy().view(np.uint32), expected.view(np.uint32)):
        raise SystemExit("the flushed pool differs from the forward along the accepted paths")
    print("every step matched the forward along the accepted paths, bit for bit")


if __name__ == "__main__":
    main()
