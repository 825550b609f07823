"""The sharded step benchmark (``gdfold-max bench-shards``): its graphs build and run on
the CPU (two shards sharing it, no broadcast) and on one GPU, and on two GPUs where there
are two; bad shard counts are refused before anything compiles."""

from __future__ import annotations

import math

import pytest
from max.driver import CPU, Accelerator
from max.dtype import DType
from max.engine import InferenceSession
from typer.testing import CliRunner

from conftest import NEEDS_TWO_GPUS
from gdfold_max.bench.harness import FoldShape
from gdfold_max.bench.shards import ShardedSteps, run_shard_bench, shard_shape
from gdfold_max.cli import app

TINY = FoldShape(num_layers=1, num_value_heads=4, num_key_heads=2, key_dim=32, value_dim=32)


def test_a_shard_holds_its_share_of_the_heads() -> None:
    half = shard_shape(FoldShape(), 2)
    assert (half.num_value_heads, half.num_key_heads, half.key_dim) == (16, 8, 128)
    with pytest.raises(ValueError, match="num_shards: 3 does not divide the 16 key heads"):
        shard_shape(FoldShape(), 3)


@pytest.mark.parametrize("shards", ["3", "0"])
def test_the_command_refuses_shards_that_do_not_split_the_heads(shards: str) -> None:
    result = CliRunner().invoke(app, ["bench-shards", "--device", "cpu", "--shards", shards])
    assert result.exit_code == 2 and "--shards" in result.output


def check_rows(rows: list, shards: int) -> None:
    assert [(r.shards, r.state_dtype, r.batch) for r in rows] == [(shards, "float32", 2)]
    assert rows[0].shards_us >= 0 and rows[0].one_us >= 0
    if rows[0].shards_us > 0:
        assert math.isclose(rows[0].one_over_shards, rows[0].one_us / rows[0].shards_us)


def test_on_one_device_one_shard_runs_on_the_every_shard_graphs() -> None:
    """On one device ``one`` and ``shards`` are the same graph, compiled once (two graphs,
    one step and two chained, not four); on several they differ."""
    session = InferenceSession(devices=[CPU()])
    assert ShardedSteps(session, [CPU()], TINY, 2).serving("one") == "shards"
    assert ShardedSteps(session, [CPU(), CPU()], TINY, 2).serving("one") == "one"


def test_one_shard_on_the_cpu() -> None:
    """The benchmark end to end on the CPU (several shards' graphs run on the CPU in
    tests/test_sharded.py)."""
    check_rows(run_shard_bench([CPU()], [2], [DType.float32], shape=TINY, chain=2, repeats=1), 1)


@pytest.mark.gpu
def test_one_shard_on_a_gpu() -> None:
    check_rows(run_shard_bench([Accelerator(0)], [2], [DType.float32], shape=TINY, chain=2, repeats=1), 1)


@pytest.mark.gpu
@NEEDS_TWO_GPUS
def test_two_shards_on_two_gpus_broadcast_the_counts() -> None:
    check_rows(run_shard_bench([Accelerator(0), Accelerator(1)], [2], [DType.float32], shape=TINY, chain=2,
                               repeats=1), 2)
