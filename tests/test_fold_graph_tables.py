"""Row tables of any integer dtype in a graph: an entry that uint32 cannot hold (negative,
or past 2**32 - 1) is never wrapped onto another row. It saturates to an id past every pool,
so the CPU op refuses it before writing and the GPU kernel skips that (layer, request)."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from max.driver import CPU, Accelerator, Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, DeviceRef, Graph, TensorType

from conftest import assert_bits_equal
from gdfold_max import kernels_path, state_fold
from gdfold_max.cases import FoldCase, random_fold_case

DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
#: (table, entry) pairs that uint32 cannot hold: each wraps onto row or ring row 0 or 1
#: when cast, except -1, which wraps to 2**32 - 1.
IDS_PAST_UINT32 = [("row_ids", 2**32 + 1), ("ring_row_ids", 2**32), ("row_ids", -1), ("ring_row_ids", -(2**32) + 1)]


@cache
def case() -> FoldCase:
    return random_fold_case(41, layers=2, batch=4, key_dim=16, value_dim=16, ring_len=4, num_accepted=[1, 2, 3, 4])


@cache
def int64_fold(device: str) -> Model:
    """The fold with int64 tables on ``device``, compiled once."""
    where = DeviceRef.CPU() if device == "cpu" else DeviceRef.GPU()
    c = case()
    inputs = [BufferType(DType.float32, ["rows", *c.state_in.shape[1:]], where),
              BufferType(DType.float32, ["ring_rows", *c.ring.shape[1:]], where),
              TensorType(DType.int64, ["L", "B"], where), TensorType(DType.int64, ["L", "B"], where),
              TensorType(DType.int64, ["B"], where)]
    with Graph(f"int64_tables_{device}", input_types=inputs, custom_extensions=[kernels_path()]) as graph:
        state, ring, *tables = graph.inputs
        state_fold(state.buffer, ring.buffer, *(t.tensor for t in tables))
        graph.output()
    return InferenceSession(devices=[CPU() if device == "cpu" else Accelerator()]).load(graph)


def run(device: str, row_ids: np.ndarray, ring_row_ids: np.ndarray, num_accepted: np.ndarray) -> np.ndarray:
    """Folds a copy of the case's pool with these int64 tables; returns the pool."""
    where = CPU() if device == "cpu" else Accelerator()
    c = case()
    state = Buffer.from_numpy(c.state_in.copy()).to(where)
    tables = [Buffer.from_numpy(np.ascontiguousarray(t, dtype=np.int64)).to(where)
              for t in (row_ids, ring_row_ids, num_accepted)]
    int64_fold(device).execute(state, Buffer.from_numpy(c.ring).to(where), *tables)
    return state.to(CPU()).to_numpy()


@pytest.mark.parametrize("device", DEVICES)
def test_int64_tables_in_range_fold_exactly(device: str) -> None:
    c = case()
    assert_bits_equal(run(device, c.row_ids, c.ring_row_ids, c.num_accepted), c.state_out)


@pytest.mark.parametrize("device", DEVICES)
def test_a_count_past_uint32_is_not_wrapped(device: str) -> None:
    """2**32 + 1 records would wrap to 1 record; saturated past RING_LEN, request 2 is not folded."""
    c = case()
    counts = c.num_accepted.astype(np.int64)
    counts[2] = 2**32 + 1
    want = c.state_out_skipping({(layer, 2) for layer in range(c.row_ids.shape[0])})
    assert_bits_equal(run(device, c.row_ids, c.ring_row_ids, counts), want)


@pytest.mark.parametrize(("table", "value"), IDS_PAST_UINT32)
def test_cpu_refuses_an_id_past_uint32_before_writing(table: str, value: int) -> None:
    c = case()
    tables = {"row_ids": c.row_ids.astype(np.int64), "ring_row_ids": c.ring_row_ids.astype(np.int64)}
    tables[table][1, 3] = value
    state = c.state_in.copy()
    tables_in = [Buffer.from_numpy(t) for t in (tables["row_ids"], tables["ring_row_ids"],
                                                c.num_accepted.astype(np.int64))]
    with pytest.raises(ValueError, match=rf"{table}: id 4294967295 at flat index 7 is out of range"):
        int64_fold("cpu").execute(Buffer.from_numpy(state), Buffer.from_numpy(c.ring), *tables_in)
    assert_bits_equal(state, c.state_in)


@pytest.mark.gpu
@pytest.mark.parametrize(("table", "value"), IDS_PAST_UINT32)
def test_gpu_skips_an_id_past_uint32(table: str, value: int) -> None:
    """Wrapped, the entry would name row (or ring row) 0 or 1: another pair's, or a spare row."""
    c = case()
    tables = {"row_ids": c.row_ids.astype(np.int64), "ring_row_ids": c.ring_row_ids.astype(np.int64)}
    tables[table][1, 3] = value
    got = run("gpu", tables["row_ids"], tables["ring_row_ids"], c.num_accepted.astype(np.int64))
    assert_bits_equal(got, c.state_out_skipping({(1, 3)}))
