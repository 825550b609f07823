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
from contextlib import nullcontext
from pathlib import Path

import ml_dtypes
import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to fetch

#: A small Qwen3.5: three Gated DeltaNet layers, then one full-attention layer, and a
#: one-layer MTP head. K = V = 128, as MAX's state kernels require.
HIDDEN, LAYERS, VOCAB, KEY_HEADS, VALUE_HEADS, HEAD_DIM, FFN = 256, 4, 512, 2, 4, 128, 512
ATTENTION_HEADS, KV_HEADS = 2, 1
#: Its vision tower, one block: never run on these text prompts, but the plain pipeline
#: compiles it and MAX refuses a checkpoint without its weights.
VISION_HIDDEN, VISION_FFN, PATCH, TEMPORAL_PATCH, MERGE, VISION_POSITIONS = 64, 128, 16, 2, 2, 64
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<think>", "</think>", "<|image_pad|>", "<|video_pad|>",
                  "<|vision_start|>", "<|vision_end|>", "<|im_end|>")
FIRST_SPECIAL = VOCAB - len(SPECIAL_TOKENS)


def special_id(token: str) -> int:
    return FIRST_SPECIAL + SPECIAL_TOKENS.index(token)


def hf_config() -> dict:
    """``config.json`` of a multimodal Qwen3.5 checkpoint, as the published ones are: the text
    config and a vision tower (which MAX's fused speculative graph leaves out)."""
    layer_types = ["linear_attention"] * (LAYERS - 1) + ["full_attention"]
    text = {
        "model_type": "qwen3_5_text", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": LAYERS, "layer_types": layer_types, "full_attention_interval": LAYERS,
        "num_attention_heads": ATTENTION_HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM,
        "linear_num_key_heads": KEY_HEADS, "linear_num_value_heads": VALUE_HEADS,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [6, 5, 5], "mrope_interleaved": True},
        "attn_output_gate": True, "mtp_num_hidden_layers": 1, "tie_word_embeddings": False,
        "eos_token_id": special_id("<|im_end|>"), "dtype": "float32",
    }
    vision = {
        "model_type": "qwen3_5", "depth": 1, "hidden_size": VISION_HIDDEN, "intermediate_size": VISION_FFN,
        "num_heads": 2, "in_channels": 3, "patch_size": PATCH, "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL_PATCH, "out_hidden_size": HIDDEN, "num_position_embeddings": VISION_POSITIONS,
        "deepstack_visual_indexes": [],
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text, "vision_config": vision, "tie_word_embeddings": False, "dtype": "float32",
        "image_token_id": special_id("<|image_pad|>"), "video_token_id": special_id("<|video_pad|>"),
        "vision_start_token_id": special_id("<|vision_start|>"),
        "vision_end_token_id": special_id("<|vision_end|>"),
    }


def weight_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, named as Qwen3.5's published checkpoints name them."""
    conv_dim = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM
    value_dim = VALUE_HEADS * HEAD_DIM

    def mlp(prefix: str) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}mlp.gate_proj.weight": (FFN, HIDDEN), f"{prefix}mlp.up_proj.weight": (FFN, HIDDEN),
                f"{prefix}mlp.down_proj.weight": (HIDDEN, FFN),
                f"{prefix}input_layernorm.weight": (HIDDEN,), f"{prefix}post_attention_layernorm.weight": (HIDDEN,)}

    def attention(prefix: str) -> dict[str, tuple[int, ...]]:
        # The query projection also yields the output gate (attn_output_gate).
        return {f"{prefix}self_attn.q_proj.weight": (2 * ATTENTION_HEADS * HEAD_DIM, HIDDEN),
                f"{prefix}self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                f"{prefix}self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                f"{prefix}self_attn.o_proj.weight": (HIDDEN, ATTENTION_HEADS * HEAD_DIM),
                f"{prefix}self_attn.q_norm.weight": (HEAD_DIM,), f"{prefix}self_attn.k_norm.weight": (HEAD_DIM,)}

    def gated_deltanet(prefix: str) -> dict[str, tuple[int, ...]]:
        p = f"{prefix}linear_attn."
        return {f"{p}in_proj_qkv.weight": (conv_dim, HIDDEN), f"{p}in_proj_z.weight": (value_dim, HIDDEN),
                f"{p}in_proj_b.weight": (VALUE_HEADS, HIDDEN), f"{p}in_proj_a.weight": (VALUE_HEADS, HIDDEN),
                f"{p}conv1d.weight": (conv_dim, 1, 4), f"{p}dt_bias": (VALUE_HEADS,), f"{p}A_log": (VALUE_HEADS,),
                f"{p}norm.weight": (HEAD_DIM,), f"{p}out_proj.weight": (HIDDEN, value_dim)}

    def vision_tower(p: str) -> dict[str, tuple[int, ...]]:
        # One block, the patch projection as a Conv3D, and the merger of MERGE x MERGE patches.
        merged = MERGE * MERGE * VISION_HIDDEN
        linear = {f"{p}blocks.0.attn.qkv": (3 * VISION_HIDDEN, VISION_HIDDEN),
                  f"{p}blocks.0.attn.proj": (VISION_HIDDEN, VISION_HIDDEN),
                  f"{p}blocks.0.mlp.linear_fc1": (VISION_FFN, VISION_HIDDEN),
                  f"{p}blocks.0.mlp.linear_fc2": (VISION_HIDDEN, VISION_FFN),
                  f"{p}merger.linear_fc1": (merged, merged), f"{p}merger.linear_fc2": (HIDDEN, merged),
                  f"{p}patch_embed.proj": (VISION_HIDDEN, 3, TEMPORAL_PATCH, PATCH, PATCH)}
        layer_norms = (f"{p}blocks.0.norm1", f"{p}blocks.0.norm2", f"{p}merger.norm")
        return ({f"{name}.weight": shape for name, shape in linear.items()}
                | {f"{name}.bias": (shape[0],) for name, shape in linear.items()}
                | {f"{name}.{part}": (VISION_HIDDEN,) for name in layer_norms for part in ("weight", "bias")}
                | {f"{p}pos_embed.weight": (VISION_POSITIONS, VISION_HIDDEN)})

    shapes: dict[str, tuple[int, ...]] = {
        "model.language_model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.language_model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN),
        "mtp.pre_fc_norm_embedding.weight": (HIDDEN,), "mtp.pre_fc_norm_hidden.weight": (HIDDEN,),
        "mtp.fc.weight": (HIDDEN, 2 * HIDDEN), "mtp.norm.weight": (HIDDEN,),
        **mlp("mtp.layers.0."), **attention("mtp.layers.0."),
    }
    for layer in range(LAYERS):
        prefix = f"model.language_model.layers.{layer}."
        shapes |= mlp(prefix)
        shapes |= gated_deltanet(prefix) if layer < LAYERS - 1 else attention(prefix)
    return shapes | vision_tower("model.visual.")


def random_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Small random weights; norms are Qwen3.5's (1 + w) RMS norms at w = 0, except the
    Gated DeltaNet output norm, which scales by w; decays between exp(-1) and exp(-16); the
    vision tower's layer norms are the identity and its biases zero."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes().items():
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
    return {name: w.astype(ml_dtypes.bfloat16) if name.startswith("model.visual.") else w
            for name, w in weights.items()}


def write_checkpoint(folder: Path) -> Path:
    """The config, the weights and a word-level tokenizer whose special tokens are the ones
    MAX's Qwen3.5 tokenizer looks up (``<think>``, ``</think>``, the vision markers)."""
    from safetensors.numpy import save_file
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(), indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": special_id("<|im_end|>")}))
    save_file(random_weights(), str(folder / "model.safetensors"))
    vocab = {f"w{i}": i for i in range(FIRST_SPECIAL)} | {t: special_id(t) for t in SPECIAL_TOKENS}
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


def decode_side_by_side(folder: Path, drafts: int, new_tokens: int) -> dict[str, np.ndarray]:
    """Runs every decoding of DECODINGS in a process of its own, all at once; echoes their
    output line by line as it comes, each line led by its decoding's name."""
    speculative_folder(folder)  # made once here, not by two children at once
    children = {name: subprocess.Popen(
        [sys.executable, __file__, "--folder", str(folder), "--drafts", str(drafts), "--new-tokens",
         str(new_tokens), "--decode", name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name in DECODINGS}
    tokens: dict[str, np.ndarray] = {}

    def echo(name: str, child: subprocess.Popen) -> None:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(TOKENS_LINE):
                tokens[name] = np.array(json.loads(line[len(TOKENS_LINE):]))
            print(f"[{name}] {line}", end="", flush=True)

    readers = [threading.Thread(target=echo, args=item) for item in children.items()]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    codes = {name: child.wait() for name, child in children.items()}
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
