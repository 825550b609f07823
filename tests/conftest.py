"""Shared fixtures: one compiled fold per static shape for the whole session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from max.driver import accelerator_count

from gdfold_max import StateFolder, folder_for
from gdfold_max.cases import FoldCase, WindowCase

CONFORMANCE_DIR = Path(__file__).resolve().parents[1] / "tests" / "data"


#: Where the window ops run in tests: the CPU, and each of the GPU's two kernels, forced
#: (the op's automatic choice would give small test cases the latency kernel only).
WINDOW_TARGETS = [
    pytest.param(("cpu", "auto"), id="cpu"),
    pytest.param(("gpu", "latency"), id="gpu-latency", marks=pytest.mark.gpu),
    pytest.param(("gpu", "throughput"), id="gpu-throughput", marks=pytest.mark.gpu),
]


def has_accelerator() -> bool:
    return accelerator_count() > 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_accelerator():
        return
    skip = pytest.mark.skip(reason="needs an accelerator")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cpu_folder() -> StateFolder:
    return folder_for("cpu")


@pytest.fixture(scope="session")
def gpu_folder() -> StateFolder:
    return folder_for("gpu")


def bits(array: np.ndarray) -> np.ndarray:
    """The raw bit pattern of a float32 or bfloat16 array, for exact comparison."""
    return np.asarray(array).view(np.uint16 if array.dtype.itemsize == 2 else np.uint32)


def folded(folder: StateFolder, case: FoldCase) -> np.ndarray:
    """A fresh copy of the case's pool, folded by ``folder``."""
    state, *rest = case.fold_operands()
    folder.fold(state, *rest)
    return state


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str = "pool") -> None:
    differ = bits(got) != bits(want)
    count = int(np.count_nonzero(differ))
    assert count == 0, f"{what}: {count} of {differ.size} elements differ in their bits"


def verify_step(verify: Callable[..., np.ndarray], case: WindowCase, *, fold_on_load: bool
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Readout, pool and ring after ``verify`` (ours or the reference) on fresh copies."""
    state, ring = case.fresh()
    previous = {}
    if fold_on_load:
        previous = {"previous_ring_row_ids": case.previous_ring_row_ids,
                    "previous_num_accepted": case.previous_num_accepted}
    out = verify(*case.tokens(), state, ring, case.row_ids, case.ring_row_ids, case.input_row_offsets, **previous)
    return out, state, ring
