"""The spec-decode example runs end to end on the CPU and checks itself every step."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "spec_decode_cycle.py"


def test_spec_decode_cycle(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--steps", "3", "--cpu"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("bit-exact") == 3
    assert "every step matched" in out
