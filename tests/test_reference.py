"""The numpy oracle: its fma is exact, its fold agrees with its forward and with MAX."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CONFORMANCE_DIR, assert_bits_equal
from gdfold_max import reference
from gdfold_max.cases import FoldCase, spec_decode_case
from gdfold_max.layout import RecordLayout


def round_to_f32(value: Fraction) -> float:
    """Rounds an exact rational to the nearest float32 (ties to even), independently of numpy."""
    if value == 0:
        return 0.0
    sign = -1 if value < 0 else 1
    x = abs(value)
    exponent = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** exponent > x:
        exponent -= 1
    while Fraction(2) ** (exponent + 1) <= x:
        exponent += 1
    ulp = Fraction(2) ** max(exponent - 23, -149)
    quotient = x / ulp
    whole = quotient.numerator // quotient.denominator
    rest = quotient - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    result = sign * whole * ulp
    if abs(result) >= Fraction(2) ** 128:
        return sign * float("inf")
    return float(result)


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-(2.0**60), max_value=2.0**60)


@settings(max_examples=400, deadline=None)
@given(finite_f32, finite_f32, finite_f32)
def test_fma_f32_is_correctly_rounded(a: float, b: float, c: float) -> None:
    want = round_to_f32(Fraction(a) * Fraction(b) + Fraction(c))
    got = float(reference.fma_f32(np.float32(a), np.float32(b), np.float32(c)))
    assert got == want or (got == 0 and want == 0), (a, b, c, got, want)


def test_fma_f32_rounds_once_where_two_roundings_differ() -> None:
    a = np.float32(1 + 2**-12)
    c = np.float32(-(1 + 2**-11))
    two_roundings = np.float32(a * a) + c  # the product alone rounds away the 2**-24 term
    assert float(two_roundings) == 0.0
    assert float(reference.fma_f32(a, a, c)) == 2.0**-24


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_fold_of_verify_records_equals_forward_over_accepted_tokens(state_dtype: str, group: int) -> None:
    case = spec_decode_case(11, state_dtype=state_dtype, num_value_heads=2 * group, num_key_heads=2,
                            key_dim=32, value_dim=32, ring_len=4, verify_width=3, batch=5,
                            num_accepted=[4, 0, 1, 3, 2])
    folded = reference.fold(*case.fold_operands())
    assert_bits_equal(folded, case.state_out)


def test_reference_fold_reproduces_recorded_max_case() -> None:
    case = FoldCase.load(CONFORMANCE_DIR / "public_case_a.npz")
    folded = reference.fold(*case.fold_operands())
    assert_bits_equal(folded, case.state_out)


def test_reference_verify_writes_max_records() -> None:
    """Keys and decays are copies, so they match MAX's ring bit for bit; the deltas
    come out of reductions whose order MAX does not document, so they are compared
    with a tolerance (relative to the largest delta)."""
    case = FoldCase.load(CONFORMANCE_DIR / "public_case_a.npz")
    meta = case.meta
    layout = RecordLayout(meta["K"], meta["V"], meta["nv"] // meta["nk"])
    ring = np.full_like(case.ring, np.nan)
    state = case.state_in.copy()
    for layer in range(meta["L"]):
        reference.verify_ring(case.extras["qkv"][layer], case.extras["decay"][layer], case.extras["beta"][layer],
                              state, ring, case.row_ids[layer], case.ring_row_ids[layer],
                              case.extras["input_row_offsets"])
    written = ~np.isnan(case.ring)
    assert written.any()
    keys = np.s_[..., : layout.key_dim]
    decays = np.s_[..., layout.decay_offset(0) : layout.elements]
    deltas = np.s_[..., layout.delta_offset(0) : layout.decay_offset(0)]
    for part in (keys, decays):
        mask = written[part]
        assert np.array_equal(ring[part][mask].view(np.uint32), case.ring[part][mask].view(np.uint32))
    mask = written[deltas]
    scale = np.abs(case.ring[deltas][mask]).max()
    assert np.abs(ring[deltas][mask] - case.ring[deltas][mask]).max() <= 1e-5 * scale
    assert np.array_equal(state.view(np.uint32), case.state_in.view(np.uint32)), "verify wrote the pool"


def test_verify_longer_than_ring_commits_the_pool() -> None:
    case = spec_decode_case(3, key_dim=16, value_dim=16, ring_len=4, verify_width=3, batch=1, layers=1,
                            num_accepted=[4])
    qkv, decay, beta = (case.extras[k][0] for k in ("qkv", "decay", "beta"))
    offsets = case.extras["input_row_offsets"]
    short_ring = np.full((case.ring.shape[0], case.ring.shape[1], 2, case.ring.shape[3]), np.nan, np.float32)
    committed = case.state_in.copy()
    reference.verify_ring(qkv, decay, beta, committed, short_ring, case.row_ids[0], case.ring_row_ids[0], offsets)
    assert np.isnan(short_ring).all(), "a window longer than the ring must not be recorded"
    forward = case.state_in.copy()
    reference.recurrence(qkv, decay, beta, forward, case.row_ids[0], offsets, num_key_heads=2)
    assert_bits_equal(committed, forward)
