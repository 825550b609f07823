"""Tensor-parallel shards: the heads split across devices, each device with its own
pool, ring and row tables, as MAX's Qwen3.5 rollback runs them
(``unified_mtp_qwen3_5.state_rollback.fold_state_pools``).

Value heads never mix in the gated delta recurrence, and a key head's records hold
only its own group's value heads, so splitting the key heads evenly (each with its G
value heads) splits every op exactly: each device runs the ops on its own shard and
nothing crosses devices but the accepted counts, which MAX's sampler produces on one
device and :func:`broadcast_counts` hands to the others.

* :func:`shard_heads` says which heads each of ``n`` devices holds;
* :func:`shard_window_inputs`, :func:`shard_pool` and :func:`shard_ring` cut numpy
  operands to one shard (``cases.shard_window_case`` cuts a whole verify case, for tests);
* :func:`fold_shards` and :func:`verify_shards` put the ops of every device in one MAX
  graph, with the counts broadcast where there is more than one device.

Several shards may share a device (tests do, on the CPU); shards on several devices
need the ``max.nn.comm.Signals`` buffers of those devices, as MAX's own collectives do.

Qwen3-Next-80B's 32 value heads and 16 key heads on two GPUs:

    >>> shard_heads(num_value_heads=32, num_key_heads=16, num_shards=2)[1]
    HeadShard(index=1, key_heads=range(8, 16), value_heads=range(16, 32))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from max.dtype import DType
from max.graph import BufferValue, DeviceRef, TensorValue, ops

from .ops.fold import state_fold
from .ops.window import verify_ring


@dataclass(frozen=True)
class HeadShard:
    """The heads one device holds: a run of key heads and their value heads."""

    index: int
    key_heads: range
    value_heads: range


def shard_heads(num_value_heads: int, num_key_heads: int, num_shards: int) -> list[HeadShard]:
    """Splits the key heads evenly over ``num_shards`` devices, each key head with its
    G = nv / nk value heads (value head ``vh`` reads key head ``vh // G``).

    Raises:
        ValueError: naming the count that does not divide.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards: {num_shards} must be at least 1")
    if num_key_heads < 1 or num_value_heads % num_key_heads != 0:
        raise ValueError(f"num_key_heads: {num_key_heads} must divide num_value_heads={num_value_heads}")
    if num_key_heads % num_shards != 0:
        raise ValueError(f"num_shards: {num_shards} must divide num_key_heads={num_key_heads}")
    group = num_value_heads // num_key_heads
    per_shard = num_key_heads // num_shards
    return [
        HeadShard(i, range(i * per_shard, (i + 1) * per_shard),
                  range(i * per_shard * group, (i + 1) * per_shard * group))
        for i in range(num_shards)
    ]


def shard_window_inputs(qkv: np.ndarray, decay: np.ndarray, beta: np.ndarray, shard: HeadShard, *,
                        num_key_heads: int, key_dim: int, value_dim: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One shard's ``qkv`` (its key heads' q, then their k, then its value heads' v),
    ``decay`` and ``beta`` (its value heads), as a tensor-parallel projection gives them."""
    kh, vh = shard.key_heads, shard.value_heads
    q = qkv[:, kh.start * key_dim : kh.stop * key_dim]
    k = qkv[:, (num_key_heads + kh.start) * key_dim : (num_key_heads + kh.stop) * key_dim]
    v_at = 2 * num_key_heads * key_dim
    v = qkv[:, v_at + vh.start * value_dim : v_at + vh.stop * value_dim]
    return (np.concatenate([q, k, v], axis=1),
            np.array(decay[:, vh.start : vh.stop], order="C", copy=True),
            np.array(beta[:, vh.start : vh.stop], order="C", copy=True))


def shard_pool(pool: np.ndarray, shard: HeadShard) -> np.ndarray:
    """One shard's ``[rows, nv / n, K, V]`` pool: its value heads of every row, as a new
    array (never a view that an in-place op on the shard would write through)."""
    return np.array(pool[:, shard.value_heads.start : shard.value_heads.stop], order="C", copy=True)


def shard_ring(ring: np.ndarray, shard: HeadShard) -> np.ndarray:
    """One shard's ``[ring_rows, nk / n, RING_LEN, stride]`` ring: its key heads' records
    (a key head's record holds its own group's delta rows and decays only), as a new array."""
    return np.array(ring[:, shard.key_heads.start : shard.key_heads.stop], order="C", copy=True)


def broadcast_counts(counts: TensorValue, devices: Sequence[DeviceRef],
                     signal_buffers: Sequence[BufferValue] = ()) -> list[TensorValue]:
    """The accepted counts for each entry of ``devices``, as MAX's rollback places them:
    across several devices an ``ops.distributed_broadcast`` from the counts' device (one
    signal buffer per device, ``max.nn.comm.Signals``); on a single device the counts
    themselves, for every entry.

    Raises:
        ValueError: if the devices are several and the signal buffers do not name each once.
    """
    counts = counts.cast(DType.uint32) if counts.dtype != DType.uint32 else counts
    distinct = list(dict.fromkeys(devices))
    if len(distinct) <= 1:
        return [counts] * len(devices)
    signal_devices = [buffer.device for buffer in signal_buffers]
    if sorted(map(str, signal_devices)) != sorted(map(str, distinct)):
        raise ValueError(f"signal_buffers: on {[str(d) for d in signal_devices]}, but the shards are on"
                         f" {[str(d) for d in distinct]} (one signal buffer per device)")
    placed = dict(zip(map(str, signal_devices), ops.distributed_broadcast(counts, list(signal_buffers)),
                      strict=True))
    return [placed[str(device)] for device in devices]


def _check_devices(what: str, count: int, **lists: Sequence[object]) -> None:
    for name, values in lists.items():
        if len(values) != count:
            raise ValueError(f"{name}: {len(values)} entries, but {what} has {count} (one per device)")


def fold_shards(
    pools: Sequence[BufferValue],
    rings: Sequence[BufferValue],
    row_ids: Sequence[TensorValue],
    ring_row_ids: Sequence[TensorValue],
    num_accepted: TensorValue,
    signal_buffers: Sequence[BufferValue] = (),
    verify_width: TensorValue | None = None,
) -> None:
    """One :func:`gdfold_max.state_fold` per device over its own pool, ring and
    ``[num_layers, batch]`` row tables, after the counts are broadcast: what MAX's
    ``fold_state_pools`` does, with our fold.

    Raises:
        ValueError: if the per-device lists differ in length (and as ``state_fold`` does).
    """
    _check_devices("pools", len(pools), rings=rings, row_ids=row_ids, ring_row_ids=ring_row_ids)
    counts = broadcast_counts(num_accepted, [pool.device for pool in pools], signal_buffers)
    for device in range(len(pools)):
        state_fold(pools[device], rings[device], row_ids[device], ring_row_ids[device], counts[device],
                   verify_width)


def verify_shards(
    qkvs: Sequence[TensorValue],
    decays: Sequence[TensorValue],
    betas: Sequence[TensorValue],
    pools: Sequence[BufferValue],
    rings: Sequence[BufferValue],
    row_ids: Sequence[TensorValue],
    ring_row_ids: Sequence[TensorValue],
    input_row_offsets: Sequence[TensorValue],
    *,
    previous_ring_row_ids: Sequence[TensorValue] | None = None,
    previous_num_accepted: TensorValue | None = None,
    signal_buffers: Sequence[BufferValue] = (),
) -> list[TensorValue]:
    """One layer's :func:`gdfold_max.verify_ring` on every device, over its own shard;
    with ``previous_ring_row_ids`` (one table per device) and ``previous_num_accepted``
    (one ``[batch]`` tensor, broadcast to every device), the verify with fold on load.
    Returns each device's readout ``[T, (nv / n) * V]``.

    Raises:
        ValueError: if the per-device lists differ in length, or only one of the fold on
            load arguments is given (and as ``verify_ring`` does).
    """
    _check_devices("pools", len(pools), qkvs=qkvs, decays=decays, betas=betas, rings=rings, row_ids=row_ids,
                   ring_row_ids=ring_row_ids, input_row_offsets=input_row_offsets)
    if (previous_ring_row_ids is None) != (previous_num_accepted is None):
        raise ValueError("previous_ring_row_ids, previous_num_accepted: give both for fold on load, or neither")
    counts: list[TensorValue] | None = None
    if previous_ring_row_ids is not None and previous_num_accepted is not None:
        _check_devices("pools", len(pools), previous_ring_row_ids=previous_ring_row_ids)
        counts = broadcast_counts(previous_num_accepted, [pool.device for pool in pools], signal_buffers)
    readouts = []
    for device in range(len(pools)):
        previous = {}
        if counts is not None and previous_ring_row_ids is not None:
            previous = {"previous_ring_row_ids": previous_ring_row_ids[device],
                        "previous_num_accepted": counts[device]}
        readouts.append(verify_ring(qkvs[device], decays[device], betas[device], pools[device], rings[device],
                                    row_ids[device], ring_row_ids[device], input_row_offsets[device], **previous))
    return readouts
