"""gdfold_max's Qwen3.5 speculative architectures for ``max serve``: MTP and DFlash2.

    GDFOLD_MAX_QWEN3_5=fused max serve --model-path DIR --speculative-method mtp \\
        --custom-architectures gdfold_max.integrations.max_qwen3_5_serve

MAX 26.7 selects its ``UnifiedMTPQwen3_5ForConditionalGeneration`` for a Qwen3.5
checkpoint with an MTP head when ``--speculative-method mtp`` is given, and its
``UnifiedDflash2Qwen3_5ForConditionalGeneration`` for a Qwen3.5 target with
``--speculative-method dflash2 --draft-model-path DRAFT`` (a ``DFlash2DraftModel``
checkpoint); this module registers an architecture of each name, which replaces MAX's
(:mod:`.dflash2` for the DFlash2 one). The environment variable
``GDFOLD_MAX_QWEN3_5`` picks what it runs, read when the module is imported (by the API
process and again by the model worker it spawns, which inherits the environment):

* ``fused`` (the default): every Gated DeltaNet layer of the target runs our verify
  with fold on load (:class:`~gdfold_max.integrations.max_qwen3_5.FusedGatedDeltaNet`),
  and the step launches no rollback fold; see :mod:`.fused` and :mod:`.ring`. With
  DFlash2 it is not validated, and loads only with ``GDFOLD_MAX_QWEN3_5_DFLASH2=unvalidated``
  (:mod:`.dflash2`).
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
from max.pipelines.architectures.unified_dflash2_qwen3_5.arch import unified_dflash2_qwen3_5_arch
from max.pipelines.architectures.unified_dflash2_qwen3_5.model import UnifiedDflash2Qwen3_5Model
from max.pipelines.architectures.unified_mtp_qwen3_5.arch import unified_mtp_qwen3_5_arch
from max.pipelines.architectures.unified_mtp_qwen3_5.model import UnifiedMTPQwen3_5Model
from max.pipelines.lib import SupportedArchitecture

from .. import max_qwen3_5
from .dflash2 import FusedDflash2Config, FusedDflash2MemoryPlanner, FusedDflash2Model
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


class PatchedBuild:
    """Mixed in before a MAX pipeline model: built and compiled under ``patched()``
    (``patched(verify=True)`` where ``verify``)."""

    verify: bool = False

    def load_model(self, session: InferenceSession) -> Model:
        with max_qwen3_5.patched(verify=self.verify):
            return super().load_model(session)  # type: ignore[misc]


class PatchedMTPModel(PatchedBuild, UnifiedMTPQwen3_5Model):
    """MAX's MTP pipeline model, built and compiled under ``patched()``."""


class PatchedVerifyMTPModel(PatchedMTPModel):
    verify = True


class PatchedDflash2Model(PatchedBuild, UnifiedDflash2Qwen3_5Model):
    """MAX's DFlash2 pipeline model, built and compiled under ``patched()``: its target
    rolls back through the same ``fold_state_pools`` and its Gated DeltaNet layers are
    MAX's Qwen3.5 ones, so the same names are routed."""


class PatchedVerifyDflash2Model(PatchedDflash2Model):
    verify = True


def architectures(chosen: str) -> list[SupportedArchitecture]:
    """The architectures registered for a mode: MAX's MTP one and MAX's DFlash2 one,
    each under its own name, with our model (and, fused, our config, batch processor
    and memory planner)."""
    if chosen not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {chosen!r}")
    mtp: dict[str, Any]
    dflash2: dict[str, Any]
    if chosen == "fused":
        mtp = {"pipeline_model": FusedMTPModel, "config": FusedMTPConfig, "batching": FusedMTPBatchProcessor,
               "memory_planner": FusedMTPMemoryPlanner}
        dflash2 = {"pipeline_model": FusedDflash2Model, "config": FusedDflash2Config,
                   "batching": FusedMTPBatchProcessor, "memory_planner": FusedDflash2MemoryPlanner}
    else:
        verify = chosen == "fold+verify"
        mtp = {"pipeline_model": PatchedVerifyMTPModel if verify else PatchedMTPModel}
        dflash2 = {"pipeline_model": PatchedVerifyDflash2Model if verify else PatchedDflash2Model}
    return [dataclasses.replace(unified_mtp_qwen3_5_arch, **mtp),
            dataclasses.replace(unified_dflash2_qwen3_5_arch, **dflash2)]


#: What ``--custom-architectures`` registers.
ARCHITECTURES = architectures(mode())

__all__ = ["ARCHITECTURES", "ENV", "MODES", "PatchedDflash2Model", "PatchedMTPModel", "PatchedVerifyDflash2Model",
           "PatchedVerifyMTPModel", "architectures", "mode"]
