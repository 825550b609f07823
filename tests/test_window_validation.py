"""Bad input to the verify and the forward: a clear error naming the argument and the bad
value, and nothing written (pool and ring bits unchanged)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from conftest import assert_bits_equal
from gdfold_max.cases import WindowCase, random_window_case
from gdfold_max.eager.window import runner_for


def _case() -> WindowCase:
    return random_window_case(11)


def _verify_kwargs(case: WindowCase) -> dict[str, Any]:
    return {
        "qkv": case.qkv, "decay": case.decay, "beta": case.beta,
        "row_ids": case.row_ids, "ring_row_ids": case.ring_row_ids, "input_row_offsets": case.input_row_offsets,
        "previous_ring_row_ids": case.previous_ring_row_ids, "previous_num_accepted": case.previous_num_accepted,
    }


def _bad_rows(case: WindowCase) -> dict[str, Any]:
    rows = case.row_ids.copy()
    rows[2] = case.state.shape[0]
    return {"row_ids": rows}


def _bad_ring_rows(case: WindowCase) -> dict[str, Any]:
    rows = case.ring_row_ids.copy()
    rows[0] = case.ring.shape[0] + 3
    return {"ring_row_ids": rows}


def _bad_previous_rows(case: WindowCase) -> dict[str, Any]:
    rows = case.previous_ring_row_ids.copy()
    rows[1] = 1 << 20
    return {"previous_ring_row_ids": rows}


def _overlap(case: WindowCase) -> dict[str, Any]:
    rows = case.ring_row_ids.copy()
    rows[4] = case.previous_ring_row_ids[0]  # request 4 records where request 0 folds from
    return {"ring_row_ids": rows}


def _offsets(values: list[int]) -> Callable[[WindowCase], dict[str, Any]]:
    return lambda case: {"input_row_offsets": np.asarray(values, np.uint32)}


BAD_INPUTS: dict[str, tuple[Callable[[WindowCase], dict[str, Any]], type[Exception], str]] = {
    "row id past the pool": (_bad_rows, ValueError, "row_ids: id 7 at flat index 2 is out of range (must be < 7)"),
    "ring row id past the ring": (_bad_ring_rows, ValueError, "ring_row_ids: id 14 at flat index 0 is out of range"),
    "previous ring row id past the ring": (_bad_previous_rows, ValueError,
                                           "previous_ring_row_ids: id 1048576 at flat index 1 is out of range"),
    "negative row id": (lambda c: {"row_ids": np.array([0, -1, 2, 3, 4])}, ValueError,
                        "row_ids: negative id -1 at flat index 1"),
    "float row ids": (lambda c: {"row_ids": c.row_ids.astype(np.float32)}, ValueError,
                      "row_ids: dtype float32 is not an integer dtype"),
    "ring row recorded into and folded from": (_overlap, ValueError,
                                               "ring_row_ids: request 4 records into ring row"),
    "offsets not starting at 0": (_offsets([1, 4, 4, 5, 11, 13]), ValueError,
                                  "input_row_offsets: must start at 0, got 1"),
    "decreasing offsets": (_offsets([0, 4, 3, 5, 11, 13]), ValueError,
                           "input_row_offsets: decreases at index 2 (4 then 3)"),
    "offsets short of the tokens": (_offsets([0, 4, 4, 5, 11, 12]), ValueError,
                                    "input_row_offsets: ends at 12, but qkv has 13 tokens"),
    "offsets of the wrong length": (_offsets([0, 4, 4, 5, 13]), ValueError,
                                    "input_row_offsets: length 5 differs from batch + 1 (6)"),
    "ring rows of the wrong length": (lambda c: {"ring_row_ids": c.ring_row_ids[:4]}, ValueError,
                                      "ring_row_ids: length 4 differs from the batch of row_ids (5)"),
    "qkv of the wrong width": (lambda c: {"qkv": c.qkv[:, :-8]}, ValueError,
                               "qkv: width 504 differs from 2*nk*K + nv*V = 512"),
    "qkv in float64": (lambda c: {"qkv": c.qkv.astype(np.float64)}, ValueError,
                       "qkv: dtype float64 is unsupported (float32)"),
    "decay per key head": (lambda c: {"decay": c.decay[:, :2]}, ValueError, "decay: expected [13, 4], got [13, 2]"),
    "beta one token short": (lambda c: {"beta": c.beta[:-1]}, ValueError, "beta: expected [13, 4], got [12, 4]"),
    "only one previous table": (lambda c: {"previous_num_accepted": None}, ValueError,
                                "previous_ring_row_ids, previous_num_accepted: give both"),
    "qkv as a list": (lambda c: {"qkv": c.qkv.tolist()}, TypeError, "qkv: expected a numpy array"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_verify_input_is_refused_and_nothing_is_written(name: str) -> None:
    change, error, message = BAD_INPUTS[name]
    case = _case()
    pool, ring = case.fresh()
    kwargs = _verify_kwargs(case) | change(case)
    with pytest.raises(error) as raised:
        runner_for("cpu").verify_ring(recurrent_state=pool, ring=ring, **kwargs)
    assert message in str(raised.value)
    assert_bits_equal(pool, case.state, "pool")
    assert_bits_equal(ring, case.ring, "ring")


def test_bad_forward_input_is_refused_and_nothing_is_written() -> None:
    case = _case()
    pool = case.state.copy()
    with pytest.raises(ValueError, match=r"qkv: width 520 is not 2\*nk\*64 \+ nv\*64 with nk dividing nv=4"):
        runner_for("cpu").recurrence(np.zeros((13, 520), np.float32), case.decay, case.beta, pool, case.row_ids,
                                     case.input_row_offsets)
    with pytest.raises(ValueError, match="row_ids: id 9 at flat index 0"):
        runner_for("cpu").recurrence(case.qkv, case.decay, case.beta, pool, np.array([9, 0, 1, 2, 3]),
                                     case.input_row_offsets)
    assert_bits_equal(pool, case.state, "pool")


def test_cpu_op_checks_offsets_and_overlap_itself() -> None:
    """Past the host checks, the compiled CPU op raises before its first store."""
    from max.driver import Buffer
    from max.dtype import DType

    runner = runner_for("cpu")
    case = _case()
    model = runner.model("fold_on_load", DType.float32, {"K": 64, "V": 64, "RING_LEN": 4})
    for change, message in (
        (_offsets([0, 4, 3, 5, 11, 13]), "input_row_offsets: decreases at index 2"),
        (_overlap, "which request 0 folds from"),
        (_bad_previous_rows, "previous_ring_row_ids: id 1048576 at flat index 1 is out of range"),
    ):
        pool, ring = case.fresh()
        kwargs = _verify_kwargs(case) | change(case)
        tables = [kwargs[name] for name in ("row_ids", "ring_row_ids", "input_row_offsets", "previous_ring_row_ids",
                                            "previous_num_accepted")]
        inputs = [Buffer.from_numpy(np.ascontiguousarray(a)) for a in (case.qkv, case.decay, case.beta)]
        with pytest.raises(ValueError, match=message):
            model.execute(*inputs, Buffer.from_numpy(pool), Buffer.from_numpy(ring),
                          *(Buffer.from_numpy(np.ascontiguousarray(t, dtype=np.uint32)) for t in tables))
        assert_bits_equal(pool, case.state, "pool")
        assert_bits_equal(ring, case.ring, "ring")


def test_empty_batch_is_a_no_op_through_the_op_itself() -> None:
    """Batch 0 through the compiled fold-on-load verify (the eager runner returns before
    the graph): an empty readout, and the pool and the ring unchanged."""
    from max.driver import Buffer
    from max.dtype import DType

    case = _case()
    model = runner_for("cpu").model("fold_on_load", DType.float32, {"K": 64, "V": 64, "RING_LEN": 4})
    pool, ring = case.fresh()
    empty = np.zeros(0, np.uint32)
    tokens = [np.ascontiguousarray(a[:0]) for a in (case.qkv, case.decay, case.beta)]
    tables = [empty, empty, np.zeros(1, np.uint32), empty, empty]
    (readout,) = model.execute(*(Buffer.from_numpy(a) for a in tokens), Buffer.from_numpy(pool),
                               Buffer.from_numpy(ring), *(Buffer.from_numpy(t) for t in tables))
    assert list(readout.shape) == [0, case.state.shape[1] * case.state.shape[3]]
    assert_bits_equal(pool, case.state, "pool")
    assert_bits_equal(ring, case.ring, "ring")
    runner = runner_for("cpu")
    assert runner.verify_ring(*tokens, pool, ring, empty, empty, np.zeros(1, np.uint32)).shape[0] == 0
    assert_bits_equal(pool, case.state, "pool")


def test_graph_build_errors_name_the_argument() -> None:
    from max.dtype import DType
    from max.graph import BufferType, DeviceRef, Graph, TensorType

    from gdfold_max import kernels_path, recurrence, verify_ring

    cpu = DeviceRef.CPU()
    types = [
        TensorType(DType.float32, ["T", 512], cpu),
        TensorType(DType.float32, ["T", 4], cpu),
        TensorType(DType.float32, ["T", 4], cpu),
        BufferType(DType.float32, [7, 4, 64, 64], cpu),
        BufferType(DType.float32, [11, 2, 4, 224], cpu),
        TensorType(DType.uint32, ["B"], cpu),
        TensorType(DType.uint32, ["B"], cpu),
        TensorType(DType.uint32, ["B1"], cpu),
        TensorType(DType.uint32, ["B", 2], cpu),
        TensorType(DType.float16, ["T", 512], cpu),
        TensorType(DType.float32, ["T", 520], cpu),
    ]
    with Graph("bad", input_types=types, custom_extensions=[kernels_path()]) as graph:
        qkv, decay, beta, pool, ring, rows, ring_rows, offsets, table_2d, qkv_half, qkv_wide = (
            x.tensor if isinstance(x.type, TensorType) else x.buffer for x in graph.inputs)
        with pytest.raises(ValueError, match="column_tile: 24 must be 4, 8, 16 or a multiple of 16, and divide V=64"):
            verify_ring(qkv, decay, beta, pool, ring, rows, ring_rows, offsets, column_tile=24)
        with pytest.raises(ValueError, match="requests_per_block: 0 must be at least 1"):
            recurrence(qkv, decay, beta, pool, rows, offsets, requests_per_block=0)
        with pytest.raises(ValueError, match=r"row_ids: expected rank 1, got shape \[B, 2\]"):
            verify_ring(qkv, decay, beta, pool, ring, table_2d, ring_rows, offsets)
        with pytest.raises(ValueError, match="qkv: dtype float16 is unsupported"):
            recurrence(qkv_half, decay, beta, pool, rows, offsets)
        with pytest.raises(ValueError, match=r"qkv: width 520 differs from 2\*nk\*K \+ nv\*V = 512"):
            verify_ring(qkv_wide, decay, beta, pool, ring, rows, ring_rows, offsets)
        with pytest.raises(ValueError, match="previous_ring_row_ids, previous_num_accepted: give both"):
            verify_ring(qkv, decay, beta, pool, ring, rows, ring_rows, offsets, previous_ring_row_ids=rows)
        graph.output()


def test_gpu_tiling_defaults_and_explicit_values() -> None:
    """Without keywords the op sizes its own grid (0); the tile is 64 columns where V
    allows, whatever K."""
    from max.dtype import DType

    from gdfold_max.ops.window import gpu_tiling

    f32 = DType.float32
    auto = {"GPU_PATH": 0}
    assert gpu_tiling(f32, 128, 128, None, None) == {"COLUMN_TILE": 64, "REQUESTS_PER_BLOCK": 0, **auto}
    assert gpu_tiling(f32, 256, 256, None, None, fold_on_load=True) == {"COLUMN_TILE": 64, "REQUESTS_PER_BLOCK": 0,
                                                                         **auto}
    assert gpu_tiling(f32, 64, 64, 16, 3) == {"COLUMN_TILE": 16, "REQUESTS_PER_BLOCK": 3, **auto}
    with pytest.raises(ValueError, match="requests_per_block: -1 must be at least 1"):
        gpu_tiling(f32, 64, 64, None, -1)


def test_gpu_path_names_its_kernel_and_bad_names_are_refused() -> None:
    from max.dtype import DType

    from gdfold_max.ops.window import gpu_tiling

    f32 = DType.float32
    paths = ("auto", "latency", "throughput")
    assert [gpu_tiling(f32, 64, 64, None, None, gpu_path=p)["GPU_PATH"] for p in paths] == [0, 1, 2]
    # "walk", the walking kernel's name before it was removed, is refused like any other.
    for name in ("fast", "walk"):
        with pytest.raises(ValueError, match=f"gpu_path: '{name}' must be one of 'auto', 'latency', 'throughput'$"):
            gpu_tiling(f32, 64, 64, None, None, gpu_path=name)
        with pytest.raises(ValueError, match=f"gpu_path: '{name}' must be one of 'auto', 'latency', 'throughput'$"):
            runner_for("cpu", name)


@pytest.mark.parametrize(("value_dim", "column_tile"), [(96, 24), (96, 12), (40, 40), (120, 20)])
def test_gpu_tiles_that_split_a_warp_are_refused(value_dim: int, column_tile: int) -> None:
    """A block holds two threads per column: 24 columns make 48 threads, a warp and a
    half, and such a block never finished on an H200. The tile must be 4, 8, 16 or a
    multiple of 16; where the caller names none, the widest of those that divides V."""
    from max.dtype import DType

    from gdfold_max.ops.window import gpu_tiling

    with pytest.raises(ValueError, match=f"column_tile: {column_tile} must be 4, 8, 16 or a multiple of 16,"
                                         f" and divide V={value_dim}"):
        gpu_tiling(DType.float32, 64, value_dim, column_tile, None)
    default = gpu_tiling(DType.float32, 64, value_dim, None, None)["COLUMN_TILE"]
    assert default == {96: 48, 40: 8, 120: 8}[value_dim]


# Each case as the kernel's own compile-time check decides it (mojo build for sm_90).
@pytest.mark.parametrize(("state_dtype", "key_dim", "column_tile", "fits"), [
    ("float32", 256, 128, True),
    ("float32", 256, 256, False),
    ("float32", 192, 256, False),  # the tile with the buffers passes 227 KiB
    ("float32", 128, 256, True),
    ("bfloat16", 256, 128, True),
    ("bfloat16", 256, 256, False),  # the tokens' and records' buffers alone pass 48 KiB
])
def test_column_tile_too_wide_for_an_sm_is_refused_at_graph_build(state_dtype: str, key_dim: int,
                                                                  column_tile: int, fits: bool) -> None:
    from max.dtype import DType
    from max.graph import BufferType, DeviceRef, Graph, TensorType

    from gdfold_max import kernels_path, verify_ring

    gpu, dtype = DeviceRef.GPU(), DType[state_dtype]
    types = [
        TensorType(DType.float32, ["T", 2 * key_dim + 256], gpu),
        TensorType(DType.float32, ["T", 1], gpu),
        TensorType(DType.float32, ["T", 1], gpu),
        BufferType(dtype, [3, 1, key_dim, 256], gpu),
        BufferType(DType.float32, [6, 1, 4, key_dim + 256 + 4], gpu),
        *[TensorType(DType.uint32, [name], gpu) for name in ("B", "B", "B1", "B", "B")],
    ]
    with Graph("tiles", input_types=types, custom_extensions=[kernels_path()]) as graph:
        qkv, decay, beta, pool, ring, rows, ring_rows, offsets, previous_rows, accepted = (
            x.tensor if isinstance(x.type, TensorType) else x.buffer for x in graph.inputs)
        build = lambda: verify_ring(qkv, decay, beta, pool, ring, rows, ring_rows, offsets,  # noqa: E731
                                    previous_ring_row_ids=previous_rows, previous_num_accepted=accepted,
                                    column_tile=column_tile)
        if fits:
            build()
        else:
            with pytest.raises(ValueError, match=f"column_tile: {column_tile} columns of a K={key_dim} {state_dtype}"
                                                 " state need [0-9]+ bytes of (static )?shared memory per GPU block"):
                build()


@pytest.mark.parametrize(("api", "architecture", "refused"), [
    ("cuda", "sm_90a", False),
    ("cuda", "sm_90", False),
    ("cuda", "sm_80", True),
    ("cuda", "sm_100a", True),
    ("hip", "gfx942", True),
])
def test_window_ops_refuse_a_gpu_other_than_hopper_at_build(monkeypatch: pytest.MonkeyPatch, api: str,
                                                            architecture: str, refused: bool) -> None:
    """The GPU kernel uses sm_90 instructions: any other GPU is refused when the graph is
    built (the device is faked here; the op checks it again before it enqueues)."""
    from max.graph import DeviceRef

    from gdfold_max.ops import window

    class FakeGpu:
        def __init__(self, device_id: int) -> None:
            self.api, self.architecture_name = api, architecture

    monkeypatch.setattr(window, "accelerator_count", lambda: 1)
    monkeypatch.setattr(window, "Accelerator", FakeGpu)
    if refused:
        with pytest.raises(ValueError, match=rf"recurrent_state: lives on GPU 0 \({api} {architecture}\); the GPU"
                                             r" verify and forward need an NVIDIA Hopper GPU"):
            window.check_window_device(DeviceRef.GPU(0))
    else:
        window.check_window_device(DeviceRef.GPU(0))
    window.check_window_device(DeviceRef.CPU())


class _LookedUp(Exception):
    """Raised where a call would compile or run: its graph's key was looked up."""


@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_precompile_compiles_the_graphs_the_calls_look_up(monkeypatch: pytest.MonkeyPatch, dtype: str,
                                                         gate: str) -> None:
    """Every kind: the key a call looks its graph up under is one that ``precompile``
    compiles (nothing is compiled here: both are recorded)."""
    from gdfold_max import StateFolder, trees
    from gdfold_max.eager.window import WINDOW_KINDS, WindowRunner

    runner, folder = WindowRunner("cpu"), StateFolder("cpu")
    precompiled: set[tuple[object, ...]] = set()
    looked_up: list[tuple[object, ...]] = []

    def compiled(key: tuple[object, ...], build: object) -> None:
        looked_up.append(key)
        raise _LookedUp

    for compiler in (runner, folder):
        monkeypatch.setattr(compiler, "compile_together", precompiled.update)
        monkeypatch.setattr(compiler, "compiled", compiled)
    case = random_window_case(7, windows=[4, 0, 1, 2], state_dtype=dtype, gate=gate)  # type: ignore[arg-type]
    runner.precompile([(kind, dtype) for kind in WINDOW_KINDS], key_dim=64, value_dim=64, ring_len=4,
                      gate=gate)  # type: ignore[arg-type]
    folder.precompile([dtype], key_dim=64, value_dim=64, ring_len=4, gates=[gate], paths=[False, True])  # type: ignore[list-item]
    tables = (case.row_ids, case.ring_row_ids, case.input_row_offsets)
    previous = {"previous_ring_row_ids": case.previous_ring_row_ids,
                "previous_num_accepted": case.previous_num_accepted}
    path, parents = trees.chain_path(4, 4), trees.chain_parents(4, 4)
    fold_tables = (case.row_ids[None], case.ring_row_ids[None], case.previous_num_accepted)
    calls: list[Callable[[], Any]] = [
        lambda: runner.verify_ring(*case.tokens(), *case.fresh(), *tables),
        lambda: runner.verify_ring(*case.tokens(), *case.fresh(), *tables, **previous),
        lambda: runner.recurrence(*case.tokens(), case.fresh()[0], case.row_ids, case.input_row_offsets),
        lambda: runner.verify_tree(*case.tokens(), *case.fresh(), *tables, parents),
        lambda: runner.verify_tree(*case.tokens(), *case.fresh(), *tables, parents, previous_accepted_nodes=path,
                                   **previous),
        lambda: folder.fold(*case.fresh(), *fold_tables, gate=gate),  # type: ignore[arg-type]
        lambda: folder.fold(*case.fresh(), *fold_tables, gate=gate, accepted_nodes=path),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(_LookedUp):
            call()
    assert len(set(looked_up)) == len(calls)
    assert set(looked_up) <= precompiled
    with pytest.raises(ValueError, match="graphs: state dtype 'bf16' is unsupported"):
        runner.precompile([("verify", "bf16")], key_dim=64, value_dim=64, ring_len=4)
    with pytest.raises(ValueError, match="graphs: kind 'fold' is not one of"):
        runner.precompile([("fold", "float32")], key_dim=64, value_dim=64, ring_len=4)
