"""The GPU suite's groups (``tests/gpu_suite.py``) hold every test file with GPU tests, once."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from gpu_suite import GROUPS, command

TESTS = Path(__file__).resolve().parent
#: A file has GPU tests where it marks them, or names a GPU target of the shared lists.
GPU_MARK = re.compile(r"pytest\.mark\.gpu|marks=pytest\.mark\.gpu|WINDOW_TARGETS|NEEDS_TWO_GPUS")


def test_every_file_with_gpu_tests_is_in_one_group() -> None:
    grouped = Counter(name for files, _ in GROUPS.values() for name in files)
    assert [name for name, n in grouped.items() if n > 1] == []
    with_gpu_tests = {p.name for p in TESTS.glob("test_*.py")
                      if p.name != Path(__file__).name and GPU_MARK.search(p.read_text())}
    assert sorted(with_gpu_tests - set(grouped)) == []
    assert sorted(set(grouped) - {p.name for p in TESTS.glob("test_*.py")}) == []


def test_a_group_names_every_test_and_selects_gpu_tests() -> None:
    argv = command("range", 4)
    options = argv[argv.index("pytest") + 1 :]
    assert options[options.index("-m") + 1] == "gpu" and "-rA" in options
    assert argv[argv.index("--dist") + 1] == "load" and argv[-1] == "tests/test_supported_range.py"
