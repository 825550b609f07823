"""The tree verify with fold on load of a previous accepted path over the supported range
(range_matrix.RANGE), on the CPU and on the GPU (whose tree verify runs on the latency
kernel, whatever the path, with one warp a unit and with leaves shared among four), bit
for bit against the reference: readout, pool and ring."""

from __future__ import annotations

import pytest

from range_matrix import check_tree_op


@pytest.mark.parametrize(("device", "leaf_warps"), [
    ("cpu", 1), pytest.param("gpu", 1, marks=pytest.mark.gpu), pytest.param("gpu", 4, marks=pytest.mark.gpu)])
def test_tree_op(device: str, leaf_warps: int) -> None:
    check_tree_op(device, leaf_warps)
