"""MAX's full Qwen3.5 MTP pipeline from the tiny offline checkpoint of
``examples/max_qwen3_5_pipeline.py``: on the CPU, MAX's registry takes the checkpoint (the
fused MTP architecture when speculation is asked for); on a GPU, greedy decoding gives the
same tokens plain, speculative with MAX's fold, and speculative under ``patched()``."""

from __future__ import annotations

import runpy
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


@pytest.mark.gpu
def test_plain_speculative_and_patched_decode_the_same_tokens(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--new-tokens", "12"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    print(out)
    assert out.count("the same tokens as plain decoding") == 2
