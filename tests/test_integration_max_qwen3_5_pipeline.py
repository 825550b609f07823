"""MAX's full Qwen3.5 MTP pipeline from the tiny offline checkpoint of
``examples/max_qwen3_5_pipeline.py``: on the CPU, MAX's registry takes the checkpoint (the
fused MTP architecture when speculation is asked for) and MAX's Qwen3.5 modules
construct from it, and its tokenizer builds the rows; on a GPU, greedy decoding gives the
same tokens plain, speculative with MAX's fold, and speculative under ``patched()``."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("max.pipelines.architectures.unified_mtp_qwen3_5.state_rollback",
                    reason="MAX's pipelines need the max-pipelines extra")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "max_qwen3_5_pipeline.py"


@pytest.fixture(scope="module")
def example() -> dict:
    return runpy.run_path(str(EXAMPLE))


def test_the_checkpoint_resolves_to_max_s_mtp_architecture(example: dict, tmp_path: Path) -> None:
    folder = example["write_checkpoint"](tmp_path / "tiny")
    assert example["architecture_of"](folder, 0, "cpu") == "Qwen3_5ForConditionalGeneration"
    assert example["architecture_of"](folder, 3, "cpu") == "UnifiedMTPQwen3_5ForConditionalGeneration"
    # Still plain after a speculative config was resolved: MAX renames the architecture of
    # the config it caches per folder, so the speculative pipelines read a copy.
    assert example["architecture_of"](folder, 0, "cpu") == "Qwen3_5ForConditionalGeneration"


def adapted_checkpoint(example: dict, folder: Path, drafts: int) -> tuple[object, dict]:
    """The pipeline config MAX resolves for ``drafts`` and the checkpoint as that
    architecture's own weight adapter hands it to the model."""
    from max.graph.weights import WeightsFormat, load_weights
    from max.pipelines.lib.registry import PIPELINE_REGISTRY

    pipeline = example["pipeline_config"](folder, drafts, "cpu")
    adapter = PIPELINE_REGISTRY.architecture_for_config(pipeline).weight_adapters[WeightsFormat.safetensors]
    weights = load_weights([folder / "model.safetensors"])
    return pipeline, adapter(dict(weights.items()), huggingface_config=pipeline.model.huggingface_config,
                             pipeline_config=pipeline)


def test_the_checkpoint_builds_max_s_qwen3_5_and_mtp_modules(example: dict, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """MAX's plain and fused-MTP Qwen3.5 modules construct from the checkpoint's config, as
    the GPU pipelines construct them: constructing checks the config against the shapes
    (the rotary sections against the head width, the heads against the weights). Then
    MAX's own weight checks pass (every weight a graph declares is in the adapted
    checkpoint: the plain graph compiles the vision tower too) and the weights load into
    the modules, shapes checked. Each layer's ``Allreduce`` opens one accelerator per
    device at construction; with no GPU here it is given the CPU instead, which it would
    use only in a graph."""
    import max.nn.comm.allreduce as allreduce
    from max.driver import CPU
    from max.pipelines.architectures.qwen3_5.model import _check_weights_match as check_plain_weights
    from max.pipelines.architectures.qwen3_5.model_config import Qwen3_5Config
    from max.pipelines.architectures.qwen3_5.qwen3_5 import Qwen3_5
    from max.pipelines.architectures.unified_mtp_qwen3_5.model import _check_weights_match as check_mtp_weights
    from max.pipelines.architectures.unified_mtp_qwen3_5.unified_mtp_qwen3_5 import UnifiedMTPQwen3_5

    monkeypatch.setattr(allreduce, "Accelerator", lambda id: CPU())
    folder = example["write_checkpoint"](tmp_path / "tiny")
    for drafts, check in ((0, check_plain_weights), (3, check_mtp_weights)):
        pipeline, state = adapted_checkpoint(example, folder, drafts)
        config = Qwen3_5Config.initialize(pipeline, max_seq_len=256)
        config.finalize(huggingface_config=Qwen3_5Config._get_text_config(pipeline.model.huggingface_config),
                        state_dict=state, return_logits=None, norm_method="rms_norm", attention_bias=False)
        if drafts == 0:
            assert config.vision_config is not None
            model = Qwen3_5(config)
            assert len(model.linear_layer_indices) == example["LAYERS"] - 1
        else:
            # As MAX's fused MTP model readies the config: no subgraphs, no vision tower.
            config.use_subgraphs = False
            config.mrope_without_encoder = config.vision_config is not None
            config.vision_config = None
            assert pipeline.needs_bitmask_constraints and not pipeline.speculative.use_greedy_acceptance
            model = UnifiedMTPQwen3_5(config, speculative_config=pipeline.speculative, enable_structured_output=True)
        check(expected=set(model.raw_state_dict()), provided=set(state))
        model.load_state_dict(state, override_quantization_encoding=True, weight_alignment=1, strict=False)


def test_the_pipeline_s_tokenizer_builds_greedy_rows_from_token_ids(example: dict, tmp_path: Path) -> None:
    """The rows the example decodes: MAX's Qwen3.5 tokenizer (no GPU needed) turns token-id
    prompts into the vision-and-text contexts the pipeline takes, prompts unchanged, greedy,
    ignoring the end token, with room for the new tokens."""
    import asyncio

    from max.pipelines.context import SamplingParams
    from max.pipelines.lib.registry import PIPELINE_REGISTRY

    folder = example["write_checkpoint"](tmp_path / "tiny")
    retrieved = PIPELINE_REGISTRY.retrieve_factory(example["pipeline_config"](folder, 3, "cpu"))
    prompts = [[1, 2, 3], [7, 5, 9, 11]]
    contexts = asyncio.run(example["prompt_contexts"](
        retrieved.tokenizer, prompts, SamplingParams(top_k=1, max_new_tokens=5, ignore_eos=True, seed=0)))
    assert [type(c).__name__ for c in contexts] == ["Qwen3VLTextAndVisionContext"] * 2
    assert [[int(t) for t in c.tokens.prompt] for c in contexts] == prompts
    assert all(c.sampling_params.top_k == 1 and c.sampling_params.ignore_eos for c in contexts)
    assert [c.max_length for c in contexts] == [len(p) + 5 for p in prompts]
    assert len({c.request_id for c in contexts}) == 2


def test_a_decoding_that_fails_is_named_with_its_exit_status(example: dict, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The three decodings run in processes of their own; one that fails (here: each, since
    the folder holds no checkpoint) stops the example with its name and exit status, and
    its output reaches ours, each line led by its name."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stopped:
        example["decode_side_by_side"](tmp_path / "empty", 3, 4)
    echoed = capsys.readouterr().out
    for name in example["DECODINGS"]:
        assert f"{name!r}: 1" in str(stopped.value)
        assert f"[{name}] Traceback" in echoed


@pytest.mark.gpu
def test_plain_speculative_and_patched_decode_the_same_tokens() -> None:
    """The example as a user runs it, its output echoed line by line as it comes (the three
    decodings build side by side for minutes)."""
    child = subprocess.Popen([sys.executable, str(EXAMPLE), "--new-tokens", "12"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    assert child.stdout is not None
    lines = []
    for line in child.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    assert child.wait() == 0
    assert "".join(lines).count("the same tokens as plain decoding") == 2
