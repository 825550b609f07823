"""gdfold_max: the speculative-decoding state fold for Gated DeltaNet, on MAX.

``state_fold`` puts the fold into a MAX graph; ``fold`` and ``StateFolder`` run it
eagerly on numpy arrays or MAX buffers. ``verify_ring`` (optionally folding the
previous step's records as it loads the state) and ``recurrence`` put the verify and
the forward into a graph; ``WindowRunner`` runs them eagerly. ``reference`` is the
numpy oracle and ``layout`` the ring record layout.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import layout, reference
from .eager import StateFolder, fold, folder_for
from .graph import FOLD_OP_NAME, kernels_path, state_fold
from .window_eager import WindowRunner, runner_for
from .window_graph import RECURRENCE_OP_NAME, VERIFY_FOLD_ON_LOAD_OP_NAME, VERIFY_OP_NAME, recurrence, verify_ring

try:
    __version__ = version("gdfold_max")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

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
]
