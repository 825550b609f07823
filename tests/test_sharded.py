"""Tensor-parallel shards by heads: each shard's ops equal the unsharded ops on its heads,
bit for bit, and a graph over the devices (the CPU here; on a GPU machine the first GPU,
the second, and both) runs every device's verify with fold on load, or its fold then its
plain verify, against the reference."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
from max.driver import CPU, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType

from conftest import NEEDS_TWO_GPUS, assert_bits_equal
from gdfold_max import reference, runner_for
from gdfold_max.cases import WindowCase, random_fold_case, random_window_case, shard_window_case
from gdfold_max.eager.base import host_buffer
from gdfold_max.ops.kernels import kernels_path
from gdfold_max.sharded import (
    fold_shards,
    shard_heads,
    shard_pool,
    shard_ring,
    shard_window_inputs,
)

# K = V = 64, RING_LEN 4 and fp32: the eager verify graphs are the ones test_window_cpu_gpu
# compiles (heads are symbolic), so these tests compile no graph of their own.
K = V = 64


def window_case() -> WindowCase:
    # nv 8, nk 4 (G = 2): two shards of 2 key heads and 4 value heads each.
    return random_window_case(81, windows=[4, 0, 1, 6, 3], num_value_heads=8, num_key_heads=4, key_dim=K,
                              value_dim=V)


def test_shards_are_copies() -> None:
    """An in-place op on a shard must not write through to the whole pool or ring."""
    case = window_case()
    (whole,) = shard_heads(8, 4, 1)
    for cut, source in ((shard_pool, case.state), (shard_ring, case.ring)):
        part = cut(source, whole)
        assert not np.shares_memory(part, source)
    qkv, decay, beta = shard_window_inputs(*case.tokens(), whole, num_key_heads=4, key_dim=K, value_dim=V)
    assert not any(np.shares_memory(a, b) for a, b in zip((qkv, decay, beta), case.tokens(), strict=True))


def test_heads_split_evenly_with_their_groups() -> None:
    shards = shard_heads(num_value_heads=48, num_key_heads=16, num_shards=4)
    assert [s.key_heads for s in shards] == [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    assert [s.value_heads for s in shards] == [range(0, 12), range(12, 24), range(24, 36), range(36, 48)]
    for bad, match in (((48, 16, 3), "num_shards: 3 must divide num_key_heads=16"),
                       ((48, 16, 0), "num_shards: 0 must be at least 1"),
                       ((48, 5, 1), "num_key_heads: 5 must divide num_value_heads=48")):
        with pytest.raises(ValueError, match=match):
            shard_heads(*bad)


@pytest.mark.parametrize("fold_on_load", [False, True])
def test_each_shard_equals_the_unsharded_ops_on_its_heads(fold_on_load: bool) -> None:
    case = window_case()
    runner = runner_for("cpu")
    previous = ({"previous_ring_row_ids": case.previous_ring_row_ids,
                 "previous_num_accepted": case.previous_num_accepted} if fold_on_load else {})
    tables = (case.row_ids, case.ring_row_ids, case.input_row_offsets)
    whole, whole_pool, whole_ring = case.run_verify(reference.verify_ring, fold_on_load=fold_on_load)
    for shard in shard_heads(8, 4, 2):
        qkv, decay, beta, pool, ring = shard_window_case(case, shard)
        out = runner.verify_ring(qkv, decay, beta, pool, ring, *tables, **previous)
        columns = slice(shard.value_heads.start * V, shard.value_heads.stop * V)
        assert_bits_equal(out, whole[:, columns], f"shard {shard.index}: readout")
        assert_bits_equal(pool, shard_pool(whole_pool, shard), f"shard {shard.index}: pool")
        assert_bits_equal(ring, shard_ring(whole_ring, shard), f"shard {shard.index}: ring")


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sharded_step.py"


def run_example(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--steps", "2", *args])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    return capsys.readouterr().out


def test_example_graph_of_shards_on_the_cpu(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Two shards' verify with fold on load in one graph (they share the CPU and its
    counts), checked by the example against the reference on each shard's heads."""
    out = run_example(monkeypatch, capsys, "--cpu", "--shards", "2")
    assert out.count("2 shards, every shard bit-exact") == 2
    assert "every step matched" in out


def test_example_graph_of_shards_folding_then_verifying_on_the_cpu(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The same steps with every shard's fold, then its plain verify: the same bits."""
    out = run_example(monkeypatch, capsys, "--cpu", "--shards", "2", "--separate-fold")
    assert out.count("2 shards, every shard bit-exact") == 2
    assert "every step matched" in out


def test_example_refuses_gpus_that_are_not_there(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    beyond = str(accelerator_count())
    with pytest.raises(SystemExit, match=f"--first-gpu {beyond}: needs GPUs {beyond} to {beyond}"):
        run_example(monkeypatch, capsys, "--shards", "1", "--first-gpu", beyond)


@pytest.mark.gpu
@pytest.mark.parametrize("args", [
    pytest.param(("--shards", "1"), id="gpu0-fold-on-load"),
    pytest.param(("--shards", "1", "--separate-fold"), id="gpu0-separate-fold"),
    pytest.param(("--shards", "1", "--first-gpu", "1"), id="gpu1-fold-on-load", marks=NEEDS_TWO_GPUS),
    pytest.param(("--shards", "2"), id="gpu0-gpu1-fold-on-load", marks=NEEDS_TWO_GPUS),
    pytest.param(("--shards", "2", "--separate-fold"), id="gpu0-gpu1-separate-fold", marks=NEEDS_TWO_GPUS),
])
def test_example_graph_of_shards_on_gpus(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                         args: tuple[str, ...]) -> None:
    """Every shard bit-exact on its GPU: the first alone, the second alone, and two with
    the counts broadcast between them."""
    out = run_example(monkeypatch, capsys, *args)
    assert out.count("every shard bit-exact") == 2
    assert "every step matched" in out


def test_fold_of_two_shards_in_one_graph_matches_reference() -> None:
    case = random_fold_case(82, layers=2, batch=4, num_value_heads=8, num_key_heads=4, key_dim=K, value_dim=V)
    shards = shard_heads(8, 4, 2)
    pools = [shard_pool(case.state_in, s) for s in shards]
    rings = [shard_ring(case.ring, s) for s in shards]
    cpu = DeviceRef.CPU()
    f32, u32 = DType.float32, DType.uint32
    inputs = [BufferType(f32, list(p.shape), cpu) for p in pools] + [BufferType(f32, list(r.shape), cpu)
                                                                    for r in rings]
    inputs += [TensorType(u32, list(case.row_ids.shape), cpu), TensorType(u32, list(case.ring_row_ids.shape), cpu),
               TensorType(u32, list(case.num_accepted.shape), cpu)]
    with Graph("fold_two_shards", input_types=inputs, custom_extensions=[kernels_path()]) as graph:
        values = list(graph.inputs)
        rows, ring_rows, accepted = (v.tensor for v in values[4:])
        fold_shards([v.buffer for v in values[:2]], [v.buffer for v in values[2:4]], [rows] * 2, [ring_rows] * 2,
                    accepted)
        graph.output()
    model = InferenceSession(devices=[CPU()]).load(graph)
    model.execute(*(host_buffer(a) for a in (*pools, *rings, case.row_ids, case.ring_row_ids, case.num_accepted)))
    for shard, pool in zip(shards, pools, strict=True):
        assert_bits_equal(pool, shard_pool(case.state_out, shard), f"shard {shard.index}: pool")


def test_per_device_lists_must_agree() -> None:
    with Graph("bad_lists", input_types=[BufferType(DType.float32, [2, 2, K, V], DeviceRef.CPU())]) as graph:
        pool = graph.inputs[0].buffer
        with pytest.raises(ValueError, match=r"rings: 0 entries, but pools has 1 \(one per device\)"):
            fold_shards([pool], [], [], [], None)  # type: ignore[arg-type]
