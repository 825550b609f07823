"""Two ring halves per request and the previous step's counts, carried on the device.

The fused verify folds the previous step's accepted records while it loads the state,
so a request needs two ring rows per layer (the records of the previous step are read
while this step's are written) and, at each step, how many records the previous step
kept. MAX's overlap scheduler builds a step's inputs before the previous step's counts
reach the host, so the counts stay on the device, in a small table with one row per
ring block (a request's ring block is stable for its whole life in MAX 26.7):
``[tag_lo, tag_hi, last_half, count]``. The host sends a 64-bit tag per request, 0 on
a step where the request has generated nothing yet (a prefill chunk, the first step
after admission or after a preemption); a table row whose tag differs, the null block 0
that padding rows point at, and a step's tag of 0 carry nothing. The last matters where a
step verifies drafts of contexts that have generated nothing (MAX's warmup builds such
contexts, ``overlap_text_generation.py:2287-2320``): it stores a count under the tag 0,
and the block's next prefill, tagged 0 too, would otherwise fold those records into the
new request's fresh state.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from max.dtype import DType
from max.graph import BufferType, BufferValue, DeviceRef, TensorType, TensorValue, ops
from max.nn.kv_cache import RecurrentStateRegion
from max.pipelines.architectures.qwen3_5.state_cache import RING_DTYPE, RING_LEAF_ID, _ring_record_stride

#: The symbolic row count of the carry table (ring blocks on one device).
BLOCKS_DIM = "gdfold_ring_blocks"
#: Columns of a carry table row.
TAG_LO, TAG_HI, LAST_HALF, COUNT = range(4)


def two_half_ring(regions: Sequence[RecurrentStateRegion]) -> tuple[RecurrentStateRegion, ...]:
    """MAX's state regions with the ring declared for ``2 * num_layers`` rows per
    request: half 0 is rows ``[0, L)`` of the request's ring block, half 1 rows
    ``[L, 2L)``. The record stride is padded as MAX pads it
    (``qwen3_5/state_cache.py:_ring_record_stride``), for the doubled page."""
    live = tuple(r for r in regions if not r.scratch)
    rings = [r for r in regions if r.scratch]
    if len(rings) != 1 or rings[0].leaf_id != RING_LEAF_ID or len(live) != 2:
        raise ValueError(f"regions: expected the conv, recurrent and ring leaves, got {[r.leaf_id for r in regions]}")
    ring = rings[0]
    nv, key_dim, value_dim = live[1].row_shape
    nk, ring_len, _ = ring.row_shape
    layers = 2 * ring.num_layers
    stride = _ring_record_stride(
        record_elements=key_dim + (nv // nk) * (value_dim + 1),
        bytes_per_element=layers * nk * ring_len * RING_DTYPE.size_in_bytes,
        page_multiple_of=math.lcm(*(r.bytes_per_page for r in live)))
    return (*live, replace(ring, num_layers=layers, row_shape=(nk, ring_len, stride)))


def request_tag(request_id: object, generated_length: int) -> tuple[int, int]:
    """The host's tag of a request for this step, as two uint32 words: 0 while it has
    generated nothing (nothing to carry), else a 64-bit hash of its id with the low bit
    set (never 0)."""
    if generated_length == 0:
        return 0, 0
    digest = int.from_bytes(hashlib.blake2b(str(request_id).encode(), digest_size=8).digest(), "little") | 1
    return digest & 0xFFFFFFFF, digest >> 32


def tag_rows(tags: Sequence[tuple[int, int]], batch: int) -> np.ndarray:
    """``[batch, 2]`` uint32: the tags of the batch's requests, then 0 for padding rows."""
    if len(tags) > batch:
        raise ValueError(f"tags: {len(tags)} requests for a batch of {batch} rows")
    rows = np.zeros((batch, 2), np.uint32)
    if tags:
        rows[: len(tags)] = np.asarray(tags, np.uint32)
    return rows


def carry_input_types(devices: Sequence[DeviceRef]) -> list[BufferType | TensorType]:
    """The graph inputs the carry adds, after MAX's: one table per device, then the
    ``[batch, 2]`` tags per device."""
    return ([BufferType(DType.uint32, [BLOCKS_DIM, 4], device=d) for d in devices]
            + [TensorType(DType.uint32, ["batch_size", 2], device=d) for d in devices])


@dataclass
class RingCarry:
    """What one device's step reads from its table (graph values)."""

    block: TensorValue
    tags: TensorValue
    last: TensorValue
    count: TensorValue
    current_rows: TensorValue
    previous_rows: TensorValue


def _u32(value: int, device: DeviceRef) -> TensorValue:
    return ops.constant(value, DType.uint32, device=device)


def read_carry(table: BufferValue, tags: TensorValue, ring_rows: TensorValue, layers: int) -> RingCarry:
    """Reads a device's carry: ``ring_rows`` is the ``[2L, batch]`` ring table MAX
    stages, ``tags`` ``[batch, 2]``. This step records into the half the previous
    step did not; the previous half and count feed the fold on load."""
    device = ring_rows.device
    rows = ring_rows.cast(DType.uint32)
    block = rows[0] // _u32(2 * layers, device)
    loaded = ops.buffer_load(table)
    # Gather indices as MAX documents them (int32 or int64), not the uint32 of the rows.
    entry = ops.gather(loaded, block.cast(DType.int64), axis=0)
    zero = ops.broadcast_to(_u32(0, device), block.shape)
    same = ops.logical_and(ops.equal(entry[:, TAG_LO], tags[:, 0]), ops.equal(entry[:, TAG_HI], tags[:, 1]))
    # A live tag has its low bit set (request_tag), so its low word is never 0.
    tagged = ops.not_equal(tags[:, 0], zero)
    valid = ops.logical_and(ops.logical_and(same, tagged), ops.not_equal(block, zero))
    last = ops.where(valid, entry[:, LAST_HALF], zero)
    count = ops.where(valid, entry[:, COUNT], zero)
    in_half_1 = ops.broadcast_to(ops.unsqueeze(ops.equal(last, _u32(1, device)), 0), [layers, rows.shape[1]])
    first, second = rows[:layers], rows[layers:]
    return RingCarry(block=block, tags=tags, last=last, count=count,
                     current_rows=ops.where(in_half_1, first, second),
                     previous_rows=ops.where(in_half_1, second, first))


def carried_counts(kept: TensorValue, num_draft_tokens: TensorValue,
                   signal_buffers: Sequence[BufferValue], num_devices: int) -> list[TensorValue]:
    """``[batch, 2]`` uint32 per device: the records each request keeps for the next
    step (``kept`` on a step with drafts, 0 on a step without: its window landed on the
    pool) and whether the step recorded (1: the halves swap). Built on the first
    device, broadcast as MAX broadcasts its fold counts (``state_rollback.py:241-249``)."""
    device = kept.device
    recorded = ops.greater(num_draft_tokens.cast(DType.int64), ops.constant(0, DType.int64, device=device))
    zero = ops.broadcast_to(_u32(0, device), kept.shape)
    one = ops.broadcast_to(_u32(1, device), kept.shape)
    packed = ops.stack([ops.where(recorded, kept.cast(DType.uint32), zero), ops.where(recorded, one, zero)], axis=1)
    return ops.distributed_broadcast(packed, list(signal_buffers)) if num_devices > 1 else [packed]


def write_carry(table: BufferValue, carry: RingCarry, counts: TensorValue) -> None:
    """Stores this step's entries in a device's table: the tags, the half it recorded
    into (or the same half when it recorded nothing) and the count to fold next."""
    device = carry.block.device
    swap = ops.equal(counts[:, 1], _u32(1, device))
    one = ops.broadcast_to(_u32(1, device), carry.last.shape)
    last = ops.where(swap, one - carry.last, carry.last)
    entries = ops.stack([carry.tags[:, 0], carry.tags[:, 1], last, counts[:, 0]], axis=1)
    index = ops.unsqueeze(carry.block.cast(DType.int64), 1)
    # The table is read again here rather than scattered into the value read_carry
    # loaded at the start of the step: nothing writes it in between, but a store derived
    # from that early load, across the whole step's graph, crashes MAX 26.7's compiler:
    # a segmentation fault inside session.load, seven seconds into compiling the fused
    # MTP graph for the CPU, and the fused server's model worker on an H100 the same way.
    ops.buffer_store(table, ops.scatter_nd(ops.buffer_load(table), entries, index))
