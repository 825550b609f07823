"""The README's Python examples run, so they cannot rot. (Docstring examples run as
doctests: pytest collects ``python/gdfold_max`` with ``--doctest-modules``.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {})
