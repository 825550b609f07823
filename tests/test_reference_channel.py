"""The numpy reference with per-channel gates (Kimi Delta Attention): each key row of a
value head's state decays by its own factor, ``S[i, :] *= d[i]``, and the records hold K
decays per value head. The reference's own promises hold bit for bit, as they do with
one decay per head; its forward agrees with a float64 recurrence."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_bits_equal, float64_channel_forward
from gdfold_max import reference
from gdfold_max.cases import random_fold_case, random_window_case, spec_decode_case
from gdfold_max.layout import RecordLayout


@pytest.mark.parametrize(("k", "v", "g"), [(128, 128, 2), (64, 32, 1), (8, 8, 3)])
def test_per_channel_layout_tiles_the_record(k: int, v: int, g: int) -> None:
    layout = RecordLayout(k, v, g, gate="channel")
    assert layout.decay_length == k
    assert [layout.decay_offset(j) for j in range(g)] == [k + g * v + j * k for j in range(g)]
    assert layout.decay_offset(g - 1) + k == layout.elements == k + g * (v + k)
    assert layout.min_stride % 32 == 0 and layout.min_stride - 32 < layout.elements <= layout.min_stride


def test_unknown_gate_and_decay_rank_are_refused() -> None:
    with pytest.raises(ValueError, match="gate: 'row' is not 'head' or 'channel'"):
        RecordLayout(64, 64, 2, gate="row")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"decay: expected \[T, nv\] or \[T, nv, K\], got rank 1"):
        reference.gate_of(np.ones(3, np.float32))


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_fold_of_verify_records_equals_forward_over_accepted_tokens(state_dtype: str) -> None:
    case = spec_decode_case(61, layers=2, batch=4, num_accepted=[4, 0, 1, 3], gate="channel",
                            state_dtype=state_dtype)
    assert case.extras["decay"].shape[-1] == 64
    folded = reference.fold(case.state_in.copy(), case.ring, case.row_ids, case.ring_row_ids, case.num_accepted,
                            gate="channel")
    assert_bits_equal(folded, case.state_out)
    # Read as one decay per head, the same records give another state: the gate matters.
    as_heads = reference.fold(case.state_in.copy(), case.ring, case.row_ids, case.ring_row_ids, case.num_accepted)
    assert not np.array_equal(as_heads, case.state_out)


def test_fold_on_load_equals_fold_then_verify() -> None:
    case = random_window_case(62, gate="channel")
    fused_pool, fused_ring = case.fresh()
    fused = reference.verify_ring(*case.tokens(), fused_pool, fused_ring, case.row_ids, case.ring_row_ids,
                                  case.input_row_offsets, previous_ring_row_ids=case.previous_ring_row_ids,
                                  previous_num_accepted=case.previous_num_accepted)
    pool, ring = case.fresh()
    reference.fold(pool, ring, case.row_ids[None], case.previous_ring_row_ids[None], case.previous_num_accepted,
                   gate="channel")
    plain = reference.verify_ring(*case.tokens(), pool, ring, case.row_ids, case.ring_row_ids,
                                  case.input_row_offsets)
    for name, a, b in (("readout", fused, plain), ("pool", fused_pool, pool), ("ring", fused_ring, ring)):
        assert_bits_equal(a, b, name)


def test_equal_channel_decays_give_the_head_gate_s_bits() -> None:
    """K equal decays per head are one decay per head: every output the same bits."""
    case = random_window_case(63)
    spread = np.repeat(case.decay[:, :, None], case.state.shape[2], axis=2)
    head_pool, channel_pool = case.state.copy(), case.state.copy()
    tables = (case.row_ids, case.input_row_offsets)
    head = reference.recurrence(case.qkv, case.decay, case.beta, head_pool, *tables,
                                    num_key_heads=case.num_key_heads)
    channel = reference.recurrence(case.qkv, spread, case.beta, channel_pool, *tables,
                                       num_key_heads=case.num_key_heads)
    assert_bits_equal(channel, head, "readout")
    assert_bits_equal(channel_pool, head_pool, "pool")
    fold_case = random_fold_case(64, layers=2, batch=4)
    layout, wide = RecordLayout(64, 64, 2), RecordLayout(64, 64, 2, gate="channel")
    ring = np.full(fold_case.ring.shape[:3] + (wide.min_stride,), np.nan, np.float32)
    ring[..., : layout.decay_offset(0)] = fold_case.ring[..., : layout.decay_offset(0)]
    for j in range(2):
        ring[..., wide.decay_offset(j) : wide.decay_offset(j) + 64] = fold_case.ring[..., layout.decay_offset(j), None]
    channel_state = reference.fold(fold_case.state_in.copy(), ring, fold_case.row_ids, fold_case.ring_row_ids,
                                   fold_case.num_accepted, gate="channel")
    assert_bits_equal(channel_state, fold_case.state_out)


def test_forward_agrees_with_a_float64_recurrence() -> None:
    """Tolerance, not bits: float64 rounds differently (and sums in numpy's order); the
    fp32 recurrence over 9 tokens stays within a few fp32 ulps of the largest value."""
    case = random_window_case(65, windows=[9], previous_num_accepted=[0], gate="channel")
    pool = case.state.copy()
    readout = reference.recurrence(*case.tokens(), pool, case.row_ids, case.input_row_offsets,
                                       num_key_heads=case.num_key_heads)
    row = int(case.row_ids[0])
    want_out, want_state = float64_channel_forward(case.qkv, case.decay, case.beta, case.state[row], case.num_key_heads)
    assert np.max(np.abs(readout - want_out)) <= 2e-6 * np.max(np.abs(want_out))
    assert np.max(np.abs(pool[row] - want_state)) <= 2e-6 * np.max(np.abs(want_state))
