"""Greedy speculative decoding, end to end, through a tiny random-weight model built from
MAX's own Qwen3.5 Gated DeltaNet layers, on the GPU.

The model: a token embedding, ``LAYERS`` of MAX's ``GatedDeltaNet`` with residuals, and a
linear head; greedy sampling. Each speculative step verifies a window of the last token
and ``DRAFTS`` drafts per request, accepts the longest prefix of drafts the model itself
would have produced, and lands the pools on it as MAX's MTP pipeline does
(``unified_mtp_qwen3_5.state_rollback``: ``accepted_row_plan``, ``replay_conv_pools``
for the conv windows, ``fold_state_pools`` for the recurrent state), all in the step's
graph. A plain step is the same layers at verify width 0. The drafts come from the plain
run's tokens, some replaced at random, so acceptance varies across requests and steps.

The claims, per variant (MAX's ops; ``patched()``: our fold; ``patched(verify=True)``:
our verify and fold; ``FusedGatedDeltaNet``: our verify with fold on load, the rollback
folding nothing):

* speculative decoding gives the plain run's tokens;
* under ``patched()`` the pools are bit-identical to MAX's own run;
* the fused layer's pools are bit-identical to ours unfused.

MAX's Qwen3.5 attention layers are not in the model: they read MAX's paged KV cache
(``PagedCacheValues``), whose rollback is moving a length back, not a state fold.
MAX's Gated DeltaNet conv kernel has no CPU path, so the decoding runs on a GPU only;
on the CPU the graphs are built (not compiled).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import cache

import numpy as np
import pytest

pytest.importorskip("max.pipelines.architectures.unified_mtp_qwen3_5.state_rollback",
                    reason="MAX's pipelines need the max-pipelines extra")

from max.driver import Accelerator, Buffer  # noqa: E402
from max.dtype import DType  # noqa: E402
from max.engine import InferenceSession, Model  # noqa: E402
from max.graph import BufferType, BufferValue, DeviceRef, Dim, Graph, TensorType, TensorValue, ops  # noqa: E402
from max.graph import Module as GraphModule  # noqa: E402
from max.nn import LayerList, Module  # noqa: E402
from max.nn.state_space import verify_width_operand  # noqa: E402
from max.pipelines.architectures.qwen3_5.layers.gated_deltanet import GatedDeltaNet  # noqa: E402
from max.pipelines.architectures.qwen3_5.state_cache import GatedDeltaRingAccess  # noqa: E402
from max.pipelines.architectures.unified_mtp_qwen3_5 import state_rollback  # noqa: E402

from conftest import assert_bits_equal  # noqa: E402
from gdfold_max import fold, kernels_path  # noqa: E402
from gdfold_max.eager.base import copy_back  # noqa: E402
from gdfold_max.integrations import max_qwen3_5  # noqa: E402
from gdfold_max.layout import RecordLayout  # noqa: E402

#: One xdist worker runs this file's GPU tests under ``--dist loadgroup``: they share six
#: graphs, compiled together, which several workers would each compile again.
pytestmark = pytest.mark.xdist_group("max_qwen3_5_decoding")

HIDDEN, NK, NV, HEAD, CONV, LAYERS, VOCAB = 256, 2, 4, 128, 4, 2, 64
BATCH, DRAFTS, PROMPT, NEW_TOKENS = 3, 3, 3, 12
WINDOW = 1 + DRAFTS
RING_LEN = WINDOW
STRIDE = RecordLayout(HEAD, HEAD, NV // NK).min_stride
CONV_DIM = 2 * NK * HEAD + NV * HEAD
#: How each variant routes MAX's names (None: MAX as it ships).
ROUTES: dict[str, dict[str, bool] | None] = {"max": None, "patched": {}, "ours": {"verify": True}, "fused": {}}
#: The plain graph each variant's prefill runs: a graph at width 0 folds nothing, so
#: ``patched`` is MAX's there; the fused layer's is ours.
PLAIN_OF = {"max": "max", "patched": "max", "ours": "ours", "fused": "ours"}


class TinyModel(Module):
    """The layers, whose weights the graphs name; the embedding and the head are
    constants of the graph."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        cls = max_qwen3_5.FusedGatedDeltaNet if fused else GatedDeltaNet
        self.layers = LayerList([cls(HIDDEN, NK, NV, HEAD, HEAD, CONV, DType.float32, DeviceRef.GPU())
                                 for _ in range(LAYERS)])

    def __call__(self, tokens: TensorValue, conv: BufferValue, pool: BufferValue, ring: BufferValue,
                 rows: TensorValue, ring_rows: TensorValue, offsets: TensorValue, width: TensorValue,
                 captures: list | None = None, fused_tables: tuple[TensorValue, TensorValue] | None = None
                 ) -> TensorValue:
        """The greedy token after every position: embedding, the layers, the head."""
        embedding, head = embedding_and_head()
        where = tokens.device
        hidden = ops.gather(ops.constant(embedding, DType.float32, where), tokens, axis=0)
        for index, layer in enumerate(self.layers):
            extra = {}
            if fused_tables is not None:
                extra = {"previous_ring_row_id": fused_tables[0][index], "previous_num_accepted": fused_tables[1]}
            hidden = hidden + layer(hidden, conv, rows[index], pool, rows[index], offsets, replay_capture=captures,
                                    ring=GatedDeltaRingAccess(pool=ring, row_id=ring_rows[index]),
                                    verify_width=width, **extra)
        logits = ops.matmul(hidden, ops.constant(head, DType.float32, where))
        return ops.reshape(ops.argmax(logits, axis=-1), [-1])


@cache
def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(61)
    shapes = {name: [int(d) for d in w.shape] for name, w in TinyModel(False).raw_state_dict().items()}
    return {name: (0.05 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}


@cache
def embedding_and_head() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(62)
    return (rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32),
            (rng.standard_normal((HIDDEN, VOCAB)) / np.sqrt(HIDDEN)).astype(np.float32))


def pool_types(where: DeviceRef) -> list[BufferType]:
    return [BufferType(DType.float32, [LAYERS * BATCH, CONV_DIM, CONV - 1], where),
            BufferType(DType.float32, [LAYERS * BATCH, NV, HEAD, HEAD], where),
            BufferType(DType.float32, [2 * LAYERS * BATCH, NK, RING_LEN, STRIDE], where)]


def plain_graph(variant: str, module: GraphModule | None = None) -> tuple[Graph, TinyModel]:
    """Any number of tokens per request at verify width 0: the window lands on the pools.
    Built into ``module`` when one is given (``Graph(module=...)``)."""
    where, u32 = DeviceRef.GPU(), DType.uint32
    model = TinyModel(False)
    model.load_state_dict(weights())
    inputs = [TensorType(DType.int64, ["T"], where), *pool_types(where), TensorType(u32, [LAYERS, BATCH], where),
              TensorType(u32, [LAYERS, BATCH], where), TensorType(u32, [BATCH + 1], where)]
    routes = ROUTES[variant]
    with Graph(f"tiny_plain_{variant}", input_types=inputs, custom_extensions=[kernels_path()],
               module=module) as graph, \
            (max_qwen3_5.patched(**routes) if routes is not None else nullcontext()):
        tokens, conv, pool, ring, rows, ring_rows, offsets = graph.inputs
        graph.output(model(tokens.tensor, conv.buffer, pool.buffer, ring.buffer, rows.tensor, ring_rows.tensor,
                           offsets.tensor, verify_width_operand(0)))
    return graph, model


def speculative_graph(variant: str, module: GraphModule | None = None) -> tuple[Graph, TinyModel]:
    """One verify of every request's window, the greedy acceptance, and MAX's rollback:
    the conv windows replayed, the accepted records folded (the fused layer folds them
    on the next verify's load instead). Outputs the greedy tokens and the records each
    request keeps (1 + accepted drafts). Built into ``module`` when one is given."""
    where, u32, i64 = DeviceRef.GPU(), DType.uint32, DType.int64
    fused = variant == "fused"
    model = TinyModel(fused)
    model.load_state_dict(weights())
    inputs = [TensorType(i64, [BATCH * WINDOW], where), *pool_types(where),
              *(TensorType(u32, [LAYERS, BATCH], where) for _ in range(3)),
              TensorType(u32, [BATCH + 1], where), TensorType(u32, [BATCH], where)]
    routes = ROUTES[variant]
    with Graph(f"tiny_speculative_{variant}", input_types=inputs, custom_extensions=[kernels_path()],
               module=module) as graph, \
            (max_qwen3_5.patched(**routes) if routes is not None else nullcontext()):
        tokens, conv, pool, ring, rows, ring_rows, previous_ring_rows, offsets, previous_kept = graph.inputs
        width = verify_width_operand(DRAFTS)
        captures: list = []
        greedy = model(tokens.tensor, conv.buffer, pool.buffer, ring.buffer, rows.tensor, ring_rows.tensor,
                       offsets.tensor, width, captures,
                       (previous_ring_rows.tensor, previous_kept.tensor) if fused else None)
        # The drafts accepted: the leading ones equal to the model's own next token.
        grid = ops.reshape(greedy, [BATCH, WINDOW])
        drafts = ops.reshape(tokens.tensor, [BATCH, WINDOW])[:, 1:]
        misses = ops.cast(ops.logical_not(ops.equal(grid[:, :DRAFTS], drafts)), i64)
        accepted = ops.reshape(ops.sum(ops.cast(ops.equal(ops.cumsum(misses, axis=1), 0), i64), axis=1), [BATCH])
        draft_count = ops.constant(DRAFTS, i64, where)
        row_indices, replay_offsets = state_rollback.accepted_row_plan(
            offsets.tensor, accepted, draft_count, Dim(BATCH * WINDOW), where)
        state_rollback.replay_conv_pools([captures], [conv.buffer], [rows.tensor], row_indices, replay_offsets, [],
                                         width)
        kept = state_rollback.accepted_lengths(offsets.tensor, accepted, draft_count)
        if not fused:
            state_rollback.fold_state_pools([pool.buffer], [rows.tensor], [ring.buffer], [ring_rows.tensor], kept, [],
                                            width)
        graph.output(greedy, ops.cast(kept, u32))
    return graph, model


#: The compiled graphs, by (kind, variant).
GRAPHS = [("plain", v) for v in sorted(set(PLAIN_OF.values()))] + [("speculative", v) for v in ROUTES]


@cache
def compiled_graphs() -> dict[tuple[str, str], Model]:
    """Every graph, built one after another into one module (``patched`` swaps module
    names while a graph is built) and compiled in one call: the six graphs share their
    kernels, which one compile builds once. Compiled one by one, each took 72 to 119 s on
    the H200's host (bench/results/decoding-tests-h200-2026-12-04-cut-short.txt at bc6af9b). Every
    model loads the same weights under the same names, so one registry serves them all."""
    session = InferenceSession(devices=[Accelerator()])
    module = GraphModule()
    names: dict[tuple[str, str], str] = {}
    registry: dict = {}
    for key in GRAPHS:
        graph, model = (plain_graph if key[0] == "plain" else speculative_graph)(key[1], module)
        names[key] = graph.name
        registry.update(model.state_dict())
    models = session.load_all(module, custom_extensions=[kernels_path()], weights_registry=registry)
    return {key: models[name] for key, name in names.items()}


def compiled(kind: str, variant: str) -> Model:
    return compiled_graphs()[(kind, variant)]


ROWS = np.arange(LAYERS * BATCH, dtype=np.uint32).reshape(LAYERS, BATCH)


def ring_rows_of(step: int) -> np.ndarray:
    """Two ring rows per (layer, request), alternating by step."""
    return ROWS + np.uint32(LAYERS * BATCH * (step % 2))


class Run:
    """The pools of one decoding run on the GPU, and the tokens each request has."""

    def __init__(self, prompts: np.ndarray) -> None:
        self.gpu = Accelerator()
        self.host = [np.zeros((LAYERS * BATCH, CONV_DIM, CONV - 1), np.float32),
                     np.zeros((LAYERS * BATCH, NV, HEAD, HEAD), np.float32),
                     np.zeros((2 * LAYERS * BATCH, NK, RING_LEN, STRIDE), np.float32)]
        self.pools = [Buffer.from_numpy(a).to(self.gpu) for a in self.host]
        self.tokens = [list(p) for p in prompts]

    def up(self, array: np.ndarray) -> Buffer:
        return Buffer.from_numpy(np.ascontiguousarray(array)).to(self.gpu)

    def plain(self, variant: str, window: np.ndarray, per_request: int) -> np.ndarray:
        offsets = np.arange(0, BATCH * per_request + 1, per_request, dtype=np.uint32)
        (greedy,) = compiled("plain", variant).execute(self.up(window.reshape(-1).astype(np.int64)), *self.pools,
                                                        self.up(ROWS), self.up(ring_rows_of(0)), self.up(offsets))
        return greedy.to_numpy().reshape(BATCH, per_request)

    def prefill(self, variant: str) -> None:
        """Every prompt token but the last, which the first step then reads."""
        self.plain(variant, np.array([t[: PROMPT - 1] for t in self.tokens]), PROMPT - 1)

    def final_pools(self) -> list[np.ndarray]:
        for buffer, array in zip(self.pools, self.host, strict=True):
            copy_back(buffer, array)
        return self.host[:2]


def plain_decode(variant: str, prompts: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    run = Run(prompts)
    run.prefill(variant)
    for _ in range(NEW_TOKENS):
        greedy = run.plain(variant, np.array([t[-1:] for t in run.tokens]), 1)
        for b in range(BATCH):
            run.tokens[b].append(int(greedy[b, 0]))
    return np.array(run.tokens)[:, PROMPT:], run.final_pools()


def speculative_decode(variant: str, prompts: np.ndarray, reference: np.ndarray, seed: int
                       ) -> tuple[np.ndarray, list[np.ndarray], list[list[int]]]:
    """Decodes until every request has NEW_TOKENS; the drafts are the reference tokens,
    each replaced by another at random half the time. Returns the tokens, the pools after
    the same number of steps (the fused run's last records folded, as the next verify
    would), and each step's accepted drafts."""
    rng = np.random.default_rng(seed)
    run = Run(prompts)
    run.prefill(PLAIN_OF[variant])
    previous_kept = np.zeros(BATCH, np.uint32)
    history = []
    step = 0
    while min(len(t) for t in run.tokens) < PROMPT + NEW_TOKENS:
        window = np.zeros((BATCH, WINDOW), np.int64)
        for b, tokens in enumerate(run.tokens):
            made = len(tokens) - PROMPT
            window[b, 0] = tokens[-1]
            for j in range(1, WINDOW):
                true = int(reference[b, made + j - 1]) if made + j - 1 < NEW_TOKENS else int(rng.integers(VOCAB))
                window[b, j] = true if rng.random() < 0.5 else (true + 1 + int(rng.integers(VOCAB - 1))) % VOCAB
        offsets = np.arange(0, BATCH * WINDOW + 1, WINDOW, dtype=np.uint32)
        greedy, kept = compiled("speculative", variant).execute(
            run.up(window.reshape(-1)), *run.pools, run.up(ROWS), run.up(ring_rows_of(step)),
            run.up(ring_rows_of(step + 1)), run.up(offsets), run.up(previous_kept))
        greedy_grid = greedy.to_numpy().reshape(BATCH, WINDOW)
        kept_host = kept.to_numpy()
        history.append([int(k) - 1 for k in kept_host])
        for b in range(BATCH):
            run.tokens[b].extend(int(t) for t in greedy_grid[b, : kept_host[b]])
        previous_kept = kept_host.astype(np.uint32)
        step += 1
    pools = run.final_pools()
    if variant == "fused":
        fold(pools[1], run.host[2], ROWS, ring_rows_of(step - 1), previous_kept, device="gpu")
    return np.array([t[PROMPT : PROMPT + NEW_TOKENS] for t in run.tokens]), pools, history


@pytest.mark.parametrize("variant", ["max", "fused"])
def test_the_speculative_graphs_build(variant: str) -> None:
    """Building needs no GPU: MAX's layers and rollback, and the fused layer, fit
    together (the other graphs are parts of these two)."""
    graph, _ = speculative_graph(variant)
    assert len(graph.output_types) == 2


@pytest.fixture(scope="module")
def prompts() -> np.ndarray:
    return np.random.default_rng(63).integers(0, VOCAB, (BATCH, PROMPT))


@pytest.fixture(scope="module")
def runs(prompts: np.ndarray) -> dict[str, tuple[np.ndarray, list[np.ndarray], list[list[int]]]]:
    reference, _ = plain_decode("max", prompts)
    return {variant: speculative_decode(variant, prompts, reference, seed=64) for variant in ROUTES}


@pytest.mark.gpu
def test_speculative_decoding_gives_the_plain_tokens(prompts: np.ndarray, runs: dict) -> None:
    for variant in ("max", "ours"):
        plain, _ = plain_decode(variant, prompts)
        speculative, _, history = runs[variant]
        np.testing.assert_array_equal(speculative, plain, err_msg=f"{variant}: speculative tokens")
        accepted = sorted({a for step in history for a in step})
        print(f"\n{variant}: {len(history)} speculative steps for {NEW_TOKENS} tokens; accepted drafts seen:"
              f" {accepted}")
        assert len(accepted) > 1, "every step accepted the same number of drafts: the test exercises too little"
    # Each route against the run whose sums it shares: our verify rounds differently from
    # MAX's, so a near tie in the head could pick another token there, never here.
    for variant, same_sums in (("patched", "max"), ("fused", "ours")):
        np.testing.assert_array_equal(runs[variant][0], runs[same_sums][0], err_msg=f"{variant}: speculative tokens")


@pytest.mark.gpu
def test_patched_pools_are_max_s_bit_for_bit(runs: dict) -> None:
    for name, ours, theirs in zip(("conv pool", "recurrent pool"), runs["patched"][1], runs["max"][1], strict=True):
        assert_bits_equal(ours, theirs, name)
    assert runs["patched"][2] == runs["max"][2]


@pytest.mark.gpu
def test_fused_pools_are_ours_unfused_bit_for_bit(runs: dict) -> None:
    for name, fused, unfused in zip(("conv pool", "recurrent pool"), runs["fused"][1], runs["ours"][1], strict=True):
        assert_bits_equal(fused, unfused, name)
    assert runs["fused"][2] == runs["ours"][2]
