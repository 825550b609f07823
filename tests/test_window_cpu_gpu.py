"""The verify (plain and fold on load) and the forward, against the numpy reference and
against each other, bit for bit, on the CPU and (marked ``gpu``) on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import WINDOW_TARGETS, assert_bits_equal, assert_recurrence_matches_reference
from gdfold_max import reference
from gdfold_max.cases import WindowCase, chunked_fold_on_load_case, random_window_case
from gdfold_max.eager.fold import folder_for
from gdfold_max.eager.window import WindowRunner, runner_for

DTYPES = ["float32", "bfloat16"]
GPU_PATHS = ["latency", "throughput"]


@pytest.fixture(scope="session", params=WINDOW_TARGETS)
def target(request: pytest.FixtureRequest) -> tuple[str, str]:
    device, gpu_path = request.param
    return str(device), str(gpu_path)


@pytest.fixture(scope="session")
def device(target: tuple[str, str]) -> str:
    return target[0]


@pytest.fixture(scope="session")
def runner(target: tuple[str, str]) -> WindowRunner:
    runner = runner_for(*target)
    if target[0] == "cpu":
        # The graphs this file's CPU tests call, compiled together: the kernels they share
        # compile once (RING_LEN 8's fold on load compiles when first called).
        runner.precompile([(kind, dtype) for kind in ("verify", "fold_on_load", "forward") for dtype in DTYPES],
                          key_dim=64, value_dim=64, ring_len=4)
        folder_for("cpu").precompile(DTYPES, key_dim=64, value_dim=64, ring_len=4)
    return runner


def assert_same_step(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...], what: str) -> None:
    for name, a, b in zip(("readout", "pool", "ring"), got, want, strict=True):
        assert_bits_equal(a, b, f"{what}: {name}")


def assert_step_matches_reference(runner: WindowRunner, case: WindowCase, *, fold_on_load: bool,
                                  what: str) -> tuple[np.ndarray, ...]:
    """The verify (with fold on load where asked) against the reference, bit for bit;
    returns ours."""
    got = case.run_verify(runner.verify_ring, fold_on_load=fold_on_load)
    assert_same_step(got, case.run_verify(reference.verify_ring, fold_on_load=fold_on_load), what)
    return got


def assert_verify_matches_reference(runner: WindowRunner, case: WindowCase) -> None:
    """The verify with fold on load, then without, against the reference, bit for bit."""
    for fold_on_load in (True, False):
        assert_step_matches_reference(runner, case, fold_on_load=fold_on_load, what=f"fold_on_load={fold_on_load}")


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_verify_matches_reference(runner: WindowRunner, state_dtype: str) -> None:
    case = random_window_case(1, state_dtype=state_dtype)
    got = assert_step_matches_reference(runner, case, fold_on_load=False, what="verify vs reference")
    # The pool is only read, except the request whose window is past RING_LEN.
    committed = case.row_ids[3]
    untouched = np.setdiff1d(np.arange(case.state.shape[0]), [committed])
    assert_bits_equal(got[1][untouched], case.state[untouched], "rows a verify may not write")


def test_precompiled_graphs_serve_the_calls(runner: WindowRunner, device: str) -> None:
    """After ``precompile`` a verify, a fold on load and a forward of those dims compile
    nothing more."""
    if device != "cpu":
        pytest.skip("the GPU runners compile as they are called")
    compiled = runner.compiled_keys
    case = random_window_case(3, state_dtype="bfloat16")
    case.run_verify(runner.verify_ring, fold_on_load=True)
    case.run_verify(runner.verify_ring, fold_on_load=False)
    state, _ = case.fresh()
    runner.recurrence(*case.tokens(), state, case.row_ids, case.input_row_offsets)
    assert runner.compiled_keys == compiled


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_fold_on_load_equals_fold_then_verify(runner: WindowRunner, device: str, state_dtype: str) -> None:
    case = random_window_case(2, state_dtype=state_dtype)
    fused = assert_step_matches_reference(runner, case, fold_on_load=True, what="fold on load vs reference")

    state, ring = case.fresh()
    folder_for(device).fold(state, ring, case.row_ids[None], case.previous_ring_row_ids[None],
                            case.previous_num_accepted)
    out = runner.verify_ring(*case.tokens(), state, ring, case.row_ids, case.ring_row_ids, case.input_row_offsets)
    assert_same_step(fused, (out, state, ring), "fold on load vs fold then verify")


def test_fold_on_load_and_windows_longer_than_a_chunk(runner: WindowRunner) -> None:
    """RING_LEN 8: folds of more records, and recorded windows of more tokens, than a GPU
    block stages at once (4), including a fold with no window after it."""
    case = random_window_case(8, windows=[8, 5, 0, 9, 3], previous_num_accepted=[8, 5, 6, 2, 0], ring_len=8)
    assert_step_matches_reference(runner, case, fold_on_load=True, what="fold on load vs reference")


@pytest.mark.parametrize(("num_value_heads", "num_key_heads"), [(3, 3), (8, 2)])
def test_other_head_groups_match_reference(runner: WindowRunner, num_value_heads: int, num_key_heads: int) -> None:
    """One and four value heads per key head (the other cases have two): each head's
    slot in the group places its delta factors and decays in the shared record."""
    case = random_window_case(13, num_value_heads=num_value_heads, num_key_heads=num_key_heads)
    assert_verify_matches_reference(runner, case)


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_recurrence_matches_reference(runner: WindowRunner, state_dtype: str) -> None:
    # Windows longer than a GPU block's token chunk, and an empty one.
    case = random_window_case(3, state_dtype=state_dtype, windows=[9, 0, 1, 5])
    assert_recurrence_matches_reference(runner, case)


def test_verify_then_fold_equals_forward_over_accepted_tokens(runner: WindowRunner, device: str) -> None:
    """The product's promise, with our own ops end to end."""
    ring_len = 4
    case = random_window_case(4, windows=[4, 4, 3, 4], ring_len=ring_len)
    accepted = np.array([4, 0, 2, 1], np.uint32)
    state, ring = case.fresh()
    runner.verify_ring(*case.tokens(), state, ring, case.row_ids, case.ring_row_ids, case.input_row_offsets)
    folder_for(device).fold(state, ring, case.row_ids[None], case.ring_row_ids[None], accepted)

    starts = case.input_row_offsets[:-1]
    kept = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, accepted, strict=True)]).astype(np.int64)
    kept_offsets = np.concatenate([[0], np.cumsum(accepted)]).astype(np.uint32)
    forward = case.state.copy()
    readout = runner.recurrence(case.qkv[kept], case.decay[kept], case.beta[kept], forward, case.row_ids,
                                kept_offsets)
    assert_bits_equal(state, forward, "verify + fold vs forward over the accepted tokens")
    verify_readout = runner.verify_ring(*case.tokens(), case.state.copy(), case.ring.copy(), case.row_ids,
                                        case.ring_row_ids, case.input_row_offsets)
    assert_bits_equal(verify_readout[kept], readout, "readout of the accepted tokens")


def test_two_steps_of_fold_on_load_alternating_ring_rows(runner: WindowRunner, device: str) -> None:
    """Step 2 folds step 1's records from the rows step 1 wrote, and writes the others."""
    case = random_window_case(5, windows=[4, 3, 4, 2, 1])
    state, ring = case.fresh()
    want_state, want_ring = case.fresh()
    rows_a, rows_b = case.previous_ring_row_ids, case.ring_row_ids
    for step, (read, write) in enumerate(((rows_a, rows_b), (rows_b, rows_a))):
        accepted = np.array([4, 1, 0, 2, 5], np.uint32) if step else case.previous_num_accepted
        out = runner.verify_ring(*case.tokens(), state, ring, case.row_ids, write, case.input_row_offsets,
                                 previous_ring_row_ids=read, previous_num_accepted=accepted)
        want = reference.verify_ring(*case.tokens(), want_state, want_ring, case.row_ids, write,
                                     case.input_row_offsets, previous_ring_row_ids=read,
                                     previous_num_accepted=accepted)
        assert_same_step((out, state, ring), (want, want_state, want_ring), f"step {step}")


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_path", GPU_PATHS)
def test_gpu_window_skips_out_of_range_ids(gpu_path: str) -> None:
    """Inside a graph the GPU trusts its tables but never follows an id out of bounds:
    that request is skipped and its readout is NaN; every other request is exact."""
    from max.driver import CPU, Buffer
    from max.dtype import DType

    from gdfold_max.eager.base import copy_back, host_buffer

    runner = runner_for("gpu", gpu_path)
    case = random_window_case(6, windows=[4, 2, 3])
    bad_rows = case.row_ids.copy()
    bad_rows[1] = 0xFFFFFFFF
    parameters = {"K": 64, "V": 64, "RING_LEN": 4}
    model = runner.model("fold_on_load", DType.float32, parameters)

    def up(array: np.ndarray) -> Buffer:
        return host_buffer(np.ascontiguousarray(array)).to(runner.device)

    state, ring = case.fresh()
    pool, ring_buffer = up(state), up(ring)
    tables = (bad_rows, case.ring_row_ids, case.input_row_offsets, case.previous_ring_row_ids,
              case.previous_num_accepted)
    (out,) = model.execute(*(up(x) for x in case.tokens()), pool, ring_buffer, *(up(t) for t in tables))
    copy_back(pool, state)
    copy_back(ring_buffer, ring)
    readout = np.asarray(out.to(CPU()).to_numpy())

    want = case.run_verify(reference.verify_ring, fold_on_load=True)
    skipped = slice(int(case.input_row_offsets[1]), int(case.input_row_offsets[2]))
    assert np.isnan(readout[skipped]).all()
    kept = np.r_[0 : skipped.start, skipped.stop : readout.shape[0]]
    assert_bits_equal(readout[kept], want[0][kept], "readout of the other requests")
    others = [int(case.row_ids[0]), int(case.row_ids[2])]
    assert_bits_equal(state[others], want[1][others], "pool rows of the other requests")
    assert_bits_equal(state[int(case.row_ids[1])], case.state[int(case.row_ids[1])], "the skipped request's row")
    # The skipped request's ring rows: the one it would record into and the one it would
    # fold from are as they were; every other request's ring rows are as the reference's.
    skipped_rings = [int(case.ring_row_ids[1]), int(case.previous_ring_row_ids[1])]
    assert_bits_equal(ring[skipped_rings], case.ring[skipped_rings], "the skipped request's ring rows")
    other_rings = np.setdiff1d(np.arange(ring.shape[0]), skipped_rings)
    assert_bits_equal(ring[other_rings], want[2][other_rings], "ring rows of the other requests")


# (state dtype, column_tile, requests_per_block, number of requests). The small cases
# above give each block one unit (one request on one column tile of one head); these
# make blocks run several in turn, so that one unit's copies and fold overlap another's
# tokens and a block moves between heads, tiles and requests. At two units per block
# the blocks run units a grid apart; at three or more they claim them from the kernel's
# counter. The last leaves the grid to the op at 128 requests on 8 column tiles, more
# than twice the blocks an H200 holds at once, so that they claim.
# The launch modes (mojo/window_launch.mojo; 4 heads of 128 columns, 8 units a request):
# at batch 7 two units a block (28 blocks) start as programmatic dependents of the kernel
# before them; 4-column tiles (448 blocks of two units) and batch 40 (320 blocks of one),
# more blocks than an H200's 132 SMs, do not; nor do the launches whose blocks claim.
GPU_TILINGS = [
    ("float32", None, 2, 7),
    ("float32", None, 3, 7),
    ("bfloat16", None, 3, 7),
    ("float32", 4, 2, 7),
    ("float32", None, 70, 70),
    ("float32", None, None, 40),
    ("float32", None, None, 128),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("state_dtype", "column_tile", "requests_per_block", "batch"), GPU_TILINGS)
def test_gpu_tilings_match_reference(state_dtype: str, column_tile: int | None, requests_per_block: int | None,
                                     batch: int) -> None:
    runner = WindowRunner("gpu", column_tile=column_tile, requests_per_block=requests_per_block,
                          gpu_path="throughput")
    pattern = [4, 0, 1, 6, 2, 3, 4]  # full, empty, short, past RING_LEN (commits), ...
    windows = [pattern[b % len(pattern)] for b in range(batch)]
    case = random_window_case(7, windows=windows, state_dtype=state_dtype, key_dim=128, value_dim=128)
    assert_verify_matches_reference(runner, case)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("gate", ["head", "channel"])
def test_gpu_fold_on_load_of_several_chunks_matches_reference(state_dtype: str, gate: str) -> None:
    """RING_LEN 16 on the throughput kernel, three units a block: folds on load of two to
    four chunks of records, or none (a block stages four at a time; odd and even numbers of
    chunks), each block's next unit folding in chunks or not."""
    runner = WindowRunner("gpu", requests_per_block=3, gpu_path="throughput")
    case = chunked_fold_on_load_case(state_dtype, gate)
    assert_step_matches_reference(runner, case, fold_on_load=True, what="fold on load vs reference")


# The widest heads the ops take, K = V = 256: a GPU thread then holds 32 state rows of
# four columns, near its 255 registers, and a block's state tile is twice as tall.
@pytest.mark.gpu
@pytest.mark.parametrize(("state_dtype", "column_tile", "gpu_path"),
                         [("float32", None, "throughput"), ("float32", 16, "throughput"),
                          ("bfloat16", None, "throughput"), ("float32", None, "latency"),
                          ("bfloat16", None, "latency")])
def test_gpu_wide_heads_match_reference(state_dtype: str, column_tile: int | None, gpu_path: str) -> None:
    runner = WindowRunner("gpu", column_tile=column_tile, requests_per_block=2, gpu_path=gpu_path)
    case = random_window_case(11, num_value_heads=2, num_key_heads=1, key_dim=256, value_dim=256,
                              state_dtype=state_dtype)
    assert_verify_matches_reference(runner, case)



# A tile of three whole warps that is no power of two (V = 96: 48 columns by default,
# 96 threads), the kind of block whose warps the staging must not split.
@pytest.mark.gpu
@pytest.mark.parametrize("gpu_path", GPU_PATHS)
def test_gpu_three_warp_tile_matches_reference(gpu_path: str) -> None:
    runner = WindowRunner("gpu", requests_per_block=3, gpu_path=gpu_path)
    case = random_window_case(13, windows=[4, 0, 1, 6, 2, 3, 4], key_dim=64, value_dim=96)
    assert_verify_matches_reference(runner, case)


# The latency kernel over the batches the throughput kernel's tilings above cover (many
# warps per SM, every kind of window; batch 7 starts as a dependent launch, batch 70's
# 2240 warps, over 16 per SM on an H200, do not), and the automatic choice at a small
# and a large batch (LATENCY_WARPS_PER_SM in mojo/window_launch.mojo decides which
# kernel it runs).
@pytest.mark.gpu
@pytest.mark.parametrize(("state_dtype", "gpu_path", "batch"),
                         [("float32", "latency", 7), ("bfloat16", "latency", 7), ("float32", "latency", 70),
                          ("float32", "auto", 7), ("float32", "auto", 128), ("bfloat16", "auto", 128)])
def test_gpu_latency_and_automatic_paths_match_reference(state_dtype: str, gpu_path: str, batch: int) -> None:
    runner = runner_for("gpu", gpu_path)
    pattern = [4, 0, 1, 6, 2, 3, 4]
    windows = [pattern[b % len(pattern)] for b in range(batch)]
    case = random_window_case(7, windows=windows, state_dtype=state_dtype, key_dim=128, value_dim=128)
    assert_verify_matches_reference(runner, case)


# Plain decoding on "auto": one-token windows run on the latency kernel up to two of its
# warps an SM (ONE_TOKEN_LATENCY_WARPS_PER_SM in mojo/window_launch.mojo), else on the
# throughput kernel. At 8 heads of 128 x 128 (8 slabs a head) a request is 64 warps:
# batch 1 is under the bound on any GPU of 32 SMs or more, batch 40 (2560 warps) over it
# on one of up to 1279. Both launches, the forward and the verify, bit for bit.
@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 40])
def test_gpu_automatic_path_at_one_token_windows_matches_reference(state_dtype: str, batch: int) -> None:
    runner = runner_for("gpu", "auto")
    case = random_window_case(11, windows=[1] * batch, state_dtype=state_dtype, num_value_heads=8,
                              num_key_heads=4, key_dim=128, value_dim=128)
    assert_recurrence_matches_reference(runner, case)
    assert_verify_matches_reference(runner, case)
