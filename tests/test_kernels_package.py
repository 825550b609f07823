"""The kernel package a graph is built with: the sources, or a precompiled package that
``GDFOLD_MAX_KERNELS`` names, with the same bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gdfold_max import StateFolder
from gdfold_max.cases import random_fold_case
from gdfold_max.ops.kernels import KERNELS_ENV, kernel_sources, kernels_path, precompile_kernels


def test_without_the_variable_graphs_use_the_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert kernels_path() == kernel_sources()
    assert (kernel_sources() / "fold_ops.mojo").is_file()


def test_a_missing_package_is_refused_naming_the_variable_and_the_path(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.mojoc"
    monkeypatch.setenv(KERNELS_ENV, str(missing))
    with pytest.raises(FileNotFoundError, match=f"{KERNELS_ENV}='{missing}': no such Mojo package"):
        kernels_path()


def test_precompile_wants_a_mojoc_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"out: '.*kernels\.mojopkg' must end in \.mojoc"):
        precompile_kernels(tmp_path / "kernels.mojopkg")
    assert not (tmp_path / "kernels.mojopkg").exists()


def _fold_bits(monkeypatch: pytest.MonkeyPatch, package: Path | None) -> np.ndarray:
    if package is None:
        monkeypatch.delenv(KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(KERNELS_ENV, str(package))
    case = random_fold_case(71, batch=3, key_dim=16, value_dim=16)
    state, ring, row_ids, ring_row_ids, num_accepted = case.fold_operands()
    StateFolder("cpu").fold(state, ring, row_ids, ring_row_ids, num_accepted)
    assert np.array_equal(state.view(np.uint32), case.state_out.view(np.uint32))
    return state.view(np.uint32)


def test_a_precompiled_package_folds_the_bits_of_the_sources(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    """A fold built from a freshly precompiled package and one built from the sources
    (each a new folder, so each builds its own graph) give the reference's bits."""
    package = precompile_kernels(tmp_path / "kernels.mojoc")
    assert np.array_equal(_fold_bits(monkeypatch, package), _fold_bits(monkeypatch, None))
