"""Bad input never corrupts a pool: a clear error naming the argument, nothing written."""

from __future__ import annotations

import threading
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from max.driver import Buffer

from cases_matrix import matrix_case
from conftest import assert_bits_equal
from gdfold_max import StateFolder, reference
from gdfold_max.cases import FoldCase, random_fold_case
from gdfold_max.eager.fold import validate_fold

CASE = "fp32-K64-G2-R4"


def _operands() -> dict:
    case = matrix_case(CASE)
    return dict(recurrent_state=case.state_in.copy(), ring=case.ring.copy(), row_ids=case.row_ids.copy(),
                ring_row_ids=case.ring_row_ids.copy(), num_accepted=case.num_accepted.copy())


def _with(**changes: Callable[[dict], object]) -> dict:
    operands = _operands()
    for name, change in changes.items():
        operands[name] = change(operands)
    return operands


def _set(array_name: str, index: tuple, value: int) -> Callable[[dict], np.ndarray]:
    def change(ops: dict) -> np.ndarray:
        array = ops[array_name].copy()
        array[index] = value
        return array
    return change


BAD_INPUTS = {
    "row id past the pool": (
        lambda: _with(row_ids=_set("row_ids", (1, 2), 999)), ValueError,
        r"row_ids: id 999 at flat index 7 is out of range \(must be < 18\)"),
    "ring row id past the ring": (
        lambda: _with(ring_row_ids=_set("ring_row_ids", (0, 0), 16)), ValueError,
        r"ring_row_ids: id 16 at flat index 0 is out of range \(must be < 16\)"),
    "row tables of different shapes": (
        lambda: _with(ring_row_ids=lambda ops: ops["ring_row_ids"][:2]), ValueError,
        r"ring_row_ids: shape \[2, 5\] differs from row_ids \[3, 5\]"),
    "row_ids not 2-D": (
        lambda: _with(row_ids=lambda ops: ops["row_ids"].reshape(-1)), ValueError,
        r"row_ids: expected rank 2 \[num_layers, batch\], got shape \[15\]"),
    "ring_row_ids not 2-D": (
        lambda: _with(ring_row_ids=lambda ops: ops["ring_row_ids"][None]), ValueError,
        r"ring_row_ids: expected rank 2 \[num_layers, batch\], got shape \[1, 3, 5\]"),
    "num_accepted not of length B": (
        lambda: _with(num_accepted=lambda ops: ops["num_accepted"][:4]), ValueError,
        r"num_accepted: length 4 differs from the batch 5 of row_ids"),
    "negative id in a signed table": (
        lambda: _with(row_ids=lambda ops: np.where(np.arange(15).reshape(3, 5) == 4, -3,
                                                   ops["row_ids"].astype(np.int64))), ValueError,
        r"row_ids: negative id -3 at flat index 4"),
    "negative count in a signed table": (
        lambda: _with(num_accepted=lambda ops: np.array([1, -1, 0, 2, 1], np.int32)), ValueError,
        r"num_accepted: negative id -1 at flat index 1"),
    "float table": (
        lambda: _with(ring_row_ids=lambda ops: ops["ring_row_ids"].astype(np.float32)), ValueError,
        r"ring_row_ids: dtype float32 is not an integer dtype"),
    "pool not 4-D": (
        lambda: _with(recurrent_state=lambda ops: ops["recurrent_state"][0]), ValueError,
        r"recurrent_state: expected rank 4 \[rows, nv, K, V\], got rank 3"),
    "ring not 4-D": (
        lambda: _with(ring=lambda ops: ops["ring"][0]), ValueError,
        r"ring: expected rank 4 \[ring_rows, nk, RING_LEN, stride\], got rank 3"),
    "nv not a multiple of nk": (
        lambda: _with(ring=lambda ops: np.ascontiguousarray(np.concatenate([ops["ring"]] * 3, axis=1)[:, :3])),
        ValueError, r"ring: key heads nk=3 must divide the pool's value heads nv=4"),
    "record stride too small": (
        lambda: _with(ring=lambda ops: np.ascontiguousarray(ops["ring"][..., :128])), ValueError,
        r"ring: record stride 128 is smaller than K \+ G\*\(V\+1\) = 194"),
    "record stride not 16-byte aligned": (
        lambda: _with(ring=lambda ops: np.ascontiguousarray(ops["ring"][..., :198])), ValueError,
        r"ring: record stride 198 is not a multiple of 4 floats \(16 bytes\)"),
    "K unsupported": (
        lambda: _with(recurrent_state=lambda ops: np.zeros((4, 4, 12, 64), np.float32)), ValueError,
        r"recurrent_state: K: 12 is unsupported \(a multiple of 8 up to 256\)"),
    "V unsupported": (
        lambda: _with(recurrent_state=lambda ops: np.zeros((4, 4, 64, 264), np.float32)), ValueError,
        r"recurrent_state: V: 264 is unsupported \(a multiple of 8 up to 256\)"),
    "RING_LEN unsupported": (
        lambda: _with(ring=lambda ops: np.zeros((4, 2, 33, 224), np.float32)), ValueError,
        r"ring: RING_LEN 33 is unsupported \(1..32\)"),
    "state dtype float16": (
        lambda: _with(recurrent_state=lambda ops: ops["recurrent_state"].astype(np.float16)), ValueError,
        r"recurrent_state: dtype DType.float16 is unsupported \(float32 or bfloat16\)"),
    "ring dtype float64": (
        lambda: _with(ring=lambda ops: ops["ring"].astype(np.float64)), ValueError,
        r"ring: dtype DType.float64 is unsupported \(float32\)"),
    "ring dtype bfloat16": (
        lambda: _with(ring=lambda ops: ops["ring"].astype(ml_dtypes.bfloat16)), ValueError,
        r"ring: dtype DType.bfloat16 is unsupported \(float32\)"),
    "pool not contiguous": (
        lambda: _with(recurrent_state=lambda ops: np.asfortranarray(ops["recurrent_state"])), ValueError,
        r"recurrent_state: must be C-contiguous to be written in place"),
    "pool read-only": (
        lambda: _with(recurrent_state=lambda ops: _read_only(ops["recurrent_state"])), ValueError,
        r"recurrent_state: the array is read-only"),
    "pool of the wrong kind": (
        lambda: _with(recurrent_state=lambda ops: ops["recurrent_state"].tolist()), TypeError,
        r"recurrent_state: expected a numpy array or a max.driver.Buffer, got list"),
}


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_raises_and_writes_nothing(cpu_folder: StateFolder, name: str) -> None:
    make, error, message = BAD_INPUTS[name]
    operands = make()
    before = {k: np.array(v, copy=True) for k, v in operands.items()}
    with pytest.raises(error, match=message):
        cpu_folder.fold(**operands)
    for key, value in before.items():
        after = np.asarray(operands[key])
        if after.dtype.kind == "f" or after.dtype == np.dtype(ml_dtypes.bfloat16):
            assert_bits_equal(after, value, key)
        else:
            assert np.array_equal(after, value), key


def test_cpu_op_checks_ids_before_its_first_store(cpu_folder: StateFolder) -> None:
    """Past the host checks, the CPU op itself refuses a bad id and writes nothing."""
    case = matrix_case(CASE)
    call = validate_fold(case.state_in, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted,
                         cpu_folder.device)
    model = cpu_folder.model(call.state.dtype, call.parameters)
    for table_index, name in ((0, "row_ids"), (1, "ring_row_ids")):
        tables = [case.row_ids.copy(), case.ring_row_ids.copy()]
        tables[table_index][2, 4] = 4000
        state = case.state_in.copy()
        with pytest.raises(ValueError, match=rf"{name}: id 4000 at flat index 14 is out of range"):
            model.execute(Buffer.from_numpy(state), Buffer.from_numpy(case.ring.copy()),
                          *[Buffer.from_numpy(t) for t in tables], Buffer.from_numpy(case.num_accepted))
        assert_bits_equal(state, case.state_in)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_tables_are_a_no_op(cpu_folder: StateFolder, shape: tuple[int, int]) -> None:
    """Through the eager API (which returns before the graph) and through the compiled
    op itself, whose own check of the empty launch is what a graph user reaches."""
    case = matrix_case(CASE)
    state = case.state_in.copy()
    empty = np.zeros(shape, np.uint32)
    cpu_folder.fold(state, case.ring, empty, empty, np.zeros(shape[1], np.uint32))
    assert_bits_equal(state, case.state_in)
    call = validate_fold(case.state_in, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted,
                         cpu_folder.device)
    model = cpu_folder.model(call.state.dtype, call.parameters)
    ring = case.ring.copy()
    model.execute(Buffer.from_numpy(state), Buffer.from_numpy(ring), Buffer.from_numpy(empty),
                  Buffer.from_numpy(empty), Buffer.from_numpy(np.zeros(shape[1], np.uint32)))
    assert_bits_equal(state, case.state_in)
    assert_bits_equal(ring, case.ring, "ring")


def test_counts_past_ring_len_skip_the_row(cpu_folder: StateFolder) -> None:
    case = matrix_case(CASE)
    state = case.state_in.copy()
    cpu_folder.fold(state, case.ring, case.row_ids, case.ring_row_ids, np.full(5, 5, np.uint32))
    assert_bits_equal(state, case.state_in)


def test_nan_and_inf_in_records_propagate_as_the_math_says(cpu_folder: StateFolder) -> None:
    case = random_fold_case(5, layers=1, batch=1, num_accepted=[1], key_dim=64, value_dim=64)
    ring = case.ring.copy()
    ring_row = int(case.ring_row_ids[0, 0])
    ring[ring_row, 0, 0, 0] = np.inf  # key row 0 of key head 0: inf * u + S
    ring[ring_row, 1, 0, 64] = np.nan  # delta column 0 of value head 2
    state = case.state_in.copy()
    cpu_folder.fold(state, ring, case.row_ids, case.ring_row_ids, case.num_accepted)
    want = reference.fold(case.state_in.copy(), ring, case.row_ids, case.ring_row_ids, case.num_accepted)
    assert_bits_equal(state, want)
    row = int(case.row_ids[0, 0])
    assert not np.isfinite(state[row, 0, 0]).all() and np.isnan(state[row, 2, :, 0]).all()


def _maybe_break(draw: st.DrawFn, case: FoldCase) -> dict:
    """Operands of a case, each table possibly broken in one of the ways a caller can."""
    operands = dict(recurrent_state=case.state_in.copy(), ring=case.ring.copy(), row_ids=case.row_ids.copy(),
                    ring_row_ids=case.ring_row_ids.copy(), num_accepted=case.num_accepted.copy())
    for name in ("row_ids", "ring_row_ids", "num_accepted"):
        how = draw(st.sampled_from(["keep", "keep", "keep", "too big", "negative", "float", "drop column"]))
        table = operands[name]
        if how == "too big" and table.size:
            table = table.astype(np.int64)
            table.reshape(-1)[draw(st.integers(0, table.size - 1))] = draw(st.integers(18, 2**32 - 1))
        elif how == "negative" and table.size:
            table = table.astype(np.int64)
            table.reshape(-1)[draw(st.integers(0, table.size - 1))] = -draw(st.integers(1, 2**31))
        elif how == "float":
            table = table.astype(np.float64)
        elif how == "drop column" and table.shape[-1] > 1:
            table = table[..., :-1]
        operands[name] = table
    return operands


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), batch=st.integers(1, 5), data=st.data())
def test_random_partly_invalid_calls_raise_cleanly_or_fold_exactly(cpu_folder: StateFolder, seed: int,
                                                                    batch: int, data: st.DataObject) -> None:
    counts = data.draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch))
    case = random_fold_case(seed, layers=2, batch=batch, num_accepted=counts, spare_rows=18 - 2 * batch)
    operands = _maybe_break(data.draw, case)
    pool_before = operands["recurrent_state"].copy()
    ring_before = operands["ring"].copy()
    try:
        cpu_folder.fold(**operands)
    except (ValueError, TypeError) as error:
        assert str(error).split(":")[0] in {"row_ids", "ring_row_ids", "num_accepted"}, error
        assert_bits_equal(operands["recurrent_state"], pool_before)
    else:
        want = reference.fold(pool_before, ring_before, np.asarray(operands["row_ids"]),
                              np.asarray(operands["ring_row_ids"]), np.asarray(operands["num_accepted"]))
        assert_bits_equal(operands["recurrent_state"], want)
    assert_bits_equal(operands["ring"], ring_before, "ring")


def test_two_threads_fold_different_pools_at_once(cpu_folder: StateFolder) -> None:
    cases = [random_fold_case(seed, layers=3, batch=5, num_accepted=[4, 1, 3, 2, 4]) for seed in (21, 22)]
    pools = [c.state_in.copy() for c in cases]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        try:
            start.wait()
            for _ in range(3):
                pools[i][...] = cases[i].state_in
                cpu_folder.fold(pools[i], cases[i].ring, cases[i].row_ids, cases[i].ring_row_ids,
                                cases[i].num_accepted)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for pool, case in zip(pools, cases, strict=True):
        assert_bits_equal(pool, case.state_out)
