"""The op on the GPU: equal, bit for bit, to the CPU path and the reference."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer

from cases_matrix import MATRIX, SPEC_DECODE, matrix_case, spec_case
from conftest import CONFORMANCE_DIR, assert_bits_equal
from gdfold_max import StateFolder
from gdfold_max.cases import FoldCase
from gdfold_max.eager.fold import validate_fold

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_gpu_fold_matches_cpu_and_reference(gpu_folder: StateFolder, cpu_folder: StateFolder, name: str) -> None:
    case = matrix_case(name)
    on_gpu, *rest = case.fold_operands()
    gpu_folder.fold(on_gpu, *rest)
    on_cpu, *rest = case.fold_operands()
    cpu_folder.fold(on_cpu, *rest)
    assert_bits_equal(on_gpu, case.state_out, "GPU vs reference")
    assert_bits_equal(on_gpu, on_cpu, "GPU vs CPU")


@pytest.mark.parametrize("name", sorted(SPEC_DECODE))
def test_gpu_fold_of_verify_equals_forward(gpu_folder: StateFolder, name: str) -> None:
    case = spec_case(name)
    state, *rest = case.fold_operands()
    gpu_folder.fold(state, *rest)
    assert_bits_equal(state, case.state_out)


def test_gpu_reproduces_recorded_max_case(gpu_folder: StateFolder) -> None:
    case = FoldCase.load(CONFORMANCE_DIR / "public_case_a.npz")
    state, *rest = case.fold_operands()
    gpu_folder.fold(state, *rest)
    assert_bits_equal(state, case.state_out)


def test_gpu_key_dim_tiles_agree() -> None:
    """Other tilings than the default fold the same bits."""
    case = matrix_case("fp32-K128-G1-R8")
    for tile, rows in ((16, 4), (128, 16), (32, 2)):
        state, *rest = case.fold_operands()
        StateFolder("gpu", key_dim_tile=tile, rows_per_thread=rows).fold(state, *rest)
        assert_bits_equal(state, case.state_out, f"KEY_DIM_TILE {tile}, ROWS_PER_THREAD {rows}")


def test_gpu_kernel_skips_out_of_range_rows(gpu_folder: StateFolder) -> None:
    """Inside a graph the tables are trusted, yet an out-of-range id is never followed:
    that (layer, request) is skipped and every other one folds exactly."""
    case = matrix_case("fp32-K64-G2-R4")
    row_ids, ring_row_ids = case.row_ids.copy(), case.ring_row_ids.copy()
    rows, ring_rows = case.state_in.shape[0], case.ring.shape[0]
    row_ids[0, 2] = rows + 5
    ring_row_ids[1, 2] = ring_rows
    row_ids[2, 3] = 0xFFFFFFFF
    bad = {(0, 2), (1, 2), (2, 3)}
    call = validate_fold(case.state_in, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted,
                         gpu_folder.device)
    model = gpu_folder.model(call.state.dtype, call.parameters)
    state = Buffer.from_numpy(case.state_in.copy()).to(gpu_folder.device)
    tables = [Buffer.from_numpy(np.ascontiguousarray(t)).to(gpu_folder.device)
              for t in (row_ids, ring_row_ids, case.num_accepted)]
    model.execute(state, Buffer.from_numpy(case.ring).to(gpu_folder.device), *tables)
    got = state.to(CPU()).to_numpy()
    assert_bits_equal(got, case.state_out_skipping(bad))
    # The context is healthy afterwards: a valid fold still runs and is exact.
    again, *rest = case.fold_operands()
    gpu_folder.fold(again, *rest)
    assert_bits_equal(again, case.state_out)


def test_gpu_folder_refuses_a_host_buffer(gpu_folder: StateFolder) -> None:
    case = matrix_case("fp32-K64-G2-R4")
    state = Buffer.from_numpy(case.state_in.copy())
    with pytest.raises(ValueError, match="recurrent_state: buffer lives on cpu"):
        gpu_folder.fold(state, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted)


def test_gpu_eager_rejects_bad_row_id_untouched(gpu_folder: StateFolder) -> None:
    case = matrix_case("fp32-K64-G2-R4")
    state = case.state_in.copy()
    row_ids = case.row_ids.copy()
    row_ids[1, 1] = state.shape[0]
    with pytest.raises(ValueError, match="row_ids: id"):
        gpu_folder.fold(state, case.ring, row_ids, case.ring_row_ids, case.num_accepted)
    assert_bits_equal(state, case.state_in)
