"""Random fold cases, for tests, the demo and ``gdfold-max record``.

Two kinds:

* :func:`random_fold_case`: random records straight into a ring. Cheap, and it can
  name counts past RING_LEN. Records past ``num_accepted[b]`` and the padding of every
  record are NaN, so a fold that reads them poisons the state.
* :func:`spec_decode_case`: a real verify step. The numpy reference runs each layer's
  verify window into the ring, and ``state_out`` is the reference forward over the
  accepted tokens alone, so a correct fold of ``state_in`` equals it bit for bit.

Both return a :class:`FoldCase`, whose fields are those of a recorded case file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

from . import reference
from .layout import Gate, RecordLayout
from .trees import root_path

if TYPE_CHECKING:
    from .sharded import HeadShard


@dataclass
class FoldCase:
    """The operands of one fold, and what the pool must hold after it."""

    state_in: NDArray
    ring: NDArray
    row_ids: NDArray
    ring_row_ids: NDArray
    num_accepted: NDArray
    state_out: NDArray
    extras: dict[str, NDArray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def fold_operands(self) -> tuple[NDArray, NDArray, NDArray, NDArray, NDArray]:
        """A fresh copy of the pool, and the ring and tables, ready to fold."""
        return self.state_in.copy(), self.ring, self.row_ids, self.ring_row_ids, self.num_accepted

    def state_out_skipping(self, skipped: set[tuple[int, int]]) -> NDArray:
        """The reference fold of ``state_in`` with the (layer, request) pairs of ``skipped``
        left out, as a GPU kernel leaves a pair whose id it does not follow."""
        state = self.state_in.copy()
        for layer in range(self.row_ids.shape[0]):
            counts = self.num_accepted.copy()
            counts[[b for (skipped_layer, b) in skipped if skipped_layer == layer]] = 0
            reference.fold(state, self.ring, self.row_ids[layer : layer + 1], self.ring_row_ids[layer : layer + 1],
                           counts, gate=self.meta.get("gate", "head"))
        return state

    def save(self, path: str | Path) -> None:
        """Writes the case in the recorded-case format (``np.load`` fields)."""
        arrays: dict[str, Any] = {
            "meta": np.array(json.dumps(self.meta)),
            "state_in": self.state_in,
            "ring": self.ring,
            "row_ids": self.row_ids,
            "ring_row_ids": self.ring_row_ids,
            "num_accepted": self.num_accepted,
            "state_out": self.state_out,
            **self.extras,
        }
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> FoldCase:
        """Reads a recorded case; a bf16 pool stored as uint16 bits comes back as bf16."""
        with np.load(path) as data:
            fields = {name: data[name] for name in data.files}
        meta = json.loads(str(fields.pop("meta"))) if "meta" in fields else {}
        if meta.get("state_dtype") == "bfloat16":
            for name in ("state_in", "state_out"):
                fields[name] = fields[name].view(ml_dtypes.bfloat16)
        core = {name: fields.pop(name) for name in
                ("state_in", "ring", "row_ids", "ring_row_ids", "num_accepted", "state_out")}
        return cls(**core, extras=fields, meta=meta)


def _state_dtype(name: str) -> np.dtype:
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"state_dtype: {name!r} is not 'float32' or 'bfloat16'")
    return np.dtype(np.float32) if name == "float32" else np.dtype(ml_dtypes.bfloat16)


def _layer_major_tables(rng: np.random.Generator, layers: int, batch: int, rows: int, ring_rows: int
                        ) -> tuple[NDArray, NDArray]:
    """Distinct, shuffled pool and ring rows for every (layer, request)."""
    row_ids = rng.permutation(rows)[: layers * batch].reshape(layers, batch).astype(np.uint32)
    ring_row_ids = rng.permutation(ring_rows)[: layers * batch].reshape(layers, batch).astype(np.uint32)
    return row_ids, ring_row_ids


def _case_meta(layers: int, batch: int, num_value_heads: int, num_key_heads: int, key_dim: int, value_dim: int,
               ring_len: int, stride: int, state_dtype: str, seed: int, **more: Any) -> dict[str, Any]:
    """A case's shape and origin, under the keys of the recorded-case format."""
    return dict(L=layers, B=batch, nv=num_value_heads, nk=num_key_heads, K=key_dim, V=value_dim,
                RING_LEN=ring_len, stride=stride, state_dtype=state_dtype, seed=seed, **more)


def random_fold_case(
    seed: int,
    *,
    layers: int = 2,
    batch: int = 4,
    num_value_heads: int = 4,
    num_key_heads: int = 2,
    key_dim: int = 64,
    value_dim: int = 64,
    ring_len: int = 4,
    state_dtype: str = "float32",
    num_accepted: list[int] | None = None,
    spare_rows: int = 3,
    stride_pad: int = 0,
    gate: Gate = "head",
) -> FoldCase:
    """Random records straight into a NaN-poisoned ring; ``state_out`` from the reference fold.

    ``num_accepted`` defaults to counts cycling through 0, 1, RING_LEN and RING_LEN + 1.
    The pool has ``spare_rows`` rows that no (layer, request) names.
    """
    rng = np.random.default_rng(seed)
    dtype = _state_dtype(state_dtype)
    layout = RecordLayout(key_dim, value_dim, num_value_heads // num_key_heads, gate)
    stride = layout.min_stride + stride_pad
    rows = layers * batch + spare_rows
    ring_rows = layers * batch + 1
    if num_accepted is None:
        cycle = [0, 1, ring_len, ring_len + 1]
        num_accepted = [cycle[b % len(cycle)] for b in range(batch)]
    accepted = np.asarray(num_accepted, np.uint32)
    state = rng.standard_normal((rows, num_value_heads, key_dim, value_dim)).astype(np.float32).astype(dtype)
    ring = np.full((ring_rows, num_key_heads, ring_len, stride), np.nan, np.float32)
    row_ids, ring_row_ids = _layer_major_tables(rng, layers, batch, rows, ring_rows)
    g = layout.group_size
    for layer in range(layers):
        for b in range(batch):
            written = min(int(accepted[b]), ring_len)  # past RING_LEN the verify wrote none it kept
            records = ring[ring_row_ids[layer, b], :, :written]
            records[..., :key_dim] = rng.standard_normal((num_key_heads, written, key_dim)) * 0.3
            deltas = layout.delta_offset(0)
            records[..., deltas : deltas + g * value_dim] = rng.standard_normal(
                (num_key_heads, written, g * value_dim)) * 0.3
            decays, width = layout.decay_offset(0), g * layout.decay_length
            records[..., decays : decays + width] = rng.uniform(0.5, 1.0, (num_key_heads, written, width))
    state_out = reference.fold(state.copy(), ring, row_ids, ring_row_ids, accepted, gate=gate)
    meta = _case_meta(layers, batch, num_value_heads, num_key_heads, key_dim, value_dim, ring_len, stride,
                      state_dtype, seed, source="gdfold_max.cases.random_fold_case (numpy reference fold)")
    meta["gate"] = gate
    return FoldCase(state, ring, row_ids, ring_row_ids, accepted, state_out, meta=meta)


def spec_decode_case(
    seed: int,
    *,
    layers: int = 2,
    batch: int = 4,
    num_value_heads: int = 4,
    num_key_heads: int = 2,
    key_dim: int = 64,
    value_dim: int = 64,
    ring_len: int = 4,
    verify_width: int = 3,
    state_dtype: str = "float32",
    num_accepted: list[int] | None = None,
    gate: Gate = "head",
) -> FoldCase:
    """A verify step run by the numpy reference, with the expected pool after the fold.

    Each request verifies ``verify_width + 1`` tokens (the last accepted token and the
    drafts) into its ring row; ``num_accepted`` (random in 0..verify_width+1 by default)
    says how many to keep. ``state_out`` is the reference forward over the kept tokens.
    """
    if verify_width + 1 > ring_len:
        raise ValueError(f"verify_width: {verify_width} + 1 tokens do not fit RING_LEN {ring_len}")
    rng = np.random.default_rng(seed)
    dtype = _state_dtype(state_dtype)
    heads = reference.HeadShape(num_key_heads, num_value_heads, key_dim, value_dim)
    layout = RecordLayout(key_dim, value_dim, heads.group_size, gate)
    window = verify_width + 1
    rows, ring_rows = layers * batch + 2, layers * batch + 1
    if num_accepted is None:
        num_accepted = [int(n) for n in rng.integers(0, window + 1, batch)]
    accepted = np.asarray(num_accepted, np.uint32)
    tokens = batch * window
    offsets = np.arange(0, tokens + 1, window, dtype=np.uint32)
    qkv = rng.standard_normal((layers, tokens, heads.qkv_width)).astype(np.float32)
    decay_shape = (layers, tokens, num_value_heads) + ((key_dim,) if gate == "channel" else ())
    decay = rng.uniform(0.6, 1.0, decay_shape).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (layers, tokens, num_value_heads)).astype(np.float32)
    state = (rng.standard_normal((rows, num_value_heads, key_dim, value_dim)) * 0.1).astype(np.float32).astype(dtype)
    ring = np.full((ring_rows, num_key_heads, ring_len, layout.min_stride), np.nan, np.float32)
    row_ids, ring_row_ids = _layer_major_tables(rng, layers, batch, rows, ring_rows)
    state_out = state.copy()
    kept = np.concatenate([np.arange(b * window, b * window + int(accepted[b])) for b in range(batch)]).astype(int)
    kept_offsets = np.concatenate([[0], np.cumsum(accepted)]).astype(np.uint32)
    for layer in range(layers):
        reference.verify_ring(qkv[layer], decay[layer], beta[layer], state, ring, row_ids[layer],
                              ring_row_ids[layer], offsets)
    reference.recurrence_layers(qkv[:, kept], decay[:, kept], beta[:, kept], state_out, row_ids, kept_offsets,
                                num_key_heads=num_key_heads)
    # Records past the accepted count stay in the ring (a fold must not read them);
    # poison them so a fold that does is caught.
    for layer in range(layers):
        for b in range(batch):
            ring[ring_row_ids[layer, b], :, int(accepted[b]):] = np.nan
    meta = _case_meta(layers, batch, num_value_heads, num_key_heads, key_dim, value_dim, ring_len,
                      layout.min_stride, state_dtype, seed, verify_width=verify_width,
                      source="gdfold_max.cases.spec_decode_case (numpy reference verify + forward)")
    meta["gate"] = gate
    extras = dict(qkv=qkv, decay=decay, beta=beta, input_row_offsets=offsets)
    return FoldCase(state, ring, row_ids, ring_row_ids, accepted, state_out, extras=extras, meta=meta)


@dataclass
class WindowCase:
    """The operands of one verify step (and of its fold-on-load variant) or forward.

    ``previous_ring_row_ids`` name ring rows holding the previous step's records (random
    records, NaN padding); ``ring_row_ids`` name other rows, all NaN, for the new ones.
    """

    qkv: NDArray
    decay: NDArray
    beta: NDArray
    state: NDArray
    ring: NDArray
    row_ids: NDArray
    ring_row_ids: NDArray
    input_row_offsets: NDArray
    previous_ring_row_ids: NDArray
    previous_num_accepted: NDArray

    @property
    def num_key_heads(self) -> int:
        return int(self.ring.shape[1])

    def tokens(self) -> tuple[NDArray, NDArray, NDArray]:
        return self.qkv, self.decay, self.beta

    def fresh(self) -> tuple[NDArray, NDArray]:
        """Copies of the pool and the ring, to be written by one run."""
        return self.state.copy(), self.ring.copy()

    def run_verify(self, verify: Callable[..., NDArray], *, fold_on_load: bool) -> tuple[NDArray, NDArray, NDArray]:
        """Readout, pool and ring after ``verify`` (ours, e.g. ``WindowRunner.verify_ring``,
        or ``reference.verify_ring``) on fresh copies, folding the previous records on
        load when asked."""
        state, ring = self.fresh()
        previous = {}
        if fold_on_load:
            previous = {"previous_ring_row_ids": self.previous_ring_row_ids,
                        "previous_num_accepted": self.previous_num_accepted}
        out = verify(*self.tokens(), state, ring, self.row_ids, self.ring_row_ids, self.input_row_offsets,
                     **previous)
        return out, state, ring


def random_window_case(
    seed: int,
    *,
    windows: list[int] | None = None,
    previous_num_accepted: list[int] | None = None,
    num_value_heads: int = 4,
    num_key_heads: int = 2,
    key_dim: int = 64,
    value_dim: int = 64,
    ring_len: int = 4,
    state_dtype: str = "float32",
    gate: Gate = "head",
) -> WindowCase:
    """A ragged batch of windows over a random pool, with previous records to fold.

    ``windows`` defaults to token counts RING_LEN, 0, 1, RING_LEN + 2 (recorded as a
    forward: it commits) and 2; ``previous_num_accepted`` to RING_LEN, 1, 0,
    RING_LEN + 1 (nothing to fold) and 2.
    """
    rng = np.random.default_rng(seed)
    dtype = _state_dtype(state_dtype)
    windows = windows if windows is not None else [ring_len, 0, 1, ring_len + 2, 2]
    batch = len(windows)
    counts = previous_num_accepted if previous_num_accepted is not None else [ring_len, 1, 0, ring_len + 1, 2]
    counts = [counts[b % len(counts)] for b in range(batch)]
    layout = RecordLayout(key_dim, value_dim, num_value_heads // num_key_heads, gate)
    offsets = np.concatenate([[0], np.cumsum(windows)]).astype(np.uint32)
    tokens = int(offsets[-1])
    width = 2 * num_key_heads * key_dim + num_value_heads * value_dim
    rows = rng.permutation(batch + 2)[:batch].astype(np.uint32)
    ring_rows = rng.permutation(2 * batch + 1)
    previous_rows, new_rows = ring_rows[:batch].astype(np.uint32), ring_rows[batch : 2 * batch].astype(np.uint32)
    state = (0.1 * rng.standard_normal((batch + 2, num_value_heads, key_dim, value_dim))).astype(np.float32)
    ring = np.full((2 * batch + 1, num_key_heads, ring_len, layout.min_stride), np.nan, np.float32)
    records = ring[previous_rows]
    records[..., :key_dim] = rng.standard_normal(records[..., :key_dim].shape)
    deltas = slice(layout.delta_offset(0), layout.decay_offset(0))
    records[..., deltas] = 0.1 * rng.standard_normal(records[..., deltas].shape)
    decays = slice(layout.decay_offset(0), layout.elements)
    records[..., decays] = rng.uniform(0.6, 1.0, records[..., decays].shape)
    ring[previous_rows] = records
    return WindowCase(
        qkv=rng.standard_normal((tokens, width)).astype(np.float32),
        decay=rng.uniform(0.6, 1.0, (tokens, num_value_heads) + ((key_dim,) if gate == "channel" else ())
                          ).astype(np.float32),
        beta=rng.uniform(0.0, 1.0, (tokens, num_value_heads)).astype(np.float32),
        state=state.astype(dtype),
        ring=ring,
        row_ids=rows,
        ring_row_ids=new_rows,
        input_row_offsets=offsets,
        previous_ring_row_ids=previous_rows,
        previous_num_accepted=np.asarray(counts, np.uint32),
    )


def chunked_fold_on_load_case(state_dtype: str = "float32", gate: Gate = "head") -> WindowCase:
    """RING_LEN 16 at K = V = 128, windows of 16, 3, 8, 1, 5, 2 and 4 tokens after folds on
    load of 9, 12, 16, 13, 5, 0 and 8 records: two to four chunks of four records, or none,
    so that units of three to a block fold odd and even numbers of chunks one after
    another (the throughput kernel stages a fold on load four records at a time)."""
    return random_window_case(16, windows=[16, 3, 8, 1, 5, 2, 4], previous_num_accepted=[9, 12, 16, 13, 5, 0, 8],
                              ring_len=16, key_dim=128, value_dim=128, state_dtype=state_dtype, gate=gate)


def random_parents(seed: int, windows: list[int], ring_len: int) -> NDArray:
    """A random token tree per request (``trees``' ``parents`` table ``[batch, RING_LEN]``
    int32): node 0 continues the committed state, every later node picks its parent among
    the nodes before it (the one just before half of the time, so that paths run deep) or,
    one time in ten, the committed state too (a forest); entries past a window are -1."""
    rng = np.random.default_rng(seed)
    parents = np.full((len(windows), ring_len), -1, np.int32)
    for b, window in enumerate(windows):
        for i in range(1, window):
            draw = rng.random()
            parents[b, i] = -1 if draw < 0.1 else i - 1 if draw < 0.55 else rng.integers(0, i)
    return parents


def random_accepted_nodes(seed: int, parents: NDArray, windows: list[int]) -> tuple[NDArray, NDArray]:
    """A random accepted path per request along ``parents``: the root path of a random
    node (none, for an empty window, and now and then for any). Returns
    ``(accepted_nodes [batch, RING_LEN] uint32, num_accepted [batch] uint32)``; entries
    past a path are RING_LEN, a node no window holds."""
    rng = np.random.default_rng(seed)
    batch, ring_len = parents.shape
    nodes = np.full((batch, ring_len), ring_len, np.uint32)
    counts = np.zeros(batch, np.uint32)
    for b, window in enumerate(windows):
        if window == 0 or rng.random() < 0.15:
            continue
        path = root_path(parents[b], int(rng.integers(0, window)))
        nodes[b, : len(path)] = path
        counts[b] = len(path)
    return nodes, counts


def shard_window_case(case: WindowCase, shard: HeadShard) -> tuple[np.ndarray, ...]:
    """A verify case's ``qkv``, ``decay``, ``beta``, pool and ring cut to one shard (its row
    tables serve every shard as they are). Imports ``gdfold_max.sharded``, so needs MAX."""
    from .sharded import shard_pool, shard_ring, shard_window_inputs

    _, _, key_dim, value_dim = case.state.shape
    tokens = shard_window_inputs(*case.tokens(), shard, num_key_heads=case.num_key_heads, key_dim=key_dim,
                                 value_dim=value_dim)
    return (*tokens, shard_pool(case.state, shard), shard_ring(case.ring, shard))
