"""The spec-decode example runs end to end on the CPU and checks itself every step."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "spec_decode_cycle.py"
TREE_EXAMPLE = EXAMPLE.with_name("tree_decode_cycle.py")


def test_spec_decode_cycle(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--steps", "3", "--cpu"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("bit-exact") == 3
    assert "every step matched" in out


def test_tree_decode_cycle(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Random trees, random accepted paths (some empty), every step bit-exact, and the
    fold along the last paths flushes the pool to the forward."""
    monkeypatch.setattr(sys, "argv", [str(TREE_EXAMPLE), "--steps", "3", "--cpu"])
    runpy.run_path(str(TREE_EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("bit-exact") == 3
    assert "every step matched the forward along the accepted paths" in out
