"""The op on the CPU against the numpy reference, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from max.driver import Buffer
from max.dtype import DType

from cases_matrix import MATRIX, SPEC_DECODE, matrix_case, spec_case
from conftest import CONFORMANCE_DIR, assert_bits_equal, folded
from gdfold_max import StateFolder, reference
from gdfold_max.cases import FoldCase, random_fold_case


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_fold_matches_reference(cpu_folder: StateFolder, name: str) -> None:
    case = matrix_case(name)
    assert_bits_equal(folded(cpu_folder, case), case.state_out)


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_rows_no_pair_names_stay_identical(cpu_folder: StateFolder, name: str) -> None:
    case = matrix_case(name)
    state = folded(cpu_folder, case)
    named = set(case.row_ids.reshape(-1).tolist())
    skipped = {int(r) for layer in case.row_ids for r, n in zip(layer, case.num_accepted, strict=True)
               if n == 0 or n > case.ring.shape[2]}
    untouched = sorted(set(range(state.shape[0])) - named | skipped)
    assert untouched, "the case must leave some rows alone"
    assert_bits_equal(state[untouched], case.state_in[untouched], "untouched rows")


@pytest.mark.parametrize("name", sorted(SPEC_DECODE))
def test_fold_of_verify_equals_forward_over_accepted(cpu_folder: StateFolder, name: str) -> None:
    case = spec_case(name)
    assert_bits_equal(folded(cpu_folder, case), case.state_out)


def test_nan_poison_catches_a_fold_that_reads_too_far(cpu_folder: StateFolder) -> None:
    """The unread records are NaN: folding one more record than accepted must show it."""
    case = matrix_case("fp32-K64-G2-R4")
    ring_len = case.ring.shape[2]
    one_more = np.where((case.num_accepted > 0) & (case.num_accepted < ring_len), case.num_accepted + 1,
                        case.num_accepted).astype(np.uint32)
    assert (one_more != case.num_accepted).any()
    state = case.state_in.copy()
    cpu_folder.fold(state, case.ring, case.row_ids, case.ring_row_ids, one_more)
    assert np.isnan(state).any()


def test_recorded_max_case_reproduced(cpu_folder: StateFolder) -> None:
    case = FoldCase.load(CONFORMANCE_DIR / "public_case_a.npz")
    assert_bits_equal(folded(cpu_folder, case), case.state_out)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**31),
    layers=st.integers(1, 4),
    batch=st.integers(1, 6),
    groups=st.sampled_from([(4, 4), (4, 2), (4, 1), (8, 2)]),
    spare_rows=st.integers(0, 4),
    stride_pad=st.sampled_from([0, 32, 96]),
    data=st.data(),
)
def test_fold_matches_reference_on_random_tables(cpu_folder: StateFolder, seed: int, layers: int, batch: int,
                                                 groups: tuple[int, int], spare_rows: int, stride_pad: int,
                                                 data: st.DataObject) -> None:
    counts = data.draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch))
    nv, nk = groups
    case = random_fold_case(seed, layers=layers, batch=batch, num_value_heads=nv, num_key_heads=nk, key_dim=64,
                            value_dim=64, ring_len=4, num_accepted=counts, spare_rows=spare_rows,
                            stride_pad=stride_pad)
    assert_bits_equal(folded(cpu_folder, case), case.state_out)


def test_repeated_row_touches_no_other_row(cpu_folder: StateFolder) -> None:
    """Two pairs on one row (padding on a null block) may race, but only on that row."""
    case = matrix_case("fp32-K64-G2-R4")
    row_ids = case.row_ids.copy()
    null_row = int(row_ids[0, 0])
    row_ids[1, :] = null_row
    state = case.state_in.copy()
    cpu_folder.fold(state, case.ring, row_ids, case.ring_row_ids, case.num_accepted)
    want = case.state_in.copy()
    reference.fold(want, case.ring, row_ids, case.ring_row_ids, case.num_accepted)
    others = np.arange(state.shape[0]) != null_row
    assert_bits_equal(state[others], want[others], "rows other than the shared one")


def test_bf16_pool_rounds_to_nearest_even_saturates_and_keeps_nan(cpu_folder: StateFolder) -> None:
    """Ties, overflow to inf, subnormals and NaN at the bf16 store, against ml_dtypes' rounding."""
    import ml_dtypes

    case = matrix_case("bf16-K128-G4-R2")
    nv, kd, vd = case.state_in.shape[1:]
    nk, stride = case.ring.shape[1], case.ring.shape[3]
    state = np.zeros((1, nv, kd, vd), np.float32)
    state[...] = 1.0
    state[..., 1::2] = 1 + 2**-7  # odd last bit: a tie rounds up; even columns (1.0) round down
    state = state.astype(ml_dtypes.bfloat16)
    ring = np.full((1, nk, 2, stride), np.nan, np.float32)
    record = ring[0, :, 0]
    record[:, :kd] = 1.0
    deltas = np.zeros(vd, np.float32)
    deltas[:64] = 2.0**-8  # exactly half a bf16 ulp at 1 and 2
    deltas[64:80] = np.finfo(np.float32).max  # overflows bf16 to inf
    deltas[80:96] = 2.0**-130  # an fp32 subnormal added to 0 after the decay below
    deltas[96:] = np.nan
    group = nv // nk
    record[:, kd : kd + group * vd] = np.tile(deltas, group)
    record[:, kd + group * vd : kd + group * vd + group] = 1.0
    state[..., 80:96] = 0
    folded = state.copy()
    cpu_folder.fold(folded, ring, [[0]], [[0]], [1])
    want = reference.fold(state.copy(), ring, [[0]], [[0]], [1])
    as_f32 = np.asarray(folded, np.float32)
    assert np.isnan(as_f32[..., 96:]).all()
    assert np.isposinf(as_f32[..., 64:80]).all()
    assert (as_f32[..., 0:64:2] == 1.0).all() and (as_f32[..., 1:64:2] == 1 + 2**-6).all()
    assert (as_f32[..., 80:96] == 2.0**-130).all()
    assert_bits_equal(folded[..., :96], want[..., :96])


def test_fold_accepts_max_buffers(cpu_folder: StateFolder) -> None:
    """Buffers on the folder's device are folded in place, tables may be Buffers too."""
    case = matrix_case("bf16-K128-G4-R2")
    bits16 = case.state_in.view(np.uint16).copy()
    state = Buffer.from_numpy(bits16).view(DType.bfloat16)
    tables = [Buffer.from_numpy(np.ascontiguousarray(t)) for t in (case.row_ids, case.ring_row_ids,
                                                                    case.num_accepted)]
    returned = cpu_folder.fold(state, Buffer.from_numpy(case.ring), *tables)
    assert returned is state
    assert np.array_equal(bits16, case.state_out.view(np.uint16))
