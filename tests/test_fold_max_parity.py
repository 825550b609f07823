"""On records written by MAX's own verify, our fold equals MAX's fold and MAX's forward
over the accepted tokens alone, bit for bit (GPU only: MAX's ops have no CPU path)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_bits_equal
from gdfold_max import reference
from gdfold_max.layout import RecordLayout

pytestmark = pytest.mark.gpu

LAYERS, BATCH, NV, NK, DIM = 2, 4, 4, 2, 128


def _parity_graph(state_dtype, ring_len: int, accepted: np.ndarray, where):  # noqa: ANN001, ANN202
    from max.dtype import DType
    from max.graph import BufferType, Graph, TensorType
    from max.nn.state_space import (
        gated_delta_recurrence_fwd,
        gated_delta_recurrence_verify_ring_fwd,
        gated_delta_state_fold,
        verify_width_operand,
    )

    from gdfold_max import kernels_path, state_fold

    window = ring_len
    conv_dim = 2 * NK * DIM + NV * DIM
    rows, ring_rows = LAYERS * BATCH + 2, LAYERS * BATCH + 1
    stride = RecordLayout(DIM, DIM, NV // NK).min_stride
    kept = int(accepted.sum())
    keepers = int(np.count_nonzero(accepted))
    u32 = DType.uint32
    types = [
        BufferType(state_dtype, [rows, NV, DIM, DIM], where),  # pool folded by MAX
        BufferType(state_dtype, [rows, NV, DIM, DIM], where),  # pool folded by us
        BufferType(state_dtype, [rows, NV, DIM, DIM], where),  # pool run forward over the kept tokens
        BufferType(DType.float32, [ring_rows, NK, ring_len, stride], where),
        TensorType(u32, [LAYERS, BATCH], where),
        TensorType(u32, [LAYERS, BATCH], where),
        TensorType(u32, [BATCH], where),
        TensorType(u32, [BATCH + 1], where),
        TensorType(u32, [keepers + 1], where),
    ]
    for _ in range(LAYERS):
        types += [
            TensorType(DType.float32, [BATCH * window, conv_dim], where),
            TensorType(DType.float32, [BATCH * window, NV], where),
            TensorType(DType.float32, [BATCH * window, NV], where),
            TensorType(u32, [BATCH], where),
            TensorType(u32, [BATCH], where),
            TensorType(DType.float32, [kept, conv_dim], where),
            TensorType(DType.float32, [kept, NV], where),
            TensorType(DType.float32, [kept, NV], where),
            TensorType(u32, [keepers], where),
        ]
    with Graph(f"parity_{state_dtype.name}_r{ring_len}", input_types=types,
               custom_extensions=[kernels_path()]) as graph:
        pool_max, pool_ours, pool_fwd, ring, row_ids, ring_row_ids, num_accepted, offsets, kept_offsets = (
            graph.inputs[:9])
        width = verify_width_operand(window - 1)
        outputs = []
        for layer in range(LAYERS):
            qkv, decay, beta, slots, ring_slots, kqkv, kdecay, kbeta, kslots = graph.inputs[9 + 9 * layer:
                                                                                           18 + 9 * layer]
            outputs.append(gated_delta_recurrence_verify_ring_fwd(
                qkv.tensor, decay.tensor, beta.tensor, pool_max.buffer, ring.buffer, slots.tensor,
                ring_slots.tensor, offsets.tensor, width))
            outputs.append(gated_delta_recurrence_fwd(
                kqkv.tensor, kdecay.tensor, kbeta.tensor, pool_fwd.buffer, kslots.tensor, kept_offsets.tensor))
        gated_delta_state_fold(pool_max.buffer, ring.buffer, row_ids.tensor, ring_row_ids.tensor,
                               num_accepted.tensor, width)
        state_fold(pool_ours.buffer, ring.buffer, row_ids.tensor, ring_row_ids.tensor, num_accepted.tensor, width)
        graph.output(*outputs)
    return graph


@pytest.mark.parametrize("state_dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("ring_len", [2, 4, 8])
def test_our_fold_equals_max_fold_and_forward(state_dtype_name: str, ring_len: int) -> None:
    import ml_dtypes
    from max.driver import CPU, Accelerator, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef

    from gdfold_max.eager.base import copy_back, host_buffer

    device = Accelerator()
    state_dtype = DType.float32 if state_dtype_name == "float32" else DType.bfloat16
    np_dtype = np.float32 if state_dtype_name == "float32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(ring_len)
    window = ring_len
    accepted = np.array([ring_len, 0, 1, max(ring_len - 1, 1)], np.uint32)
    rows, ring_rows = LAYERS * BATCH + 2, LAYERS * BATCH + 1
    stride = RecordLayout(DIM, DIM, NV // NK).min_stride
    conv_dim = 2 * NK * DIM + NV * DIM
    state_in = (rng.standard_normal((rows, NV, DIM, DIM)) * 0.1).astype(np.float32).astype(np_dtype)
    ring = np.full((ring_rows, NK, ring_len, stride), np.nan, np.float32)
    row_ids = rng.permutation(rows)[: LAYERS * BATCH].reshape(LAYERS, BATCH).astype(np.uint32)
    ring_row_ids = rng.permutation(ring_rows)[: LAYERS * BATCH].reshape(LAYERS, BATCH).astype(np.uint32)
    offsets = np.arange(0, BATCH * window + 1, window, dtype=np.uint32)
    keep_mask = accepted > 0
    kept_offsets = np.concatenate([[0], np.cumsum(accepted[keep_mask])]).astype(np.uint32)
    kept_tokens = np.concatenate([np.arange(b * window, b * window + int(accepted[b])) for b in range(BATCH)])

    graph = _parity_graph(state_dtype, ring_len, accepted, DeviceRef.from_device(device))
    model = InferenceSession(devices=[device]).load(graph)

    def up(array: np.ndarray) -> Buffer:
        return host_buffer(np.ascontiguousarray(array)).to(device)

    pools = [up(state_in) for _ in range(3)]
    ring_buffer = up(ring)
    args = [*pools, ring_buffer, up(row_ids), up(ring_row_ids), up(accepted), up(offsets), up(kept_offsets)]
    for layer in range(LAYERS):
        qkv = rng.standard_normal((BATCH * window, conv_dim)).astype(np.float32)
        decay = rng.uniform(0.6, 1.0, (BATCH * window, NV)).astype(np.float32)
        beta = rng.uniform(0.0, 1.0, (BATCH * window, NV)).astype(np.float32)
        args += [up(qkv), up(decay), up(beta), up(row_ids[layer]), up(ring_row_ids[layer]),
                 up(qkv[kept_tokens]), up(decay[kept_tokens]), up(beta[kept_tokens]),
                 up(row_ids[layer][keep_mask])]
    model.execute(*args)

    folded = [np.empty_like(state_in) for _ in range(3)]
    for pool, out in zip(pools, folded, strict=True):
        copy_back(pool, out)
    by_max, by_us, by_forward = folded
    assert_bits_equal(by_us, by_max, "ours vs MAX gated_delta_state_fold")
    assert_bits_equal(by_us, by_forward, "ours vs MAX gated_delta_recurrence_fwd over the accepted tokens")
    ring_after = ring_buffer.to(CPU()).to_numpy()
    assert_bits_equal(reference.fold(state_in.copy(), ring_after, row_ids, ring_row_ids, accepted), by_us,
                      "numpy reference fold of MAX's records vs ours")
