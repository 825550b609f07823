"""Checks that the package's dependencies, with the extras the README installs
(``test`` and ``max-pipelines``), resolve to wheels for every Python minor version that
``requires-python`` allows, not just the one CI runs on.

For each version pip resolves the dependencies of ``pyproject.toml`` and its extras for
that interpreter (``--python-version``, binary wheels only) without installing: PyPI
serves each wheel's metadata apart from the wheel, so nothing large is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]

#: The extras of the README's install command, resolved with the base dependencies.
README_EXTRAS = ("test", "max-pipelines")


def allowed_versions(requires: str) -> list[str]:
    spec = SpecifierSet(requires)
    return [f"3.{minor}" for minor in range(8, 30) if f"3.{minor}.0" in spec]


def resolve(version: str, requirements: list[str]) -> subprocess.CompletedProcess[str]:
    """pip's dry-run resolution of ``requirements`` for Python ``version``."""
    with tempfile.TemporaryDirectory() as target:
        return subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
             "--only-binary=:all:", "--python-version", version, "--target", target, *requirements],
            capture_output=True, text=True)


def main() -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    versions = allowed_versions(project["requires-python"])
    if not versions:
        print(f"requires-python {project['requires-python']!r} allows no version")
        return 1
    extras = project["optional-dependencies"]
    requirements = [*project["dependencies"], *(r for name in README_EXTRAS for r in extras[name])]
    # The resolutions wait on the package index, not the CPU: run them side by side.
    with ThreadPoolExecutor(len(versions)) as pool:
        results = list(pool.map(lambda version: resolve(version, requirements), versions))
    failed = []
    for version, result in zip(versions, results, strict=True):
        outcome = "resolves" if result.returncode == 0 else "DOES NOT RESOLVE"
        print(f"Python {version}: the dependencies with extras {', '.join(README_EXTRAS)}: {outcome}")
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if not line.startswith("WARNING")]
            print("\n".join(errors[-15:]))
            failed.append(version)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
