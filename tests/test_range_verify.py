"""The verify and the verify with fold on load over the supported range (range_matrix.RANGE), on the
CPU and on each GPU kernel path that has the point's gate, bit for bit against the
reference: readout, pool and ring."""

from __future__ import annotations

import pytest

from range_matrix import CPU_TARGET, GPU_TARGETS, check_window_op


@pytest.mark.parametrize("kind", ["verify", "fold_on_load"])
@pytest.mark.parametrize("target", [CPU_TARGET, *GPU_TARGETS])
def test_window_op(target: tuple[str, str], kind: str) -> None:
    check_window_op(*target, kind)
