"""The fold with per-channel gates (Kimi Delta Attention) on the CPU and the GPU: each
record holds K decays per value head, ``S[i, j] = fma(k[i], u[j], S[i, j] * d[i])``. Bit
for bit against the numpy reference and against the forward over the accepted tokens;
bad input refused with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import Buffer

from conftest import assert_bits_equal
from gdfold_max import StateFolder, folder_for
from gdfold_max.cases import random_fold_case, spec_decode_case
from gdfold_max.eager.fold import validate_fold
from gdfold_max.layout import RecordLayout


@pytest.fixture(scope="module", params=[pytest.param("cpu", id="cpu"),
                                        pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)])
def folder(request: pytest.FixtureRequest) -> StateFolder:
    return folder_for(str(request.param))


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_channel_fold_matches_the_reference(folder: StateFolder, state_dtype: str) -> None:
    """Counts of 0, 1, a full ring and past the ring; G = 2, padding past the records."""
    case = random_fold_case(71, layers=3, batch=4, state_dtype=state_dtype, gate="channel", stride_pad=32)
    state = case.state_in.copy()
    folder.fold(state, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted, gate="channel")
    assert_bits_equal(state, case.state_out)
    assert not np.array_equal(state, case.state_in)


def test_channel_fold_of_a_verify_equals_the_forward_over_accepted_tokens(folder: StateFolder) -> None:
    case = spec_decode_case(72, layers=2, batch=4, num_value_heads=6, num_key_heads=2, num_accepted=[4, 0, 1, 3],
                            gate="channel")
    state = case.state_in.copy()
    folder.fold(state, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted, gate="channel")
    assert_bits_equal(state, case.state_out)


def test_a_ring_too_small_for_per_channel_records_is_refused(cpu_folder: StateFolder) -> None:
    case = random_fold_case(73, layers=2, batch=4)  # head-gate records: stride 224
    needed = RecordLayout(64, 64, 2, gate="channel").elements
    state = case.state_in.copy()
    with pytest.raises(ValueError, match=rf"ring: record stride 224 is smaller than K \+ G\*\(V\+K\) = {needed}"):
        cpu_folder.fold(state, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted, gate="channel")
    assert_bits_equal(state, case.state_in)
    # Past the host checks, the op itself refuses it before its first store.
    wide = random_fold_case(73, layers=2, batch=4, gate="channel")
    call = validate_fold(wide.state_in, wide.ring, wide.row_ids, wide.ring_row_ids, wide.num_accepted,
                         cpu_folder.device, gate="channel")
    model = cpu_folder.model(call.state.dtype, call.parameters, "channel")
    with pytest.raises(ValueError, match=rf"ring: record stride 224 is smaller than K \+ G\*\(V\+K\) = {needed}"):
        model.execute(Buffer.from_numpy(state), Buffer.from_numpy(case.ring),
                      *(Buffer.from_numpy(t) for t in (case.row_ids, case.ring_row_ids, case.num_accepted)))
    assert_bits_equal(state, case.state_in)


def test_unknown_gate_is_refused(cpu_folder: StateFolder) -> None:
    case = random_fold_case(74, layers=1, batch=2)
    with pytest.raises(ValueError, match="gate: 'row' is not 'head' or 'channel'"):
        cpu_folder.fold(case.state_in.copy(), case.ring, case.row_ids, case.ring_row_ids, case.num_accepted,
                        gate="row")  # type: ignore[arg-type]
