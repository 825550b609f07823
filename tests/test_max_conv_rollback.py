"""MAX's conv-window rollback, which every speculative route keeps (ours included): after a
verify, ``gated_delta_conv1d_verify_fwd(rollback=True)`` over the accepted rows, gathered
and offset as MAX's ``replay_conv_pools`` gathers them (``accepted_row_plan``: one row per
token and draft of every request, the rows past the accepted total repeating the last
accepted one), must leave each request's conv window as the accepted tokens alone would:
the last ``kernel_size - 1`` inputs, oldest first, stored in the pool's dtype. Checked step
after step on the same pool, fp32 and bf16 pools, at MAX's MTP and DFlash2 widths.

With bf16 state pools every speculative Qwen3.5 server answered token 0 where plain
decoding did not, MAX's own included (docs/integrations.md, "DFlash2"); MAX's verify and
fold are checked bit for bit with bf16 pools elsewhere (test_fold_max_parity.py), the conv
rollback is checked here. GPU only: MAX's conv ops have no CPU kernel; the graph is built
on the CPU too, so that a change in MAX's signatures shows in CI.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conftest import assert_bits_equal

pytest.importorskip("max.pipelines.architectures.unified_mtp_qwen3_5.state_rollback",
                    reason="MAX's pipelines need the max-pipelines extra")

#: The tiny checkpoint's conv: 2 key heads and 4 value heads of 128, a kernel of 4.
KEY_HEADS, VALUE_HEADS, HEAD_DIM, KERNEL = 2, 4, 128, 4
CONV_DIM = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM
BATCH, SLOTS, STEPS = 4, 7, 3


def rollback_graph(state_dtype: Any, drafts: int, device: Any) -> Any:
    """One speculative step of MAX's conv on a pool: the verify's launch (the window only
    read at a width above 0), then the rollback over the accepted rows as
    ``replay_conv_pools`` runs it. Inputs: the verify's conv input ``[batch * (1 +
    drafts), CONV_DIM]``, the weights, the pool, the requests' slots, the verify's offsets
    and the accepted drafts; output: the verify's conv output."""
    from max.dtype import DType
    from max.graph import BufferType, Dim, Graph, TensorType, ops
    from max.nn.state_space import gated_delta_conv1d_verify_fwd, verify_width_operand
    from max.pipelines.architectures.unified_mtp_qwen3_5.state_rollback import accepted_row_plan

    types = [TensorType(DType.float32, ["total_rows", CONV_DIM], device),
             TensorType(DType.float32, [CONV_DIM, KERNEL], device),
             BufferType(state_dtype, ["slots", CONV_DIM, KERNEL - 1], device),
             TensorType(DType.uint32, ["batch_size"], device),
             TensorType(DType.uint32, ["offsets_len"], device),
             TensorType(DType.int64, ["batch_size"], device)]
    with Graph(f"max_conv_rollback_{drafts}", input_types=types) as graph:
        qkv, weight, pool, slots, offsets, accepted = graph.inputs
        width = verify_width_operand(drafts)
        out = gated_delta_conv1d_verify_fwd(qkv.tensor, weight.tensor, pool.buffer, slots.tensor, offsets.tensor,
                                            width, rollback=False)
        rows, replay_offsets = accepted_row_plan(
            offsets.tensor, accepted.tensor, ops.constant(drafts, DType.int64, device=device), Dim("total_rows"),
            device, plan_rows=Dim("batch_size") * (1 + drafts))
        gated_delta_conv1d_verify_fwd(ops.gather(qkv.tensor, rows, axis=0), weight.tensor, pool.buffer,
                                      slots.tensor, replay_offsets.cast(DType.uint32), width, rollback=True)
        graph.output(out)
    return graph


def test_the_rollback_graph_builds_as_max_s_replay_builds_it() -> None:
    from max.dtype import DType
    from max.graph import DeviceRef

    for state_dtype in (DType.float32, DType.bfloat16):
        text = str(rollback_graph(state_dtype, 7, DeviceRef.GPU()))
        assert text.count('"gated_delta_conv1d_verify_fwd"') == 2


def expected_windows(pool: np.ndarray, qkv: np.ndarray, slots: np.ndarray, accepted: np.ndarray,
                     drafts: int) -> np.ndarray:
    """The pool after the step: each request's window moved over its token and accepted
    drafts (oldest first), in the pool's dtype; other slots as they were."""
    out = pool.copy()
    for b, slot in enumerate(slots):
        start = b * (1 + drafts)
        kept = qkv[start:start + 1 + int(accepted[b])]
        window = np.concatenate([pool[slot].astype(np.float32).T, kept])
        out[slot] = window[-(KERNEL - 1):].T.astype(pool.dtype)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("drafts", [3, 7])
def test_max_s_conv_rollback_keeps_the_accepted_tokens_window(state_dtype_name: str, drafts: int) -> None:
    import ml_dtypes
    from max.driver import CPU, Accelerator
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef

    from gdfold_max.eager.base import copy_back, host_buffer

    device = Accelerator()
    state_dtype = DType.float32 if state_dtype_name == "float32" else DType.bfloat16
    np_dtype = np.float32 if state_dtype_name == "float32" else ml_dtypes.bfloat16
    model = InferenceSession(devices=[device]).load(rollback_graph(state_dtype, drafts,
                                                                   DeviceRef.from_device(device)))
    rng = np.random.default_rng(drafts)
    pool = rng.standard_normal((SLOTS, CONV_DIM, KERNEL - 1)).astype(np.float32).astype(np_dtype)
    weight = rng.standard_normal((CONV_DIM, KERNEL)).astype(np.float32)
    slots = rng.permutation(SLOTS)[:BATCH].astype(np.uint32)
    offsets = np.arange(0, BATCH * (1 + drafts) + 1, 1 + drafts, dtype=np.uint32)
    pool_buffer = host_buffer(pool.copy()).to(device)
    # What every step reads as it is: uploaded once.
    weight_buffer, slots_buffer, offsets_buffer = (host_buffer(a).to(device) for a in (weight, slots, offsets))
    want = pool.copy()
    for step in range(STEPS):
        # Every request a different count each step: none, one, all, and between.
        accepted = np.roll(np.array([0, 1, drafts, drafts // 2], np.int64), step)
        qkv = rng.standard_normal((BATCH * (1 + drafts), CONV_DIM)).astype(np.float32)
        (out,) = model.execute(host_buffer(qkv).to(device), weight_buffer, pool_buffer, slots_buffer, offsets_buffer,
                               host_buffer(accepted).to(device))
        assert np.isfinite(out.to(CPU()).to_numpy()).all(), f"conv output at step {step}"
        want = expected_windows(want, qkv, slots, accepted, drafts)
        got = np.empty_like(pool)
        copy_back(pool_buffer, got)
        assert_bits_equal(got, want, f"conv pool after step {step} (accepted {accepted.tolist()})")
