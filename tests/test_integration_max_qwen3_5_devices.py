"""MAX's Qwen3.5 rollback fold (``fold_state_pools``) under ``patched()`` on heads split
over devices, as MAX runs a tensor-parallel model: each device holds one shard's pool,
ring and row tables, and MAX broadcasts the accepted counts from the first device
(``ops.distributed_broadcast``) before one fold per device. Each device's pool, bit for
bit, against the reference fold on its own heads. GPU only (MAX's broadcast and its
``Signals`` need accelerators; one device on the CPU is tests/test_integration_max_qwen3_5.py's):
the first GPU alone, the second alone, and two GPUs where there are two."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("max.pipelines.architectures.unified_mtp_qwen3_5.state_rollback",
                    reason="MAX's pipelines need the max-pipelines extra")

from max.driver import Accelerator, Buffer  # noqa: E402
from max.dtype import DType  # noqa: E402
from max.engine import InferenceSession  # noqa: E402
from max.graph import BufferType, DeviceRef, Graph, TensorType  # noqa: E402
from max.nn.comm import Signals  # noqa: E402
from max.nn.state_space import verify_width_operand  # noqa: E402
from max.pipelines.architectures.unified_mtp_qwen3_5 import state_rollback  # noqa: E402

from conftest import NEEDS_TWO_GPUS, assert_bits_equal  # noqa: E402
from gdfold_max import kernels_path, reference  # noqa: E402
from gdfold_max.cases import random_fold_case  # noqa: E402
from gdfold_max.eager.base import copy_back  # noqa: E402
from gdfold_max.integrations import max_qwen3_5  # noqa: E402
from gdfold_max.sharded import shard_heads, shard_pool, shard_ring  # noqa: E402

pytestmark = pytest.mark.gpu


def rollback_over(gpus: list[int], case: object) -> list[np.ndarray]:
    """MAX's ``fold_state_pools`` built under ``patched()`` over ``gpus``, shard i on
    GPU gpus[i]; returns each shard's pool after one execution."""
    c = case
    nv, nk = c.state_in.shape[1], c.ring.shape[1]  # type: ignore[attr-defined]
    shards = shard_heads(nv, nk, len(gpus))
    where = [DeviceRef.GPU(i) for i in gpus]
    f32, u32 = DType.float32, DType.uint32
    inputs: list[BufferType | TensorType] = []
    for ref in where:
        inputs += [BufferType(f32, ["rows", nv // len(gpus), *c.state_in.shape[2:]], ref),  # type: ignore[attr-defined]
                   BufferType(f32, ["ring_rows", nk // len(gpus), *c.ring.shape[2:]], ref),  # type: ignore[attr-defined]
                   TensorType(u32, ["layers", "batch"], ref), TensorType(u32, ["layers", "batch"], ref)]
    inputs.append(TensorType(u32, ["batch"], where[0]))
    signals = Signals(where) if len(where) > 1 else None
    if signals is not None:
        inputs += signals.input_types()
    with max_qwen3_5.patched(), Graph(f"rollback_{'_'.join(map(str, gpus))}", input_types=inputs,
                                      custom_extensions=[kernels_path()]) as graph:
        values = list(graph.inputs)
        per_device = [values[4 * i: 4 * i + 4] for i in range(len(where))]
        signal_buffers = [v.buffer for v in values[4 * len(where) + 1:]]
        state_rollback.fold_state_pools(
            [d[0].buffer for d in per_device], [d[2].tensor for d in per_device], [d[1].buffer for d in per_device],
            [d[3].tensor for d in per_device], values[4 * len(where)].tensor, signal_buffers,
            verify_width_operand(3))
        graph.output()
    devices = [Accelerator(i) for i in gpus]
    model = InferenceSession(devices=devices).load(graph)
    pools = [shard_pool(c.state_in, shard) for shard in shards]  # type: ignore[attr-defined]
    buffers: list[Buffer] = []
    for device, shard, pool in zip(devices, shards, pools, strict=True):
        buffers += [Buffer.from_numpy(pool).to(device), Buffer.from_numpy(shard_ring(c.ring, shard)).to(device),  # type: ignore[attr-defined]
                    Buffer.from_numpy(c.row_ids).to(device), Buffer.from_numpy(c.ring_row_ids).to(device)]  # type: ignore[attr-defined]
    buffers.append(Buffer.from_numpy(c.num_accepted).to(devices[0]))  # type: ignore[attr-defined]
    model.execute(*buffers, *(signals.buffers() if signals is not None else []))
    for i, pool in enumerate(pools):
        copy_back(buffers[4 * i], pool)
    return pools


@pytest.mark.parametrize("gpus", [
    pytest.param([0], id="gpu0"),
    pytest.param([1], id="gpu1", marks=NEEDS_TWO_GPUS),
    pytest.param([0, 1], id="gpu0-gpu1", marks=NEEDS_TWO_GPUS),
])
def test_max_rollback_under_patched_folds_every_device_s_heads_bit_exactly(gpus: list[int]) -> None:
    """Several layers, shuffled tables, counts of 0, 1, a full ring and past the ring."""
    case = random_fold_case(43, layers=3, batch=4, num_accepted=[0, 1, 4, 5])
    want = reference.fold(case.state_in.copy(), case.ring, case.row_ids, case.ring_row_ids, case.num_accepted)
    pools = rollback_over(gpus, case)
    for shard, pool in zip(shard_heads(4, 2, len(gpus)), pools, strict=True):
        assert_bits_equal(pool, shard_pool(want, shard), f"shard {shard.index} on GPU {gpus[shard.index]}")
