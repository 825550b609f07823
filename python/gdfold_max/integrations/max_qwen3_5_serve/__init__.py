"""gdfold_max's Qwen3.5 MTP architecture for ``max serve``.

    GDFOLD_MAX_QWEN3_5=fused max serve --model-path DIR --speculative-method mtp \\
        --custom-architectures gdfold_max.integrations.max_qwen3_5_serve

MAX 26.7 selects its ``UnifiedMTPQwen3_5ForConditionalGeneration`` for a Qwen3.5
checkpoint with an MTP head when ``--speculative-method mtp`` is given; this module
registers an architecture of that name, which replaces MAX's. The environment variable
``GDFOLD_MAX_QWEN3_5`` picks what it runs, read when the module is imported (by the API
process and again by the model worker it spawns, which inherits the environment):

* ``fused`` (the default): every Gated DeltaNet layer of the target runs our verify
  with fold on load (:class:`~gdfold_max.integrations.max_qwen3_5.FusedGatedDeltaNet`),
  and the step launches no rollback fold; see :mod:`.fused` and :mod:`.ring`.
* ``fold``: MAX's pipeline built under
  :func:`gdfold_max.integrations.max_qwen3_5.patched`: its rollback folds with
  :func:`gdfold_max.state_fold`.
* ``fold+verify``: the same with ``patched(verify=True)``: our verify and our fold,
  run as MAX runs its own. Its pools equal the fused mode's bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from max.engine import InferenceSession, Model
from max.pipelines.architectures.unified_mtp_qwen3_5.arch import unified_mtp_qwen3_5_arch
from max.pipelines.architectures.unified_mtp_qwen3_5.model import UnifiedMTPQwen3_5Model
from max.pipelines.lib import SupportedArchitecture

from .. import max_qwen3_5
from .fused import FusedMTPBatchProcessor, FusedMTPConfig, FusedMTPMemoryPlanner, FusedMTPModel

#: The environment variable that picks the mode.
ENV = "GDFOLD_MAX_QWEN3_5"
MODES = ("fused", "fold", "fold+verify")


def mode(environ: Mapping[str, str] | None = None) -> str:
    """The mode ``GDFOLD_MAX_QWEN3_5`` asks for (``fused`` when unset)."""
    value = (os.environ if environ is None else environ).get(ENV, "fused")
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


class PatchedMTPModel(UnifiedMTPQwen3_5Model):
    """MAX's MTP pipeline model, built and compiled under ``patched()``."""

    verify: bool = False

    def load_model(self, session: InferenceSession) -> Model:
        with max_qwen3_5.patched(verify=self.verify):
            return super().load_model(session)


class PatchedVerifyMTPModel(PatchedMTPModel):
    verify = True


def architectures(chosen: str) -> list[SupportedArchitecture]:
    """The architectures registered for a mode: MAX's MTP one, under its own name,
    with our model (and, fused, our config, batch processor and memory planner)."""
    if chosen not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {chosen!r}")
    changes: dict[str, Any]
    if chosen == "fused":
        changes = {"pipeline_model": FusedMTPModel, "config": FusedMTPConfig, "batching": FusedMTPBatchProcessor,
                   "memory_planner": FusedMTPMemoryPlanner}
    else:
        changes = {"pipeline_model": PatchedVerifyMTPModel if chosen == "fold+verify" else PatchedMTPModel}
    return [dataclasses.replace(unified_mtp_qwen3_5_arch, **changes)]


#: What ``--custom-architectures`` registers.
ARCHITECTURES = architectures(mode())

__all__ = ["ARCHITECTURES", "ENV", "MODES", "PatchedMTPModel", "PatchedVerifyMTPModel", "architectures", "mode"]
