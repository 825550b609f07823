"""gdfold_max: the speculative-decoding state fold for Gated DeltaNet, on MAX.

``state_fold`` puts the fold into a MAX graph; ``fold`` and ``StateFolder`` run it
eagerly on numpy arrays or MAX buffers; ``reference`` is the numpy oracle and
``layout`` the ring record layout.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import layout, reference
from .eager import StateFolder, fold, folder_for
from .graph import FOLD_OP_NAME, kernels_path, state_fold

try:
    __version__ = version("gdfold_max")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "FOLD_OP_NAME",
    "StateFolder",
    "__version__",
    "fold",
    "folder_for",
    "kernels_path",
    "layout",
    "reference",
    "state_fold",
]
