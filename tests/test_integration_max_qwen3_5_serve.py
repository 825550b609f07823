"""gdfold_max's Qwen3.5 MTP and DFlash2 architectures for ``max serve``
(``gdfold_max.integrations.max_qwen3_5_serve``).

On the CPU: the mode flag, the two-half ring geometry where each of the three sites
derives it, the carry's tag / half / count ops (a small CPU graph of just those ops,
stepped against a plain-Python model of the carry), the registration over MAX's entry
for the tiny checkpoint of ``examples/max_qwen3_5_pipeline.py`` (and, for DFlash2, a bf16
copy of it with the example's tiny drafter), and the fused graph built (not compiled) by
MAX's own builder, MTP and DFlash2: its input signature and which state ops it holds.
The MAX sources the architecture follows are pinned by hash.

On a GPU: ``max serve`` on localhost, fused, fold-only, fold+verify, MAX's own MTP and
plain decoding, each answering the same concurrent requests; and the same for DFlash2
(a bf16 copy of the checkpoint with the example's tiny drafter, fp32 state pools) beside
MAX's own DFlash2.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("max.pipelines.architectures.unified_mtp_qwen3_5.state_rollback",
                    reason="MAX's pipelines need the max-pipelines extra")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "max_qwen3_5_pipeline.py"
MODULE = "gdfold_max.integrations.max_qwen3_5_serve"


@pytest.fixture(scope="module")
def example() -> dict:
    return runpy.run_path(str(EXAMPLE))


# --- the mode flag -------------------------------------------------------------------


def test_the_mode_flag_names_the_variable_and_the_value() -> None:
    from gdfold_max.integrations import max_qwen3_5_serve as serve

    assert serve.mode({}) == "fused"
    assert [serve.mode({serve.ENV: m}) for m in serve.MODES] == list(serve.MODES)
    for bad in ("Fused", "fold+", ""):
        message = f"GDFOLD_MAX_QWEN3_5={bad!r}: expected one of fused, fold, fold+verify"
        with pytest.raises(ValueError, match=re.escape(message)):
            serve.mode({serve.ENV: bad})
    with pytest.raises(ValueError, match="mode: expected one of .* got 'nope'"):
        serve.architectures("nope")


def test_max_s_cli_runs_without_its_script_on_the_way(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A MAX installed with ``pip install --target`` has no ``max`` beside the Python nor on
    ``PATH``: the command then runs MAX's own entry point with this Python, and it serves."""
    from gdfold_max.integrations.max_qwen3_5_serve import server

    python = sys.executable
    monkeypatch.setattr(server.sys, "executable", str(tmp_path / "python3"))
    monkeypatch.setattr(server.shutil, "which", lambda name: None)
    command = server.max_command()
    assert command == [str(tmp_path / "python3"), "-c", server.MAX_ENTRY]
    run = subprocess.run([python, *command[1:], "serve", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Usage: max serve" in run.stdout


def test_a_bad_mode_stops_the_import_with_that_message() -> None:
    env = {**os.environ, "GDFOLD_MAX_QWEN3_5": "fast", "PYTHONPATH": str(ROOT / "python")}
    run = subprocess.run([sys.executable, "-c", f"import {MODULE}"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode != 0
    assert "GDFOLD_MAX_QWEN3_5='fast': expected one of fused, fold, fold+verify" in run.stderr


def test_each_mode_replaces_max_s_mtp_and_dflash2_architectures_under_their_names() -> None:
    from max.pipelines.architectures.unified_dflash2_qwen3_5.arch import unified_dflash2_qwen3_5_arch as max_dflash2
    from max.pipelines.architectures.unified_mtp_qwen3_5.arch import unified_mtp_qwen3_5_arch as max_mtp

    from gdfold_max.integrations import max_qwen3_5_serve as serve
    from gdfold_max.integrations.max_qwen3_5_serve import dflash2, fused

    models = {"fused": (fused.FusedMTPModel, dflash2.FusedDflash2Model),
              "fold": (serve.PatchedMTPModel, serve.PatchedDflash2Model),
              "fold+verify": (serve.PatchedVerifyMTPModel, serve.PatchedVerifyDflash2Model)}
    for mode, pair in models.items():
        archs = serve.architectures(mode)
        for arch, max_arch, model in zip(archs, (max_mtp, max_dflash2), pair, strict=True):
            assert arch.name == max_arch.name and arch.task == max_arch.task
            assert arch.pipeline_model is model
            # What the checkpoint and MAX's scheduler rely on stays MAX's.
            assert arch.required_arguments == {"enable_prefix_caching": False}
            assert not arch.supports_device_graph_capture
            assert (arch.tool_parser, arch.reasoning_parser) == ("qwen3_5", "qwen3_5")
            assert arch.weight_adapters == max_arch.weight_adapters and arch.tokenizer is max_arch.tokenizer
            assert arch.checkpoint_draft_width is max_arch.checkpoint_draft_width
            assert arch.multi_gpu_supported == max_arch.multi_gpu_supported
    assert not serve.PatchedMTPModel.verify and serve.PatchedVerifyMTPModel.verify
    assert not serve.PatchedDflash2Model.verify and serve.PatchedVerifyDflash2Model.verify
    mtp, dflash = serve.architectures("fused")
    assert (mtp.config, mtp.batching, mtp.memory_planner) == (
        fused.FusedMTPConfig, fused.FusedMTPBatchProcessor, fused.FusedMTPMemoryPlanner)
    assert (dflash.config, dflash.batching, dflash.memory_planner) == (
        dflash2.FusedDflash2Config, fused.FusedMTPBatchProcessor, dflash2.FusedDflash2MemoryPlanner)
    assert dflash2.FusedDflash2Model.batch_processor_cls is fused.FusedMTPBatchProcessor
    assert dflash2.FusedDflash2Model.model_config_cls is dflash2.FusedDflash2Config


# --- MAX's sources this follows ------------------------------------------------------

#: sha256 (first 16 hex digits) of the MAX 26.7.0 sources the architecture subclasses,
#: rebinds or mirrors (paths under max/pipelines/architectures). A change in any of them
#: needs a look at gdfold_max/integrations/max_qwen3_5_serve before the hash is updated.
PINNED = {
    "unified_mtp_qwen3_5.model.UnifiedMTPQwen3_5Model._build_graph_for_compile": "3db103b797fc2625",
    "unified_mtp_qwen3_5.spec_state.Qwen3_5RecurrentState": "0a146d5e3cd88b91",
    "unified_mtp_qwen3_5.batch_processor.UnifiedMTPQwen3_5BatchProcessor.prepare_initial_token_inputs":
        "a3035cfa7cb3a66a",
    "unified_mtp_qwen3_5.inputs.UnifiedMTPQwen3_5Inputs": "1b76eef7056c77a2",
    "unified_mtp_qwen3_5.memory_planner.UnifiedMTPQwen3_5MemoryPlanner": "440a6119bed592da",
    "unified_mtp_qwen3_5.unified_mtp_qwen3_5.UnifiedMTPQwen3_5": "906cfcbc69cc4158",
    "qwen3_5.qwen3_5.Qwen3_5LinearAttentionBlock.__call__": "4af1d8ddbfee07d4",
    "qwen3_5.model_config.Qwen3_5Config.construct_kv_params": "f78cbdbdf1bcad37",
    "qwen3_5.model_config.Qwen3_5Config._per_request_ring_bytes": "e435a90a4e200b46",
    "qwen3_5.state_cache.linear_state_regions": "c2529487b7961062",
    "unified_dflash2_qwen3_5.model.UnifiedDflash2Qwen3_5Model": "1b26fd8bd4ebb52c",
    "unified_dflash2_qwen3_5.model_config.UnifiedDflash2Qwen3_5Config.initialize": "d676b3042ae80e80",
    "unified_dflash2_qwen3_5.model_config.UnifiedDflash2Qwen3_5Config.get_kv_params": "9b2f37a37aeb8b05",
    "unified_dflash2_qwen3_5.model_config.dflash2_kv_params": "2f1518e33cb7c3c6",
    "unified_dflash2_qwen3_5.unified_dflash2_qwen3_5.UnifiedDflash2Qwen3_5": "aaadeb517b7278cc",
    "unified_dflash2_qwen3_5.spec_adapters.Qwen3_5BlockTarget": "e9b2ad66a9d3f31b",
    "unified_dflash2_qwen3_5.spec_adapters.DFlash2Qwen3_5Proposer.materialize": "04c27bcef55b7c8e",
    "unified_dflash2_qwen3_5.memory_planner.UnifiedDflash2Qwen3_5MemoryPlanner": "fd5f09510724ecf5",
    "unified_dflash2_qwen3_5.arch": "537fae39bddea16b",
}


def test_the_max_sources_followed_are_the_ones_read() -> None:
    import importlib

    changed = {}
    for dotted, digest in PINNED.items():
        parts = dotted.split(".")
        for split in range(len(parts), 0, -1):
            try:
                obj: Any = importlib.import_module("max.pipelines.architectures." + ".".join(parts[:split]))
            except ImportError:
                continue
            for name in parts[split:]:
                obj = getattr(obj, name)
            break
        got = hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
        if got != digest:
            changed[dotted] = got
    assert not changed, f"MAX's source changed: {changed}"
    # The builder looks the driver class up by this module name, which is what
    # FusedMTPModel rebinds while it builds.
    from max.pipelines.architectures.unified_mtp_qwen3_5 import model

    assert "nn_model = UnifiedMTPQwen3_5(" in inspect.getsource(model.UnifiedMTPQwen3_5Model._build_graph_for_compile)
    # The names FusedDflash2Model and FusedDflash2Config rebind while MAX's code runs.
    from max.pipelines.architectures.unified_dflash2_qwen3_5 import model as dflash2_model
    from max.pipelines.architectures.unified_dflash2_qwen3_5 import model_config as dflash2_config

    sources = {
        dflash2_model.UnifiedDflash2Qwen3_5Model.get_kv_params: "UnifiedMTPQwen3_5Config.construct_kv_params(",
        dflash2_model.UnifiedDflash2Qwen3_5Model._create_model_config: "UnifiedDflash2Qwen3_5Config.initialize(",
        dflash2_model.UnifiedDflash2Qwen3_5Model._build_graph_for_compile: "nn_model = UnifiedDflash2Qwen3_5(",
        dflash2_config.UnifiedDflash2Qwen3_5Config.initialize: "UnifiedMTPQwen3_5Config.initialize_from_config(",
    }
    for function, call in sources.items():
        assert call in inspect.getsource(function), function


# --- the carry: tags, halves, counts --------------------------------------------------


def test_the_tags_go_through_an_input_stager_beside_max_s() -> None:
    """Each step's tags are staged as MAX stages its tokens (host staging, a copy behind
    the queued work) into one buffer per device, reused step after step, by a stager of
    their own: MAX's keeps exactly its token inputs. A batch over the pipeline's largest
    is refused by the stager, naming the input."""
    from types import SimpleNamespace

    from max.driver import CPU

    from gdfold_max.integrations.max_qwen3_5_serve import fused

    runtime = SimpleNamespace(devices=[CPU()], max_global_batch_size=8, max_batch_size=8, max_batch_active_tokens=64,
                              max_batch_input_tokens=64, max_seq_len=256, enable_chunked_prefill=True,
                              data_parallel_degree=1, signal_buffers=())
    processor = fused.FusedMTPBatchProcessor(SimpleNamespace(), runtime)
    maxs = processor._stager._slots  # MAX's stager, as MAX built it
    assert fused.CARRY_TAGS not in maxs and len(maxs) == 2
    first = np.arange(6, dtype=np.uint32).reshape(3, 2) + 1
    (staged,) = processor.staged_tags(first)
    assert staged.shape == (3, 2) and np.array_equal(staged.to_numpy(), first)
    second = np.full((5, 2), 7, np.uint32)
    (again,) = processor.staged_tags(second)
    assert np.array_equal(again.to_numpy(), second)
    assert np.array_equal(staged.to_numpy(), second[:3]), "one buffer, reused"
    with pytest.raises(RuntimeError, match=fused.CARRY_TAGS):
        processor.staged_tags(np.zeros((9, 2), np.uint32))


def test_request_tags_are_zero_until_a_request_has_generated() -> None:
    from gdfold_max.integrations.max_qwen3_5_serve.ring import request_tag, tag_rows

    assert request_tag("a", 0) == (0, 0)
    lo, hi = request_tag("a", 1)
    assert lo & 1 and request_tag("a", 7) == (lo, hi) and request_tag("b", 1) != (lo, hi)
    assert max(lo, hi) < 2**32
    rows = tag_rows([(lo, hi), (0, 0)], 3)
    assert rows.dtype == np.uint32 and rows.tolist() == [[lo, hi], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="tags: 2 requests for a batch of 1 rows"):
        tag_rows([(1, 0), (3, 0)], 1)


class CarryModel:
    """The carry as plain Python: a dict per ring block."""

    def __init__(self, blocks: int) -> None:
        self.table = [(0, 0, 0, 0)] * blocks

    def step(self, blocks: list[int], tags: list[tuple[int, int]], drafts: int, accepted: list[int]
             ) -> tuple[list[int], list[int]]:
        """Returns (half recorded into, count folded on load) per row."""
        halves, counts, writes = [], [], []
        for block, tag, acc in zip(blocks, tags, accepted, strict=True):
            lo, hi, last, count = self.table[block]
            valid = (lo, hi) == tag and block != 0 and tag != (0, 0)
            last, count = (last, count) if valid else (0, 0)
            halves.append(1 - last)
            counts.append(count)
            writes.append((block, (*tag, 1 - last if drafts else last, 1 + acc if drafts else 0)))
        for block, entry in writes:
            self.table[block] = entry
        return halves, counts


@pytest.fixture(scope="module")
def carry_graph() -> Any:
    """read_carry / carried_counts / write_carry alone, compiled for the CPU, with MAX's
    ``accepted_lengths`` between them as the fused step has it."""
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType
    from max.pipelines.architectures.unified_mtp_qwen3_5.state_rollback import accepted_lengths

    from gdfold_max.integrations.max_qwen3_5_serve.ring import (
        carried_counts,
        carry_input_types,
        read_carry,
        write_carry,
    )

    cpu = DeviceRef.CPU()
    types = [*carry_input_types([cpu]), TensorType(DType.uint32, [2 * LAYERS, "batch_size"], cpu),
             TensorType(DType.uint32, ["offsets"], cpu), TensorType(DType.int64, ["batch_size"], cpu),
             TensorType(DType.int64, [], cpu)]
    with Graph("gdfold_carry", input_types=types) as graph:
        table, tags, rows, offsets, accepted, drafts = graph.inputs
        carry = read_carry(table.buffer, tags.tensor, rows.tensor, LAYERS)
        kept = accepted_lengths(offsets.tensor, accepted.tensor, drafts.tensor)
        write_carry(table.buffer, carry, carried_counts(kept, drafts.tensor, [], 1)[0])
        graph.output(carry.current_rows, carry.previous_rows, carry.count)
    return InferenceSession(devices=[CPU()]).load(graph)


LAYERS = 3


def test_the_carry_alternates_halves_and_folds_the_previous_counts(carry_graph: Any) -> None:
    """Two requests share a batch, then one finishes and a new request takes its ring
    block; a padding row points at block 0; a step without drafts lands its window and
    carries nothing. Each step must record into the half the previous one did not, and
    fold the previous step's ``1 + accepted`` records. A step tagged 0 that verifies drafts
    (contexts that have generated nothing, as MAX's warmup builds) leaves nothing for the
    block's next prefill, also tagged 0, to fold."""
    from max.driver import Buffer

    from gdfold_max.integrations.max_qwen3_5_serve.ring import request_tag, tag_rows

    blocks_total = 6
    table = Buffer.from_numpy(np.zeros((blocks_total, 4), np.uint32))
    model = CarryModel(blocks_total)
    a, b, c = (request_tag(name, 1) for name in "abc")
    zero = (0, 0)
    # (ring block per row, tag per row, drafts K, accepted per row)
    steps = [
        ([3, 5, 0], [zero, zero, zero], 0, [0, 0, 0]),   # prefill of a and b, a padding row
        ([3, 5, 0], [a, b, zero], 3, [2, 0, 0]),
        ([3, 5, 0], [a, b, zero], 3, [3, 1, 0]),
        ([3, 5], [a, b], 0, [0, 0]),                       # an adaptive width of 0
        ([3, 5], [a, b], 3, [1, 3]),
        ([3, 5], [zero, b], 0, [0, 0]),                   # c admitted on a's block: prefill
        ([3, 5], [c, b], 3, [0, 2]),
        ([3, 5], [c, b], 3, [3, 3]),
        ([4], [zero], 3, [2]),                             # drafts verified under the tag 0 (a warmup)
        ([4], [zero], 0, [0]),                             # the block's next prefill folds nothing
    ]
    for seen, (blocks, tags, drafts, accepted) in enumerate(steps):
        rows = np.array([[blk * 2 * LAYERS + layer for blk in blocks] for layer in range(2 * LAYERS)], np.uint32)
        per_row = drafts + 1
        offsets = np.arange(len(blocks) + 1, dtype=np.uint32) * per_row
        current, previous, count = (o.to_numpy() for o in carry_graph.execute(
            table, Buffer.from_numpy(tag_rows(tags, len(blocks))), Buffer.from_numpy(rows),
            Buffer.from_numpy(offsets), Buffer.from_numpy(np.array(accepted, np.int64)),
            Buffer.from_numpy(np.array(drafts, np.int64))))
        halves, counts = model.step(blocks, tags, drafts, accepted)
        assert count.tolist() == counts, (seen, blocks, tags)
        for row, (blk, half) in enumerate(zip(blocks, halves, strict=True)):
            base = blk * 2 * LAYERS
            assert current[:, row].tolist() == [base + half * LAYERS + layer for layer in range(LAYERS)]
            assert previous[:, row].tolist() == [base + (1 - half) * LAYERS + layer for layer in range(LAYERS)]
    # The model itself, spot-checked: c's last step kept 1 + 3 records, b's 1 + 3; the
    # prefill on block 4 folded none of the 1 + 2 its tag-0 step left.
    assert [entry[3] for entry in model.table[3:6:2]] == [4, 4]
    assert count.tolist() == [0]
    assert [entry[:2] for entry in model.table[3:6:2]] == [c, b]


# --- the geometry and the graph, from MAX's own builder --------------------------------


@pytest.fixture(scope="module")
def fused_graph(example: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """MAX's ``_build_graph_for_compile`` run by our pipeline model on the CPU for the
    tiny checkpoint (built, not compiled). Two GPU-only pieces are stood in for: each
    layer's ``Allreduce`` opens an accelerator per device at construction (given the CPU
    here), and the bitmask's host wait exists only on GPUs (left out here)."""
    from dataclasses import replace

    import max.nn.comm.allreduce as allreduce
    import max.pipelines.speculative.unified_graph_ops as graph_ops
    from max.driver import CPU
    from max.dtype import DType
    from max.graph import DeviceRef
    from max.graph.weights import WeightsFormat, load_weights
    from max.nn.kv_cache import MultiKVCacheParams, recurrent_leaf
    from max.pipelines.architectures.qwen3_5.model_config import Qwen3_5Config
    from max.pipelines.architectures.qwen3_5.state_cache import attn_cache
    from max.pipelines.lib.registry import PIPELINE_REGISTRY

    from gdfold_max.integrations.max_qwen3_5_serve import fused

    folder = example["write_checkpoint"](tmp_path_factory.mktemp("serve") / "tiny")
    pipeline = example["pipeline_config"](folder, 3, "cpu")
    adapter = PIPELINE_REGISTRY.architecture_for_config(pipeline).weight_adapters[WeightsFormat.safetensors]
    raw = adapter(dict(load_weights([folder / "model.safetensors"]).items()),
                  huggingface_config=pipeline.model.huggingface_config, pipeline_config=pipeline)
    hf = pipeline.model.huggingface_config
    kv = fused.FusedMTPModel.get_kv_params(huggingface_config=hf, pipeline_config=pipeline, devices=[DeviceRef.CPU()],
                                           kv_cache_config=pipeline.model.kv_cache, cache_dtype=DType.float32)
    model = object.__new__(fused.FusedMTPModel)
    model.pipeline_config = pipeline
    model.devices = [CPU()]
    model._draft_state_dict = {k[len("draft."):]: v for k, v in raw.items() if k.startswith("draft.")}
    target = {k[len("target."):]: v for k, v in raw.items() if k.startswith("target.")}
    # As MAX's _create_model_config readies the cache and the config
    # (unified_mtp_qwen3_5/model.py:119-164).
    attn = attn_cache(kv)
    model.kv_params = MultiKVCacheParams.from_params({"target": attn, "draft": replace(attn, num_layers=1),
                                                      "state": recurrent_leaf(kv)})
    config = Qwen3_5Config.initialize(pipeline, max_seq_len=256)
    config.finalize(huggingface_config=Qwen3_5Config._get_text_config(hf), state_dict=target, return_logits=None,
                    norm_method="rms_norm", attention_bias=False)
    config.use_subgraphs = False
    config.mrope_without_encoder = config.vision_config is not None
    config.vision_config = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(allreduce, "Accelerator", lambda id: CPU())
        patch.setattr(graph_ops, "wait_host_value_with_dep", lambda *args, **kwargs: None)
        graph, _ = model._build_graph_for_compile(None, target, config)  # type: ignore[arg-type]
    planner_config = fused.FusedMTPConfig.initialize(pipeline, max_seq_len=256)
    return {"graph": graph, "nn": model._fused_nn_model, "kv": kv, "model_kv": model.kv_params,
            "planner_config": planner_config, "pipeline": pipeline, "text": str(graph)}


def test_the_three_sites_of_the_ring_geometry_agree(fused_graph: dict, example: dict) -> None:
    from max.nn.kv_cache import recurrent_leaf
    from max.pipelines.architectures.unified_mtp_qwen3_5.unified_mtp_qwen3_5 import ring_len_for_config

    layers = example["LAYERS"] - 1
    cache = recurrent_leaf(fused_graph["kv"]).regions
    graph = tuple(fused_graph["nn"].state_regions)
    assert cache == graph
    live, ring = cache[:2], cache[2]
    assert [r.num_layers for r in live] == [layers, layers] and ring.num_layers == 2 * layers and ring.scratch
    ring_len = ring_len_for_config(fused_graph["pipeline"].speculative)
    assert ring.row_shape[:2] == (example["KEY_HEADS"], ring_len)
    # Memory planning prices the same ring, both halves.
    priced = fused_graph["planner_config"]._per_request_ring_bytes(ring_len)
    assert priced == ring.bytes_per_page == 2 * layers * ring.row_elements * 4
    # A record fits its stride (raw key, then each value head's delta row and decay).
    heads_per_key = example["VALUE_HEADS"] // example["KEY_HEADS"]
    assert ring.row_shape[2] >= example["HEAD_DIM"] + heads_per_key * (example["HEAD_DIM"] + 1)


def assert_max_s_inputs_then_the_carry(ours: list, theirs: list) -> None:
    """Our graph's inputs are MAX's, in MAX's order, then the carry's table and tags."""
    from max.dtype import DType

    assert [str(t) for t in ours[:len(theirs)]] == [str(t) for t in theirs]
    assert len(ours) == len(theirs) + 2
    table, tags = ours[-2:]
    assert (table.dtype, [str(d) for d in table.shape]) == (DType.uint32, ["gdfold_ring_blocks", "4"])
    assert (tags.dtype, [str(d) for d in tags.shape]) == (DType.uint32, ["batch_size", "2"])


def test_the_fused_graph_signature_is_max_s_then_the_carry(fused_graph: dict) -> None:
    from max.pipelines.architectures.unified_mtp_qwen3_5.unified_mtp_qwen3_5 import UnifiedMTPQwen3_5

    nn = fused_graph["nn"]
    ours = [v.type for v in fused_graph["graph"].inputs]
    from max.pipelines.architectures.unified_mtp_qwen3_5.spec_state import graph_kv_params

    theirs = list(UnifiedMTPQwen3_5.input_types(nn, graph_kv_params(fused_graph["model_kv"])))
    assert_max_s_inputs_then_the_carry(ours, theirs)
    # Before the carry: the ring rows of both halves, then the M-RoPE positions.
    assert nn.target.mrope_enabled
    assert [str(d) for d in ours[-3].shape] == ["3", "merged_total_seq_len"]
    assert [str(d) for d in ours[-4].shape] == [str(2 * len(nn.target.linear_layer_indices)), "batch_size"]


def assert_our_ops_only(text: str, layers: int) -> None:
    """In a graph's text: per Gated DeltaNet layer one verify with fold on load that runs
    the fold and the forward at a width of 0 (``gdfold_verify_or_forward``, no branch in
    the graph), the conv in the verify and in MAX's conv rollback; none of MAX's verify,
    forward or fold."""
    assert text.count('"gdfold_verify_or_forward"') == layers
    assert "mo.if" not in text
    for ours in ("gdfold_verify_ring_fold_on_load", "gdfold_state_fold", "gdfold_recurrence"):
        assert f'"{ours}"' not in text
    assert text.count('"gated_delta_conv1d_verify_fwd"') == 2 * layers
    for max_op in ("gated_delta_state_fold", "gated_delta_recurrence_verify_ring", "gated_delta_recurrence_fwd"):
        assert f'"{max_op}"' not in text


def test_the_fused_graph_folds_on_load_and_never_rolls_back_the_pool(fused_graph: dict, example: dict) -> None:
    """Every Gated DeltaNet layer of the target verifies with fold on load (and, at a
    verify width of 0, folds then runs the window: our fold and our forward); MAX's
    verify and MAX's rollback fold appear nowhere; the conv kernel runs in the verify and
    in MAX's conv rollback of each layer."""
    layers = example["LAYERS"] - 1
    text = fused_graph["text"]
    assert_our_ops_only(text, layers)


def test_registering_the_module_overrides_max_s_entry_for_the_checkpoint(example: dict, tmp_path: Path) -> None:
    """As ``PipelineConfig.from_args`` registers ``--custom-architectures`` (MAX's
    ``import_custom_architectures``; in a process of its own, so that this one's registry
    keeps MAX's entry): the checkpoint with speculation resolves to our
    pipeline model under MAX's name; without, to MAX's plain Qwen3.5."""
    folder = example["write_checkpoint"](tmp_path / "tiny")
    script = f"""
import runpy
from pathlib import Path
from max.pipelines.lib.arch_lookup import import_custom_architectures
from max.pipelines.lib.registry import PIPELINE_REGISTRY
ex = runpy.run_path({str(EXAMPLE)!r})
import_custom_architectures([{MODULE!r}])
for drafts in (3, 0):
    arch = PIPELINE_REGISTRY.architecture_for_config(ex["pipeline_config"](Path({str(folder)!r}), drafts, "cpu"))
    print("ARCH", drafts, arch.name, arch.pipeline_model.__module__, arch.pipeline_model.__qualname__)
"""
    lines = {}
    for mode in ("fused", "fold+verify"):
        env = {**os.environ, "GDFOLD_MAX_QWEN3_5": mode, "PYTHONPATH": str(ROOT / "python"),
               "HF_HUB_OFFLINE": "1"}
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        lines[mode] = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("ARCH")]
    module = f"{MODULE}.fused"
    assert lines["fused"][0] == ["3", "UnifiedMTPQwen3_5ForConditionalGeneration", module, "FusedMTPModel"]
    assert lines["fold+verify"][0] == ["3", "UnifiedMTPQwen3_5ForConditionalGeneration", MODULE,
                                       "PatchedVerifyMTPModel"]
    for mode in lines:
        assert lines[mode][1][:2] == ["0", "Qwen3_5ForConditionalGeneration"]
        assert not lines[mode][1][2].startswith("gdfold_max")


# --- DFlash2: the geometry, the graph and the registration ----------------------------


@pytest.fixture(scope="module")
def dflash2_checkpoint(example: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny checkpoint in bf16 and the example's tiny DFlash2 drafter."""
    folder = tmp_path_factory.mktemp("dflash2")
    shapes = example["Shapes"](dtype="bfloat16")
    return {"target": example["write_checkpoint"](folder / "tiny-bf16", shapes),
            "draft": example["write_dflash2_draft"](folder / "draft", shapes), "shapes": shapes}


@pytest.fixture(scope="module")
def dflash2_graph(example: dict, dflash2_checkpoint: dict) -> dict:
    """MAX's DFlash2 ``_create_model_config`` and ``_build_graph_for_compile`` run by our
    pipeline model (built, not compiled; a ``gpu`` device spec, which resolves without
    one), with the stand-ins of ``fused_graph``; MAX's default state pools (bf16)."""
    return build_dflash2_graph(example, dflash2_checkpoint)


def build_dflash2_graph(example: dict, dflash2_checkpoint: dict, state_pool_dtype: str | None = None,
                        model_cls: type | None = None) -> dict:
    """:func:`dflash2_graph` with ``--state-pool-dtype state_pool_dtype``, built by
    ``model_cls`` (default our ``FusedDflash2Model``)."""
    from types import SimpleNamespace

    import max.nn.comm.allreduce as allreduce
    import max.pipelines.speculative.unified_graph_ops as graph_ops
    from max.driver import CPU
    from max.dtype import DType
    from max.graph import DeviceRef
    from max.graph.weights import WeightsFormat, load_weights
    from max.pipelines.architectures.llama3.weight_adapters import _convert_safetensor_with_model_config
    from max.pipelines.lib.registry import PIPELINE_REGISTRY

    from gdfold_max.integrations.max_qwen3_5_serve import dflash2

    target, draft = dflash2_checkpoint["target"], dflash2_checkpoint["draft"]
    pipeline = example["dflash2_pipeline_config"](target, draft, state_pool_dtype=state_pool_dtype)
    adapter = PIPELINE_REGISTRY.architecture_for_config(pipeline).weight_adapters[WeightsFormat.safetensors]
    hf = pipeline.model.huggingface_config
    state_dict = adapter(dict(load_weights([target / "model.safetensors"]).items()), huggingface_config=hf,
                         pipeline_config=pipeline)
    kv = dflash2.FusedDflash2Model.get_kv_params(huggingface_config=hf, pipeline_config=pipeline,
                                                 devices=[DeviceRef.GPU()], kv_cache_config=pipeline.model.kv_cache,
                                                 cache_dtype=DType.bfloat16)
    model = object.__new__(model_cls or dflash2.FusedDflash2Model)
    model.pipeline_config = pipeline
    model.devices = [CPU()]
    model.memory_plan = SimpleNamespace(planned_max_length=256)  # type: ignore[assignment]
    drafter = pipeline.draft_model
    # As MAX's _load_state_dict reads the drafter (unified_dflash2_qwen3_5/model.py:160-178).
    model._draft_state_dict = _convert_safetensor_with_model_config(
        dict(load_weights([draft / "model.safetensors"]).items()), drafter.huggingface_config, drafter)
    config = model._create_model_config(state_dict)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(allreduce, "Accelerator", lambda id: CPU())
        patch.setattr(graph_ops, "wait_host_value_with_dep", lambda *args, **kwargs: None)
        graph, _ = model._build_graph_for_compile(None, state_dict, config)  # type: ignore[arg-type]
        # A driver like the one the builder made, for its regions and MAX's signature.
        driver = dflash2.FusedDflash2Driver(config, enable_structured_output=True)
    planner = dflash2.FusedDflash2MemoryPlanner(dflash2.FusedDflash2Config.initialize(pipeline, max_seq_len=256))
    return {"graph": graph, "kv": kv, "model_kv": model.kv_params, "config": config, "planner": planner,
            "driver": driver, "pipeline": pipeline, "text": str(graph)}


def op_counts(text: str) -> Counter[str]:
    """The ops of a graph's text by name (``mo.custom`` counted once per kernel symbol)."""
    ops = Counter(re.findall(r"(?:= |^\s*)((?:r?mo)\.[a-zA-Z_.]+)", text, re.M))
    ops.update(f"custom:{name}" for name in re.findall(r'mo\.custom \[symbol = "([a-z_0-9]+)"', text))
    return ops


def test_patched_builds_max_s_dflash2_graph_with_only_the_routed_ops_changed(example: dict,
                                                                           dflash2_checkpoint: dict) -> None:
    """What ``fold`` and ``fold+verify`` serve: MAX's DFlash2 pipeline model built under
    ``patched()`` (``patched(verify=True)``) keeps every op of MAX's own graph but the
    routed ones: MAX's fold becomes ours, and with ``verify`` MAX's verify becomes ours
    (at a width of 0 our forward); each adds only the branch on the verify width that
    picks the side as the graph runs. (``PatchedDflash2Model`` builds exactly this: its
    ``load_model`` runs MAX's inside ``patched()``, which this test does around MAX's
    graph builder, without compiling.)"""
    from max.pipelines.architectures.unified_dflash2_qwen3_5.model import UnifiedDflash2Qwen3_5Model

    from gdfold_max.integrations import max_qwen3_5

    layers = example["LAYERS"] - 1

    def built(verify: bool | None) -> Counter[str]:
        with ExitStack() as stack:
            if verify is not None:
                stack.enter_context(max_qwen3_5.patched(verify=verify))
            graph = build_dflash2_graph(example, dflash2_checkpoint, model_cls=UnifiedDflash2Qwen3_5Model)
        return op_counts(graph["text"])

    theirs, fold, fold_verify = built(None), built(False), built(True)
    assert theirs["custom:gated_delta_state_fold"] == 1
    assert theirs["custom:gated_delta_recurrence_verify_ring_fwd"] == layers
    branch = {"mo.if", "mo.yield", "mo.constant", "rmo.shape_to_tensor", "rmo.slice", "rmo.reshape", "rmo.equal"}
    fold_routes = {"gated_delta_state_fold": "gdfold_state_fold"}
    verify_routes = fold_routes | {"gated_delta_recurrence_verify_ring_fwd": "gdfold_verify_ring"}
    # (graph, MAX's kernel -> ours, every kernel of ours in the graph)
    for ours, routed, kernels in ((fold, fold_routes, {"gdfold_state_fold"}),
                                  (fold_verify, verify_routes,
                                   {"gdfold_state_fold", "gdfold_verify_ring", "gdfold_recurrence"})):
        for max_op, our_op in routed.items():
            assert ours[f"custom:{max_op}"] == 0 and ours[f"custom:{our_op}"] == theirs[f"custom:{max_op}"]
        kept = Counter({op: n for op, n in theirs.items() if op.removeprefix("custom:") not in routed})
        assert not kept - ours, f"MAX's ops missing: {kept - ours}"
        added = ours - theirs
        assert {op for op in added if not op.startswith("custom:")} <= branch | {"mo.custom"}, added
        assert {op.removeprefix("custom:") for op in added if op.startswith("custom:")} == kernels
    assert fold["mo.if"] == theirs["mo.if"] + 1  # the fold, skipped at a width of 0
    assert fold_verify["custom:gdfold_recurrence"] == layers  # the verify's width-0 side
    assert fold_verify["mo.if"] == theirs["mo.if"] + 1 + layers


def test_the_dflash2_graph_with_fp32_pools_folds_on_load_into_them(example: dict, dflash2_checkpoint: dict) -> None:
    """The served DFlash2 test's servers keep fp32 state pools (``DFLASH2_POOLS``): the
    fused graph is built for them, our ops only, the live pools fp32, and the ring's
    geometry agrees where the cache, the model, the driver and the planner derive it."""
    from max.dtype import DType
    from max.nn.kv_cache import recurrent_leaf

    built = build_dflash2_graph(example, dflash2_checkpoint, state_pool_dtype="float32")
    assert_our_ops_only(built["text"], example["LAYERS"] - 1)
    live = recurrent_leaf(built["kv"]).regions[:2]
    assert [region.dtype for region in live] == [DType.float32, DType.float32]
    assert ", 4, 128, 128], f32, gpu:0>" in built["text"]  # the recurrent pool the verify reads
    assert_dflash2_ring_geometry_agrees(built, example)


def test_dflash2_s_three_sites_of_the_ring_geometry_agree(dflash2_graph: dict, example: dict) -> None:
    assert_dflash2_ring_geometry_agrees(dflash2_graph, example)


def assert_dflash2_ring_geometry_agrees(dflash2_graph: dict, example: dict) -> None:
    """The two-half ring where MAX allocates the cache, where the model keeps it, where the
    driver declares the state tail and where the planner prices it."""
    from max.nn.kv_cache import recurrent_leaf
    from max.pipelines.architectures.qwen3_5.state_cache import ring_len_for_window

    from gdfold_max.integrations.max_qwen3_5_serve import dflash2, fused

    layers = example["LAYERS"] - 1
    config = dflash2_graph["config"]
    assert isinstance(config, dflash2.FusedDflash2Config) and isinstance(config.target, fused.FusedMTPConfig)
    # The cache MAX allocates (get_kv_params), the cache the model keeps (the config's)
    # and the state tail the driver declares.
    cache = recurrent_leaf(dflash2_graph["kv"]).regions
    assert recurrent_leaf(dflash2_graph["model_kv"]).regions == cache
    assert tuple(dflash2_graph["driver"].state_regions) == cache
    live, ring = cache[:2], cache[2]
    assert [r.num_layers for r in live] == [layers, layers] and ring.num_layers == 2 * layers and ring.scratch
    # Blocks of 8: 7 drafts, a ring of one 8-token window.
    assert (config.block_size, dflash2_graph["pipeline"].speculative.num_speculative_tokens) == (8, 7)
    assert ring.row_shape[:2] == (example["KEY_HEADS"], ring_len_for_window(8))
    # Memory planning prices the same ring, both halves.
    assert dflash2_graph["planner"].spec_state_bytes(dflash2_graph["pipeline"]) == ring.bytes_per_page


def test_the_dflash2_graph_signature_is_max_s_then_the_carry(dflash2_graph: dict) -> None:
    from max.pipelines.architectures.unified_dflash2_qwen3_5.unified_dflash2_qwen3_5 import UnifiedDflash2Qwen3_5
    from max.pipelines.architectures.unified_mtp_qwen3_5.spec_state import graph_kv_params

    driver = dflash2_graph["driver"]
    ours = [v.type for v in dflash2_graph["graph"].inputs]
    theirs = list(UnifiedDflash2Qwen3_5.input_types(driver, graph_kv_params(dflash2_graph["model_kv"])))
    assert_max_s_inputs_then_the_carry(ours, theirs)
    # Before the carry: the ring rows of both halves (no M-RoPE or penalty inputs).
    assert [str(d) for d in ours[-3].shape] == [str(2 * len(driver.target.linear_layer_indices)), "batch_size"]


def test_the_dflash2_graph_folds_on_load_and_never_rolls_back_the_pool(dflash2_graph: dict, example: dict) -> None:
    layers = example["LAYERS"] - 1
    text = dflash2_graph["text"]
    assert_our_ops_only(text, layers)


def test_the_fused_dflash2_model_refuses_to_load_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Served, the fused DFlash2 step answered token 0 after the first token
    (docs/integrations.md, "DFlash2"): its pipeline model refuses to load, naming the
    variable that loads it all the same, before it builds or compiles anything."""
    from gdfold_max.integrations.max_qwen3_5_serve import dflash2

    model = object.__new__(dflash2.FusedDflash2Model)
    for value in (None, "1"):
        if value is None:
            monkeypatch.delenv(dflash2.UNVALIDATED_ENV, raising=False)
        else:
            monkeypatch.setenv(dflash2.UNVALIDATED_ENV, value)
        found = "unset" if value is None else f"'{value}'"
        with pytest.raises(RuntimeError, match=rf"GDFOLD_MAX_QWEN3_5_DFLASH2=unvalidated .* is {found}\)"):
            model.load_model(None)  # type: ignore[arg-type]
    # Asked for, it goes on to MAX's loading (which needs a model built in full).
    monkeypatch.setenv(dflash2.UNVALIDATED_ENV, "unvalidated")
    with pytest.raises(AttributeError):
        model.load_model(None)  # type: ignore[arg-type]


def test_registering_the_module_overrides_max_s_dflash2_entry(dflash2_checkpoint: dict) -> None:
    """As the MTP test above: the bf16 checkpoint with ``--speculative-method dflash2`` and
    the drafter resolves to our pipeline model under MAX's DFlash2 name."""
    target, draft = dflash2_checkpoint["target"], dflash2_checkpoint["draft"]
    script = f"""
import runpy
from pathlib import Path
from max.pipelines.lib.arch_lookup import import_custom_architectures
from max.pipelines.lib.registry import PIPELINE_REGISTRY
ex = runpy.run_path({str(EXAMPLE)!r})
import_custom_architectures([{MODULE!r}])
config = ex["dflash2_pipeline_config"](Path({str(target)!r}), Path({str(draft)!r}))
arch = PIPELINE_REGISTRY.architecture_for_config(config)
print("ARCH", arch.name, arch.pipeline_model.__module__, arch.pipeline_model.__qualname__)
"""
    found = {}
    for mode in ("fused", "fold"):
        env = {**os.environ, "GDFOLD_MAX_QWEN3_5": mode, "PYTHONPATH": str(ROOT / "python"), "HF_HUB_OFFLINE": "1"}
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        found[mode] = next(line.split()[1:] for line in run.stdout.splitlines() if line.startswith("ARCH"))
    name = "UnifiedDflash2Qwen3_5ForConditionalGeneration"
    assert found["fused"] == [name, f"{MODULE}.dflash2", "FusedDflash2Model"]
    assert found["fold"] == [name, MODULE, "PatchedDflash2Model"]


# --- the KV cache the served flags give (CPU) ------------------------------------------

#: ``max serve``'s --max-length and --max-batch-size for the tiny checkpoint.
SERVED_LENGTH = 256
SERVED_BATCH = 8
#: The speculative tokens the MTP servers draft (--num-speculative-tokens).
SERVED_DRAFTS = 3


def served_cache(example: dict, tmp_path: Path, model_cls: type, batch: int) -> Any:
    """The KV cache ``max serve`` builds for the tiny checkpoint's MTP pipeline, as MAX 26.7
    sizes and then creates it: the size from the architecture's KV params for ``batch``
    requests (``_calculate_kv_cache_size``, ``max/pipelines/lib/memory_estimation.py:546``),
    the manager from the model's own params, which hold the draft's attention cache too
    (``SpecDecodeState.load``, ``max/pipelines/lib/pipeline_variants/overlap_text_generation.py:571``,
    with ``model.kv_params`` as ``unified_mtp_qwen3_5/model.py:119-164`` builds them)."""
    from dataclasses import replace

    from max.dtype import DType
    from max.graph import DeviceRef
    from max.nn.kv_cache import MultiKVCacheParams, recurrent_leaf
    from max.pipelines.architectures.qwen3_5.state_cache import attn_cache
    from max.pipelines.kv_cache.paged_kv_cache.jenga_cache_manager import JengaKVCacheManager
    from max.pipelines.kv_cache.registry import kv_cache_memory_size

    folder = example["write_checkpoint"](tmp_path / "tiny")
    pipeline = example["pipeline_config"](folder, SERVED_DRAFTS, "cpu")
    arch_params = model_cls.get_kv_params(huggingface_config=pipeline.model.huggingface_config,
                                          pipeline_config=pipeline, devices=[DeviceRef.CPU()],
                                          kv_cache_config=pipeline.model.kv_cache, cache_dtype=DType.float32)
    size = kv_cache_memory_size(params=arch_params, available_cache_memory=1 << 30, max_batch_size=batch,
                                max_seq_len=SERVED_LENGTH, is_di_enabled=False, model_name="tiny")
    attn = attn_cache(arch_params)
    model_params = MultiKVCacheParams.from_params({"target": attn, "draft": replace(attn, num_layers=1),
                                                   "state": recurrent_leaf(arch_params)})
    return JengaKVCacheManager.create(params=model_params, available_bytes=size, max_batch_size=batch,
                                      max_seq_len=SERVED_LENGTH, max_num_input_tokens=8192)


@pytest.mark.parametrize("route", ["max", "fused"])
def test_the_served_flags_give_a_cache_that_holds_a_request(example: dict, tmp_path: Path, route: str) -> None:
    """MAX 26.7 sizes the cache without the draft's attention cache, then builds it with
    it, and exits when one request of --max-length plus the speculative slack does not
    fit. For the tiny checkpoint that happens at a batch of 2 or 3 (MAX's own MTP
    pipeline as well as ours; jenga_cache_manager.py:318); at the served batch of 8 a
    request fits, for MAX's KV params and for the fused two-half ring's."""
    from max.pipelines.architectures.unified_mtp_qwen3_5.model import UnifiedMTPQwen3_5Model

    from gdfold_max.integrations.max_qwen3_5_serve import fused

    model_cls = UnifiedMTPQwen3_5Model if route == "max" else fused.FusedMTPModel
    with pytest.raises(RuntimeError, match="Insufficient cache memory to support a batch containing one request"):
        served_cache(example, tmp_path / "two", model_cls, 2)
    cache = served_cache(example, tmp_path / "served", model_cls, SERVED_BATCH)
    assert cache.effective_max_seq_length >= SERVED_LENGTH


# --- served, on a GPU -----------------------------------------------------------------

#: Token-id prompts of a wave: more than --max-batch-size, so requests are admitted
#: while others decode and ring blocks are reused.
PROMPTS = [[1, 2, 3], [7, 5, 9, 11], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [300],
           [17, 18, 19, 20, 21, 22], [99, 98, 97, 96, 95], [5], [61, 62], [210, 3, 77], [8, 8, 8, 8],
           [123, 45], [6, 28, 496]]
NEW_TOKENS = 12
#: Each prompt's max_tokens: 12, 9, 6 and 3 in turn, so that with 12 prompts on batches of 8
#: requests leave at different steps and the waiting ones arrive mid-batch.
LENGTHS = [NEW_TOKENS - 3 * (i % 4) for i in range(len(PROMPTS))]
READY_S = 1500.0


def speculative_flags(method: str | None, draft: Path | None) -> list[str]:
    """``max serve``'s speculative flags for ``method`` (none for plain decoding). DFlash2's
    drafter comes with its own width (its blocks of 8: 7 drafts) and runs in bf16 (MAX
    26.7 pins its KV cache to bf16)."""
    if method is None:
        return []
    if method == "mtp":
        return ["--speculative-method", "mtp", "--num-speculative-tokens", str(SERVED_DRAFTS)]
    assert method == "dflash2" and draft is not None
    return ["--speculative-method", "dflash2", "--draft-model-path", str(draft),
            "--draft-quantization-encoding", "bfloat16"]


@contextmanager
def served(name: str, folder: Path, logs: Path, *, mode: str | None, method: str | None,
           extra: tuple[str, ...] = (), encoding: str = "float32", draft: Path | None = None) -> Iterator[dict]:
    """``max serve`` in a process group of its own, until the block ends (SIGTERM, then
    SIGKILL to that group only)."""
    from gdfold_max.integrations.max_qwen3_5_serve import dflash2
    from gdfold_max.integrations.max_qwen3_5_serve.server import free_port, max_command, running

    port = free_port()
    argv = [*max_command(), "serve", "--model-path", str(folder), "--weight-path", str(folder / "model.safetensors"),
            "--quantization-encoding", encoding, "--max-length", str(SERVED_LENGTH),
            "--max-batch-size", str(SERVED_BATCH), "--device-memory-utilization", "0.1", "--no-device-graph-capture",
            "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "tiny", *extra, *speculative_flags(method, draft)]
    # faulthandler: a model worker that crashes leaves its Python stack in the log.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MAX_SERVE_DISABLE_TELEMETRY": "1",
           "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")]))}
    env.pop("GDFOLD_MAX_QWEN3_5", None)
    if mode is not None:
        argv += ["--custom-architectures", MODULE]
        env["GDFOLD_MAX_QWEN3_5"] = mode
    if (mode, method) == ("fused", "dflash2"):
        # The fused DFlash2 step, which a server refuses unless asked: these tests study it.
        env[dflash2.UNVALIDATED_ENV] = "unvalidated"
    log = logs / f"{name}.log"
    with running(argv, env, log) as proc:
        yield {"name": name, "url": f"http://127.0.0.1:{port}", "proc": proc, "log": log}


async def ready(server: dict, deadline: float) -> None:
    """``wait_ready`` for one of several servers that share a deadline."""
    from gdfold_max.integrations.max_qwen3_5_serve.server import wait_ready

    try:
        await wait_ready(server["url"], server["proc"], server["log"], max(0.0, deadline - time.monotonic()))
    except RuntimeError as error:
        raise AssertionError(f"{server['name']}: {error}") from error


def test_a_server_is_waited_for_and_stopped(tmp_path: Path) -> None:
    """The process helpers the served test, example and benchmark share, on a plain HTTP
    server: ready once /health answers 200, stopped at the block's end; a process that
    exits first is named with its exit status and its log."""
    from gdfold_max.integrations.max_qwen3_5_serve.server import free_port, running, wait_ready

    (tmp_path / "health").write_text("ok")
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with running(argv, dict(os.environ), tmp_path / "http.log") as proc:
        asyncio.run(wait_ready(f"http://127.0.0.1:{port}", proc, tmp_path / "http.log", 60))
    assert proc.returncode is not None
    assert (tmp_path / "http.log").read_text().startswith(" ".join(argv))
    with running([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), tmp_path / "dead.log") as proc:
        with pytest.raises(RuntimeError, match="max serve exited 3"):
            asyncio.run(wait_ready(f"http://127.0.0.1:{free_port()}", proc, tmp_path / "dead.log", 60))


async def completion_ids(client: Any, url: str, prompt: list[int], new_tokens: int) -> list[int]:
    reply = await client.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    ids = choice.get("token_ids")
    assert ids is not None, f"no token_ids in {choice}"
    return [int(t) for t in ids][-new_tokens:]


async def cancel_a_stream(client: Any, url: str) -> int:
    """A streamed completion dropped after two chunks; returns the chunks read."""
    chunks = 0
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunks += 1
                if chunks == 2:
                    break
    return chunks


async def exercise(server: dict) -> dict:
    """A wave of concurrent completions of several lengths, a chat completion and a
    cancelled stream side by side, then the same wave again. Each prompt is also asked
    alone, one after another, before and after all that (``alone`` and ``alone_after``):
    a batch of one request, the same at every server."""
    import httpx

    url = server["url"]
    async with httpx.AsyncClient(timeout=600) as client:
        async def one_at_a_time() -> list[list[int]]:
            return [await completion_ids(client, url, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]

        before = await one_at_a_time()
        chat = client.post(url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 8,
            "temperature": 0})
        def wave() -> Any:
            return asyncio.gather(*(completion_ids(client, url, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)))

        first, chat_reply, chunks = await asyncio.gather(wave(), chat, cancel_a_stream(client, url))
        second = await wave()
        after = await one_at_a_time()
        healthy = (await client.get(url + "/health")).status_code
    assert chat_reply.status_code == 200, chat_reply.text
    message = chat_reply.json()["choices"][0]["message"]
    return {"first": list(first), "second": list(second), "chunks": chunks, "healthy": healthy,
            "alone": before, "alone_after": after,
            "chat": (message.get("content") or "") + (message.get("reasoning_content") or "")}


#: The DFlash2 servers' state pools. With the bf16 pools MAX 26.7 gives a bf16 checkpoint by
#: default, MAX's own DFlash2 server answered the first prompt asked alone with one ordinary
#: token and then token 0, and every later one with token 0 throughout; so did the
#: fold-only and fused routes, while fold+verify answered other tokens and plain decoding
#: with the same pools ordinary ones (an H100, 2026-12-07, main 737b664,
#: ``git show 14d3425:bench/results/gpu-tests-max-serve-h100-2026-12-07.txt``). With fp32
#: pools, where MAX says a speculated generation follows the state trajectory of an
#: unspeculated one (``qwen3_5/model_config.py:155-166``), MAX's own DFlash2, the fold-only
#: route and fold+verify answer ordinary tokens; the fused route still answers each prompt
#: asked alone with one ordinary token and then token 0 (an H100, 2026-12-07, main 14d3425,
#: bench/results/gpu-tests-max-serve-h100-2026-12-07.txt). MAX's default bf16 pools have no
#: served DFlash2 test.
DFLASH2_POOLS = ("--state-pool-dtype", "float32")

#: name -> (GDFOLD_MAX_QWEN3_5 or None for MAX's own, speculative method or None for plain
#: decoding, extra flags). The ``dflash2-`` servers serve a bf16 copy of the checkpoint, with
#: fp32 state pools.
SERVERS: dict[str, tuple[str | None, str | None, tuple[str, ...]]] = {
    "fused": ("fused", "mtp", ()),
    "fused-no-overlap": ("fused", "mtp", ("--disable-overlap",)),
    "fold+verify": ("fold+verify", "mtp", ()),
    "fold": ("fold", "mtp", ()),
    "max-mtp": (None, "mtp", ()),
    "plain": (None, None, ()),
    "dflash2-fused": ("fused", "dflash2", DFLASH2_POOLS),
    "dflash2-fold+verify": ("fold+verify", "dflash2", DFLASH2_POOLS),
    "dflash2-fold": ("fold", "dflash2", DFLASH2_POOLS),
    "dflash2-max": (None, "dflash2", DFLASH2_POOLS),
    "dflash2-plain": (None, None, DFLASH2_POOLS),
}


def same_graph_waves(names: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """``names`` split into the servers whose graphs no earlier one builds, and the rest
    (a server's graph is set by its route and method; ``--disable-overlap`` leaves it as is,
    and ``DFLASH2_POOLS``, which changes it, every ``dflash2-`` server has, and
    serve_and_ask never mixes those with others)."""
    seen: set[tuple[str | None, str | None]] = set()
    first, later = [], []
    for name in names:
        mode, method, _ = SERVERS[name]
        (later if (mode, method) in seen else first).append(name)
        seen.add((mode, method))
    return first, later


def test_servers_of_other_graphs_start_together() -> None:
    assert same_graph_waves(("fused", "fused-no-overlap", "fold+verify", "plain")) == (
        ["fused", "fold+verify", "plain"], ["fused-no-overlap"])
    every = tuple(name for name in SERVERS if name.startswith("dflash2-"))
    assert same_graph_waves(every) == (list(every), [])


def serve_and_ask(names: tuple[str, ...], example: dict, tmp_path: Path) -> dict[str, dict]:
    """The named servers of the tiny checkpoint side by side (each a tenth of the GPU), all
    asked the same (:func:`exercise`), each prompt alone too. Returns each server's answers.

    Every server must answer every prompt alone after the concurrent waves (a cancelled
    stream, requests arriving and leaving mid-batch, ring blocks reused) as it did before
    them, and no request may come back as token 0 to its end (what NaN logits give greedy
    sampling). ``dflash2-`` names serve the checkpoint in bf16 with the example's tiny
    drafter (MAX 26.7 runs DFlash2's drafter in bf16), with fp32 state pools
    (``DFLASH2_POOLS``); a bf16 target's greedy tokens may depend on how requests are
    batched into calls, so with concurrent, racy arrivals no such server need repeat its
    own waves. Otherwise (an fp32 checkpoint) each must answer its second wave as its
    first."""
    pytest.importorskip("httpx")
    dflash2 = names[0].startswith("dflash2-")
    assert all(n.startswith("dflash2-") == dflash2 for n in names), names
    if dflash2:
        shapes = example["Shapes"](dtype="bfloat16")
        folder = example["write_checkpoint"](tmp_path / "tiny", shapes)
        draft = example["write_dflash2_draft"](tmp_path / "draft", shapes)
    else:
        folder, draft = example["write_checkpoint"](tmp_path / "tiny"), None
    logs = tmp_path / "logs"
    logs.mkdir()
    with ExitStack() as stack:
        servers: dict[str, dict] = {}

        def start(name: str) -> None:
            mode, method, extra = SERVERS[name]
            # A folder per server: MAX caches a checkpoint's config per folder.
            copy = tmp_path / f"tiny-{name}"
            shutil.copytree(folder, copy)
            servers[name] = stack.enter_context(served(
                name, copy, logs, mode=mode, method=method, extra=extra,
                encoding="bfloat16" if dflash2 else "float32", draft=draft if method else None))

        async def everything() -> dict:
            deadline = time.monotonic() + READY_S
            # Servers of graphs of their own compile side by side; one that builds the
            # graph of a server before it (the same route and method, other flags) starts
            # once that one is up, and finds MAX's compiled graphs in its cache.
            first, later = same_graph_waves(names)
            for name in first:
                start(name)
            await asyncio.gather(*(ready(servers[n], deadline) for n in first))
            for name in later:
                start(name)
            await asyncio.gather(*(ready(servers[n], deadline) for n in later))
            results = await asyncio.gather(*(exercise(servers[n]) for n in names))
            return dict(zip(names, results, strict=True))

        started = time.monotonic()
        try:
            results = asyncio.run(everything())
        except BaseException:
            for server in servers.values():
                print(f"--- {server['name']} log tail ---\n{server['log'].read_text()[-3000:]}")
            raise
        print(f"served and answered in {time.monotonic() - started:.0f} s")
    print(json.dumps({name: r["first"] for name, r in results.items()}, indent=None))
    print(json.dumps({name: {"alone": r["alone"], "second": r["second"]} for name, r in results.items()},
                     indent=None))
    # Every server's failures, not the first one's alone, printed whole (pytest shortens
    # the assertion's message).
    failures = served_failures(results, dflash2)
    print(json.dumps({"failures": failures}, indent=None))
    assert not failures, failures
    return results


def zeros_from(ids: list[int]) -> int | None:
    """Where an answer turns into token 0 to its end, two tokens or more of it (a whole
    answer of one token 0 too): what NaN logits from some step on give greedy sampling
    (two 0s by chance are about one answer in 260,000 of a 512-token vocabulary). None
    where it does not."""
    start = len(ids)
    while start > 0 and ids[start - 1] == 0:
        start -= 1
    run = len(ids) - start
    return start if run >= 2 or run == len(ids) == 1 else None


def served_failures(results: dict[str, dict], dflash2: bool) -> list[str]:
    """What each server's answers (:func:`exercise`) break of :func:`serve_and_ask`'s rules."""
    failures = []
    for name, r in results.items():
        if r["chunks"] != 2 or r["healthy"] != 200:
            failures.append(f"{name}: {r['chunks']} chunks of the cancelled stream, /health {r['healthy']}")
        waves = [w for w in ("first", "second", "alone", "alone_after") if r[w] is not None]
        for wave in waves:
            if [len(ids) for ids in r[wave]] != LENGTHS:
                failures.append(f"{name}: {wave}: lengths {[len(ids) for ids in r[wave]]}, not {LENGTHS}")
        if r["alone_after"] != r["alone"]:
            failures.append(f"{name}: a prompt alone after the concurrent waves differs from before")
        zeros = [(wave, i, first) for wave in waves for i, ids in enumerate(r[wave])
                 if (first := zeros_from(ids)) is not None]
        if zeros:
            failures.append(f"{name}: token 0 to the end, (wave, prompt, from token) {zeros}")
        if not dflash2 and r["second"] != r["first"]:
            failures.append(f"{name}: the second wave differs")
    return failures


def test_the_served_rules_catch_what_the_served_runs_broke() -> None:
    """The rules of :func:`serve_and_ask` on answers as a served run gives them: the
    DFlash2 fused server whose second wave came back as token 0 (prompt 0, an H100,
    2026-12-07), one whose prompts asked alone turned into token 0 after their first token,
    a server whose prompts alone changed after the concurrent waves, one
    cut short, one whose stream was not cancelled; and answers that keep every rule."""
    good = [[7 + i] * n for i, n in enumerate(LENGTHS)]
    ok = {"first": good, "second": good, "alone": None, "alone_after": None, "chunks": 2, "healthy": 200}
    assert served_failures({"fused": ok, "plain": ok}, dflash2=False) == []
    other = [[9] * LENGTHS[0], *good[1:]]  # another answer to prompt 0
    assert served_failures({"fused": ok | {"second": other}}, dflash2=False) == ["fused: the second wave differs"]
    first_wave = [[37, 56, 111, 230, 404, 325, 69, 420, 403, 288, 184, 122], *good[1:]]
    zeroed = [[0] * LENGTHS[0], *good[1:]]
    alone = ok | {"alone": good, "alone_after": good}
    # The fused route with fp32 pools (an H100, 2026-12-07, 14d3425): each prompt asked
    # alone, one ordinary token, then token 0; a lone 0 inside an answer is no failure.
    turned = [[136] + [0] * (LENGTHS[0] - 1), [13] + [0] * (LENGTHS[1] - 1), *good[2:]]
    one_zero = [[193, 0, 40, 422, 459, 319, 99, 159, 342, 230, 244, 266], *good[1:]]
    answers = {"dflash2-fused": alone | {"first": first_wave, "second": zeroed},
               "dflash2-fused+": alone | {"first": one_zero, "alone": turned, "alone_after": turned},
               "dflash2-max": alone | {"second": other},  # a bf16 target's waves may differ
               "dflash2-fold": alone | {"alone_after": other},
               "dflash2-plain": alone | {"first": good[:-1], "chunks": 1}}
    assert served_failures(answers, dflash2=True) == [
        "dflash2-fused: token 0 to the end, (wave, prompt, from token) [('second', 0, 0)]",
        "dflash2-fused+: token 0 to the end, (wave, prompt, from token) [('alone', 0, 1), ('alone', 1, 1),"
        " ('alone_after', 0, 1), ('alone_after', 1, 1)]",
        "dflash2-fold: a prompt alone after the concurrent waves differs from before",
        "dflash2-plain: 1 chunks of the cancelled stream, /health 200",
        f"dflash2-plain: first: lengths {LENGTHS[:-1]}, not {LENGTHS}",
    ]


@pytest.mark.gpu
def test_max_serve_gives_the_fused_step_the_tokens_of_our_verify_then_fold(example: dict, tmp_path: Path) -> None:
    """The fused step's pools equal fold+verify's bit for bit, so their greedy tokens
    must be equal, with MAX's overlap scheduler and without it; and a user of the fused
    step must get plain decoding's tokens (MAX's own plain pipeline: its forward rounds
    otherwise than our verify, so this holds where no greedy choice is that close). Each
    prompt asked alone too: a batch of one, the fused step's carry at its simplest."""
    results = serve_and_ask(("fused", "fused-no-overlap", "fold+verify", "plain"), example, tmp_path)
    assert results["fused"]["alone"] == results["fold+verify"]["alone"]
    assert results["fused"]["first"] == results["fold+verify"]["first"]
    assert results["fused-no-overlap"]["first"] == results["fused"]["first"]
    assert results["fused"]["chat"] == results["fold+verify"]["chat"]
    assert results["fused"]["first"] == results["plain"]["first"]


@pytest.mark.gpu
def test_max_serve_with_our_fold_gives_max_s_tokens(example: dict, tmp_path: Path) -> None:
    """Our fold is bit-identical to MAX's, so the fold-only route must give MAX's MTP
    tokens, and both plain decoding's (as MAX's pipeline gives them on this checkpoint:
    examples/max_qwen3_5_pipeline.py)."""
    results = serve_and_ask(("fold", "max-mtp", "plain"), example, tmp_path)
    assert results["fold"]["alone"] == results["max-mtp"]["alone"]
    assert results["fold"]["first"] == results["max-mtp"]["first"]
    assert results["fold"]["chat"] == results["max-mtp"]["chat"]
    assert results["max-mtp"]["first"] == results["plain"]["first"]


@pytest.mark.gpu
def test_max_serve_dflash2_fused_gives_fold_verify_s_tokens_and_fold_max_s(example: dict, tmp_path: Path) -> None:
    """MAX's DFlash2 pipeline (blocks of 8 from the example's tiny drafter, a bf16 target,
    fp32 state pools) with our ops, each prompt asked alone (a batch of one, the same at
    every server): the fused step gives fold+verify's tokens (the same pools, bit for bit)
    and the fold-only route MAX's DFlash2 tokens (our fold is bit-identical to MAX's). How
    far the fused route and MAX's DFlash2 agree with each other and with plain decoding is
    printed, not required: MAX's verify rounds otherwise than ours, and the bf16 target's
    logits depend on how tokens are batched into calls (``serve_and_ask``)."""
    results = serve_and_ask(("dflash2-fused", "dflash2-fold+verify", "dflash2-fold", "dflash2-max", "dflash2-plain"),
                            example, tmp_path)
    for name, other in (("dflash2-max", "dflash2-plain"), ("dflash2-fused", "dflash2-plain"),
                        ("dflash2-fused", "dflash2-max")):
        theirs = results[other]["alone"]
        same = sum(a == b for a, b in zip(results[name]["alone"], theirs, strict=True))
        print(f"{name}: {same} of {len(theirs)} prompts alone give {other}'s tokens")
    assert results["dflash2-fused"]["alone"] == results["dflash2-fold+verify"]["alone"]
    assert results["dflash2-fold"]["alone"] == results["dflash2-max"]["alone"]
