"""Decoding steps of a tensor-parallel model: the heads split over devices, each device
with its own pool, ring and row tables, the accepted counts broadcast as MAX's Qwen3.5
rollback does, and every device checked bit for bit against the numpy reference on its
own heads.

    python examples/sharded_step.py                 # one shard per GPU (all of them)
    python examples/sharded_step.py --shards 2      # two GPUs
    python examples/sharded_step.py --shards 1 --first-gpu 1  # the second GPU alone
    python examples/sharded_step.py --cpu --shards 2  # two shards on the CPU
    python examples/sharded_step.py --separate-fold   # fold, then a plain verify

Each step runs, in one MAX graph over the devices, every shard's verify with fold on
load (the previous step's accepted records folded as the state loads), or with
``--separate-fold`` every shard's fold of those records and then its plain verify, then
checks the readouts, pools and rings of every shard against the reference (the same
bits either way). Across several GPUs the counts reach each
device by ``ops.distributed_broadcast`` (``max.nn.comm.Signals``); shards that share a
device share the counts.
"""

from __future__ import annotations

import argparse

import numpy as np
from max.driver import CPU, Accelerator, Device, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops
from max.nn.comm import Signals

from gdfold_max import reference
from gdfold_max.cases import random_window_case, shard_window_case
from gdfold_max.eager.base import copy_back, host_buffer
from gdfold_max.ops.kernels import kernels_path
from gdfold_max.sharded import (
    fold_shards,
    shard_heads,
    shard_pool,
    shard_ring,
    verify_shards,
)

# A small model: 8 value heads over 4 key heads (G = 2), K = V = 32, RING_LEN 4.
NUM_VALUE_HEADS, NUM_KEY_HEADS, K, V = 8, 4, 32, 32
TOKENS_PER_SHARD = 5  # qkv, decay, beta, pool, ring
TABLES = ("row_ids", "ring_row_ids", "input_row_offsets", "previous_ring_row_ids", "previous_num_accepted")


def build_graph(where: list[DeviceRef], operands: list[list[np.ndarray]], tables: dict[str, np.ndarray],
                separate_fold: bool = False) -> tuple[Graph, Signals | None]:
    """One layer's verify with fold on load on every shard (shard i on where[i]), or with
    ``separate_fold`` every shard's fold then its plain verify, and the signals whose
    buffers the graph takes when the shards span several devices."""
    f32, u32 = DType.float32, DType.uint32
    inputs: list[TensorType | BufferType] = []
    for device, (qkv, decay, beta, pool, ring) in zip(where, operands, strict=True):
        inputs += [TensorType(f32, list(qkv.shape), device), TensorType(f32, list(decay.shape), device),
                   TensorType(f32, list(beta.shape), device), BufferType(f32, list(pool.shape), device),
                   BufferType(f32, list(ring.shape), device)]
        inputs += [TensorType(u32, list(tables[name].shape), device) for name in TABLES[:-1]]
    # The sampler's counts, on the first device; the others get them by broadcast.
    inputs.append(TensorType(u32, list(tables["previous_num_accepted"].shape), where[0]))
    distinct = list(dict.fromkeys(where))
    signals = None
    if len(distinct) > 1:
        signals = Signals(distinct)
        inputs += signals.input_types()
    name = f"sharded_{'fold_then_verify' if separate_fold else 'step'}_{len(where)}"
    with Graph(name, input_types=inputs, custom_extensions=[kernels_path()]) as graph:
        values = list(graph.inputs)
        per = TOKENS_PER_SHARD + len(TABLES) - 1
        shards = [values[i * per : (i + 1) * per] for i in range(len(where))]
        counts = values[len(where) * per].tensor
        signal_buffers = [v.buffer for v in values[len(where) * per + 1 :]]
        pools, rings = [s[3].buffer for s in shards], [s[4].buffer for s in shards]
        previous_rows = [s[8].tensor for s in shards]
        if separate_fold:
            # The fold's tables are [layers, batch]: this one layer's rows, and the rows
            # the previous step recorded into.
            fold_shards(pools, rings, [ops.unsqueeze(s[5].tensor, 0) for s in shards],
                        [ops.unsqueeze(rows, 0) for rows in previous_rows], counts, signal_buffers)
        readouts = verify_shards(
            [s[0].tensor for s in shards], [s[1].tensor for s in shards], [s[2].tensor for s in shards],
            pools, rings, [s[5].tensor for s in shards], [s[6].tensor for s in shards],
            [s[7].tensor for s in shards], previous_ring_row_ids=None if separate_fold else previous_rows,
            previous_num_accepted=None if separate_fold else counts, signal_buffers=signal_buffers,
        )
        graph.output(*readouts)
    return graph, signals


def run(num_shards: int, steps: int, on_cpu: bool, first_gpu: int = 0, separate_fold: bool = False) -> bool:
    """Runs ``steps`` steps on ``num_shards`` shards (on GPUs ``first_gpu`` on, or the
    CPU); True when every shard matched."""
    if on_cpu:
        drivers: list[Device] = [CPU()] * num_shards
        where = [DeviceRef.CPU()] * num_shards
    else:
        gpus = range(first_gpu, first_gpu + num_shards)
        if first_gpu < 0 or accelerator_count() < gpus.stop:
            raise SystemExit(f"--shards {num_shards} --first-gpu {first_gpu}: needs GPUs {gpus.start} to"
                             f" {gpus.stop - 1}, and {accelerator_count()} are here (--cpu runs on the CPU)")
        drivers = [Accelerator(i) for i in gpus]
        where = [DeviceRef.GPU(i) for i in gpus]
    shards = shard_heads(NUM_VALUE_HEADS, NUM_KEY_HEADS, num_shards)
    session = InferenceSession(devices=list(dict.fromkeys(drivers)))
    model = None
    all_matched = True
    for step in range(steps):
        case = random_window_case(100 + step, windows=[4, 0, 1, 6, 3], num_value_heads=NUM_VALUE_HEADS,
                                  num_key_heads=NUM_KEY_HEADS, key_dim=K, value_dim=V)
        tables = {name: getattr(case, name) for name in TABLES}
        operands = [list(shard_window_case(case, shard)) for shard in shards]
        if model is None:
            graph, signals = build_graph(where, operands, tables, separate_fold)
            model = session.load(graph)
            signal_buffers = signals.buffers() if signals is not None else []
        buffers = []
        for driver, shard_operands in zip(drivers, operands, strict=True):
            buffers += [host_buffer(x).to(driver) for x in shard_operands]
            buffers += [host_buffer(tables[name]).to(driver) for name in TABLES[:-1]]
        buffers.append(host_buffer(tables["previous_num_accepted"]).to(drivers[0]))
        readouts = model.execute(*buffers, *signal_buffers)
        want_pool, want_ring = case.fresh()
        want = reference.verify_ring(*case.tokens(), want_pool, want_ring, case.row_ids, case.ring_row_ids,
                                     case.input_row_offsets, previous_ring_row_ids=case.previous_ring_row_ids,
                                     previous_num_accepted=case.previous_num_accepted)
        per = TOKENS_PER_SHARD + len(TABLES) - 1
        differing = 0
        for shard, readout in zip(shards, readouts, strict=True):
            pool, ring = operands[shard.index][3], operands[shard.index][4]
            copy_back(buffers[shard.index * per + 3], pool)
            copy_back(buffers[shard.index * per + 4], ring)
            columns = slice(shard.value_heads.start * V, shard.value_heads.stop * V)
            for got, expected in ((np.asarray(readout.to(CPU()).to_numpy()), want[:, columns]),
                                  (pool, shard_pool(want_pool, shard)), (ring, shard_ring(want_ring, shard))):
                differing += int(np.count_nonzero(got.view(np.uint32) != expected.view(np.uint32)))
        matched = differing == 0
        all_matched &= matched
        print(f"step {step}: {num_shards} shards, " + ("every shard bit-exact" if matched
                                                        else f"{differing} elements differ"))
    print("every step matched" if all_matched else "MISMATCH")
    return all_matched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=None, help="default: one per GPU, or 1 with --cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="every shard on the CPU")
    parser.add_argument("--first-gpu", type=int, default=0, help="the GPU of the first shard (default 0)")
    parser.add_argument("--separate-fold", action="store_true",
                        help="fold the previous records, then a plain verify (default: fold on load)")
    args = parser.parse_args()
    shards = args.shards or (1 if args.cpu else max(1, accelerator_count() - args.first_gpu))
    if not run(shards, args.steps, args.cpu, args.first_gpu, args.separate_fold):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
