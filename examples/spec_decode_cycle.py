"""A speculative-decoding loop around the fold, the way an inference server drives it.

A small multi-layer model state lives in one pool with a free list of rows. Every step:
draft W tokens per request, verify them (the numpy reference runs the recurrence over the
window and writes one record per token into the ring, leaving the pool alone), accept a
random number of them per request (some none, some all), and fold the accepted records
into the pool inside a MAX graph through ``gdfold_max.state_fold``, for all layers at
once. After every step the pool is checked, bit for bit, against the reference forward
run over the accepted tokens only. Runs on the GPU where there is one, else on the CPU.

    python examples/spec_decode_cycle.py [--steps 4] [--cpu]
"""

from __future__ import annotations

import argparse

import numpy as np
from max.driver import CPU, Accelerator, Buffer, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType

import gdfold_max
from gdfold_max import reference
from gdfold_max.layout import RecordLayout

LAYERS, NV, NK, DIM, RING_LEN, DRAFTS, BATCH = 3, 4, 2, 32, 4, 3, 3
HEADS = reference.HeadShape(NK, NV, DIM, DIM)
STRIDE = RecordLayout(DIM, DIM, NV // NK).min_stride
NULL_ROW = 0  # padding requests fold into this row, which nothing reads


class StatePool:
    """The live pool and its free list; row NULL_ROW is reserved for padding."""

    def __init__(self, rows: int) -> None:
        self.state = np.zeros((rows, NV, DIM, DIM), np.float32)
        self.free = list(range(rows - 1, NULL_ROW, -1))

    def admit(self) -> list[int]:
        """One fresh, zeroed row per layer for a new request."""
        rows = [self.free.pop() for _ in range(LAYERS)]
        self.state[rows] = 0
        return rows

    def release(self, rows: list[int]) -> None:
        self.free.extend(rows)


def fold_graph(device: DeviceRef) -> Graph:
    """The fold alone, with every size but K, V and RING_LEN symbolic."""
    inputs = [
        BufferType(DType.float32, ["rows", NV, DIM, DIM], device),
        BufferType(DType.float32, ["ring_rows", NK, RING_LEN, STRIDE], device),
        TensorType(DType.uint32, [LAYERS, "batch"], device),
        TensorType(DType.uint32, [LAYERS, "batch"], device),
        TensorType(DType.uint32, ["batch"], device),
    ]
    with Graph("spec_decode_fold", input_types=inputs, custom_extensions=[gdfold_max.kernels_path()]) as graph:
        state, ring, row_ids, ring_row_ids, accepted = graph.inputs
        gdfold_max.state_fold(state.buffer, ring.buffer, row_ids.tensor, ring_row_ids.tensor, accepted.tensor)
        graph.output()
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cpu", action="store_true", help="fold on the CPU even where there is a GPU")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    device = CPU() if args.cpu or accelerator_count() == 0 else Accelerator()
    model = InferenceSession(devices=[device]).load(fold_graph(DeviceRef.from_device(device)))
    print(f"folding on {device.label}; {LAYERS} layers, nv {NV}, nk {NK}, K = V = {DIM}, "
          f"RING_LEN {RING_LEN}, {DRAFTS} drafts per step")

    pool = StatePool(rows=LAYERS * (BATCH + 1) + 1)
    expected = pool.state.copy()  # the reference forward over accepted tokens only
    ring = np.full((LAYERS * BATCH, NK, RING_LEN, STRIDE), np.nan, np.float32)
    requests = [pool.admit() for _ in range(BATCH)]
    # Ring rows are per (layer, batch slot): layer-major, like the row table.
    ring_row_ids = np.arange(LAYERS * BATCH, dtype=np.uint32).reshape(LAYERS, BATCH)
    pool_on_device = Buffer.from_numpy(pool.state).to(device)

    for step in range(args.steps):
        if step == 2:  # request 1 finishes; a new one takes rows from the free list
            pool.release(requests[1])
            requests[1] = pool.admit()
            expected[requests[1]] = 0
            pool_on_device = Buffer.from_numpy(pool.state).to(device)
        row_ids = np.array(requests, np.uint32).T.copy()  # [LAYERS, BATCH], layer-major
        window = DRAFTS + 1  # the last accepted token plus the drafts
        offsets = np.arange(0, BATCH * window + 1, window, dtype=np.uint32)
        qkv = rng.standard_normal((LAYERS, BATCH * window, HEADS.qkv_width)).astype(np.float32)
        decay = rng.uniform(0.7, 1.0, (LAYERS, BATCH * window, NV)).astype(np.float32)
        beta = rng.uniform(0.0, 1.0, (LAYERS, BATCH * window, NV)).astype(np.float32)

        # Verify: records into the ring; the pool is not written.
        ring[:] = np.nan
        snapshot = pool.state.copy()
        for layer in range(LAYERS):
            reference.verify_ring(qkv[layer], decay[layer], beta[layer], snapshot, ring, row_ids[layer],
                                  ring_row_ids[layer], offsets)

        # Accept: the sampler's counts, at least one request rejecting all and one keeping all.
        accepted = rng.integers(0, window + 1, BATCH).astype(np.uint32)
        accepted[step % BATCH], accepted[(step + 1) % BATCH] = 0, window

        # Fold, in the graph.
        tables = [Buffer.from_numpy(np.ascontiguousarray(t)).to(device) for t in (row_ids, ring_row_ids, accepted)]
        model.execute(pool_on_device, Buffer.from_numpy(ring).to(device), *tables)
        pool.state[...] = pool_on_device.to(CPU()).to_numpy()

        # The witness: the forward over the accepted tokens alone.
        kept = np.concatenate([np.arange(b * window, b * window + int(accepted[b])) for b in range(BATCH)])
        kept_offsets = np.concatenate([[0], np.cumsum(accepted)]).astype(np.uint32)
        for layer in range(LAYERS):
            reference.recurrence_fwd(qkv[layer][kept], decay[layer][kept], beta[layer][kept], expected,
                                     row_ids[layer], kept_offsets, num_key_heads=NK)
        differ = int(np.count_nonzero(pool.state.view(np.uint32) != expected.view(np.uint32)))
        print(f"step {step}: accepted {accepted.tolist()}, rows {row_ids.T.tolist()}, "
              f"|state| max {np.abs(pool.state).max():.3f}, "
              + ("bit-exact" if differ == 0 else f"{differ} elements DIFFER"))
        if differ:
            raise SystemExit(1)
    print("every step matched the forward over the accepted tokens, bit for bit")


if __name__ == "__main__":
    main()
