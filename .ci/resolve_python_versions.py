"""Checks that the package's dependencies resolve to wheels for every Python minor
version that ``requires-python`` allows, not just the one CI runs on.

For each version pip resolves the dependencies of ``pyproject.toml`` for that
interpreter (``--python-version``, binary wheels only) without installing: PyPI serves
each wheel's metadata apart from the wheel, so nothing large is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]


def allowed_versions(requires: str) -> list[str]:
    spec = SpecifierSet(requires)
    return [f"3.{minor}" for minor in range(8, 30) if f"3.{minor}.0" in spec]


def main() -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    versions = allowed_versions(project["requires-python"])
    failed = []
    for version in versions:
        with tempfile.TemporaryDirectory() as target:
            result = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                 "--only-binary=:all:", "--python-version", version, "--target", target, *project["dependencies"]],
                capture_output=True, text=True)
        errors = [line for line in result.stderr.splitlines() if not line.startswith("WARNING")]
        print(f"Python {version}: {'resolves' if result.returncode == 0 else 'DOES NOT RESOLVE'}")
        if result.returncode != 0:
            print("\n".join(errors[-15:]))
            failed.append(version)
    if not versions:
        print(f"requires-python {project['requires-python']!r} allows no version")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
