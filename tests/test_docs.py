"""The Python examples of the README and of docs/ run, so they cannot rot. (Docstring
examples run as doctests: pytest collects ``python/gdfold_max`` with ``--doctest-modules``.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page.relative_to(ROOT), i, block) for page in PAGES
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))]


def test_readme_has_examples_and_stays_short() -> None:
    assert sum(page == README.relative_to(ROOT) for page, _, _ in BLOCKS) >= 2
    assert len(README.read_text().splitlines()) <= 200


@pytest.mark.parametrize(("page", "index", "block"), BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_example_runs(page: Path, index: int, block: str) -> None:
    exec(compile(block, f"{page} python block {index}", "exec"), {})
