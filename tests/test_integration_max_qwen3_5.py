"""gdfold_max inside MAX's own Qwen3.5 speculative pipeline: the switch, and MAX's
rollback and Gated DeltaNet layer running our ops, bit for bit.

CPU: MAX's ``fold_state_pools`` under :func:`patched` in a CPU graph (MAX's own fold
has no CPU kernel), and our stand-ins for MAX's verify. GPU (marked): MAX's own
``GatedDeltaNet`` with random weights through a verify and a rollback, MAX's ops beside
ours.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest

pytest.importorskip("max.pipelines.architectures.unified_mtp_qwen3_5.state_rollback",
                    reason="MAX's pipelines need the max-pipelines extra")

from max.driver import CPU, Buffer  # noqa: E402
from max.dtype import DType  # noqa: E402
from max.engine import InferenceSession, Model  # noqa: E402
from max.graph import (  # noqa: E402
    BufferType,
    DeviceRef,
    Graph,
    TensorType,
    TensorValue,
    default_custom_extensions,
    ops,
)
from max.graph import Module as GraphModule  # noqa: E402
from max.nn.state_space import gated_delta_state_fold, verify_width_operand  # noqa: E402
from max.pipelines.architectures.qwen3_5.layers import gated_deltanet  # noqa: E402
from max.pipelines.architectures.unified_mtp_qwen3_5 import state_rollback  # noqa: E402

from conftest import assert_bits_equal, bits  # noqa: E402
from gdfold_max import kernels_path, reference, runner_for, state_fold  # noqa: E402
from gdfold_max.cases import random_fold_case, random_window_case  # noqa: E402
from gdfold_max.integrations import max_qwen3_5  # noqa: E402

HOST = DeviceRef.CPU()
MAX_VERIFY = gated_deltanet.gated_delta_recurrence_verify_ring_fwd
MAX_FORWARD = gated_deltanet.gated_delta_recurrence_fwd
NONE_ROUTED = {"fold": False, "verify": False, "forward": False}


def test_patched_routes_the_fold_and_restores_max_on_exit() -> None:
    assert state_rollback.gated_delta_state_fold is gated_delta_state_fold
    with max_qwen3_5.patched():
        assert state_rollback.gated_delta_state_fold is state_fold
        assert gated_deltanet.gated_delta_recurrence_verify_ring_fwd is MAX_VERIFY
        assert max_qwen3_5.installed() == {"fold": True, "verify": False, "forward": False}
        assert kernels_path() in default_custom_extensions()
        with max_qwen3_5.patched(verify=True):
            assert gated_deltanet.gated_delta_recurrence_verify_ring_fwd is max_qwen3_5.verify_like_max
            assert gated_deltanet.gated_delta_recurrence_fwd is MAX_FORWARD
            with max_qwen3_5.patched(forward=True):
                assert gated_deltanet.gated_delta_recurrence_fwd is max_qwen3_5.forward_like_max
                assert gated_deltanet.gated_delta_recurrence_verify_ring_fwd is MAX_VERIFY
                assert max_qwen3_5.installed() == {"fold": True, "verify": False, "forward": True}
            assert gated_deltanet.gated_delta_recurrence_verify_ring_fwd is max_qwen3_5.verify_like_max
            assert gated_deltanet.gated_delta_recurrence_fwd is MAX_FORWARD
        assert gated_deltanet.gated_delta_recurrence_verify_ring_fwd is MAX_VERIFY
        assert state_rollback.gated_delta_state_fold is state_fold
        assert kernels_path() in default_custom_extensions()  # the outer block's, still
    assert state_rollback.gated_delta_state_fold is gated_delta_state_fold
    assert max_qwen3_5.installed() == NONE_ROUTED
    assert kernels_path() not in default_custom_extensions()


def test_names_are_restored_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="inside"), max_qwen3_5.patched(verify=True, forward=True):
        raise RuntimeError("inside")
    assert state_rollback.gated_delta_state_fold is gated_delta_state_fold
    assert gated_deltanet.gated_delta_recurrence_verify_ring_fwd is MAX_VERIFY
    assert gated_deltanet.gated_delta_recurrence_fwd is MAX_FORWARD
    assert kernels_path() not in default_custom_extensions()


def test_install_and_uninstall() -> None:
    try:
        max_qwen3_5.install(verify=True, forward=True)
        assert max_qwen3_5.installed() == {"fold": True, "verify": True, "forward": True}
        max_qwen3_5.install()
        assert max_qwen3_5.installed() == {"fold": True, "verify": False, "forward": False}
        assert gated_deltanet.gated_delta_recurrence_verify_ring_fwd is MAX_VERIFY
        assert gated_deltanet.gated_delta_recurrence_fwd is MAX_FORWARD
        assert default_custom_extensions().count(kernels_path()) == 1
    finally:
        max_qwen3_5.uninstall()
    assert state_rollback.gated_delta_state_fold is gated_delta_state_fold
    assert max_qwen3_5.installed() == NONE_ROUTED
    assert kernels_path() not in default_custom_extensions()


@pytest.fixture(scope="module")
def rollback_model() -> object:
    """MAX's ``fold_state_pools`` for one device, built under :func:`patched` into a CPU
    graph, with the draft width symbolic as in MAX's graph. The graph names no
    ``custom_extensions``, as MAX's pipelines build theirs: :func:`patched` brings our
    kernels."""
    inputs = [BufferType(DType.float32, ["rows", 4, 64, 64], HOST),
              BufferType(DType.float32, ["ring_rows", 2, 4, "stride"], HOST),
              TensorType(DType.uint32, ["layers", "batch"], HOST),
              TensorType(DType.uint32, ["layers", "batch"], HOST),
              TensorType(DType.uint32, ["batch"], HOST),
              TensorType(DType.int64, ["drafts"], HOST)]
    with max_qwen3_5.patched(), Graph("rollback", input_types=inputs) as graph:
        pool, ring, rows, ring_rows, accepted, width = graph.inputs
        state_rollback.fold_state_pools([pool.buffer], [rows.tensor], [ring.buffer], [ring_rows.tensor],
                                        accepted.tensor, [], width.tensor)
        graph.output()
    return InferenceSession(devices=[CPU()]).load(graph)


@pytest.mark.parametrize("drafts", [3, 0])
def test_max_rollback_under_patched_is_bit_exact_on_the_cpu(rollback_model: object, drafts: int) -> None:
    """Several layers, shuffled tables, counts of 0, 1, a full ring and past the ring:
    the reference's pool at any width but 0, where the verify committed and nothing folds."""
    case = random_fold_case(41, layers=3, batch=4, num_accepted=[0, 1, 4, 5])
    state = case.state_in.copy()
    rollback_model.execute(  # type: ignore[attr-defined]
        Buffer.from_numpy(state), Buffer.from_numpy(case.ring),
        *(Buffer.from_numpy(t) for t in (case.row_ids, case.ring_row_ids, case.num_accepted)),
        Buffer.from_numpy(np.arange(drafts, dtype=np.int64)))
    assert_bits_equal(state, case.state_out if drafts else case.state_in)
    if drafts:
        want = reference.fold(case.state_in.copy(), case.ring, case.row_ids, case.ring_row_ids, case.num_accepted)
        assert_bits_equal(state, want, "against the reference fold")


def _window_graph(kind: str, case: object, symbolic: bool, module: GraphModule | None = None,
                  device: DeviceRef = HOST, previous_dims: tuple[str, str] = ("B", "B")) -> Graph:
    """Our verify in MAX's signature (``verify``) or the fused one, the operands on
    ``device``; the width, as in MAX's graph, a host tensor whose length is the count.
    The previous step's two tables have the lengths ``previous_dims`` (names other than
    ``B`` let them differ from the batch, which only the op then checks)."""
    c = case
    f32, u32 = DType.float32, DType.uint32
    pool_dtype = DType.bfloat16 if c.state.dtype.name == "bfloat16" else f32  # type: ignore[attr-defined]
    width_dim = "drafts" if symbolic else 3
    inputs = [TensorType(f32, ["T", c.qkv.shape[1]], device), TensorType(f32, ["T", c.decay.shape[1]], device),  # type: ignore[attr-defined]
              TensorType(f32, ["T", c.decay.shape[1]], device),  # type: ignore[attr-defined]
              BufferType(pool_dtype, ["rows", *c.state.shape[1:]], device),  # type: ignore[attr-defined]
              BufferType(f32, ["ring_rows", *c.ring.shape[1:]], device),  # type: ignore[attr-defined]
              TensorType(u32, ["B"], device), TensorType(u32, ["B"], device), TensorType(u32, ["B1"], device),
              *(TensorType(u32, [dim], device) for dim in previous_dims),
              TensorType(DType.int64, [width_dim], HOST)]
    name = (f"{kind}_{symbolic}" + ("" if device == HOST else f"_{pool_dtype.name}_gpu")
            + ("" if previous_dims == ("B", "B") else "_previous_apart"))
    with Graph(name, input_types=inputs, custom_extensions=[kernels_path()], module=module) as graph:
        qkv, decay, beta, pool, ring, rows, ring_rows, offsets, previous, accepted, width = graph.inputs
        verify = (max_qwen3_5.verify_like_max if kind == "verify"
                  else max_qwen3_5.fused_verify(previous.tensor, accepted.tensor))
        graph.output(verify(qkv_conv_output=qkv.tensor, decay_per_token=decay.tensor, beta_per_token=beta.tensor,
                            recurrent_state=pool.buffer, ring=ring.buffer, slot_idx=rows.tensor,
                            ring_slot_idx=ring_rows.tensor, input_row_offsets=offsets.tensor,
                            verify_width=width.tensor))
    return graph


WIDTH_CASE = random_window_case(42, windows=[4, 1, 3, 2], previous_num_accepted=[4, 0, 2, 1])
#: (kind, symbolic width) of the graphs of our verify in MAX's signature.
WIDTH_GRAPHS = (("verify", False), ("verify", True), ("fused", True))


@pytest.fixture(scope="module")
def width_models() -> dict[str, Model]:
    """The graphs of :data:`WIDTH_GRAPHS`, compiled together in one module: the kernels
    they share compile once."""
    module = GraphModule()
    for kind, symbolic in WIDTH_GRAPHS:
        _window_graph(kind, WIDTH_CASE, symbolic, module)
    _window_graph("fused", WIDTH_CASE, True, module, previous_dims=("P", "Q"))
    return InferenceSession(devices=[CPU()]).load_all(module, custom_extensions=[kernels_path()])


@pytest.mark.parametrize("kind", ["verify", "fused"])
def test_our_verify_in_max_s_signature_keeps_max_s_width_rule(width_models: dict[str, Model], kind: str) -> None:
    """At a width of 0 the window lands on the pool (the forward; fused: after the
    previous records fold); otherwise it records. Both against the reference, bit for
    bit, with the width symbolic (both widths through one graph) and, for the plain
    verify, static (the same build-time branch serves the fused one)."""
    case = WIDTH_CASE
    runs = ((False, [3]), (True, [3, 0])) if kind == "verify" else ((True, [3, 0]),)
    for symbolic, widths in runs:
        model = width_models[f"{kind}_{symbolic}"]
        for drafts in widths:
            _assert_width_rule(model, kind, case, drafts, f"{kind}, width {drafts}{' (symbolic)' if symbolic else ''}")


def _assert_width_rule(model: Model, kind: str, case: Any, drafts: int, what: str, device: Any = None) -> None:
    """Runs one width through ``model`` (operands uploaded to ``device``, the host when
    None) and checks the readout, the pool and the ring against the reference, bit for
    bit: at a width of 0 the forward (fused: after the previous records fold), else the
    verify (fused: with fold on load)."""
    tables = (case.row_ids, case.ring_row_ids, case.input_row_offsets, case.previous_ring_row_ids,
              case.previous_num_accepted)
    pool, ring = case.fresh()
    out = _run_width(model, case, drafts, pool, ring, tables, device)
    want_pool, want_ring = case.fresh()
    previous = (case.previous_ring_row_ids, case.previous_num_accepted) if kind == "fused" else None
    want = _width_reference(case, drafts, want_pool, want_ring, case.row_ids, case.ring_row_ids,
                            case.input_row_offsets, previous)
    assert_bits_equal(out, want, f"{what}: readout")
    assert_bits_equal(pool, want_pool, f"{what}: pool")
    assert_bits_equal(ring, want_ring, f"{what}: ring")


def _width_reference(case: Any, drafts: int, pool: np.ndarray, ring: np.ndarray, row_ids: np.ndarray,
                     ring_row_ids: np.ndarray, offsets: np.ndarray,
                     previous: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    """The reference's step of MAX's width rule on the case's tokens, ``pool`` and ``ring``
    written in place: at a width of 0 the forward, else the verify; with ``previous``
    (ring rows, counts) the previous records fold first (as the fold, or on load)."""
    if drafts:
        extra = {} if previous is None else {"previous_ring_row_ids": previous[0], "previous_num_accepted": previous[1]}
        return reference.verify_ring(*case.tokens(), pool, ring, row_ids, ring_row_ids, offsets, **extra)
    if previous is not None:
        reference.fold(pool, ring, row_ids[None], previous[0][None], previous[1])
    return reference.recurrence(*case.tokens(), pool, row_ids, offsets, num_key_heads=case.num_key_heads)


def _run_width(model: Model, case: Any, drafts: int, pool: np.ndarray, ring: np.ndarray, tables: tuple[Any, ...],
               device: Any = None) -> np.ndarray:
    """Runs ``model`` on the case's tokens, ``pool``, ``ring`` (written back in place),
    ``tables`` and a width of ``drafts``, the operands uploaded to ``device`` (the host,
    sharing the arrays, when None); returns the readout."""
    from gdfold_max.eager.base import copy_back, host_buffer

    upload = host_buffer if device is None else (lambda a: host_buffer(a).to(device))
    pool_buffer, ring_buffer = upload(pool), upload(ring)
    (out,) = model.execute(*(upload(a) for a in case.tokens()), pool_buffer, ring_buffer,
                           *(upload(t) for t in tables), Buffer.from_numpy(np.arange(drafts, dtype=np.int64)))
    if device is not None:
        copy_back(pool_buffer, pool)
        copy_back(ring_buffer, ring)
    return np.asarray(out.to(CPU()).to_numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_the_fused_verify_keeps_the_width_rule_on_the_gpu(state_dtype: str) -> None:
    """``gdfold_verify_or_forward`` on the GPU, the width symbolic (both widths through
    one graph): at 3 the verify with fold on load, at 0 the fold and then the forward,
    bit for bit against the reference, fp32 and bf16 pools."""
    case = random_window_case(42, windows=[4, 1, 3, 2], previous_num_accepted=[4, 0, 2, 1], state_dtype=state_dtype)
    model, gpu = _fused_model(case, "gpu")
    for drafts in (3, 0, 3):
        _assert_width_rule(model, "fused", case, drafts, f"fused on the GPU, {state_dtype} pool, width {drafts}", gpu)


def _fused_model(case: Any, device: str) -> tuple[Model, Any]:
    """The fused verify's graph for ``case``, width symbolic, compiled for ``device``
    ("cpu" or "gpu"); with it the device to upload operands to (None: the host)."""
    if device == "cpu":
        return InferenceSession(devices=[CPU()]).load(_window_graph("fused", case, True),
                                                      custom_extensions=[kernels_path()]), None
    from max.driver import Accelerator

    gpu = Accelerator()
    return InferenceSession(devices=[gpu]).load(_window_graph("fused", case, True, device=DeviceRef.GPU())), gpu


@pytest.mark.parametrize(("device", "state_dtype"), [
    ("cpu", "bfloat16"),
    pytest.param("gpu", "float32", marks=pytest.mark.gpu),
    pytest.param("gpu", "bfloat16", marks=pytest.mark.gpu),
])
def test_the_fused_verify_at_max_s_dflash2_geometry(device: str, state_dtype: str) -> None:
    """``gdfold_verify_or_forward`` where MAX's DFlash2 pipeline runs it: a ring of 8
    records (blocks of 8), K = V = 128, verify windows of 8 and previous counts up to 8
    (each two chunks of fold on load and of window on the GPU), a one-token and a prefill
    window past the ring beside them, widths 7, 0 and 7 through one graph, bit for bit
    against the reference."""
    case = random_window_case(7, windows=[8, 8, 1, 8, 20, 3], previous_num_accepted=[8, 5, 7, 0, 6, 1],
                              key_dim=128, value_dim=128, ring_len=8, state_dtype=state_dtype)
    model, where = _fused_model(case, device)
    for drafts in (7, 0, 7):
        _assert_width_rule(model, "fused", case, drafts, f"fused on the {device}, {state_dtype} pool, width {drafts}",
                           where)


#: One request through the served op with the rows and counts the carry gives it
#: (``max_qwen3_5_serve.ring.read_carry``): (tokens, verify width, previous count, the half
#: it names current; the other is folded). A prefill at width 0 (tag 0: nothing carried),
#: verifies of blocks of 8 (width 7), each recording into the half the one before did not
#: and folding what that one kept, and a step without drafts, which folds, commits, records
#: nothing and swaps no half, after which nothing is carried.
SERVED_STEPS = ((3, 0, 0, 1), (8, 7, 0, 1), (8, 7, 3, 0), (8, 7, 8, 1), (1, 0, 5, 0), (8, 7, 0, 0))


@pytest.mark.parametrize(("device", "state_dtype"), [
    ("cpu", "bfloat16"),
    pytest.param("gpu", "float32", marks=pytest.mark.gpu),
    pytest.param("gpu", "bfloat16", marks=pytest.mark.gpu),
])
def test_the_fused_verify_steps_a_request_alone_as_the_served_dflash2_step_does(device: str,
                                                                              state_dtype: str) -> None:
    """A batch of one, step after step through ``gdfold_verify_or_forward`` at MAX's
    DFlash2 geometry (a ring of 8, K = V = 128), as a served prompt asked alone is stepped
    (:data:`SERVED_STEPS`): one pool row and the two ring rows of one request's block of a
    two-half ring, high in tables of 40 rows; the ring starts as NaN, as scratch never
    written may be. Readout, pool and ring after every step equal the reference's, bit for
    bit: a step that read a record never written, or wrote outside its row, fails here."""
    cases = [random_window_case(60 + i, windows=[tokens], key_dim=128, value_dim=128, ring_len=8,
                                state_dtype=state_dtype) for i, (tokens, *_) in enumerate(SERVED_STEPS)]
    model, where = _fused_model(cases[0], device)
    rng = np.random.default_rng(59)
    pool = (0.1 * rng.standard_normal((40, *cases[0].state.shape[1:]))).astype(cases[0].state.dtype)
    ring = np.full((40, *cases[0].ring.shape[1:]), np.nan, np.float32)
    want_pool, want_ring = pool.copy(), ring.copy()
    row, block = np.array([37], np.uint32), 19
    for i, (case, (tokens, drafts, count, half)) in enumerate(zip(cases, SERVED_STEPS, strict=True)):
        ring_rows = np.array([2 * block + half], np.uint32)
        previous = np.array([2 * block + 1 - half], np.uint32)
        counts = np.array([count], np.uint32)
        offsets = np.array([0, tokens], np.uint32)
        out = _run_width(model, case, drafts, pool, ring, (row, ring_rows, offsets, previous, counts), where)
        want = _width_reference(case, drafts, want_pool, want_ring, row, ring_rows, offsets, (previous, counts))
        what = f"step {i} ({tokens} tokens, width {drafts}, count {count}), {state_dtype} pool on the {device}"
        assert_bits_equal(out, want, f"{what}: readout")
        assert_bits_equal(pool, want_pool, f"{what}: pool")
        assert_bits_equal(ring, want_ring, f"{what}: ring")
        assert np.isfinite(out).all(), f"{what}: a readout that is not finite"


def test_with_a_symbolic_width_the_fused_layer_adds_no_branch() -> None:
    """The fused verify reads a symbolic width in its op (``gdfold_verify_or_forward``),
    where our verify in MAX's signature branches in the graph (an ``mo.if``)."""
    fused = str(_window_graph("fused", WIDTH_CASE, True))
    assert "gdfold_verify_or_forward" in fused and "mo.if" not in fused
    assert "mo.if" in str(_window_graph("verify", WIDTH_CASE, True))


# ---- GPU: MAX's own Gated DeltaNet layer, with random weights ----------------------------

HIDDEN, NK, NV, HEAD, CONV = 256, 2, 4, 128, 4
BATCH, WINDOW, RING_LEN, STRIDE = 3, 4, 4, 640  # stride: K + G*(V+1) = 386, padded to 128 bytes


def _layer(dtype: DType, where: DeviceRef, cls: type) -> object:
    import ml_dtypes

    from gdfold_max.eager.base import host_buffer

    layer = cls(HIDDEN, NK, NV, HEAD, HEAD, CONV, dtype, where)
    rng = np.random.default_rng(51)
    weights = {}
    for name, weight in layer.raw_state_dict().items():
        values = (0.05 * rng.standard_normal([int(d) for d in weight.shape])).astype(np.float32)
        # bf16 weights travel as their bits (DLPack has no bf16).
        weights[name] = values if weight.dtype == DType.float32 else host_buffer(values.astype(ml_dtypes.bfloat16))
    layer.load_state_dict(weights)
    return layer


def _step_graph(dtype: DType, where: DeviceRef, variant: str) -> tuple[Graph, object]:
    """One verify of every request's window through the layer, then MAX's rollback fold
    (``fold_state_pools``): ``max`` as MAX ships it, ``patched`` with our fold, ``ours``
    with our verify and fold, ``fused`` with the verify folding the previous records on
    load (and the rollback then folding nothing: its width is 0)."""
    from max.pipelines.architectures.qwen3_5.state_cache import GatedDeltaRingAccess

    cls = max_qwen3_5.FusedGatedDeltaNet if variant == "fused" else gated_deltanet.GatedDeltaNet
    layer = _layer(dtype, where, cls)
    conv_dim = 2 * NK * HEAD + NV * HEAD
    u32 = DType.uint32
    inputs = [TensorType(dtype, ["T", HIDDEN], where), BufferType(dtype, ["crows", conv_dim, CONV - 1], where),
              BufferType(dtype, ["rows", NV, HEAD, HEAD], where),
              BufferType(DType.float32, ["ring_rows", NK, RING_LEN, STRIDE], where),
              TensorType(u32, ["B"], where), TensorType(u32, ["B"], where), TensorType(u32, ["B1"], where),
              TensorType(u32, ["B"], where), TensorType(u32, ["B"], where), TensorType(u32, ["B"], where)]
    routes = {"max": None, "patched": {}, "ours": {"verify": True}, "fused": {}}[variant]
    with Graph(f"gdn_{variant}_{dtype.name}", input_types=inputs, custom_extensions=[kernels_path()]) as graph:
        width = verify_width_operand(WINDOW - 1)
        x, conv, pool, ring, rows, ring_rows, offsets, previous_rows, previous_accepted, accepted = graph.inputs
        with max_qwen3_5.patched(**routes) if routes is not None else nullcontext():
            extra = ({"previous_ring_row_id": previous_rows.tensor, "previous_num_accepted": previous_accepted.tensor}
                     if variant == "fused" else {})
            out = layer(x.tensor, conv.buffer, rows.tensor, pool.buffer, rows.tensor, offsets.tensor,
                        ring=GatedDeltaRingAccess(pool=ring.buffer, row_id=ring_rows.tensor), verify_width=width,
                        **extra)
            if variant != "fused":
                state_rollback.fold_state_pools([pool.buffer], [ops.unsqueeze(rows.tensor, 0)], [ring.buffer],
                                                [ops.unsqueeze(ring_rows.tensor, 0)], accepted.tensor, [], width)
        graph.output(out)
    return graph, layer


def _load_on_gpu(dtype: DType, graph: Graph, layer: Any, seed: int) -> tuple[Any, Any, Any, np.ndarray, np.ndarray]:
    """The layer's graph loaded on the GPU with its weights, and a random conv window and
    pool ``[BATCH, ...]`` of the pool dtype: (device, model, numpy dtype, conv, pool)."""
    import ml_dtypes
    from max.driver import Accelerator

    gpu = Accelerator()
    model = InferenceSession(devices=[gpu]).load(graph, weights_registry=layer.state_dict())
    np_dtype = np.float32 if dtype == DType.float32 else ml_dtypes.bfloat16
    rng = np.random.default_rng(seed)
    conv_dim = 2 * NK * HEAD + NV * HEAD
    conv = (0.1 * rng.standard_normal((BATCH, conv_dim, CONV - 1))).astype(np_dtype)
    pool = (0.1 * rng.standard_normal((BATCH, NV, HEAD, HEAD))).astype(np_dtype)
    return gpu, model, np_dtype, conv, pool


def _run_steps(dtype: DType, variant: str, steps: list[dict[str, np.ndarray]]) -> tuple[list[np.ndarray], np.ndarray]:
    """Runs the layer's steps on the GPU from one starting pool; returns each step's
    output and the pool after the last step's rollback (for ``fused``, after one more
    fold of the last step's records, as the next verify would do on load)."""
    from gdfold_max import fold
    from gdfold_max.eager.base import copy_back, host_buffer

    gpu, model, np_dtype, conv, pool = _load_on_gpu(dtype, *_step_graph(dtype, DeviceRef.GPU(), variant), seed=52)
    ring = np.zeros((2 * BATCH, NK, RING_LEN, STRIDE), np.float32)
    up = [host_buffer(a).to(gpu) for a in (conv, pool, ring)]
    outputs = []
    rows = np.arange(BATCH, dtype=np.uint32)
    previous_accepted = np.zeros(BATCH, np.uint32)
    for i, step in enumerate(steps):
        ring_rows = rows + np.uint32(BATCH * (i % 2))
        previous_rows = rows + np.uint32(BATCH * ((i + 1) % 2))
        tables = [rows, ring_rows, np.arange(0, BATCH * WINDOW + 1, WINDOW, dtype=np.uint32), previous_rows,
                  previous_accepted, step["accepted"]]
        (out,) = model.execute(host_buffer(step["x"].astype(np_dtype)).to(gpu), *up,
                               *(Buffer.from_numpy(t).to(gpu) for t in tables))
        host = np.empty((BATCH * WINDOW, HIDDEN), np_dtype)
        copy_back(out, host)
        outputs.append(host)
        previous_accepted = step["accepted"]
    copy_back(up[1], pool)
    if variant == "fused":  # the last step's records, as the next verify would fold them
        copy_back(up[2], ring)
        fold(pool, ring, rows[None], (rows + np.uint32(BATCH * ((len(steps) - 1) % 2)))[None], previous_accepted,
             device="gpu")
    return outputs, pool


STEPS_SEED = 53


def _steps() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(STEPS_SEED)
    return [{"x": rng.standard_normal((BATCH * WINDOW, HIDDEN)).astype(np.float32),
             "accepted": np.array(accepted, np.uint32)} for accepted in ([4, 1, 2], [0, 3, 4], [2, 2, 1])]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=["fp32", "bf16"])
def test_max_gated_deltanet_under_patched_is_bit_identical_to_max(dtype: DType) -> None:
    """MAX's layer and MAX's rollback, with our fold in place of MAX's: every output and
    the pool after three steps equal MAX's own, bit for bit."""
    steps = _steps()
    theirs, their_pool = _run_steps(dtype, "max", steps)
    ours, our_pool = _run_steps(dtype, "patched", steps)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert_bits_equal(a, b, f"step {i}: layer output")
    assert_bits_equal(our_pool, their_pool, "pool after three steps")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=["fp32", "bf16"])
def test_fused_layer_equals_our_verify_then_fold(dtype: DType) -> None:
    """The fused layer (fold on load, nothing in the rollback) against MAX's layer with
    our verify and our fold: outputs and pools bit-identical. Beside MAX's own ops, the
    outputs differ by the order of the sums over K, which MAX does not document; the
    distance is printed."""
    steps = _steps()
    unfused, unfused_pool = _run_steps(dtype, "ours", steps)
    fused, fused_pool = _run_steps(dtype, "fused", steps)
    for i, (a, b) in enumerate(zip(fused, unfused, strict=True)):
        assert_bits_equal(a, b, f"step {i}: layer output")
    assert_bits_equal(fused_pool, unfused_pool, "pool after three steps")
    theirs, their_pool = _run_steps(dtype, "max", steps)
    for i, (a, b) in enumerate(zip(unfused, theirs, strict=True)):
        print(f"[{dtype.name}] step {i}: output beside MAX's: {_distance(a, b)}")
    print(f"[{dtype.name}] pool after three steps beside MAX's: {_distance(unfused_pool, their_pool)}")


def _distance(ours: np.ndarray, theirs: np.ndarray) -> str:
    a, b = ours.astype(np.float64), theirs.astype(np.float64)
    same = float(np.mean(bits(ours) == bits(theirs)))
    return f"max relative difference {np.max(np.abs(a - b)) / np.max(np.abs(b)):.2e}, {100 * same:.1f}% bit-equal"


# ---- GPU: MAX's layer on plain steps (no verify), its forward routed to ours -------------

#: Tokens per request of each plain step: a prefill of a window, then three decoding steps.
PLAIN_STEPS = (WINDOW, 1, 1, 1)


def _plain_graph(dtype: DType, where: DeviceRef, routed: bool) -> tuple[Graph, object]:
    """MAX's layer on a plain step, ``gated_delta_recurrence_fwd`` routed to ours under
    ``patched(forward=True)`` when ``routed``. The graph also returns what the layer hands
    the forward (qkv, decays, betas) and the forward's readout, so the test can run the
    reference on exactly those."""
    layer: Any = _layer(dtype, where, gated_deltanet.GatedDeltaNet)
    conv_dim = 2 * NK * HEAD + NV * HEAD
    u32 = DType.uint32
    inputs = [TensorType(dtype, ["T", HIDDEN], where), BufferType(dtype, ["crows", conv_dim, CONV - 1], where),
              BufferType(dtype, ["rows", NV, HEAD, HEAD], where), TensorType(u32, ["B"], where),
              TensorType(u32, ["B1"], where)]
    seen: list[TensorValue] = []
    with Graph(f"gdn_plain_{routed}_{dtype.name}", input_types=inputs, custom_extensions=[kernels_path()]) as graph:
        x, conv, pool, rows, offsets = graph.inputs
        with max_qwen3_5.patched(forward=True) if routed else nullcontext():
            forward = gated_deltanet.gated_delta_recurrence_fwd

            def spy(**operands: Any) -> TensorValue:
                readout = forward(**operands)
                seen.extend([operands["qkv_conv_output"], operands["decay_per_token"], operands["beta_per_token"],
                             readout])
                return readout

            gated_deltanet.gated_delta_recurrence_fwd = spy
            try:
                out = layer(x.tensor, conv.buffer, rows.tensor, pool.buffer, rows.tensor, offsets.tensor)
            finally:
                gated_deltanet.gated_delta_recurrence_fwd = forward
        assert len(seen) == 4, "the layer's plain step did not call gated_delta_recurrence_fwd (an SM100 prefill?)"
        graph.output(out, *seen)
    return graph, layer


def _plain_step(model: Model, gpu: Any, up: list[Buffer], rows: np.ndarray, rng: np.random.Generator,
                tokens: int, np_dtype: Any) -> tuple[np.ndarray, list[Buffer]]:
    """One plain step of ``tokens`` tokens a request through the layer's graph on the GPU
    (random inputs): the step's offsets and the graph's outputs."""
    from gdfold_max.eager.base import host_buffer

    offsets = np.arange(0, BATCH * tokens + 1, tokens, dtype=np.uint32)
    x = rng.standard_normal((BATCH * tokens, HIDDEN)).astype(np_dtype)
    return offsets, model.execute(host_buffer(x).to(gpu), *up, Buffer.from_numpy(rows).to(gpu),
                                  Buffer.from_numpy(offsets).to(gpu))


def _run_plain(dtype: DType, routed: bool) -> tuple[list[np.ndarray], np.ndarray, int]:
    """The plain steps through the layer on the GPU from one starting pool. Returns each
    step's layer output and the last pool; with ``routed``, checks every step's forward
    readout and pool against the reference forward on the operands the layer gave it,
    bit for bit, and returns how many steps it checked."""
    from gdfold_max.eager.base import copy_back, host_buffer

    gpu, model, np_dtype, conv, pool = _load_on_gpu(dtype, *_plain_graph(dtype, DeviceRef.GPU(), routed), seed=54)
    rng = np.random.default_rng(55)
    up = [host_buffer(a).to(gpu) for a in (conv, pool)]
    rows = np.arange(BATCH, dtype=np.uint32)
    outputs, checked = [], 0
    for tokens in PLAIN_STEPS:
        want_pool = pool.copy()
        offsets, (out, qkv, decay, beta, readout) = _plain_step(model, gpu, up, rows, rng, tokens, np_dtype)
        host = np.empty((BATCH * tokens, HIDDEN), np_dtype)
        copy_back(out, host)
        outputs.append(host)
        copy_back(up[1], pool)
        if routed:
            before = want_pool.copy()
            want = reference.recurrence(qkv.to_numpy(), decay.to_numpy(), beta.to_numpy(), want_pool, rows,
                                            offsets, num_key_heads=NK)
            assert_bits_equal(readout.to_numpy(), want, f"{tokens}-token step: the forward's readout")
            # A pool that differs is told apart from one left as it was before the step, and
            # our forward inside MAX's layer from the same op run alone on the same operands.
            unchanged = int(np.count_nonzero(bits(pool) == bits(before)))
            alone = before.copy()
            runner_for("gpu").recurrence(qkv.to_numpy(), decay.to_numpy(), beta.to_numpy(), alone, rows, offsets)
            exact_alone = bool(np.array_equal(bits(alone), bits(want_pool)))
            assert_bits_equal(pool, want_pool, f"{tokens}-token step: pool ({unchanged} of {pool.size} elements"
                                               f" as before the step; the op alone exact: {exact_alone})")
            checked += 1
    return outputs, pool, checked


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [(WINDOW, 1, 1, 1), (1, 1, 1)], ids=["window-first", "one-token-first"])
@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=["fp32", "bf16"])
def test_max_plain_steps_pool_on_the_device_and_read_back(dtype: DType, steps: tuple[int, ...]) -> None:
    """MAX's layer under ``patched(forward=True)``, step after step, the reference pool
    carried on the host. Each step's readout (computed on the device from the device's
    pool) must equal the reference from the reference pool, and the pool read back by
    copy_back must equal it, at once and after the device synchronizes. Also reported,
    not asserted: the pool read through a view of its host copy, as copy_back read it
    before (in bf16 that read came back as before the step). Every fact is gathered
    before the assertion, which names each."""
    from gdfold_max.eager.base import copy_back, host_buffer

    gpu, model, np_dtype, conv, pool = _load_on_gpu(dtype, *_plain_graph(dtype, DeviceRef.GPU(), True), seed=54)
    rng = np.random.default_rng(55)
    up = [host_buffer(a).to(gpu) for a in (conv, pool)]
    rows = np.arange(BATCH, dtype=np.uint32)
    want_pool = pool.copy()
    facts = []
    for tokens in steps:
        before = want_pool.copy()
        offsets, (_, qkv, decay, beta, readout) = _plain_step(model, gpu, up, rows, rng, tokens, np_dtype)
        host_copy = up[1].to(CPU())
        through_host_view = (host_copy.view(DType.uint16).to_numpy().view(np_dtype) if dtype == DType.bfloat16
                             else host_copy.to_numpy()).copy()
        read_at_once = np.empty_like(pool)
        copy_back(up[1], read_at_once)
        want = reference.recurrence(qkv.to_numpy(), decay.to_numpy(), beta.to_numpy(), want_pool, rows, offsets,
                                    num_key_heads=NK)
        gpu.synchronize()
        read_after_sync = np.empty_like(pool)
        copy_back(up[1], read_after_sync)
        facts.append({
            "tokens": tokens,
            "readout exact": bool(np.array_equal(bits(readout.to_numpy()), bits(want))),
            "copy_back at once exact": bool(np.array_equal(bits(read_at_once), bits(want_pool))),
            "copy_back after synchronize exact": bool(np.array_equal(bits(read_after_sync), bits(want_pool))),
            "(reported) read through a view of the host copy: exact": bool(np.array_equal(bits(through_host_view),
                                                                                         bits(want_pool))),
            "(reported) ... as before the step": bool(np.array_equal(bits(through_host_view), bits(before))),
        })
    print(f"[{dtype.name}, steps {steps}] {facts}")
    assert all(fact[key] for fact in facts for key in fact if key.endswith("exact") and not key.startswith("(")), \
        facts


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=["fp32", "bf16"])
def test_max_own_forward_moves_the_pool_on_every_plain_step(dtype: DType) -> None:
    """MAX's layer with its own forward on a window step and two one-token steps: the
    pool read back changes at every step (the harness's read-back, without our op)."""
    from gdfold_max.eager.base import copy_back, host_buffer

    gpu, model, np_dtype, conv, pool = _load_on_gpu(dtype, *_plain_graph(dtype, DeviceRef.GPU(), False), seed=54)
    rng = np.random.default_rng(55)
    up = [host_buffer(a).to(gpu) for a in (conv, pool)]
    rows = np.arange(BATCH, dtype=np.uint32)
    changed = []
    for tokens in (WINDOW, 1, 1):
        before = pool.copy()
        _plain_step(model, gpu, up, rows, rng, tokens, np_dtype)
        copy_back(up[1], pool)
        changed.append((tokens, int(np.count_nonzero(bits(pool) != bits(before)))))
    print(f"[{dtype.name}] MAX's own forward, pool elements changed per step: {changed}")
    assert all(count > 0 for _, count in changed), changed


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=["fp32", "bf16"])
def test_max_plain_steps_under_patched_forward_run_our_forward_exactly(dtype: DType) -> None:
    """MAX's layer on a prefill and three decoding steps with ``patched(forward=True)``:
    every step's forward readout and pool equal the reference forward over the operands
    the layer gave it, bit for bit. Beside MAX's own forward the layer outputs and the
    pool differ by the order of the sums over K, which MAX does not document; the
    distance is printed."""
    ours, our_pool, checked = _run_plain(dtype, routed=True)
    assert checked == len(PLAIN_STEPS)
    theirs, their_pool, _ = _run_plain(dtype, routed=False)
    for tokens, a, b in zip(PLAIN_STEPS, ours, theirs, strict=True):
        print(f"[{dtype.name}] {tokens}-token step: layer output beside MAX's: {_distance(a, b)}")
    print(f"[{dtype.name}] pool after the steps beside MAX's: {_distance(our_pool, their_pool)}")


@pytest.mark.parametrize("drafts", [3, 0])
@pytest.mark.parametrize("table", ["previous_ring_row_ids", "previous_num_accepted"])
def test_the_fused_verify_names_a_previous_table_of_another_batch(width_models: dict[str, Model], drafts: int,
                                                                  table: str) -> None:
    """A previous-step table one entry longer than the batch is refused by its own name
    at either width (at 0 the op runs the fold, which would name its own tables), and
    nothing is written."""
    case = WIDTH_CASE
    previous = {"previous_ring_row_ids": case.previous_ring_row_ids,
                "previous_num_accepted": case.previous_num_accepted}
    previous[table] = np.append(previous[table], np.uint32(0))
    pool, ring = case.fresh()
    tables = (case.row_ids, case.ring_row_ids, case.input_row_offsets, *previous.values())
    batch = len(case.row_ids)
    with pytest.raises(Exception, match=rf"{table}: length {batch + 1} differs from the batch of row_ids \({batch}\)"):
        _run_width(width_models["fused_True_previous_apart"], case, drafts, pool, ring, tables)
    assert_bits_equal(pool, case.state, "the pool")
    assert_bits_equal(ring, case.ring, "the ring")


def test_verify_or_forward_tiles_its_fold_as_the_fold_op_does() -> None:
    """At a width of 0 the op folds up to RING_LEN records a block: its fold tile is the
    fold op's for that RING_LEN (a bf16 K = V = 256 pool at RING_LEN 32 stages too much
    at the tile of RING_LEN 16, and the GPU build would fail)."""
    import re

    from gdfold_max.ops.fold import fold_tiling

    case = random_window_case(3, windows=[2, 1], previous_num_accepted=[1, 0], num_value_heads=2, num_key_heads=1,
                              key_dim=256, value_dim=256, ring_len=32, state_dtype="bfloat16")
    text = str(_window_graph("fused", case, True))
    want = fold_tiling(256, 256, DType.bfloat16, ring_len=32)
    assert want["KEY_DIM_TILE"] < fold_tiling(256, 256, DType.bfloat16, ring_len=16)["KEY_DIM_TILE"]
    for name, value in want.items():
        assert re.findall(rf"\b{name} = (\d+)", text) == [str(value)], name


@pytest.mark.parametrize(("what", "message"), [
    ("channel", "decay: verify_or_forward takes head gates"),
    ("int32 width", "verify_width: expected a rank-1 int64 tensor on the host, got int32"),
])
def test_verify_or_forward_refuses_what_it_does_not_take(what: str, message: str) -> None:
    """Per-channel gates, and a width operand other than MAX's (rank-1 int64 on the
    host), are refused when the graph is built, naming the argument."""
    from gdfold_max import verify_or_forward

    c = WIDTH_CASE
    f32, u32 = DType.float32, DType.uint32
    heads = c.decay.shape[1]
    decay = TensorType(f32, ["T", heads, c.state.shape[2]] if what == "channel" else ["T", heads], HOST)
    width = TensorType(DType.int32 if what == "int32 width" else DType.int64, ["drafts"], HOST)
    inputs = [TensorType(f32, ["T", c.qkv.shape[1]], HOST), decay, TensorType(f32, ["T", heads], HOST),
              BufferType(f32, ["rows", *c.state.shape[1:]], HOST),
              BufferType(f32, ["ring_rows", *c.ring.shape[1:]], HOST),
              TensorType(u32, ["B"], HOST), TensorType(u32, ["B"], HOST), TensorType(u32, ["B1"], HOST),
              TensorType(u32, ["B"], HOST), TensorType(u32, ["B"], HOST), width]
    with Graph(f"refused_{what}", input_types=inputs, custom_extensions=[kernels_path()]) as graph:
        qkv, decay_value, beta, pool, ring, *tables, width_value = graph.inputs
        with pytest.raises(ValueError, match=message):
            verify_or_forward(qkv.tensor, decay_value.tensor, beta.tensor, pool.buffer, ring.buffer,
                              *(t.tensor for t in tables), width_value.tensor)
