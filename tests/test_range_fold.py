"""The fold over the supported range (range_matrix.RANGE; on the CPU one point a shape), bit for
bit against the reference: a real verify's records kept whole, in part and not at all,
every record of every request accepted, and counts of 0, 1, RING_LEN and RING_LEN + 1."""

from __future__ import annotations

import pytest

from range_matrix import DEVICES, differences, fold_call, fold_cases, range_on, run_many


@pytest.mark.parametrize("target", DEVICES)
def test_fold(target: tuple[str, str]) -> None:
    device, _ = target
    calls, names = [], []
    for point in range_on(device):
        for i, case in enumerate(fold_cases(point)):
            calls.append(fold_call(case, point.gate))
            names.append((point, i, case))
    failures = []
    for (point, i, case), (_, (pool, _)) in zip(names, run_many(device, f"range_fold_{device}", calls), strict=True):
        failures += differences(f"{point}, fold {i} (counts {case.num_accepted.tolist()})", pool, case.state_out)
    assert not failures, "\n".join(failures)
