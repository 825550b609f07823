"""The edges of the supported range, each covered at least once, bit for bit against the
numpy reference, on the CPU and (marked ``gpu``) on the GPU: K = V = 8, K != V, K = 256,
RING_LEN 1 and 16, and three value heads per key head (Qwen3.5-27B's nv 48, nk 16).

Two shapes carry every edge, so that each compiles its graphs once:

* ``small``: K = V = 8, RING_LEN 1, nv 3 and nk 1 (G = 3);
* ``large``: K = 256, V = 128, RING_LEN 16, nv 3 and nk 1 (G = 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from conftest import WINDOW_TARGETS, assert_bits_equal
from gdfold_max import folder_for, reference, runner_for
from gdfold_max.cases import random_fold_case, random_window_case, spec_decode_case


@dataclass(frozen=True)
class Edge:
    key_dim: int
    value_dim: int
    ring_len: int
    num_value_heads: int = 3
    num_key_heads: int = 1


EDGES = {"small": Edge(8, 8, 1), "large": Edge(256, 128, 16)}
DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def shape_of(edge: Edge) -> dict[str, int]:
    return {"key_dim": edge.key_dim, "value_dim": edge.value_dim, "ring_len": edge.ring_len,
            "num_value_heads": edge.num_value_heads, "num_key_heads": edge.num_key_heads}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", EDGES)
def test_fold_matches_the_forward_and_the_reference(device: str, name: str) -> None:
    edge = EDGES[name]
    folder = folder_for(device)
    # Counts of nothing, one and a full ring of a real verify's records...
    counts = sorted({0, 1, edge.ring_len})
    case = spec_decode_case(21, layers=3, batch=len(counts), verify_width=edge.ring_len - 1, num_accepted=counts,
                            **shape_of(edge))
    state = case.state_in.copy()
    folder.fold(state, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted)
    assert_bits_equal(state, case.state_out)
    # ... and of random records, past the ring too (that request's rows stay as they are).
    case = random_fold_case(24, layers=3, num_accepted=[0, 1, edge.ring_len, edge.ring_len + 1], **shape_of(edge))
    state = case.state_in.copy()
    folder.fold(state, case.ring, case.row_ids, case.ring_row_ids, case.num_accepted)
    assert_bits_equal(state, case.state_out)


@pytest.mark.parametrize("target", WINDOW_TARGETS)
@pytest.mark.parametrize("name", EDGES)
def test_verify_with_and_without_fold_on_load_matches_reference(target: tuple[str, str], name: str) -> None:
    edge = EDGES[name]
    case = random_window_case(22, **shape_of(edge))
    runner = runner_for(*target)
    for previous in (True, False):
        got = case.run_verify(runner.verify_ring, fold_on_load=previous)
        want = case.run_verify(reference.verify_ring, fold_on_load=previous)
        what = "fold on load" if previous else "verify"
        for part, a, b in zip(("readout", "pool", "ring"), got, want, strict=True):
            assert_bits_equal(a, b, f"{what}: {part}")


@pytest.mark.parametrize("target", WINDOW_TARGETS)
@pytest.mark.parametrize("name", EDGES)
def test_forward_matches_reference(target: tuple[str, str], name: str) -> None:
    edge = EDGES[name]
    case = random_window_case(23, windows=[edge.ring_len + 3, 0, 1, 2], **shape_of(edge))
    got_pool = case.state.copy()
    got = runner_for(*target).recurrence(*case.tokens(), got_pool, case.row_ids, case.input_row_offsets)
    want_pool = case.state.copy()
    want = reference.recurrence_fwd(*case.tokens(), want_pool, case.row_ids, case.input_row_offsets,
                                    num_key_heads=case.num_key_heads)
    assert_bits_equal(got, want, "readout")
    assert_bits_equal(got_pool, want_pool, "pool")
    assert not np.array_equal(got_pool, case.state), "the forward left the pool as it was"
