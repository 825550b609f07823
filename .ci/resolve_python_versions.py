"""Checks that the package's dependencies, with the extras the README installs
(``test`` and ``max-pipelines``), resolve to wheels for every Python minor version that
``requires-python`` allows, not just the one CI runs on.

For each version uv resolves ``pyproject.toml`` with those extras for that interpreter on
x86-64 Linux (``uv pip compile --python-version``, binary wheels only) without installing.
uv reads each wheel's metadata alone (the index's metadata file, or the wheel's central
directory by range requests), where pip's dry run downloads every wheel whole: about 250 MB
a version for MAX and its compiler, which a slow or small CI machine could not hold four
times over.
"""

from __future__ import annotations

import os
import shutil
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
#: MAX publishes Linux wheels for glibc 2.34 and newer.
PLATFORM = "x86_64-manylinux_2_34"


def allowed_versions(requires: str) -> list[str]:
    spec = SpecifierSet(requires)
    return [f"3.{minor}" for minor in range(8, 30) if f"3.{minor}.0" in spec]


def resolve(uv: str, version: str) -> subprocess.CompletedProcess[str]:
    """uv's resolution of the project with README_EXTRAS for Python ``version``."""
    extras = [arg for extra in README_EXTRAS for arg in ("--extra", extra)]
    with tempfile.TemporaryDirectory() as cache:
        return subprocess.run(
            [uv, "pip", "compile", str(ROOT / "pyproject.toml"), *extras, "--python-version", version,
             "--python-platform", PLATFORM, "--only-binary", ":all:", "--no-header", "--quiet",
             "--output-file", os.devnull],
            capture_output=True, text=True, env={**os.environ, "UV_CACHE_DIR": cache})


def main() -> int:
    uv = shutil.which("uv")
    if uv is None:
        print("uv is not on PATH: .ci/run installs it")
        return 1
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    versions = allowed_versions(project["requires-python"])
    if not versions:
        print(f"requires-python {project['requires-python']!r} allows no version")
        return 1
    # The resolutions wait on the package index, not the CPU: run them side by side.
    with ThreadPoolExecutor(len(versions)) as pool:
        results = list(pool.map(lambda version: resolve(uv, version), versions))
    failed = []
    for version, result in zip(versions, results, strict=True):
        outcome = "resolves" if result.returncode == 0 else "DOES NOT RESOLVE"
        print(f"Python {version}: the dependencies with extras {', '.join(README_EXTRAS)}: {outcome}")
        if result.returncode != 0:
            print("\n".join(result.stderr.splitlines()[-15:]))
            failed.append(version)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
