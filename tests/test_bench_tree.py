"""The tree step benchmark on the CPU, at a tiny model: the variants asked for are the
ones compiled and timed, and a ratio to a variant left out is NaN."""

from __future__ import annotations

import math

import pytest
from max.driver import CPU
from rich.console import Console

from gdfold_max.bench.harness import FoldShape, ratio
from gdfold_max.bench.tree import TreeShape, check_tree_variants, run_tree_bench

TINY = FoldShape(num_layers=1, num_value_heads=2, num_key_heads=1, key_dim=8, value_dim=8)


def test_only_the_variants_asked_for_are_timed_and_ratios_to_others_are_nan() -> None:
    rows = run_tree_bench([TreeShape(4, 2)], [1], shape=TINY, repeats=1, console=Console(quiet=True), device=CPU(),
                          variants=("tree", "chain"))
    assert [row.variant for row in rows] == ["tree", "chain"]
    tree, chain = rows
    # A tiny model's per-link time on the CPU may be measured as 0 (the chained graphs'
    # difference): the ratio is then NaN, as ratio() gives it.
    assert tree.step_us >= 0 and chain.step_us >= 0
    want = ratio(tree.step_us, chain.step_us)
    assert (math.isnan(want) and math.isnan(tree.tree_over_chain)) or tree.tree_over_chain == pytest.approx(want)
    assert math.isnan(tree.tree_over_chain_latency) and math.isnan(tree.paths_over_tree)
    assert math.isnan(chain.tree_over_chain)


@pytest.mark.parametrize(("variants", "message"), [
    ((), "none given"),
    (("tree", "forest"), "'forest' is not one of"),
    (("paths", "paths"), "'paths' is given twice"),
])
def test_bad_variants_are_refused_by_name(variants: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=f"variants: .*{message}"):
        check_tree_variants(variants)
