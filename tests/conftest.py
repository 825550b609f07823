"""Shared fixtures: one compiled fold per static shape for the whole session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from max.driver import accelerator_count

from gdfold_max import StateFolder, folder_for, reference
from gdfold_max.cases import FoldCase, WindowCase
from gdfold_max.eager.window import WindowRunner

CONFORMANCE_DIR = Path(__file__).resolve().parents[1] / "tests" / "data"


#: Where the window ops run in tests: the CPU, and each of the GPU's two kernels, forced
#: (the op's automatic choice would give small test cases one kernel only).
WINDOW_TARGETS = [
    pytest.param(("cpu", "auto"), id="cpu"),
    pytest.param(("gpu", "latency"), id="gpu-latency", marks=pytest.mark.gpu),
    pytest.param(("gpu", "throughput"), id="gpu-throughput", marks=pytest.mark.gpu),
]


def has_accelerator() -> bool:
    return accelerator_count() > 0


#: For the cases of several devices: the GPU machine may hold only one.
NEEDS_TWO_GPUS = pytest.mark.skipif(accelerator_count() < 2, reason="needs two GPUs")


def pytest_configure(config: pytest.Config) -> None:
    # MAX compiles some of its Python bindings (Mojo sources, such as max.nn's KV-cache ops)
    # into site-packages the first time they are imported. In a fresh environment pytest-xdist's
    # workers import them all at once and race on the file ("file too short"); importing them
    # here first, in the process that starts the workers, builds them once.
    if not hasattr(config, "workerinput"):
        import max.nn  # noqa: F401

        _precompile_kernels_for_the_session(config)


def _precompile_kernels_for_the_session(config: pytest.Config) -> None:
    """On a CPU-only machine the session's graphs are built from the kernels precompiled
    once (``GDFOLD_MAX_KERNELS``, which the workers and the examples run in subprocesses
    inherit): MAX parses a source package again for every graph, about 5 s a graph on a
    CPU core. On a machine with an accelerator the sources are used, the route on which
    the GPU results were measured. A variable already set is left as it is."""
    import os
    import shutil
    import tempfile

    from gdfold_max.ops.kernels import KERNELS_ENV, precompile_kernels

    if os.environ.get(KERNELS_ENV) or has_accelerator():
        return
    folder = Path(tempfile.mkdtemp(prefix="gdfold-max-kernels-"))
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    os.environ[KERNELS_ENV] = str(precompile_kernels(folder / "gdfold_max_kernels.mojoc"))
    config.add_cleanup(lambda: os.environ.pop(KERNELS_ENV, None))


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


def assert_recurrence_matches_reference(runner: WindowRunner, case: WindowCase) -> None:
    """The forward over the case's windows against the reference, bit for bit."""
    state = case.state.copy()
    out = runner.recurrence(*case.tokens(), state, case.row_ids, case.input_row_offsets)
    want_state = case.state.copy()
    want = reference.recurrence(*case.tokens(), want_state, case.row_ids, case.input_row_offsets,
                                num_key_heads=case.num_key_heads)
    assert_bits_equal(out, want, "readout")
    assert_bits_equal(state, want_state, "pool")


def float64_channel_forward(qkv: np.ndarray, decay: np.ndarray, beta: np.ndarray, state: np.ndarray,
                    num_key_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """The per-channel recurrence of one request (state ``[nv, K, V]``) in float64, in numpy's
    own order: readout ``[T, nv*V]`` and final state."""
    nv, kd, vd = state.shape
    g = nv // num_key_heads
    s = state.astype(np.float64)
    out = []
    for t in range(qkv.shape[0]):
        row = qkv[t].astype(np.float64)
        q = np.repeat(row[: num_key_heads * kd].reshape(num_key_heads, kd), g, axis=0)
        k = np.repeat(row[num_key_heads * kd : 2 * num_key_heads * kd].reshape(num_key_heads, kd), g, axis=0)
        v = row[2 * num_key_heads * kd :].reshape(nv, vd)
        s = s * decay[t].astype(np.float64)[:, :, None]
        k_hat = k / np.sqrt((k * k).sum(1, keepdims=True) + reference.L2_EPS)
        q_hat = q / np.sqrt((q * q).sum(1, keepdims=True) + reference.L2_EPS) / np.sqrt(kd)
        kv = np.einsum("hij,hi->hj", s, k_hat)
        u = beta[t].astype(np.float64)[:, None] * (v - kv)
        s = s + k_hat[:, :, None] * u[:, None, :]
        out.append(np.einsum("hij,hi->hj", s, q_hat).reshape(-1))
    return np.stack(out), s
