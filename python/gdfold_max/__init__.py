"""gdfold_max: the speculative-decoding state toolkit for Gated DeltaNet, on MAX.

``state_fold`` puts the fold into a MAX graph; ``fold`` and ``StateFolder`` run it
eagerly on numpy arrays or MAX buffers. ``verify_ring`` (optionally folding the
previous step's records as it loads the state) and ``recurrence`` put the verify and
the forward into a graph, ``verify_tree`` the verify of token trees (on a GPU, on the
latency kernel or the throughput kernel's blocks); ``WindowRunner`` runs them eagerly. ``reference`` is the
numpy oracle, ``layout`` the ring record layout and ``cases`` the recorded-case format.

Importing the package does not import MAX: ``reference``, ``layout`` and ``cases`` need
only numpy and ml_dtypes, so a numpy conformance test can use them where MAX is not
installed. The names that need MAX import it on first use.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from . import layout, reference

if TYPE_CHECKING:
    from .eager.fold import StateFolder, fold, folder_for
    from .eager.window import WindowRunner, runner_for
    from .ops.fold import state_fold
    from .ops.kernels import FOLD_OP_NAME, RECURRENCE_OP_NAME, VERIFY_FOLD_ON_LOAD_OP_NAME, VERIFY_OP_NAME, kernels_path
    from .ops.window import recurrence, verify_or_forward, verify_ring, verify_tree

try:
    __version__ = version("gdfold_max")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

#: The names imported on first use, and the module that defines each (all of them need
#: MAX but ``ops.kernels``, the kernel package's path and op names).
_LAZY = {
    "StateFolder": "eager.fold",
    "fold": "eager.fold",
    "folder_for": "eager.fold",
    "FOLD_OP_NAME": "ops.kernels",
    "RECURRENCE_OP_NAME": "ops.kernels",
    "VERIFY_FOLD_ON_LOAD_OP_NAME": "ops.kernels",
    "VERIFY_OP_NAME": "ops.kernels",
    "kernels_path": "ops.kernels",
    "state_fold": "ops.fold",
    "recurrence": "ops.window",
    "verify_ring": "ops.window",
    "verify_tree": "ops.window",
    "verify_or_forward": "ops.window",
    "WindowRunner": "eager.window",
    "runner_for": "eager.window",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "FOLD_OP_NAME",
    "RECURRENCE_OP_NAME",
    "VERIFY_FOLD_ON_LOAD_OP_NAME",
    "VERIFY_OP_NAME",
    "StateFolder",
    "WindowRunner",
    "__version__",
    "fold",
    "folder_for",
    "kernels_path",
    "layout",
    "recurrence",
    "reference",
    "runner_for",
    "state_fold",
    "verify_ring",
    "verify_tree",
    "verify_or_forward",
]
