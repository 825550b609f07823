"""The fused step in MAX's ``unified_dflash2_qwen3_5`` pipeline: Qwen3.5 verified with
our verify with fold on load behind a DFlash2 block drafter (blocks of 8: 7 drafts).

MAX's DFlash2 target rolls back through the MTP pipeline's state class
(``Qwen3_5BlockTarget.state``, a ``Qwen3_5RecurrentState``:
``unified_dflash2_qwen3_5/spec_adapters.py:55-99``; ``roll_forward`` from
``DFlash2Qwen3_5Proposer.materialize``, :112-131), and it batches with the MTP
pipeline's batch processor (``arch.py:44``), so :class:`.fused.FusedRecurrentState`,
the carry and :class:`.fused.FusedMTPBatchProcessor` serve it unchanged. What differs
is where the geometry is derived and where the classes are looked up, and each of those
is covered here, MAX's code run as it stands (paths under
``max/pipelines/architectures``, MAX 26.7):

* the driver, :class:`FusedDflash2Driver`, MAX's ``UnifiedDflash2Qwen3_5`` made fused
  (its ring is ``ring_len_for_window(block_size)`` long, ``unified_dflash2_qwen3_5.py:84-96``);
* the config, :class:`FusedDflash2Config`: MAX's wrapper builds its target config with
  ``UnifiedMTPQwen3_5Config.initialize_from_config`` (``model_config.py:457``), which
  here is :class:`.fused.FusedMTPConfig`, so the cache and the planner see two halves;
* the pipeline model, :class:`FusedDflash2Model`: ``get_kv_params`` (``model.py:137``)
  and ``_create_model_config`` (:183) name MAX's config classes, and
  ``_build_graph_for_compile`` (:230) MAX's driver class, by module name: each runs
  with ours bound there;
* the memory planner, MAX's (``memory_planner.py``), which prices the ring through the
  target config's ``_per_request_ring_bytes``: checked, not changed.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from max.engine import InferenceSession, Model
from max.pipelines.architectures.unified_dflash2_qwen3_5 import model as dflash2_model
from max.pipelines.architectures.unified_dflash2_qwen3_5 import model_config as dflash2_config
from max.pipelines.architectures.unified_dflash2_qwen3_5.memory_planner import UnifiedDflash2Qwen3_5MemoryPlanner
from max.pipelines.architectures.unified_dflash2_qwen3_5.model import UnifiedDflash2Qwen3_5Model
from max.pipelines.architectures.unified_dflash2_qwen3_5.model_config import UnifiedDflash2Qwen3_5Config
from max.pipelines.architectures.unified_dflash2_qwen3_5.unified_dflash2_qwen3_5 import UnifiedDflash2Qwen3_5

from .fused import CarryInputs, FusedBuild, FusedMTPBatchProcessor, FusedMTPConfig, fuse_driver, rebound

#: Set to ``unvalidated`` to load the fused DFlash2 step all the same (to study it).
UNVALIDATED_ENV = "GDFOLD_MAX_QWEN3_5_DFLASH2"


class FusedDflash2Config(UnifiedDflash2Qwen3_5Config):
    """MAX's DFlash2 config with its target a :class:`.fused.FusedMTPConfig`, so the
    target's cache (``get_kv_params``, through ``dflash2_kv_params``) and the per-request
    ring bytes the planner counts are both the two-half ring's."""

    @classmethod
    def initialize(cls, *args: Any, **kwargs: Any) -> Any:
        with rebound(dflash2_config, "UnifiedMTPQwen3_5Config", FusedMTPConfig):
            return super().initialize(*args, **kwargs)


class FusedDflash2MemoryPlanner(UnifiedDflash2Qwen3_5MemoryPlanner):
    """MAX's DFlash2 planner: MAX's MTP planner over the wrapper's target, which prices
    the ring through ``_per_request_ring_bytes``; the two halves are counted once the
    arch's config is :class:`FusedDflash2Config` (checked, not changed)."""

    def spec_state_bytes(self, pipeline_config: Any) -> int:
        assert isinstance(self._config, FusedMTPConfig), f"expected FusedMTPConfig, got {type(self._config)}"
        return super().spec_state_bytes(pipeline_config)


class FusedDflash2Driver(CarryInputs, UnifiedDflash2Qwen3_5):
    """MAX's DFlash2 driver (a ``BlockDriver``) made fused by
    :func:`.fused.fuse_driver`: its ``Qwen3_5BlockTarget`` holds a
    :class:`.fused.FusedRecurrentState`, which the proposer's ``materialize`` rolls
    forward. Its graph inputs are MAX's (the spec-decode signature, then the state tail),
    then the carry's."""

    def __init__(self, config: Any, enable_structured_output: bool = False) -> None:
        super().__init__(config, enable_structured_output=enable_structured_output)
        if getattr(config.target, "use_subgraphs", False):
            # MAX's config turns subgraphs off (model_config.py:322); each layer's
            # previous ring rows are bound per layer while the graph is built.
            raise ValueError("use_subgraphs: the fused step needs each layer traced inline")
        fuse_driver(self)


class FusedDflash2Model(FusedBuild, UnifiedDflash2Qwen3_5Model):
    """MAX's DFlash2 pipeline model, its config and cache from :class:`FusedDflash2Config`,
    built with :class:`FusedDflash2Driver` by MAX's own graph builder, our kernels among
    the default custom extensions while it compiles."""

    batch_processor_cls: ClassVar[type[Any]] = FusedMTPBatchProcessor
    model_config_cls: ClassVar[type[Any]] = FusedDflash2Config
    driver_site = (dflash2_model, "UnifiedDflash2Qwen3_5", FusedDflash2Driver)

    def load_model(self, session: InferenceSession) -> Model:
        """Refuses, unless asked for by ``GDFOLD_MAX_QWEN3_5_DFLASH2=unvalidated``: served
        on an H100, the fused DFlash2 step answered each prompt asked alone with one
        ordinary token and then token 0 (docs/integrations.md, "DFlash2")."""
        value = os.environ.get(UNVALIDATED_ENV)
        if value != "unvalidated":
            found = "unset" if value is None else f"{value!r}"
            raise RuntimeError(
                "GDFOLD_MAX_QWEN3_5=fused (the default) with --speculative-method dflash2: the fused DFlash2"
                " step is not validated (served on an H100 it answered token 0 after the first token); serve"
                f" DFlash2 with MAX's own pipeline, or set {UNVALIDATED_ENV}=unvalidated to load it all the same"
                f" ({UNVALIDATED_ENV} is {found})")
        return super().load_model(session)

    @classmethod
    def get_kv_params(cls, *args: Any, **kwargs: Any) -> Any:
        with rebound(dflash2_model, "UnifiedMTPQwen3_5Config", FusedMTPConfig):
            return super().get_kv_params(*args, **kwargs)

    def _create_model_config(self, state_dict: dict[str, Any]) -> Any:
        with rebound(dflash2_model, "UnifiedDflash2Qwen3_5Config", FusedDflash2Config):
            return super()._create_model_config(state_dict)


__all__ = ["UNVALIDATED_ENV", "FusedDflash2Config", "FusedDflash2Driver", "FusedDflash2MemoryPlanner",
           "FusedDflash2Model"]
