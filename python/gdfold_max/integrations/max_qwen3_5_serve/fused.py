"""The fused step in MAX's ``unified_mtp_qwen3_5`` pipeline: our verify with fold on
load in every Gated DeltaNet layer of the target, no rollback fold (the conv rollback
stays MAX's), two ring halves per request and the previous counts carried on the
device (:mod:`.ring`).

Each class is MAX's with the least overridden; where MAX's code is followed, the
MAX 26.7 ``file:line`` is named (paths under ``max/pipelines/architectures``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferValue, DeviceRef, Dim, Graph, TensorValue, default_custom_extensions_scope
from max.nn.kv_cache import MultiKVCacheParams, RecurrentLeafInputs, RecurrentStateInputsPerDevice, recurrent_leaf
from max.pipelines.architectures.qwen3_5.qwen3_5 import Qwen3_5, Qwen3_5LinearAttentionBlock
from max.pipelines.architectures.qwen3_5.state_cache import STATE_CACHE_KEY
from max.pipelines.architectures.unified_mtp_qwen3_5 import model as mtp_model
from max.pipelines.architectures.unified_mtp_qwen3_5.batch_processor import UnifiedMTPQwen3_5BatchProcessor
from max.pipelines.architectures.unified_mtp_qwen3_5.inputs import UnifiedMTPQwen3_5Inputs
from max.pipelines.architectures.unified_mtp_qwen3_5.memory_planner import UnifiedMTPQwen3_5MemoryPlanner
from max.pipelines.architectures.unified_mtp_qwen3_5.model import UnifiedMTPQwen3_5Model
from max.pipelines.architectures.unified_mtp_qwen3_5.model_config import UnifiedMTPQwen3_5Config
from max.pipelines.architectures.unified_mtp_qwen3_5.spec_state import (
    LIVE_CONV_POOLS,
    LIVE_CONV_ROW_IDS,
    LIVE_RECURRENT_POOLS,
    LIVE_RECURRENT_ROW_IDS,
    RING_POOLS,
    RING_ROW_IDS,
    Qwen3_5RecurrentState,
)
from max.pipelines.architectures.unified_mtp_qwen3_5.state_rollback import (
    accepted_lengths,
    accepted_row_plan,
    replay_conv_pools,
)
from max.pipelines.architectures.unified_mtp_qwen3_5.unified_mtp_qwen3_5 import UnifiedMTPQwen3_5
from max.pipelines.graph_input_stager import GraphInputStager, InputDescriptor
from max.support.algorithm import flatten2d

from ...ops.kernels import kernels_path
from ..max_qwen3_5 import FusedGatedDeltaNet
from .ring import (
    RingCarry,
    carried_counts,
    carry_input_types,
    read_carry,
    request_tag,
    tag_rows,
    two_half_ring,
    write_carry,
)

#: Keys of the carry's graph inputs in a driver batch's ``extra``.
CARRY_TABLES = "gdfold_carry_tables"
CARRY_TAGS = "gdfold_carry_tags"


class FusedMTPConfig(UnifiedMTPQwen3_5Config):
    """MAX's config with the ring declared in two halves, wherever the cache's
    geometry is derived from it: the cache itself (``construct_kv_params``,
    ``qwen3_5/model_config.py:465-510``) and the per-request ring bytes memory planning
    counts (``_per_request_ring_bytes``, :563-572)."""

    @classmethod
    def construct_kv_params(cls, *args: Any, **kwargs: Any) -> Any:
        return two_half_kv_params(super().construct_kv_params(*args, **kwargs))

    def _per_request_ring_bytes(self, ring_len: int) -> int:
        return sum(r.bytes_per_page for r in two_half_ring(self._linear_regions(ring_len)) if r.scratch)


def two_half_kv_params(params: Any) -> Any:
    """A cache's params with its recurrent state child's ring in two halves
    (:func:`.ring.two_half_ring`); params without a state child as they are."""
    state = recurrent_leaf(params)
    if state is None:
        return params
    assert isinstance(params, MultiKVCacheParams)
    children = dict(params.children)
    children[STATE_CACHE_KEY] = replace(state, regions=two_half_ring(state.regions))
    return MultiKVCacheParams.from_params(children)


class FusedMTPMemoryPlanner(UnifiedMTPQwen3_5MemoryPlanner):
    """MAX's planner (``unified_mtp_qwen3_5/memory_planner.py:34-38``); it prices the
    ring through the config's ``_per_request_ring_bytes``, so the two halves are
    counted once the arch's config is :class:`FusedMTPConfig` (checked, not changed)."""

    def spec_state_bytes(self, pipeline_config: Any) -> int:
        assert isinstance(self._config, FusedMTPConfig), f"expected FusedMTPConfig, got {type(self._config)}"
        return super().spec_state_bytes(pipeline_config)


class FusedRecurrentState(Qwen3_5RecurrentState):
    """MAX's state steps (``unified_mtp_qwen3_5/spec_state.py:205-367``) with the
    verify recording into the half the previous step did not record into, the layers
    folding the previous records as they load, and no rollback fold."""

    def __init__(self, target: Qwen3_5, state_regions: Sequence[Any]) -> None:
        super().__init__(target, state_regions)
        self.layers = len(target.linear_layer_indices)
        self.carries: list[RingCarry] = []

    def verify_state(self, extra: Mapping[str, Any], n_devs: int
                     ) -> list[RecurrentStateInputsPerDevice[TensorValue, BufferValue]]:
        self.carries = [read_carry(extra[CARRY_TABLES][i], extra[CARRY_TAGS][i], extra[RING_ROW_IDS][i], self.layers)
                        for i in range(n_devs)]
        return [
            RecurrentStateInputsPerDevice(leaves=(
                RecurrentLeafInputs(pool=extra[LIVE_CONV_POOLS][i], live_row_ids=extra[LIVE_CONV_ROW_IDS][i]),
                RecurrentLeafInputs(pool=extra[LIVE_RECURRENT_POOLS][i],
                                    live_row_ids=extra[LIVE_RECURRENT_ROW_IDS][i]),
                RecurrentLeafInputs(pool=extra[RING_POOLS][i], live_row_ids=carry.current_rows),
            ))
            for i, carry in enumerate(self.carries)
        ]

    def _bind(self, capture: Any, verify_width: TensorValue | None) -> None:
        super()._bind(capture, verify_width)
        for layer, index in enumerate(self.target.linear_layer_indices):
            block = self.target.layers[index]
            assert isinstance(block, Qwen3_5LinearAttentionBlock)
            for i, shard in enumerate(block.linear_attn_shards):
                assert isinstance(shard, FusedGatedDeltaNet), f"layer {index}: {type(shard).__name__}"
                shard.fused_previous = (None if capture is None
                                        else (self.carries[i].previous_rows[layer], self.carries[i].count))

    def roll_forward(self, extra: Mapping[str, Any], *, merged_offsets: TensorValue, num_accepted: TensorValue,
                     num_draft_tokens: TensorValue, total_rows: Dim, signal_buffers: Sequence[BufferValue],
                     device: DeviceRef) -> None:
        """MAX's conv rollback as MAX runs it (``spec_state.py:338-358``), then the
        carry's write in place of ``fold_state_pools``: the records stay in the ring
        until the next step's verify folds them."""
        assert self.verify_width is not None and self.num_draft_tokens is not None, "roll_forward before capturing"
        plan_rows = Dim("batch_size") * (1 + self.num_draft_tokens)
        row_indices, replay_offsets = accepted_row_plan(merged_offsets, num_accepted, num_draft_tokens, total_rows,
                                                        device, plan_rows=plan_rows)
        replay_conv_pools(self.captures, extra[LIVE_CONV_POOLS], extra[LIVE_CONV_ROW_IDS], row_indices,
                          replay_offsets, signal_buffers, self.verify_width)
        kept = accepted_lengths(merged_offsets, num_accepted, num_draft_tokens)
        counts = carried_counts(kept, num_draft_tokens, signal_buffers, len(self.carries))
        for i, carry in enumerate(self.carries):
            write_carry(extra[CARRY_TABLES][i], carry, counts[i])


def fuse_driver(driver: Any) -> None:
    """Turns a freshly built MAX driver over a Qwen3.5 target (MAX's MTP or DFlash2
    one: each keeps its target in ``target``, its ``Qwen3_5RecurrentState`` in
    ``_target.state`` and its regions in ``state_regions``) into the fused one: the
    two-half ring, :class:`FusedRecurrentState`, and our layer in every Gated DeltaNet
    shard of the target."""
    regions: tuple[Any, ...] = driver.state_regions
    driver.state_regions = two_half_ring(regions)
    driver._target.state = FusedRecurrentState(driver.target, driver.state_regions)
    for index in driver.target.linear_layer_indices:
        block = driver.target.layers[index]
        assert isinstance(block, Qwen3_5LinearAttentionBlock)
        for shard in block.linear_attn_shards:
            shard.__class__ = FusedGatedDeltaNet  # adds no weights or state: only __call__


class CarryInputs:
    """The carry's graph inputs after the driver's own (:func:`.ring.carry_input_types`),
    for a driver class that lists this before MAX's driver: ``input_types`` appends
    them, and ``__call__`` hands them to the state through ``extra``."""

    config: Any

    def input_types(self, kv_params: Any = None) -> tuple[Any, ...]:
        theirs: tuple[Any, ...] = super().input_types(kv_params)  # type: ignore[misc]
        return (*theirs, *carry_input_types(self.config.devices))

    def __call__(self, *args: Any, extra: Mapping[str, Any], **kwargs: Any) -> Any:
        """MAX's builders read their inputs up to the last of their own; the carry's
        follow, taken here from the graph being built."""
        n = len(self.config.devices)
        inputs = Graph.current.inputs
        ours = inputs[len(inputs) - 2 * n:]
        extra = {**extra, CARRY_TABLES: [v.buffer for v in ours[:n]], CARRY_TAGS: [v.tensor for v in ours[n:]]}
        return super().__call__(*args, extra=extra, **kwargs)  # type: ignore[misc]


class FusedUnifiedMTPQwen3_5(CarryInputs, UnifiedMTPQwen3_5):
    """MAX's MTP driver (``unified_mtp_qwen3_5/unified_mtp_qwen3_5.py:68-190``) made
    fused by :func:`fuse_driver`. Its graph inputs are MAX's, then the carry's; MAX's
    builder (``unified_mtp_qwen3_5/model.py:208-256``) reads its own up to the last."""

    def __init__(self, config: Any, speculative_config: Any = None, enable_structured_output: bool = False) -> None:
        super().__init__(config, speculative_config=speculative_config,
                         enable_structured_output=enable_structured_output)
        if self.logit_penalties:
            raise ValueError("logit_penalties: the fused Qwen3.5 step does not take penalty inputs yet; serve with"
                             " GDFOLD_MAX_QWEN3_5=fold or without penalties")
        if getattr(config, "use_subgraphs", False):
            # Each layer's previous ring rows are bound per layer while the graph is
            # built; a shared subgraph would bake layer 0's into every layer.
            raise ValueError("use_subgraphs: the fused step needs each layer traced inline")
        fuse_driver(self)


@dataclass(kw_only=True)
class FusedMTPInputs(UnifiedMTPQwen3_5Inputs):
    """MAX's inputs (``unified_mtp_qwen3_5/inputs.py:45-80``), then the carry's."""

    carry_tables: list[Buffer] = field(default_factory=list)
    carry_tags: list[Buffer] = field(default_factory=list)

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        return (*super().buffers, *self.carry_tables, *self.carry_tags)


class FusedMTPBatchProcessor(UnifiedMTPQwen3_5BatchProcessor):
    """MAX's batch (``unified_mtp_qwen3_5/batch_processor.py:143-195``) plus each
    request's tag and the carry tables, one per device, allocated zeroed on first use
    with a row per ring block and kept for the life of the pipeline.

    The tags go through an input stager (``max/pipelines/graph_input_stager.py``), as
    MAX's own tokens do through MAX's: written into host staging and copied behind the
    step before, where an upload from pageable memory could hold the host until the
    device is idle, and so stop MAX's overlap scheduler from preparing a step while the
    one before runs. The stager is our own, beside MAX's, so that MAX's token inputs keep
    their stager and their one copy."""

    def __init__(self, config: Any, runtime: Any) -> None:
        super().__init__(config, runtime)
        self._tables: list[Buffer] = []
        # The tags are the same on every device: one host staging, a copy to each.
        self._tag_stager = GraphInputStager([InputDescriptor(
            name=CARRY_TAGS, dtype=DType.uint32, max_shape=(runtime.max_global_batch_size, 2),
            destinations=list(runtime.devices))])

    def staged_tags(self, tags: np.ndarray) -> list[Buffer]:
        """Each device's ``[batch, 2]`` tags input holding ``tags``, copied from host
        staging behind the work already queued there (the same buffers every step)."""
        with self._tag_stager.stage() as staging:
            host, devices = staging.get(CARRY_TAGS, tags.shape)
            np.copyto(host.to_numpy(), tags)
        return list(devices)

    def prepare_initial_token_inputs(self, replica_batches: Any, kv_cache_inputs: Any = None,
                                     return_n_logits: int = 1) -> FusedMTPInputs:
        base = super().prepare_initial_token_inputs(replica_batches, kv_cache_inputs, return_n_logits)
        contexts = flatten2d(replica_batches)
        tables = self._tables
        carry_tables: list[Buffer] = []
        for i, (pool, rows) in enumerate(zip(base.ring_pools, base.ring_row_ids, strict=True)):
            blocks = pool.shape[0] // rows.shape[0]
            if len(tables) <= i or tables[i].shape[0] != blocks:
                tables[i:i + 1] = [Buffer.zeros(shape=[blocks, 4], dtype=DType.uint32, device=pool.device)]
            carry_tables.append(tables[i])
        batch = base.ring_row_ids[0].shape[1]
        carry_tags = self.staged_tags(
            tag_rows([request_tag(c.request_id, c.tokens.generated_length) for c in contexts], batch))
        values = {f.name: getattr(base, f.name) for f in fields(base) if f.init}
        return FusedMTPInputs(**values, carry_tables=carry_tables, carry_tags=carry_tags)


_rebind_lock = threading.RLock()


@contextmanager
def rebound(module: ModuleType, name: str, value: Any) -> Iterator[None]:
    """Binds ``value`` to ``module.name`` for the block, where a MAX function looks a
    class up by its module-level name; one block at a time (re-entrant)."""
    with _rebind_lock:
        before = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, before)


class FusedBuild:
    """Mixed in before a MAX pipeline model: MAX's own graph builder builds the graph
    with our driver bound where the builder looks its driver class up by module name
    (``driver_site``: module, name, our class), and our kernels are among the default
    custom extensions while it builds and compiles."""

    driver_site: ClassVar[tuple[ModuleType, str, type]]

    def load_model(self, session: InferenceSession) -> Model:
        with default_custom_extensions_scope(kernels_path()):
            return super().load_model(session)  # type: ignore[misc]

    def _build_graph_for_compile(self, session: InferenceSession, state_dict: dict[str, Any],
                                 model_config: Any) -> tuple[Graph, dict[str, Any]]:
        with default_custom_extensions_scope(kernels_path()), rebound(*self.driver_site):
            return super()._build_graph_for_compile(session, state_dict, model_config)  # type: ignore[misc]


class FusedMTPModel(FusedBuild, UnifiedMTPQwen3_5Model):
    """MAX's MTP pipeline model, built with :class:`FusedUnifiedMTPQwen3_5` by MAX's
    own graph builder (which looks it up at model.py:186)."""

    batch_processor_cls: ClassVar[type[Any]] = FusedMTPBatchProcessor
    model_config_cls: ClassVar[type[Any]] = FusedMTPConfig
    driver_site = (mtp_model, "UnifiedMTPQwen3_5", FusedUnifiedMTPQwen3_5)
