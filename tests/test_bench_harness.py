"""The benchmark harness: rounds, ratios and JSON that any JSON reader accepts."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from max.dtype import DType

from gdfold_max.bench.harness import (
    Rounds,
    compile_together,
    measure_rounds,
    per_link_from,
    ratio,
    times,
    write_json,
)


@dataclass
class Row:
    name: str
    seconds: float
    spread: tuple[float, float]


def test_json_writes_null_for_what_was_not_measured(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    write_json([Row("a", 1.5, (1.0, float("nan"))), Row("b", float("nan"), (2.0, 3.0))], str(path))
    text = path.read_text()
    assert "NaN" not in text
    assert json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name))) == [
        {"name": "a", "seconds": 1.5, "spread": [1.0, None]},
        {"name": "b", "seconds": None, "spread": [2.0, 3.0]},
    ]


def test_rounds_time_every_variant_in_turn_and_keep_the_median() -> None:
    calls: list[str] = []
    clock = iter([4.0, 2.0, 6.0, 2.0, 5.0, 1.0])

    def timer(name: str) -> float:
        calls.append(name)
        return next(clock)

    rounds = measure_rounds(["ours", "fused"], 3, {"ours": lambda: timer("ours"), "fused": lambda: timer("fused")})
    assert calls == ["ours", "fused"] * 3
    assert rounds.median("ours") == 5.0 and rounds.median("fused") == 2.0
    assert rounds.ratio_range("ours", "fused") == (2.0, 5.0)
    assert all(math.isnan(x) for x in rounds.ratio_range("max", "fused"))
    assert math.isnan(Rounds({}).median("max"))


def test_ratio_and_its_text() -> None:
    assert ratio(3.0, 1.5) == 2.0
    assert math.isnan(ratio(float("nan"), 1.0)) and math.isnan(ratio(1.0, 0.0))
    assert times(2.0) == "2.00x" and times(float("nan")) == "-"


def test_compile_together_refuses_sets_of_two_sessions() -> None:
    """The graph sets compile in one pool of one session; sets of two sessions are refused
    before anything compiles."""
    first = SimpleNamespace(session=object(), chain=2)
    second = SimpleNamespace(session=object(), chain=2)
    with pytest.raises(ValueError, match="one session, got 2"):
        compile_together([(first, "max"), (second, "fused")], [DType.float32])


def test_per_link_differences_the_long_run_against_one_link() -> None:
    """(t_R - t_1) / (R - 1), never below zero; t_1 is timed before t_R."""
    asked: list[int] = []

    def time_of(links: int) -> float:
        asked.append(links)
        return 0.5 + 2.0 * links

    assert per_link_from(time_of, 3) == 2.0 and asked == [1, 3]
    assert per_link_from(lambda links: 5.0 - links, 4) == 0.0
