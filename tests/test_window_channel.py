"""The verify, the verify with fold on load and the forward with per-channel gates
(Kimi Delta Attention: ``decay [T, nv, K]``), on the CPU and on both GPU kernels (each
forced, and "auto", which runs the throughput kernel at these shapes), bit for bit against the
numpy reference and against each other; bad input refused before anything is written; a
throughput tile whose per-channel staging no SM holds refused when the graph is built."""

from __future__ import annotations

import numpy as np
import pytest
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType

from conftest import assert_bits_equal, assert_recurrence_matches_reference
from gdfold_max import StateFolder, folder_for, reference, runner_for, verify_ring
from gdfold_max.cases import WindowCase, random_window_case
from gdfold_max.eager.window import WindowRunner
from gdfold_max.layout import RecordLayout
from gdfold_max.ops.kernels import kernels_path
from gdfold_max.ops.window import GPU_PATHS, gpu_tiling

#: Where the per-channel ops run, as (device, gpu_path): the CPU, the GPU's "auto" (the
#: throughput kernel at these shapes) and each of its kernels forced.
CHANNEL_TARGETS = [
    pytest.param(("cpu", "auto"), id="cpu"),
    pytest.param(("gpu", "auto"), id="gpu", marks=pytest.mark.gpu),
    pytest.param(("gpu", "latency"), id="gpu-latency", marks=pytest.mark.gpu),
    pytest.param(("gpu", "throughput"), id="gpu-throughput", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module", params=CHANNEL_TARGETS)
def target(request: pytest.FixtureRequest) -> tuple[str, str]:
    device, path = request.param
    return str(device), str(path)


@pytest.fixture(scope="module")
def device(target: tuple[str, str]) -> str:
    return target[0]


@pytest.fixture(scope="module")
def runner(target: tuple[str, str]) -> WindowRunner:
    runner = runner_for(target[0], target[1])
    if target[0] == "cpu":
        # The graphs this file's CPU tests call, compiled together (see the note below).
        runner.precompile([("verify", "float32"), ("fold_on_load", "float32"), ("fold_on_load", "bfloat16"),
                           ("forward", "float32")], key_dim=64, value_dim=64, ring_len=4, gate="channel")
    return runner


@pytest.fixture(scope="module")
def folder(device: str) -> StateFolder:
    return folder_for(device)


def run_verify(case: WindowCase, runner: WindowRunner | None, *, fold_on_load: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ours on ``runner``, or (None) the numpy reference."""
    return case.run_verify(runner.verify_ring if runner is not None else reference.verify_ring,
                           fold_on_load=fold_on_load)


# Each (op, dtype) is a graph to compile (about 26 s on two cores): fp32 runs every op,
# bf16 the fold on load, whose store rounds the folded state and whose window reads it
# back (the plain verify never writes the pool but for windows past RING_LEN).
@pytest.mark.parametrize(("state_dtype", "fold_on_load"),
                         [("float32", False), ("float32", True), ("bfloat16", True)])
def test_verify_matches_reference(runner: WindowRunner, state_dtype: str, fold_on_load: bool) -> None:
    # Windows: full, empty, one token, past RING_LEN (that request commits), ...
    case = random_window_case(71, windows=[4, 0, 1, 6, 3], state_dtype=state_dtype, gate="channel")
    assert case.decay.shape[-1] == case.state.shape[2]
    got = run_verify(case, runner, fold_on_load=fold_on_load)
    want = run_verify(case, None, fold_on_load=fold_on_load)
    for name, a, b in zip(("readout", "pool", "ring"), got, want, strict=True):
        assert_bits_equal(a, b, name)


def test_records_hold_k_decays_per_value_head(runner: WindowRunner) -> None:
    case = random_window_case(72, windows=[3, 2], gate="channel")
    _, _, ring = run_verify(case, runner, fold_on_load=False)
    _, nv, k, v = case.state.shape
    layout = RecordLayout(k, v, nv // case.num_key_heads, "channel")
    first = int(case.input_row_offsets[0])
    row = int(case.ring_row_ids[0])
    for t in range(3):
        for vh in range(case.state.shape[1]):
            key_head, slot = divmod(vh, layout.group_size)
            at = layout.decay_offset(slot)
            assert_bits_equal(ring[row, key_head, t, at : at + case.state.shape[2]], case.decay[first + t, vh],
                              f"token {t}, value head {vh}: decays")


def test_fold_on_load_equals_fold_then_verify(runner: WindowRunner, folder: StateFolder) -> None:
    case = random_window_case(73, gate="channel")
    fused = run_verify(case, runner, fold_on_load=True)
    pool, ring = case.fresh()
    folder.fold(pool, ring, case.row_ids[None], case.previous_ring_row_ids[None], case.previous_num_accepted,
                gate="channel")
    plain = runner.verify_ring(*case.tokens(), pool, ring, case.row_ids, case.ring_row_ids,
                                          case.input_row_offsets)
    for name, a, b in zip(("readout", "pool", "ring"), fused, (plain, pool, ring), strict=True):
        assert_bits_equal(a, b, name)


def test_verify_then_fold_equals_forward_over_accepted_tokens(runner: WindowRunner, folder: StateFolder) -> None:
    case = random_window_case(74, windows=[4, 4, 4], gate="channel")
    _, pool, ring = run_verify(case, runner, fold_on_load=False)
    accepted = np.array([4, 1, 2], np.uint32)
    folder.fold(pool, ring, case.row_ids[None], case.ring_row_ids[None], accepted, gate="channel")
    # The forward over the accepted tokens alone.
    keep = np.concatenate([np.arange(int(case.input_row_offsets[b]), int(case.input_row_offsets[b]) + int(n))
                           for b, n in enumerate(accepted)])
    offsets = np.concatenate([[0], np.cumsum(accepted)]).astype(np.uint32)
    forward_pool = case.state.copy()
    qkv, decay, beta = case.tokens()
    runner.recurrence(qkv[keep], decay[keep], beta[keep], forward_pool, case.row_ids, offsets)
    assert_bits_equal(pool, forward_pool)


# bf16 on the GPU only: on the CPU the fold on load covers the bf16 store and read-back,
# and each CPU graph costs CI half a minute.
@pytest.mark.parametrize("state_dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.gpu)])
def test_forward_matches_reference(runner: WindowRunner, state_dtype: str) -> None:
    case = random_window_case(75, windows=[7, 0, 1, 2], state_dtype=state_dtype, gate="channel")
    assert_recurrence_matches_reference(runner, case)


def test_per_channel_gates_differ_from_their_head_mean(runner: WindowRunner) -> None:
    """The op reads every one of the K decays: a head gate of their first value gives
    another readout."""
    case = random_window_case(76, windows=[4, 4], gate="channel")
    got, _, _ = run_verify(case, runner, fold_on_load=False)
    pool, ring = case.fresh()
    qkv, decay, beta = case.tokens()
    head_ring = np.zeros((ring.shape[0], ring.shape[1], ring.shape[2],
                          RecordLayout(case.state.shape[2], case.state.shape[3],
                                       case.state.shape[1] // case.num_key_heads).min_stride), np.float32)
    as_head = runner.verify_ring(qkv, np.ascontiguousarray(decay[:, :, 0]), beta, pool, head_ring,
                                            case.row_ids, case.ring_row_ids, case.input_row_offsets)
    assert not np.array_equal(got, as_head)


def test_bad_input_is_refused_before_anything_is_written(runner: WindowRunner) -> None:
    case = random_window_case(77, gate="channel")
    qkv, decay, beta = case.tokens()
    tables = (case.row_ids, case.ring_row_ids, case.input_row_offsets)

    def untouched(call: object, match: str, *, decays: np.ndarray = decay, ring_stride: int | None = None) -> None:
        pool, ring = case.fresh()
        if ring_stride is not None:
            ring = np.zeros(ring.shape[:3] + (ring_stride,), np.float32)
        before_pool, before_ring = pool.copy(), ring.copy()
        with pytest.raises(ValueError, match=match):
            call(qkv, decays, beta, pool, ring, *tables)  # type: ignore[operator]
        assert_bits_equal(pool, before_pool, "pool")
        assert_bits_equal(ring, before_ring, "ring")

    k = case.state.shape[2]
    untouched(runner.verify_ring, rf"decay: expected \[{decay.shape[0]}, {case.state.shape[1]}, {k}\]",
              decays=np.ascontiguousarray(decay[:, :, : k // 2]))
    untouched(runner.verify_ring, r"decay: expected rank 2 \[T, nv\] or rank 3", decays=decay[..., None].copy())
    group = case.state.shape[1] // case.num_key_heads
    head_stride = RecordLayout(k, case.state.shape[3], group).min_stride
    needed = RecordLayout(k, case.state.shape[3], group, "channel").elements
    assert head_stride < needed
    untouched(runner.verify_ring, rf"ring: record stride {head_stride} is smaller than K \+ G\*\(V\+K\) = {needed}",
              ring_stride=head_stride)


def test_the_throughput_kernel_takes_per_channel_gates() -> None:
    # Its tiling goes to the per-channel ops as to the head-gate ones; "auto" (0) leaves
    # the choice to the launch, except where the throughput kernel's staging of K decays
    # does not fit an SM: there "auto" is the latency kernel, decided when built.
    tiling = gpu_tiling(DType.float32, 128, 128, None, None, fold_on_load=True, gpu_path="throughput",
                        channel=True)
    assert tiling["GPU_PATH"] == GPU_PATHS["throughput"] and tiling["COLUMN_TILE"] == 64
    assert gpu_tiling(DType.float32, 128, 128, None, None, fold_on_load=True, channel=True)["GPU_PATH"] == 0
    for state_dtype in (DType.float32, DType.bfloat16):
        auto = gpu_tiling(state_dtype, 256, 256, None, None, fold_on_load=True, channel=True)
        assert auto["GPU_PATH"] == GPU_PATHS["latency"]
    assert gpu_tiling(DType.float32, 256, 256, None, None, fold_on_load=False, channel=True)["GPU_PATH"] == 0
    # A tile the caller names is checked, not traded for the latency kernel.
    with pytest.raises(ValueError, match="column_tile: 256 columns of a K=192 float32 state with per-channel gates"):
        gpu_tiling(DType.float32, 192, 256, 256, None, channel=True)


def test_a_throughput_tile_no_sm_holds_with_per_channel_gates_is_refused_when_built() -> None:
    gpu = DeviceRef.GPU()
    k = v = 256
    layout = RecordLayout(k, v, 2, "channel")
    with Graph("channel_on_gpu", input_types=[
            TensorType(DType.float32, ["T", 2 * 1 * k + 2 * v], gpu),
            TensorType(DType.float32, ["T", 2, k], gpu),
            TensorType(DType.float32, ["T", 2], gpu),
            BufferType(DType.float32, [4, 2, k, v], gpu),
            BufferType(DType.float32, [8, 1, 4, layout.min_stride], gpu),
            TensorType(DType.uint32, ["B"], gpu),
            TensorType(DType.uint32, ["B"], gpu),
            TensorType(DType.uint32, ["B1"], gpu),
            TensorType(DType.uint32, ["B"], gpu),
            TensorType(DType.uint32, ["B"], gpu)], custom_extensions=[kernels_path()]) as graph:
        qkv, decay, beta, pool, ring, rows, ring_rows, offsets, previous_rows, accepted = graph.inputs
        # K = 256 with a fold on load: its tokens' and records' K decays take the static
        # shared memory past 48 KiB at any tile.
        with pytest.raises(ValueError, match=r"column_tile: 64 columns of a K=256 float32 state with per-channel"
                                             r" gates need 61224 bytes of static shared memory"):
            verify_ring(qkv.tensor, decay.tensor, beta.tensor, pool.buffer, ring.buffer, rows.tensor,
                        ring_rows.tensor, offsets.tensor, previous_ring_row_ids=previous_rows.tensor,
                        previous_num_accepted=accepted.tensor, gpu_path="throughput")
