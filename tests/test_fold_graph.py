"""The graph-level API: build-time checks, the drop-in signature, verify width 0."""

from __future__ import annotations

import inspect

import pytest
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType

from gdfold_max import kernels_path, state_fold
from gdfold_max.ops.kernels import FOLD_OP_NAME

CPU = DeviceRef.CPU()


def _build(state=(8, 4, 64, 64), state_dtype=DType.float32, ring=(8, 2, 4, 224), ring_dtype=DType.float32,  # noqa: ANN001
           row_ids=(3, 2), ring_row_ids=(3, 2), accepted=(2,), table_dtype=DType.uint32,
           verify_width=None, **kwargs) -> Graph:  # noqa: ANN001, ANN003
    inputs = [BufferType(state_dtype, list(state), CPU), BufferType(ring_dtype, list(ring), CPU),
              TensorType(table_dtype, list(row_ids), CPU), TensorType(table_dtype, list(ring_row_ids), CPU),
              TensorType(table_dtype, list(accepted), CPU)]
    if verify_width is not None:
        inputs.append(TensorType(DType.int64, [verify_width], CPU))
    with Graph("build", input_types=inputs, custom_extensions=[kernels_path()]) as graph:
        values = [graph.inputs[0].buffer, graph.inputs[1].buffer, *[v.tensor for v in graph.inputs[2:]]]
        state_fold(*values, **kwargs)
        graph.output()
    return graph


def test_same_argument_order_as_max() -> None:
    from max.nn.state_space import gated_delta_state_fold

    ours = list(inspect.signature(state_fold).parameters)[:6]
    theirs = list(inspect.signature(gated_delta_state_fold).parameters)
    assert ours == theirs


def test_builds_with_our_op_name() -> None:
    assert FOLD_OP_NAME in str(_build())
    assert "gated_delta_state_fold" not in str(_build())


def test_signed_tables_are_cast_to_uint32() -> None:
    text = str(_build(table_dtype=DType.int64))
    assert FOLD_OP_NAME in text and "ui32" in text


def test_symbolic_dims_are_accepted() -> None:
    _build(state=("rows", "nv", 64, 64), ring=("ring_rows", "nk", 4, "stride"), row_ids=("L", "B"),
           ring_row_ids=("L", "B"), accepted=("B",))


def test_verify_width_zero_adds_nothing() -> None:
    assert FOLD_OP_NAME not in str(_build(verify_width=0))
    assert FOLD_OP_NAME in str(_build(verify_width=3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(state=(8, 4, 64)), r"recurrent_state: expected rank 4"),
        (dict(ring=(8, 2, 224)), r"ring: expected rank 4"),
        (dict(state_dtype=DType.float16), r"recurrent_state: dtype DType.float16 is unsupported"),
        (dict(ring_dtype=DType.bfloat16), r"ring: dtype DType.bfloat16 is unsupported"),
        (dict(state=(8, 4, 72 + 4, 64)), r"recurrent_state: K: 76 is unsupported"),
        (dict(state=(8, 4, 64, 512)), r"recurrent_state: V: 512 is unsupported"),
        (dict(state=(8, 4, "K", 64)), r"recurrent_state: K and V must be static"),
        (dict(ring=(8, 2, "R", 224)), r"ring: RING_LEN must be static"),
        (dict(ring=(8, 2, 0, 224)), r"ring: RING_LEN 0 is unsupported"),
        (dict(ring=(8, 3, 4, 224)), r"ring: key heads nk=3 must divide the pool's value heads nv=4"),
        (dict(ring=(8, 2, 4, 192)), r"ring: record stride 192 is smaller than K \+ G\*\(V\+1\) = 194"),
        (dict(ring=(8, 2, 4, 226)), r"ring: record stride 226 is not a multiple of 4 floats"),
        (dict(row_ids=(3, 2, 1)), r"row_ids: expected rank 2"),
        (dict(ring_row_ids=(3,)), r"ring_row_ids: expected rank 2"),
        (dict(accepted=(2, 1)), r"num_accepted: expected rank 1"),
        (dict(ring_row_ids=(2, 2)), r"ring_row_ids: shape \[2, 2\] differs from row_ids \[3, 2\]"),
        (dict(accepted=(3,)), r"num_accepted: length 3 differs from the batch 2 of row_ids"),
        (dict(table_dtype=DType.float32), r"row_ids: dtype DType.float32 is not an integer dtype"),
        (dict(key_dim_tile=24), r"key_dim_tile: 24 must be a multiple of 4 that divides K=64"),
        (dict(key_dim_tile=32, rows_per_thread=3), r"rows_per_thread: 3 must divide key_dim_tile=32"),
    ],
)
def test_bad_static_shapes_raise_at_build(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _build(**kwargs)


@pytest.mark.parametrize(("state_dtype", "key_dim_tile", "rows_per_thread", "threads"), [
    (DType.float32, 128, 1, 4096),
    (DType.bfloat16, 128, 1, 2048),
    (DType.float32, 64, 1, 2048),
])
def test_fold_blocks_past_1024_threads_are_refused_at_build(state_dtype: DType, key_dim_tile: int,
                                                            rows_per_thread: int, threads: int) -> None:
    """The GPU launch would fail on such a block; the graph refuses it when it is built."""
    with pytest.raises(ValueError, match=rf"key_dim_tile, rows_per_thread: \({key_dim_tile}, {rows_per_thread}\)"
                                         rf" makes GPU blocks of {threads} threads"):
        _build(state=(8, 4, 128, 128), state_dtype=state_dtype, ring=(8, 2, 4, 416), key_dim_tile=key_dim_tile,
               rows_per_thread=rows_per_thread)


def test_a_named_tile_whose_records_pass_48_kib_is_refused_at_build() -> None:
    """At RING_LEN 32 and K = V = 256 a bf16 block of 128 key rows would stage 49,280 bytes
    of records in shared memory (the GPU's static limit is 49,152): refused, naming the tile.
    The default tile halves to fit, and the graph builds."""
    ring = (8, 2, 32, 772)  # stride: K + G * (V + 1) = 770, padded to 4 floats
    with pytest.raises(ValueError, match=r"key_dim_tile: 128 stages 49280 bytes of records in a GPU block"
                                         r" \(RING_LEN 32, V=256, head gates\); at most 49152: lower key_dim_tile"):
        _build(state=(8, 4, 256, 256), state_dtype=DType.bfloat16, ring=ring, key_dim_tile=128, rows_per_thread=16)
    assert FOLD_OP_NAME in str(_build(state=(8, 4, 256, 256), state_dtype=DType.bfloat16, ring=ring))


def test_fold_blocks_of_1024_threads_build() -> None:
    """(128, 4) on an fp32 pool of V = 128: 32 column threads x 32 row threads, the most a block holds."""
    assert FOLD_OP_NAME in str(_build(state=(8, 4, 128, 128), ring=(8, 2, 4, 416), key_dim_tile=128,
                                      rows_per_thread=4))


def test_symbolic_verify_width_is_read_when_the_graph_runs() -> None:
    """As MAX's fold: at a run-time width of 0 the verify committed the state and wrote
    no records, so nothing is folded; at any other width the accepted records fold."""
    import numpy as np
    from max.driver import CPU as HOST
    from max.driver import Buffer
    from max.engine import InferenceSession

    from conftest import assert_bits_equal
    from gdfold_max.cases import random_fold_case

    case = random_fold_case(31, layers=2, batch=3, key_dim=64, value_dim=64, ring_len=4, num_accepted=[2, 4, 1])
    inputs = [BufferType(DType.float32, ["rows", 4, 64, 64], CPU),
              BufferType(DType.float32, ["ring_rows", 2, 4, "stride"], CPU),
              TensorType(DType.uint32, ["L", "B"], CPU), TensorType(DType.uint32, ["L", "B"], CPU),
              TensorType(DType.uint32, ["B"], CPU), TensorType(DType.int64, ["K"], CPU)]
    with Graph("fold_width", input_types=inputs, custom_extensions=[kernels_path()]) as graph:
        pool, ring, *tables, width = graph.inputs
        state_fold(pool.buffer, ring.buffer, *(t.tensor for t in tables), width.tensor)
        graph.output()
    model = InferenceSession(devices=[HOST()]).load(graph)
    for drafts, want in ((0, case.state_in), (3, case.state_out)):
        state = case.state_in.copy()
        model.execute(Buffer.from_numpy(state), Buffer.from_numpy(case.ring),
                      *(Buffer.from_numpy(t) for t in (case.row_ids, case.ring_row_ids, case.num_accepted)),
                      Buffer.from_numpy(np.arange(drafts, dtype=np.int64)))
        assert_bits_equal(state, want, f"width {drafts}")


def test_verify_width_of_another_rank_is_refused() -> None:
    with pytest.raises(ValueError, match=r"verify_width: expected rank 1 \[K\], got shape \[2, 3\]"):
        inputs = [BufferType(DType.float32, [8, 4, 64, 64], CPU), BufferType(DType.float32, [8, 2, 4, 224], CPU),
                  TensorType(DType.uint32, [3, 2], CPU), TensorType(DType.uint32, [3, 2], CPU),
                  TensorType(DType.uint32, [2], CPU), TensorType(DType.int64, [2, 3], CPU)]
        with Graph("bad_width", input_types=inputs, custom_extensions=[kernels_path()]) as graph:
            pool, ring, *tables, width = graph.inputs
            state_fold(pool.buffer, ring.buffer, *(t.tensor for t in tables), width.tensor)
