"""The wheel holds every Python package of the source tree: setuptools installs only the
packages pyproject.toml lists, and a package left out imports in a checkout (an editable
install) but not from the wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package_of_the_source_tree() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    source = ROOT / "python"
    in_tree = {".".join(init.parent.relative_to(source).parts) for init in source.rglob("__init__.py")}
    listed = set(setuptools["packages"]) - {"gdfold_max.mojo"}
    assert listed == in_tree, f"listed only: {sorted(listed - in_tree)}; in the tree only: {sorted(in_tree - listed)}"
    assert setuptools["package-dir"]["gdfold_max.mojo"] == "mojo"
