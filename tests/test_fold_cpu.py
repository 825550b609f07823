"""The op on the CPU against the numpy reference, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases_matrix import MATRIX, SPEC_DECODE, matrix_case, spec_case
from conftest import CONFORMANCE_DIR, assert_bits_equal
from gdfold_max import StateFolder, reference
from gdfold_max.cases import FoldCase, random_fold_case


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_fold_matches_reference(cpu_folder: StateFolder, name: str) -> None:
    case = matrix_case(name)
    state, *rest = case.fold_operands()
    cpu_folder.fold(state, *rest)
    assert_bits_equal(state, case.state_out)


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_rows_no_pair_names_stay_identical(cpu_folder: StateFolder, name: str) -> None:
    case = matrix_case(name)
    state, *rest = case.fold_operands()
    cpu_folder.fold(state, *rest)
    named = set(case.row_ids.reshape(-1).tolist())
    skipped = {int(r) for layer in case.row_ids for r, n in zip(layer, case.num_accepted, strict=True)
               if n == 0 or n > case.ring.shape[2]}
    untouched = sorted(set(range(state.shape[0])) - named | skipped)
    assert untouched, "the case must leave some rows alone"
    assert_bits_equal(state[untouched], case.state_in[untouched], "untouched rows")


@pytest.mark.parametrize("name", sorted(SPEC_DECODE))
def test_fold_of_verify_equals_forward_over_accepted(cpu_folder: StateFolder, name: str) -> None:
    case = spec_case(name)
    state, *rest = case.fold_operands()
    cpu_folder.fold(state, *rest)
    assert_bits_equal(state, case.state_out)


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
    state, *rest = case.fold_operands()
    cpu_folder.fold(state, *rest)
    assert_bits_equal(state, case.state_out)


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
    state, *rest = case.fold_operands()
    cpu_folder.fold(state, *rest)
    assert_bits_equal(state, case.state_out)


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
