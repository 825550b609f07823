"""Our per-channel forward beside MAX's own KDA decode (``max.nn.state_space.kda_decode``)
on the same inputs, on the GPU, Kimi-Linear's head size (K = V = 128).

MAX's op takes gate and beta pre-activations; ours takes them activated. ``beta_mode=
"probability"`` passes our betas as they are. No gate mode passes a decay through:
``gate_mode="original"`` decays by ``exp(-exp(a_log) * softplus(raw_gate + dt_bias))``,
so with ``a_log = dt_bias = 0`` the raw gate ``log(expm1(-log d))`` (in float64) gives
back ``d`` up to the rounding of MAX's exp and softplus. The two ops therefore cannot be
expected to agree bit for bit: both are held to a float64 recurrence of our decays
(tolerance, says why below), and their distance from each other is reported.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import float64_channel_forward
from gdfold_max import runner_for
from gdfold_max.cases import WindowCase, random_window_case

pytestmark = pytest.mark.gpu


def max_kda_forward(case: WindowCase, pool: np.ndarray) -> np.ndarray:
    """MAX's kda_decode over the case's windows; updates ``pool`` and returns the readout."""
    from max.driver import Accelerator, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import BufferType, DeviceRef, Graph, TensorType

    from gdfold_max.bench.step import max_kda_decode

    qkv, decay, beta = case.tokens()
    rows, nv, kd, vd = pool.shape
    tokens = qkv.shape[0]
    gpu = DeviceRef.GPU()
    f32, i32 = DType.float32, DType.int32
    with Graph("max_kda_decode", input_types=[
            TensorType(f32, [tokens, qkv.shape[1]], gpu), TensorType(f32, [tokens, nv, kd], gpu),
            TensorType(f32, [tokens, nv], gpu), BufferType(f32, [rows, nv, kd, vd], gpu),
            TensorType(i32, [len(case.row_ids) + 1], gpu), TensorType(i32, [len(case.row_ids)], gpu),
    ]) as graph:
        x, raw_gate, b, state, cu_seqlens, slots = graph.inputs
        graph.output(max_kda_decode(x.tensor, raw_gate.tensor, b.tensor, state.buffer, [slots.tensor],
                                    cu_seqlens.tensor, case.num_key_heads))
    device = Accelerator()
    model = InferenceSession(devices=[device]).load(graph)
    raw = np.log(np.expm1(-np.log(decay.astype(np.float64)))).astype(np.float32)
    pool_on_gpu = Buffer.from_numpy(pool).to(device)
    inputs = [qkv, raw, beta, None, case.input_row_offsets.astype(np.int32), case.row_ids.astype(np.int32)]
    (readout,) = model.execute(*(pool_on_gpu if a is None else Buffer.from_numpy(np.ascontiguousarray(a)).to(device)
                                 for a in inputs))
    pool[...] = pool_on_gpu.to_numpy()
    return readout.to_numpy()


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b)) / np.max(np.abs(b)))


def test_our_forward_beside_max_kda_decode() -> None:
    case = random_window_case(81, windows=[4, 1, 3], previous_num_accepted=[0], num_value_heads=4,
                              num_key_heads=4, key_dim=128, value_dim=128, gate="channel")
    ours_pool = case.state.copy()
    ours = runner_for("gpu").recurrence(*case.tokens(), ours_pool, case.row_ids, case.input_row_offsets)
    max_pool = case.state.copy()
    theirs = max_kda_forward(case, max_pool)
    want_out = np.zeros_like(ours, np.float64)
    for b, (start, end) in enumerate(zip(case.input_row_offsets[:-1], case.input_row_offsets[1:], strict=True)):
        row = int(case.row_ids[b])
        qkv, decay, beta = (a[start:end] for a in case.tokens())
        out, state = float64_channel_forward(qkv, decay, beta, case.state[row], case.num_key_heads)
        want_out[start:end] = out
        # Tolerance, not bits: float64 rounds differently and sums in numpy's order; an fp32
        # recurrence over 4 tokens of 128-long sums stays within a few ulps of the largest
        # value. MAX's decays carry the extra rounding of its exp and softplus.
        for name, pool in (("ours", ours_pool), ("MAX", max_pool)):
            assert relative(pool[row], state) <= 1e-5, f"{name}: state of request {b}"
    for name, out in (("ours", ours), ("MAX", theirs)):
        assert relative(out, want_out) <= 1e-5, f"{name}: readout"
    equal_out = float(np.mean(ours.view(np.uint32) == theirs.view(np.uint32)))
    equal_pool = float(np.mean(ours_pool.view(np.uint32) == max_pool.view(np.uint32)))
    print(f"\nours vs MAX kda_decode: readout bits equal {equal_out:.1%}, largest relative difference"
          f" {relative(ours, theirs.astype(np.float64)):.2e}; pool bits equal {equal_pool:.1%}, largest relative"
          f" difference {relative(ours_pool, max_pool.astype(np.float64)):.2e}")
