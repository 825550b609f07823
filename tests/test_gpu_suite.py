"""The GPU suite's groups (``tests/gpu_suite.py``) hold every test file with GPU tests, once."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

from gpu_suite import GROUPS, command

TESTS = Path(__file__).resolve().parent


def files_with_gpu_tests() -> set[str]:
    """The test files that hold a test marked ``gpu``, as pytest collects them."""
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
         "-o", "addopts=", "-p", "no:xdist", str(TESTS)],
        capture_output=True, text=True, cwd=TESTS.parent, check=False)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    return {line.split("::")[0].rsplit("/", 1)[-1] for line in collected.stdout.splitlines() if "::" in line}


def test_every_file_with_gpu_tests_is_in_one_group() -> None:
    grouped = Counter(name for files, _ in GROUPS.values() for name in files)
    assert [name for name, n in grouped.items() if n > 1] == []
    with_gpu_tests = files_with_gpu_tests()
    assert "test_fold_gpu.py" in with_gpu_tests and "test_range_verify.py" in with_gpu_tests
    assert sorted(with_gpu_tests - set(grouped)) == []
    assert sorted(set(grouped) - {p.name for p in TESTS.glob("test_*.py")}) == []


def test_a_group_names_every_test_and_selects_gpu_tests() -> None:
    argv = command("range", 4)
    options = argv[argv.index("pytest") + 1 :]
    assert options[options.index("-m") + 1] == "gpu" and "-rA" in options and "-v" in options
    files = [f"tests/test_range_{op}.py" for op in ("fold", "verify", "forward", "tree")]
    assert argv[argv.index("--dist") + 1] == "load" and argv[-4:] == files
