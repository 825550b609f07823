"""The Mojo kernel package, and the names its ops are registered under.

A graph that calls an op of ``gdfold_max.ops`` must be built with
``custom_extensions=[kernels_path()]``. The names below are the ones the Mojo sources
register (``@extensibility.register`` in ``mojo/``): this is the one table of them on
the Python side. This module needs no MAX.

>>> import re
>>> registered = {name for source in kernel_sources().glob("*.mojo")
...               for name in re.findall(r'@extensibility\\.register\\("(\\w+)"\\)', source.read_text())}
>>> sorted(registered) == sorted(REGISTERED_OPS)
True
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

#: Names a Mojo package to build our graphs with in place of the sources: a ``.mojoc``
#: from :func:`precompile_kernels` (or a source folder). MAX parses a source package
#: again for every graph it builds (about 5 s on a CPU core); a precompiled one it reads.
KERNELS_ENV = "GDFOLD_MAX_KERNELS"

#: The name our fold op is registered under (MAX's own is ``gated_delta_state_fold``).
FOLD_OP_NAME = "gdfold_state_fold"
#: The fold with per-channel gates (records with K decays per value head).
FOLD_CHANNEL_OP_NAME = "gdfold_state_fold_channel"
#: The folds along an accepted path of a token tree (an ``accepted_nodes`` table beside
#: ``num_accepted``), head and per-channel gates.
FOLD_PATH_OP_NAME = "gdfold_state_fold_path"
FOLD_PATH_CHANNEL_OP_NAME = "gdfold_state_fold_path_channel"
VERIFY_OP_NAME = "gdfold_verify_ring"
VERIFY_FOLD_ON_LOAD_OP_NAME = "gdfold_verify_ring_fold_on_load"
RECURRENCE_OP_NAME = "gdfold_recurrence"
#: The verify with fold on load, or at a verify width of 0 (MAX's operand, read on the
#: host as the op runs) the fold and then the forward; head gates.
VERIFY_OR_FORWARD_OP_NAME = "gdfold_verify_or_forward"
#: The tree verify (a ``parents`` table: each window a token tree), with and without fold
#: on load of the previous accepted path; on a GPU, the latency kernel.
VERIFY_TREE_OP_NAME = "gdfold_verify_tree"
VERIFY_TREE_FOLD_ON_LOAD_OP_NAME = "gdfold_verify_tree_fold_on_load"
#: The window ops with per-channel gates (a ``[T, nv, K]`` decay) are these names plus this.
CHANNEL_OP_SUFFIX = "_channel"

#: Every op the kernel package registers.
REGISTERED_OPS = (
    FOLD_OP_NAME,
    FOLD_CHANNEL_OP_NAME,
    FOLD_PATH_OP_NAME,
    FOLD_PATH_CHANNEL_OP_NAME,
    VERIFY_OR_FORWARD_OP_NAME,
    *(name + suffix for name in (VERIFY_OP_NAME, VERIFY_FOLD_ON_LOAD_OP_NAME, RECURRENCE_OP_NAME,
                                 VERIFY_TREE_OP_NAME, VERIFY_TREE_FOLD_ON_LOAD_OP_NAME)
      for suffix in ("", CHANNEL_OP_SUFFIX)),
)


def kernel_sources() -> Path:
    """The folder of the Mojo kernel sources.

    >>> (kernel_sources() / "fold_ops.mojo").is_file()
    True
    """
    installed = Path(str(resources.files("gdfold_max"))) / "mojo"
    if installed.is_dir():
        return installed
    # An editable install or a source checkout: the sources sit at the repository root
    # (this file is python/gdfold_max/ops/kernels.py).
    return Path(__file__).resolve().parents[3] / "mojo"


def kernels_path() -> Path:
    """The Mojo package to pass to ``Graph(..., custom_extensions=[...])``: the package
    ``$GDFOLD_MAX_KERNELS`` names, else the sources (:func:`kernel_sources`).

    Raises:
        FileNotFoundError: naming the variable and its value, when that path does not exist.
    """
    named = os.environ.get(KERNELS_ENV)
    if not named:
        return kernel_sources()
    path = Path(named)
    if not path.exists():
        raise FileNotFoundError(f"{KERNELS_ENV}={named!r}: no such Mojo package")
    return path


def mojo_compiler() -> str | None:
    """The ``mojo`` compiler installed beside this Python (MAX's), else the one on PATH."""
    beside = Path(sys.executable).with_name("mojo")
    return str(beside) if beside.exists() else shutil.which("mojo")


def precompile_kernels(out: Path) -> Path:
    """Precompiles the kernel sources into the package ``out`` (``.mojoc``) with the
    ``mojo`` compiler installed beside this Python (MAX's), and returns ``out``. Graphs
    built with it (``GDFOLD_MAX_KERNELS=out``) skip the parse of the sources.

    Raises:
        ValueError: when ``out`` does not end in ``.mojoc``.
        FileNotFoundError: when no ``mojo`` compiler is found.
        RuntimeError: with the compiler's message, when it fails.
    """
    out = Path(out)
    if out.suffix != ".mojoc":
        raise ValueError(f"out: {str(out)!r} must end in .mojoc")
    mojo = mojo_compiler()
    if mojo is None:
        raise FileNotFoundError("no `mojo` compiler beside this Python or on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([mojo, "precompile", str(kernel_sources()), "-o", str(out)], capture_output=True,
                         text=True)
    if run.returncode != 0 or not out.is_file():
        raise RuntimeError(f"mojo precompile failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    return out
