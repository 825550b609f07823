"""MAX's own Qwen3.5 MTP speculative pipeline, offline, from a tiny checkpoint written here.

Writes a random-weight Qwen3.5 checkpoint with an MTP head (``config.json``, one
``model.safetensors``, a word-level ``tokenizer.json``) into a folder, then decodes the same
prompts greedily three ways through MAX's pipeline registry, with nothing downloaded:

* ``plain``: ``Qwen3_5ForConditionalGeneration`` without speculation;
* ``max``: ``--speculative-method mtp``, which selects MAX's
  ``UnifiedMTPQwen3_5ForConditionalGeneration``: one graph that verifies the drafts, rolls
  the state back (``state_rollback.fold_state_pools``) and drafts the next ones;
* ``patched``: the same, built under ``gdfold_max.integrations.max_qwen3_5.patched()``, so
  that the rollback folds with ``gdfold_max.state_fold``.

It checks that the three give the same tokens. Each decoding runs in a process of its own,
the three side by side: building a pipeline is mostly compiling its graphs on the host,
and each process holds only its own pipeline (and MAX's per-process caches). MAX builds
Qwen3.5 pipelines on GPUs only (the layers allocate allreduce buffers on accelerators,
and the speculative ``OverlapTextGenerationPipeline`` refuses CPU devices): on a machine
without one the script writes the checkpoint, resolves both architectures, and stops
there.

    python examples/max_qwen3_5_pipeline.py [--folder DIR] [--new-tokens 16] [--drafts 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to fetch

@dataclass(frozen=True)
class Shapes:
    """A Qwen3.5 checkpoint's sizes: ``layers - 1`` Gated DeltaNet layers, then one
    full-attention layer, and a one-layer MTP head. ``head_dim`` is the Gated DeltaNet
    K = V (128, as MAX's state kernels require), ``attention_head_dim`` the full
    attention's; ``dtype`` the weights' (and so, by default, the state pools')."""

    hidden: int = 256
    layers: int = 4
    vocab: int = 512
    key_heads: int = 2
    value_heads: int = 4
    head_dim: int = 128
    ffn: int = 512
    attention_heads: int = 2
    kv_heads: int = 1
    attention_head_dim: int = 128
    dtype: str = "float32"


#: The tiny checkpoint the examples and tests write.
TINY = Shapes()
HIDDEN, LAYERS, VOCAB, KEY_HEADS, VALUE_HEADS, HEAD_DIM, FFN = (
    TINY.hidden, TINY.layers, TINY.vocab, TINY.key_heads, TINY.value_heads, TINY.head_dim, TINY.ffn)
ATTENTION_HEADS, KV_HEADS = TINY.attention_heads, TINY.kv_heads
#: Its vision tower, one block: never run on these text prompts, but the plain pipeline
#: compiles it and MAX refuses a checkpoint without its weights.
VISION_HIDDEN, VISION_FFN, PATCH, TEMPORAL_PATCH, MERGE, VISION_POSITIONS = 64, 128, 16, 2, 2, 64
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<think>", "</think>", "<|image_pad|>", "<|video_pad|>",
                  "<|vision_start|>", "<|vision_end|>", "<|im_end|>")
FIRST_SPECIAL = VOCAB - len(SPECIAL_TOKENS)


def special_id(token: str, shapes: Shapes = TINY) -> int:
    return shapes.vocab - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(token)


def hf_config(shapes: Shapes = TINY) -> dict:
    """``config.json`` of a multimodal Qwen3.5 checkpoint, as the published ones are: the text
    config and a vision tower (which MAX's fused speculative graph leaves out)."""
    s = shapes
    layer_types = ["linear_attention"] * (s.layers - 1) + ["full_attention"]
    # MAX checks the three mrope sections (temporal, height, width) sum to half the rotary
    # dimension (a quarter of the head): 16 as (6, 5, 5) for heads of 128, scaled alike.
    half_rotary = s.attention_head_dim // 8
    side = half_rotary * 5 // 16
    mrope_section = [half_rotary - 2 * side, side, side]
    text = {
        "model_type": "qwen3_5_text", "vocab_size": s.vocab, "hidden_size": s.hidden, "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers, "layer_types": layer_types, "full_attention_interval": s.layers,
        "num_attention_heads": s.attention_heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.attention_head_dim,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": s.head_dim, "linear_value_head_dim": s.head_dim,
        "linear_num_key_heads": s.key_heads, "linear_num_value_heads": s.value_heads,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": mrope_section, "mrope_interleaved": True},
        "attn_output_gate": True, "mtp_num_hidden_layers": 1, "tie_word_embeddings": False,
        "eos_token_id": special_id("<|im_end|>", s), "dtype": s.dtype,
    }
    vision = {
        "model_type": "qwen3_5", "depth": 1, "hidden_size": VISION_HIDDEN, "intermediate_size": VISION_FFN,
        "num_heads": 2, "in_channels": 3, "patch_size": PATCH, "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL_PATCH, "out_hidden_size": s.hidden, "num_position_embeddings": VISION_POSITIONS,
        "deepstack_visual_indexes": [],
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text, "vision_config": vision, "tie_word_embeddings": False, "dtype": s.dtype,
        "image_token_id": special_id("<|image_pad|>", s), "video_token_id": special_id("<|video_pad|>", s),
        "vision_start_token_id": special_id("<|vision_start|>", s),
        "vision_end_token_id": special_id("<|vision_end|>", s),
    }


def weight_shapes(shapes: Shapes = TINY) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, named as Qwen3.5's published checkpoints name them."""
    s = shapes
    hidden, ffn, head = s.hidden, s.ffn, s.attention_head_dim
    conv_dim = 2 * s.key_heads * s.head_dim + s.value_heads * s.head_dim
    value_dim = s.value_heads * s.head_dim

    def mlp(prefix: str) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}mlp.gate_proj.weight": (ffn, hidden), f"{prefix}mlp.up_proj.weight": (ffn, hidden),
                f"{prefix}mlp.down_proj.weight": (hidden, ffn),
                f"{prefix}input_layernorm.weight": (hidden,), f"{prefix}post_attention_layernorm.weight": (hidden,)}

    def attention(prefix: str) -> dict[str, tuple[int, ...]]:
        # The query projection also yields the output gate (attn_output_gate).
        return {f"{prefix}self_attn.q_proj.weight": (2 * s.attention_heads * head, hidden),
                f"{prefix}self_attn.k_proj.weight": (s.kv_heads * head, hidden),
                f"{prefix}self_attn.v_proj.weight": (s.kv_heads * head, hidden),
                f"{prefix}self_attn.o_proj.weight": (hidden, s.attention_heads * head),
                f"{prefix}self_attn.q_norm.weight": (head,), f"{prefix}self_attn.k_norm.weight": (head,)}

    def gated_deltanet(prefix: str) -> dict[str, tuple[int, ...]]:
        p = f"{prefix}linear_attn."
        return {f"{p}in_proj_qkv.weight": (conv_dim, hidden), f"{p}in_proj_z.weight": (value_dim, hidden),
                f"{p}in_proj_b.weight": (s.value_heads, hidden), f"{p}in_proj_a.weight": (s.value_heads, hidden),
                f"{p}conv1d.weight": (conv_dim, 1, 4), f"{p}dt_bias": (s.value_heads,),
                f"{p}A_log": (s.value_heads,), f"{p}norm.weight": (s.head_dim,),
                f"{p}out_proj.weight": (hidden, value_dim)}

    def vision_tower(p: str) -> dict[str, tuple[int, ...]]:
        # One block, the patch projection as a Conv3D, and the merger of MERGE x MERGE patches.
        merged = MERGE * MERGE * VISION_HIDDEN
        linear = {f"{p}blocks.0.attn.qkv": (3 * VISION_HIDDEN, VISION_HIDDEN),
                  f"{p}blocks.0.attn.proj": (VISION_HIDDEN, VISION_HIDDEN),
                  f"{p}blocks.0.mlp.linear_fc1": (VISION_FFN, VISION_HIDDEN),
                  f"{p}blocks.0.mlp.linear_fc2": (VISION_HIDDEN, VISION_FFN),
                  f"{p}merger.linear_fc1": (merged, merged), f"{p}merger.linear_fc2": (hidden, merged),
                  f"{p}patch_embed.proj": (VISION_HIDDEN, 3, TEMPORAL_PATCH, PATCH, PATCH)}
        layer_norms = (f"{p}blocks.0.norm1", f"{p}blocks.0.norm2", f"{p}merger.norm")
        return ({f"{name}.weight": shape for name, shape in linear.items()}
                | {f"{name}.bias": (shape[0],) for name, shape in linear.items()}
                | {f"{name}.{part}": (VISION_HIDDEN,) for name in layer_norms for part in ("weight", "bias")}
                | {f"{p}pos_embed.weight": (VISION_POSITIONS, VISION_HIDDEN)})

    out: dict[str, tuple[int, ...]] = {
        "model.language_model.embed_tokens.weight": (s.vocab, hidden),
        "model.language_model.norm.weight": (hidden,), "lm_head.weight": (s.vocab, hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,), "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.fc.weight": (hidden, 2 * hidden), "mtp.norm.weight": (hidden,),
        **mlp("mtp.layers.0."), **attention("mtp.layers.0."),
    }
    for layer in range(s.layers):
        prefix = f"model.language_model.layers.{layer}."
        out |= mlp(prefix)
        out |= gated_deltanet(prefix) if layer < s.layers - 1 else attention(prefix)
    return out | vision_tower("model.visual.")


def random_weights(seed: int = 0, shapes: Shapes = TINY) -> dict[str, np.ndarray]:
    """Small random weights; norms are Qwen3.5's (1 + w) RMS norms at w = 0, except the
    Gated DeltaNet output norm, which scales by w; decays between exp(-1) and exp(-16); the
    vision tower's layer norms are the identity and its biases zero."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(shapes).items():
        if name.startswith("model.visual.") and name.endswith(".bias"):
            weights[name] = np.zeros(shape, np.float32)
        elif name.startswith("model.visual.") and "norm" in name:
            weights[name] = np.ones(shape, np.float32)
        elif name.endswith("A_log"):
            weights[name] = np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            weights[name] = np.ones(shape, np.float32)
        elif name.endswith("norm.weight"):
            weights[name] = np.zeros(shape, np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    # MAX 26.7 builds Qwen3.5's vision tower in bf16 whatever the encoding (as published
    # checkpoints store it) and refuses weights of another dtype.
    bf16 = shapes.dtype == "bfloat16"
    return {name: w.astype(ml_dtypes.bfloat16) if bf16 or name.startswith("model.visual.") else w
            for name, w in weights.items()}


def write_checkpoint(folder: Path, shapes: Shapes = TINY) -> Path:
    """The config, the weights and a word-level tokenizer whose special tokens are the ones
    MAX's Qwen3.5 tokenizer looks up (``<think>``, ``</think>``, the vision markers)."""
    from safetensors.numpy import save_file
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(shapes), indent=1))
    eos = special_id("<|im_end|>", shapes)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    save_file(random_weights(shapes=shapes), str(folder / "model.safetensors"))
    first_special = shapes.vocab - len(SPECIAL_TOKENS)
    vocab = {f"w{i}": i for i in range(first_special)} | {t: special_id(t, shapes) for t in SPECIAL_TOKENS}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": "w0", "chat_template": template, "model_max_length": 4096}))
    return folder


#: A DFlash2 drafter for a target of these shapes (MAX's ``DFlash2DraftModel``): one
#: layer, taps on the target's first and last layers, blocks of 8 (7 drafts).
DRAFT_HEADS, DRAFT_KV_HEADS, DRAFT_HEAD_DIM, DRAFT_LAYERS, DRAFT_BLOCK = 2, 1, 128, 1, 8
DRAFT_CONV_TAPS, DRAFT_CONV_GROUP, DRAFT_RANK, DRAFT_TOP_K = 3, 64, 16, 4


def dflash2_draft_config(shapes: Shapes = TINY) -> dict:
    """``config.json`` of a DFlash2 drafter: a Qwen3-shaped decoder config plus the
    ``dflash_config`` block MAX 26.7 reads (``unified_dflash2_qwen3_5/model_config.py``)."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "vocab_size": shapes.vocab,
        "hidden_size": shapes.hidden, "intermediate_size": shapes.ffn, "num_hidden_layers": DRAFT_LAYERS,
        "num_attention_heads": DRAFT_HEADS, "num_key_value_heads": DRAFT_KV_HEADS, "head_dim": DRAFT_HEAD_DIM,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0, "hidden_act": "silu",
        "sliding_window": 2048, "layer_types": ["full_attention"] * DRAFT_LAYERS, "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "dflash_config": {"mask_token_id": special_id("<|endoftext|>", shapes),
                          "target_layer_ids": [0, shapes.layers - 1], "num_target_layers": shapes.layers,
                          "block_size": DRAFT_BLOCK, "conv_kernel_size": DRAFT_CONV_TAPS,
                          "conv_group_size": DRAFT_CONV_GROUP, "selector_rank": DRAFT_RANK,
                          "selector_top_k": DRAFT_TOP_K},
    }


def dflash2_draft_shapes(shapes: Shapes = TINY) -> dict[str, tuple[int, ...]]:
    """The drafter's tensors, named as MAX's ``DFlash2Qwen3_5`` module declares them (no
    embedding or head: it borrows the target's)."""
    hidden, ffn = shapes.hidden, shapes.ffn
    taps_out = 2 * DRAFT_CONV_TAPS * (hidden // DRAFT_CONV_GROUP)
    out: dict[str, tuple[int, ...]] = {
        "norm.weight": (hidden,), "hidden_norm.weight": (hidden,), "fc.weight": (hidden, 2 * hidden),
        "candidate_selector.predecessor_codebook": (shapes.vocab, DRAFT_RANK),
        "candidate_selector.successor_codebook": (shapes.vocab, DRAFT_RANK),
        "candidate_selector.hidden_projection.weight": (DRAFT_RANK, hidden),
    }
    for layer in range(DRAFT_LAYERS):
        p = f"layers.{layer}."
        out |= {f"{p}self_attn.q_proj.weight": (DRAFT_HEADS * DRAFT_HEAD_DIM, hidden),
                f"{p}self_attn.k_proj.weight": (DRAFT_KV_HEADS * DRAFT_HEAD_DIM, hidden),
                f"{p}self_attn.v_proj.weight": (DRAFT_KV_HEADS * DRAFT_HEAD_DIM, hidden),
                f"{p}self_attn.o_proj.weight": (hidden, DRAFT_HEADS * DRAFT_HEAD_DIM),
                f"{p}self_attn.q_norm.weight": (DRAFT_HEAD_DIM,), f"{p}self_attn.k_norm.weight": (DRAFT_HEAD_DIM,),
                f"{p}mlp.gate_proj.weight": (ffn, hidden), f"{p}mlp.up_proj.weight": (ffn, hidden),
                f"{p}mlp.down_proj.weight": (hidden, ffn),
                f"{p}input_layernorm.weight": (hidden,), f"{p}post_attention_layernorm.weight": (hidden,)}
        for conv in ("attention_conv", "mlp_conv"):
            out |= {f"{p}{conv}.base_kernel": (2, DRAFT_CONV_TAPS, hidden),
                    f"{p}{conv}.kernel_projection.weight": (taps_out, hidden)}
    return out


def write_dflash2_draft(folder: Path, shapes: Shapes = TINY, seed: int = 1) -> Path:
    """A random-weight DFlash2 drafter for the checkpoint of ``shapes``: ``config.json`` and
    one ``model.safetensors`` (norm weights 1, the rest small and random), in bf16 whatever
    the target's dtype: MAX 26.7 pins the drafter's KV cache to bf16
    (``construct_dflash2_draft_kv_params``), so its projections must be bf16 too."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dflash2_draft_config(shapes), indent=1))
    rng = np.random.default_rng(seed)
    weights = {name: (np.ones(shape, np.float32) if name.endswith("norm.weight")
                      else rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(ml_dtypes.bfloat16)
               for name, shape in dflash2_draft_shapes(shapes).items()}
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def speculative_folder(folder: Path) -> Path:
    """The checkpoint as the speculative pipelines read it: a copy beside ``folder``. MAX 26.7
    caches a checkpoint's Hugging Face config per folder for the life of the process, and
    resolving a speculative config renames the cached config's architecture to the fused MTP
    one in place, so a plain pipeline read from the same folder afterwards would be built as
    the fused one (and fail on its first step)."""
    copy = folder.with_name(folder.name + "-mtp")
    if not copy.exists():
        shutil.copytree(folder, copy)
    return copy


def pipeline_config(folder: Path, drafts: int, device: str):  # noqa: ANN201 (MAX's PipelineConfig)
    """Resolved as ``max generate`` resolves its flags: ``from_args`` is where MAX swaps in the
    fused MTP architecture when speculation is asked for and the checkpoint has the head."""
    from max.pipelines import PipelineConfig
    from max.pipelines.lib.pipeline_args import PipelineArgs

    speculative = {"speculative_method": "mtp", "num_speculative_tokens": drafts} if drafts else None
    folder = speculative_folder(folder) if drafts else folder
    return PipelineConfig.from_args(PipelineArgs(
        model_path=str(folder), weight_path=[folder / "model.safetensors"], quantization_encoding="float32",
        max_length=256, device_specs=[{"device_type": device, "id": 0 if device == "gpu" else -1}],
        # No device-graph capture (as `max generate`): on a GPU MAX would otherwise capture
        # a device graph per batch size and verify width while it builds each pipeline.
        speculative=speculative, runtime={"max_batch_size": 4, "device_graph_capture": False},
        # Three pipelines, each in its own process, share the GPU at once: each takes a
        # tenth of it for its cache instead of MAX's default nine tenths.
        kv_cache={"device_memory_utilization": 0.1},
    ))


def dflash2_pipeline_config(folder: Path, draft: Path, device: str = "gpu",  # noqa: ANN201 (MAX's PipelineConfig)
                            state_pool_dtype: str | None = None, memory: float = 0.1,
                            runtime: dict[str, object] | None = None):
    """As ``max serve --speculative-method dflash2 --draft-model-path DRAFT`` resolves it:
    the bf16 checkpoint in ``folder`` (written with ``Shapes(dtype="bfloat16")``; MAX 26.7's
    drafter runs in bf16 on the target's embeddings) and the drafter of
    :func:`write_dflash2_draft`. A ``gpu`` device spec resolves without a GPU (MAX refuses
    bf16 on a CPU spec); the draft width comes from the drafter (``block_size - 1``).
    ``state_pool_dtype`` is ``--state-pool-dtype`` (MAX's default, None, is the weights'
    bf16), ``memory`` the KV cache's share of device memory, and ``runtime`` runtime
    settings added to the batch of 4 without device graph capture."""
    from max.pipelines import PipelineConfig
    from max.pipelines.lib.pipeline_args import PipelineArgs

    return PipelineConfig.from_args(PipelineArgs.from_flat_kwargs(
        model_path=str(folder), weight_path=[folder / "model.safetensors"], quantization_encoding="bfloat16",
        draft_model_path=str(draft), draft_quantization_encoding="bfloat16", max_length=256,
        device_specs=[{"device_type": device, "id": 0 if device == "gpu" else -1}],
        speculative={"speculative_method": "dflash2"},
        runtime={"max_batch_size": 4, "device_graph_capture": False, **(runtime or {})},
        kv_cache={"device_memory_utilization": memory, "state_pool_dtype": state_pool_dtype},
    ))


def architecture_of(folder: Path, drafts: int, device: str) -> str:
    """The architecture MAX's registry resolves for this checkpoint (no GPU needed)."""
    from max.pipelines.lib.registry import PIPELINE_REGISTRY

    arch = PIPELINE_REGISTRY.architecture_for_config(pipeline_config(folder, drafts, device))
    return arch.name if arch is not None else "none"


def greedy_tokens(folder: Path, drafts: int, device: str, prompts: list[list[int]], new_tokens: int,
                  patched: bool = False) -> np.ndarray:
    """Builds MAX's pipeline (under ``patched()`` if asked: the graph binds the op names
    while it is built) and decodes the prompts greedily.

    Qwen3.5 takes ``Qwen3VLTextAndVisionContext`` rows, which MAX's ``generate()`` refuses to
    build; the pipeline's own tokenizer builds them here, as ``max serve`` and ``max generate``
    do, and ``GenerateIterator.from_contexts`` steps them."""
    from max.pipelines.context import SamplingParams
    from max.pipelines.lib.generate import GenerateIterator
    from max.pipelines.lib.registry import PIPELINE_REGISTRY

    from gdfold_max.integrations import max_qwen3_5

    retrieved = PIPELINE_REGISTRY.retrieve_factory(pipeline_config(folder, drafts, device))
    contexts = asyncio.run(prompt_contexts(retrieved.tokenizer, prompts, SamplingParams(
        top_k=1, max_new_tokens=new_tokens, ignore_eos=True, seed=0)))
    with max_qwen3_5.patched() if patched else nullcontext():
        pipeline = retrieved.factory()
    with GenerateIterator.from_contexts(pipeline, contexts) as batch:
        while not batch.done:
            batch.step()
        sequences = batch.sequences
    rows = [list(row[len(prompt):]) for row, prompt in zip(sequences, prompts, strict=True)]
    if min(len(row) for row in rows) < new_tokens:
        raise SystemExit(f"a request ended early: {[len(row) for row in rows]} new tokens, {new_tokens} asked")
    # A speculative step can accept past the last token asked for; compare what was asked.
    return np.array([row[:new_tokens] for row in rows])


async def prompt_contexts(tokenizer, prompts: list[list[int]], sampling):  # noqa: ANN001, ANN201 (MAX's types)
    """One context per prompt of token ids, built by the pipeline's tokenizer."""
    from max.pipelines.modeling.types import RequestID, TextGenerationRequest

    return [await tokenizer.new_context(TextGenerationRequest(
        request_id=RequestID(), model_name="tiny-qwen3_5-mtp", prompt=prompt, sampling_params=sampling))
        for prompt in prompts]


#: The three decodings: name, speculative (with --drafts draft tokens) or plain, built
#: under ``patched()``.
DECODINGS = {"plain": (False, False), "speculative, MAX's fold": (True, False),
             "speculative, patched()": (True, True)}
TOKENS_LINE = "tokens: "


def example_prompts() -> list[list[int]]:
    """Three prompts of token ids, of 5, 6 and 7 tokens."""
    return [[int(t) for t in np.random.default_rng(b).integers(0, FIRST_SPECIAL, 5 + b)] for b in range(3)]


def decode_in_child(folder: Path, name: str, drafts: int, new_tokens: int) -> None:
    """One decoding, in a process started by ``decode_side_by_side``: prints its tokens as
    JSON on a line of their own."""
    started = time.perf_counter()
    speculative, under_patch = DECODINGS[name]
    tokens = greedy_tokens(folder, drafts if speculative else 0, "gpu", example_prompts(), new_tokens,
                           patched=under_patch)
    print(f"built and decoded in {time.perf_counter() - started:.0f} s", flush=True)
    print(TOKENS_LINE + json.dumps(tokens.tolist()), flush=True)


def echo_children(children: dict[str, subprocess.Popen], on_line: Callable[[str, str], None] | None = None
                  ) -> dict[str, int]:
    """Echoes the output of processes started with ``stdout=PIPE, text=True`` line by line
    as it comes, each line led by its process's name (and handed to ``on_line``), until
    all have ended; returns their exit statuses."""
    def echo(name: str, child: subprocess.Popen) -> None:
        assert child.stdout is not None
        for line in child.stdout:
            if on_line is not None:
                on_line(name, line)
            print(f"[{name}] {line}", end="", flush=True)

    readers = [threading.Thread(target=echo, args=item) for item in children.items()]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    return {name: child.wait() for name, child in children.items()}


def decode_side_by_side(folder: Path, drafts: int, new_tokens: int) -> dict[str, np.ndarray]:
    """Runs every decoding of DECODINGS in a process of its own, all at once; echoes their
    output line by line as it comes, each line led by its decoding's name."""
    speculative_folder(folder)  # made once here, not by two children at once
    children = {name: subprocess.Popen(
        [sys.executable, __file__, "--folder", str(folder), "--drafts", str(drafts), "--new-tokens",
         str(new_tokens), "--decode", name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name in DECODINGS}
    tokens: dict[str, np.ndarray] = {}

    def keep_tokens(name: str, line: str) -> None:
        if line.startswith(TOKENS_LINE):
            tokens[name] = np.array(json.loads(line[len(TOKENS_LINE):]))

    codes = echo_children(children, keep_tokens)
    failed = {name: code for name, code in codes.items() if code != 0 or name not in tokens}
    if failed:
        raise SystemExit(f"decodings that failed (name: exit status): {failed}")
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--decode", choices=list(DECODINGS), help=argparse.SUPPRESS)  # one decoding, in a child
    args = parser.parse_args()
    if args.decode:
        decode_in_child(args.folder, args.decode, args.drafts, args.new_tokens)
        return

    from max.driver import accelerator_count

    device = "gpu" if accelerator_count() > 0 else "cpu"
    with tempfile.TemporaryDirectory() as scratch:
        folder = write_checkpoint(args.folder or Path(scratch) / "tiny-qwen3_5-mtp")
        print(f"checkpoint: {folder}")
        print(f"plain: {architecture_of(folder, 0, device)}; speculative: "
              f"{architecture_of(folder, args.drafts, device)}")
        if device == "cpu":
            # Qwen3.5's layers allocate allreduce buffers on accelerators when a pipeline
            # is built, and MAX's speculative pipeline (OverlapTextGenerationPipeline)
            # refuses CPU devices: nothing past resolving the checkpoint runs here.
            print("no GPU: MAX builds Qwen3.5 pipelines on GPUs only; the checkpoint and the architecture"
                  " resolve, decoding needs a GPU")
            return
        started = time.perf_counter()
        runs = decode_side_by_side(folder, args.drafts, args.new_tokens)
        print(f"all three built and decoded in {time.perf_counter() - started:.0f} s")
        plain = runs.pop("plain")
        for name, tokens in runs.items():
            same = np.array_equal(tokens, plain)
            print(f"{name}: {'the same tokens as plain decoding' if same else 'tokens DIFFER from plain'}")
            if not same:
                raise SystemExit(f"{name}:\n{tokens}\nplain:\n{plain}")
        print(plain)


if __name__ == "__main__":
    main()
