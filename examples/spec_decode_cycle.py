"""A speculative-decoding loop on gdfold_max's own ops, the way an inference server drives it.

A small multi-layer model state lives in one pool with a free list of rows. Every step:
draft W tokens per request and run one MAX graph that, for every layer, calls
``gdfold_max.verify_ring`` with fold on load: it first applies the previous step's
accepted records to the state as it loads it (and writes that state back), then runs
the new window and records one entry per token into the ring, so a step touches each
state element once. Each request owns two ring rows per layer and alternates between
them, so the records being folded are never the ones being written. The sampler then
accepts a random number of tokens per request (some none, some all).

Two witnesses, bit for bit, every step: the readout of every accepted token equals the
numpy reference forward run over the accepted tokens only, and the pool equals that
forward up to the previous step (this step's records are still pending). At the end one
``gdfold_max.fold`` flushes the pending records and the pool equals the forward exactly.
Runs on the GPU where there is one, else on the CPU.

    python examples/spec_decode_cycle.py [--steps 4] [--cpu]
"""

from __future__ import annotations

import argparse

import numpy as np
from max.driver import CPU, Accelerator, Buffer, Device, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, DeviceRef, Graph, TensorType

import gdfold_max
from gdfold_max import reference
from gdfold_max.layout import RecordLayout

LAYERS, NV, NK, DIM, RING_LEN, DRAFTS, BATCH = 3, 4, 2, 32, 4, 3, 3
HEADS = reference.HeadShape(NK, NV, DIM, DIM)
STRIDE = RecordLayout(DIM, DIM, NV // NK).min_stride
WINDOW = DRAFTS + 1  # the last accepted token plus the drafts
NULL_ROW = 0  # never handed out


class StatePool:
    """The live pool and its free list."""

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


def step_graph(device: DeviceRef) -> Graph:
    """One decoding step's verify for every layer, folding the previous step on load."""
    u32, f32 = DType.uint32, DType.float32
    inputs = [
        BufferType(f32, ["rows", NV, DIM, DIM], device),
        BufferType(f32, ["ring_rows", NK, RING_LEN, STRIDE], device),
        TensorType(f32, [LAYERS, "tokens", HEADS.qkv_width], device),
        TensorType(f32, [LAYERS, "tokens", NV], device),
        TensorType(f32, [LAYERS, "tokens", NV], device),
        TensorType(u32, [LAYERS, "batch"], device),  # pool rows
        TensorType(u32, [LAYERS, "batch"], device),  # ring rows to record into
        TensorType(u32, [LAYERS, "batch"], device),  # ring rows of the previous step
        TensorType(u32, ["batch"], device),  # records the previous step accepted
        TensorType(u32, ["offsets"], device),
    ]
    with Graph("spec_decode_step", input_types=inputs, custom_extensions=[gdfold_max.kernels_path()]) as graph:
        pool, ring = graph.inputs[0].buffer, graph.inputs[1].buffer
        qkv, decay, beta, rows, ring_rows, previous_rows, previous_accepted, offsets = (
            x.tensor for x in graph.inputs[2:])
        readouts = [
            gdfold_max.verify_ring(qkv[layer], decay[layer], beta[layer], pool, ring, rows[layer], ring_rows[layer],
                                   offsets, previous_ring_row_ids=previous_rows[layer],
                                   previous_num_accepted=previous_accepted)
            for layer in range(LAYERS)
        ]
        graph.output(*readouts)
    return graph


def upload(device: Device, *arrays: np.ndarray) -> list[Buffer]:
    return [Buffer.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]


def run_step(model: Model, device: Device, pool: Buffer, ring: Buffer, tokens: tuple[np.ndarray, ...],
             tables: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    outputs = model.execute(pool, ring, *upload(device, *tokens, *tables))
    return [np.asarray(out.to(CPU()).to_numpy()) for out in outputs if isinstance(out, Buffer)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where there is a GPU")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    device = CPU() if args.cpu or accelerator_count() == 0 else Accelerator()
    model = InferenceSession(devices=[device]).load(step_graph(DeviceRef.from_device(device)))
    print(f"decoding on {device.label}; {LAYERS} layers, nv {NV}, nk {NK}, K = V = {DIM}, "
          f"RING_LEN {RING_LEN}, {DRAFTS} drafts per step")

    pool = StatePool(rows=LAYERS * (BATCH + 1) + 1)
    expected = pool.state.copy()  # the reference forward over accepted tokens only
    requests = [pool.admit() for _ in range(BATCH)]
    # Two ring rows per (layer, batch slot), layer-major like the row table; steps alternate.
    ring_banks = np.arange(2 * LAYERS * BATCH, dtype=np.uint32).reshape(2, LAYERS, BATCH)
    ring = Buffer.from_numpy(np.full((2 * LAYERS * BATCH, NK, RING_LEN, STRIDE), np.nan, np.float32)).to(device)
    pool_buffer = Buffer.from_numpy(pool.state).to(device)
    previous_accepted = np.zeros(BATCH, np.uint32)
    offsets = np.arange(0, BATCH * WINDOW + 1, WINDOW, dtype=np.uint32)

    for step in range(args.steps):
        if step == 2:  # request 1 finishes; a new one takes rows from the free list
            pool.state[...] = pool_buffer.to(CPU()).to_numpy()
            pool.release(requests[1])
            requests[1] = pool.admit()
            expected[requests[1]] = 0
            previous_accepted[1] = 0  # the new request has nothing pending
            pool_buffer = Buffer.from_numpy(pool.state).to(device)
        row_ids = np.array(requests, np.uint32).T.copy()  # [LAYERS, BATCH]
        record_rows, pending_rows = ring_banks[step % 2], ring_banks[(step + 1) % 2]
        qkv = rng.standard_normal((LAYERS, BATCH * WINDOW, HEADS.qkv_width)).astype(np.float32)
        decay = rng.uniform(0.7, 1.0, (LAYERS, BATCH * WINDOW, NV)).astype(np.float32)
        beta = rng.uniform(0.0, 1.0, (LAYERS, BATCH * WINDOW, NV)).astype(np.float32)

        readouts = run_step(model, device, pool_buffer, ring, (qkv, decay, beta),
                            (row_ids, record_rows, pending_rows, previous_accepted, offsets))
        pool_now = pool_buffer.to(CPU()).to_numpy()
        lagging = int(np.count_nonzero(pool_now.view(np.uint32) != expected.view(np.uint32)))

        # Accept: the sampler's counts, at least one request rejecting all and one keeping all.
        accepted = rng.integers(0, WINDOW + 1, BATCH).astype(np.uint32)
        accepted[step % BATCH], accepted[(step + 1) % BATCH] = 0, WINDOW

        # The witness: the forward over the accepted tokens alone.
        kept = np.concatenate([np.arange(b * WINDOW, b * WINDOW + int(accepted[b])) for b in range(BATCH)])
        kept_offsets = np.concatenate([[0], np.cumsum(accepted)]).astype(np.uint32)
        wants = reference.recurrence_layers(qkv[:, kept], decay[:, kept], beta[:, kept], expected, row_ids,
                                            kept_offsets, num_key_heads=NK)
        differ = lagging + sum(int(np.count_nonzero(readout[kept].view(np.uint32) != want.view(np.uint32)))
                               for readout, want in zip(readouts, wants, strict=True))
        print(f"step {step}: accepted {accepted.tolist()}, rows {row_ids.T.tolist()}, "
              + ("bit-exact" if differ == 0 else f"{differ} elements DIFFER"))
        if differ:
            raise SystemExit(1)
        previous_accepted = accepted

    # Flush the last step's pending records with the standalone fold.
    pool.state[...] = pool_buffer.to(CPU()).to_numpy()
    ring_host = ring.to(CPU()).to_numpy()
    gdfold_max.fold(pool.state, ring_host, np.array(requests, np.uint32).T.copy(),
                    ring_banks[(args.steps - 1) % 2], previous_accepted)
    if not np.array_equal(pool.state.view(np.uint32), expected.view(np.uint32)):
        raise SystemExit("the flushed pool differs from the forward")
    print("every step matched the forward over the accepted tokens, bit for bit")


if __name__ == "__main__":
    main()
