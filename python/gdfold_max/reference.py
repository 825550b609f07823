"""A numpy reference for the gated delta recurrence, its verify ring and the fold.

This module needs only numpy and ml_dtypes (importing it does not import MAX or the
kernels), so it stays an independent witness.
Every state update goes through :func:`fma_f32`, an exact fp32 fused multiply-add:
an fp32 product is exact in fp64, and an fp64 sum rounded to odd (TwoSum error term,
then an even result nudged one ulp toward the error) rounds to the correctly rounded
fp32 result. So the reference fold reproduces the kernels bit for bit, and folding the
records of :func:`verify_ring` equals :func:`recurrence` over the accepted tokens.

The verify and the forward follow the kernels' fixed order (``mojo/recurrence_math.mojo``):
every sum over K runs on 8 lanes, lane ``p`` chaining fmas over ``i = p, p+8, ...``, and
the lanes then add pairwise (see :func:`lane_dot`); ``v - kv/|k|`` is one fma. So the
reference reproduces the kernels' readout and records bit for bit as well.

Shapes follow ``docs/design.md``: ``qkv [T, 2*nk*K + nv*V]`` (q, k, v concatenated),
``decay`` and ``beta`` ``[T, nv]``, a pool ``[rows, nv, K, V]`` of float32 or
``ml_dtypes.bfloat16``, a ring ``[ring_rows, nk, RING_LEN, stride]`` of float32.

Per-channel gates (Kimi Delta Attention): a ``decay`` of shape ``[T, nv, K]`` decays each
key row of a value head's state by its own factor, ``S[i, :] = S[i, :] * d[i]``; the rest
of the step is unchanged, and the records hold K decays per value head
(``layout.RecordLayout(..., gate="channel")``). :func:`fold` then takes ``gate="channel"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from .layout import REDUCTION_LANES, Gate, RecordLayout

#: Added to the squared norm before the square root in the L2 normalisation.
L2_EPS = 1e-6

F32 = NDArray[np.float32]


def fma_f32(a: NDArray, b: NDArray, c: NDArray) -> F32:
    """Returns ``a * b + c`` rounded once to float32, element-wise and exactly.

    Args:
        a, b, c: float32 arrays (broadcast together).

    Example:
        >>> a = np.float32(1 + 2**-12); c = np.float32(-(1 + 2**-11))
        >>> float(fma_f32(a, a, c)) == 2.0**-24   # one rounding, not two
        True
    """
    a64 = np.asarray(a, np.float32).astype(np.float64)
    b64 = np.asarray(b, np.float32).astype(np.float64)
    c64 = np.asarray(c, np.float32).astype(np.float64)
    with np.errstate(all="ignore"):
        product = a64 * b64  # exact: 24 + 24 significant bits fit in 53
        total = product + c64
        # TwoSum: the exact rounding error of `total`.
        c_part = total - product
        p_part = total - c_part
        error = (product - p_part) + (c64 - c_part)
        # Round to odd: an inexact, even-mantissa sum moves one ulp toward the error.
        even = (np.asarray(total).view(np.uint64) & np.uint64(1)) == 0
        nudge = (error != 0) & even & np.isfinite(total)
        toward = np.where(error > 0, np.inf, -np.inf)
        total = np.where(nudge, np.nextafter(total, toward), total)
        return np.asarray(total.astype(np.float32))


def _widen(block: NDArray) -> F32:
    return np.asarray(block, dtype=np.float32)


def _narrow_like(values: F32, like: NDArray) -> NDArray:
    """Rounds fp32 values to the pool's dtype (round to nearest even for bf16)."""
    return values.astype(like.dtype)


@dataclass(frozen=True)
class HeadShape:
    """Head counts and dims of one gated-delta layer."""

    num_key_heads: int
    num_value_heads: int
    key_dim: int
    value_dim: int

    @property
    def group_size(self) -> int:
        return self.num_value_heads // self.num_key_heads

    @property
    def qkv_width(self) -> int:
        return 2 * self.num_key_heads * self.key_dim + self.num_value_heads * self.value_dim

    def split(self, qkv_row: NDArray) -> tuple[F32, F32, F32]:
        """Splits one token's qkv into q, k (``[nv, K]``, repeated per group) and v."""
        nk, nv, kd, vd = self.num_key_heads, self.num_value_heads, self.key_dim, self.value_dim
        row = np.asarray(qkv_row, np.float32)
        q = row[: nk * kd].reshape(nk, kd)
        k = row[nk * kd : 2 * nk * kd].reshape(nk, kd)
        v = row[2 * nk * kd :].reshape(nv, vd)
        g = self.group_size
        return np.repeat(q, g, axis=0), np.repeat(k, g, axis=0), v


def _lane_tree(lanes: F32) -> F32:
    """Adds the 8 lane sums on axis 1 pairwise: ``(p, p+4)``, ``(p, p+2)``, ``(p, p+1)``."""
    pairs = lanes[:, :4] + lanes[:, 4:]
    quads = pairs[:, :2] + pairs[:, 2:]
    return np.asarray(quads[:, 0] + quads[:, 1], np.float32)


def lane_dot(matrix: F32, vector: F32) -> F32:
    """``sum_i matrix[h, i, :] * vector[h, i]`` in the kernels' fixed order.

    Lane ``p`` chains fmas over ``i = p, p+8, p+16, ...`` from +0; then the lanes add
    pairwise (:func:`_lane_tree`). ``matrix`` is ``[nv, K, V]``, ``vector`` ``[nv, K]``.
    """
    heads, key_dim = vector.shape
    lanes = np.zeros((heads, REDUCTION_LANES) + matrix.shape[2:], np.float32)
    for m in range(key_dim // REDUCTION_LANES):
        rows = slice(m * REDUCTION_LANES, (m + 1) * REDUCTION_LANES)
        lanes = fma_f32(matrix[:, rows], vector[:, rows].reshape(lanes.shape[:2] + (1,) * (matrix.ndim - 2)), lanes)
    return _lane_tree(lanes)


def inverse_norm(x: F32) -> F32:
    """``1 / sqrt(sum(x*x) + eps)`` per row of ``[nv, K]``, in the fixed lane order."""
    squares = lane_dot(x[:, :, None], x)[:, 0]
    return np.float32(1.0) / np.sqrt(squares + np.float32(L2_EPS))


def query_scale(key_dim: int) -> np.float32:
    """``1/sqrt(K)``, computed in float64 and rounded once to float32."""
    return np.float32(1.0 / np.sqrt(float(key_dim)))


def decayed(state: F32, decay: NDArray) -> F32:
    """``state * decay``, rounded to fp32: ``[nv]`` decays scale a value head's whole
    ``[K, V]`` state, ``[nv, K]`` decays (per-channel gates) each of its key rows."""
    decay = np.asarray(decay, np.float32)
    factor = decay[:, None, None] if decay.ndim == 1 else decay[:, :, None]
    return np.asarray(state * factor, np.float32)


def gate_of(decay: NDArray) -> Gate:
    """``"head"`` for decays of shape ``[T, nv]``, ``"channel"`` for ``[T, nv, K]``."""
    ndim = np.asarray(decay).ndim
    if ndim not in (2, 3):
        raise ValueError(f"decay: expected [T, nv] or [T, nv, K], got rank {ndim}")
    return "channel" if ndim == 3 else "head"


def _token_step(
    state: F32, q: F32, k: F32, v: F32, decay: F32, beta: F32, heads: HeadShape
) -> tuple[F32, F32, F32]:
    """One token of the recurrence on an fp32 ``[nv, K, V]`` state, in the kernels' order.

    Returns the new state, the delta factor ``u`` (``[nv, V]``) and the readout.
    """
    beta = np.asarray(beta, np.float32)
    state = decayed(state, decay)
    kv = lane_dot(state, k)
    inv_k = inverse_norm(k)[:, None]
    delta = np.asarray((beta[:, None] * fma_f32(-kv, inv_k, v)) * inv_k, np.float32)
    state = fma_f32(k[:, :, None], delta[:, None, :], state)
    q_hat = np.asarray(q * (inverse_norm(q) * query_scale(heads.key_dim))[:, None], np.float32)
    return state, delta, lane_dot(state, q_hat)


def _requests(input_row_offsets: NDArray) -> list[tuple[int, int, int]]:
    offsets = [int(x) for x in np.asarray(input_row_offsets)]
    return [(b, offsets[b], offsets[b + 1]) for b in range(len(offsets) - 1)]


def recurrence(
    qkv: NDArray,
    decay: NDArray,
    beta: NDArray,
    recurrent_state: NDArray,
    row_ids: NDArray,
    input_row_offsets: NDArray,
    *,
    num_key_heads: int,
) -> F32:
    """Runs the recurrence over a ragged batch and commits the pool in place.

    Args:
        qkv: ``[T, 2*nk*K + nv*V]`` float32, q, k and v of every token.
        decay: ``[T, nv]`` float32 decays, already exp'd, or ``[T, nv, K]`` (per-channel).
        beta: ``[T, nv]`` float32 gates.
        recurrent_state: ``[rows, nv, K, V]`` float32 or bfloat16 pool, updated in place.
        row_ids: ``[B]`` pool row of each request.
        input_row_offsets: ``[B+1]`` token offsets of the requests.
        num_key_heads: nk.

    Returns:
        The readout, ``[T, nv*V]`` float32.
    """
    _, nv, kd, vd = recurrent_state.shape
    heads = HeadShape(num_key_heads, nv, kd, vd)
    readout = np.zeros((qkv.shape[0], nv * vd), np.float32)
    for b, start, end in _requests(input_row_offsets):
        row = int(row_ids[b])
        state = _widen(recurrent_state[row])
        for t in range(start, end):
            q, k, v = heads.split(qkv[t])
            state, _, out = _token_step(state, q, k, v, decay[t], beta[t], heads)
            readout[t] = out.reshape(-1)
        recurrent_state[row] = _narrow_like(state, recurrent_state)
    return readout


def recurrence_layers(
    qkv: NDArray,
    decay: NDArray,
    beta: NDArray,
    recurrent_state: NDArray,
    row_ids: NDArray,
    input_row_offsets: NDArray,
    *,
    num_key_heads: int,
) -> list[F32]:
    """:func:`recurrence` over every layer in turn on one pool: ``qkv``, ``decay`` and
    ``beta`` lead with the layer (``[layers, T, ...]``), ``row_ids`` is layer-major
    (``[layers, B]``, as the fold takes it), the offsets are every layer's. Returns each
    layer's readout; the pool is committed in place (a decoding loop's witness)."""
    return [recurrence(qkv[layer], decay[layer], beta[layer], recurrent_state, row_ids[layer], input_row_offsets,
                       num_key_heads=num_key_heads) for layer in range(len(row_ids))]


def verify_ring(
    qkv: NDArray,
    decay: NDArray,
    beta: NDArray,
    recurrent_state: NDArray,
    ring: NDArray,
    row_ids: NDArray,
    ring_row_ids: NDArray,
    input_row_offsets: NDArray,
    *,
    previous_ring_row_ids: NDArray | None = None,
    previous_num_accepted: NDArray | None = None,
) -> F32:
    """Runs the recurrence over each request's verify window, recording into the ring.

    Token ``i`` of request ``b``'s window writes record ``i`` of ring row
    ``ring_row_ids[b]`` (with ``decay [T, nv, K]``, in the per-channel layout); the pool
    is not written. A window longer than the ring's
    RING_LEN cannot be recorded: that request commits the pool itself, as a plain
    forward would, and writes no record.

    With ``previous_ring_row_ids`` and ``previous_num_accepted`` (fold on load), the
    previous step's records are first folded into the pool, exactly as :func:`fold`
    does, and the window runs from the folded state.

    Returns:
        The readout, ``[T, nv*V]`` float32.
    """
    if previous_ring_row_ids is not None and previous_num_accepted is not None:
        fold(recurrent_state, ring, np.asarray(row_ids)[None], np.asarray(previous_ring_row_ids)[None],
             previous_num_accepted, gate=gate_of(decay))
    return _record_windows(qkv, decay, beta, recurrent_state, ring, row_ids, ring_row_ids, input_row_offsets, None)


def _record_windows(qkv: NDArray, decay: NDArray, beta: NDArray, recurrent_state: NDArray, ring: NDArray,
                    row_ids: NDArray, ring_row_ids: NDArray, input_row_offsets: NDArray,
                    parents: NDArray | None) -> F32:
    """The verify's windows: token ``i`` of a request steps from the token before it
    (``parents`` None: a chain) or from node ``parents[b, i]`` (-1: the pool's state) and
    writes record ``i``; a chain longer than the ring commits the pool instead."""
    gate = gate_of(decay)
    _, nv, kd, vd = recurrent_state.shape
    _, nk, ring_len, _ = ring.shape
    heads = HeadShape(nk, nv, kd, vd)
    layout = RecordLayout(kd, vd, heads.group_size, gate)
    deltas_at, decays_at = layout.delta_offset(0), layout.decay_offset(0)
    readout = np.zeros((qkv.shape[0], nv * vd), np.float32)
    for b, start, end in _requests(input_row_offsets):
        row = int(row_ids[b])
        state = committed = _widen(recurrent_state[row])
        record_row = ring[int(ring_row_ids[b])]
        window = end - start
        states: list[F32] = []
        for i, t in enumerate(range(start, end)):
            if parents is not None:
                parent = int(parents[b, i])
                state = committed if parent < 0 else states[parent]
            q, k, v = heads.split(qkv[t])
            state, delta, out = _token_step(state, q, k, v, decay[t], beta[t], heads)
            states.append(state)
            readout[t] = out.reshape(-1)
            if window <= ring_len:
                record = record_row[:, i]  # [nk, stride]
                record[:, :kd] = k[:: heads.group_size]
                record[:, deltas_at : deltas_at + heads.group_size * vd] = delta.reshape(nk, -1)
                record[:, decays_at : decays_at + heads.group_size * layout.decay_length] = np.asarray(
                    decay[t], np.float32
                ).reshape(nk, -1)
        if window > ring_len:
            recurrent_state[row] = _narrow_like(state, recurrent_state)
    return readout


def verify_tree(
    qkv: NDArray,
    decay: NDArray,
    beta: NDArray,
    recurrent_state: NDArray,
    ring: NDArray,
    row_ids: NDArray,
    ring_row_ids: NDArray,
    input_row_offsets: NDArray,
    parents: NDArray,
    *,
    previous_ring_row_ids: NDArray | None = None,
    previous_num_accepted: NDArray | None = None,
    previous_accepted_nodes: NDArray | None = None,
) -> F32:
    """Runs the recurrence over each request's window as a token tree, recording into
    the ring (:mod:`gdfold_max.trees`).

    Node ``i`` (token ``i`` of the window) steps from its parent's fp32 state (from the
    pool's state for a parent of -1) in the order of :func:`recurrence`, and writes record
    ``i`` as :func:`verify_ring` does. So node ``i``'s readout is the forward's over the
    tokens of its root path, bit for bit, and folding the records of an accepted path
    (:func:`fold` with ``accepted_nodes``) equals the forward over that path's tokens. A
    chain (``trees.chain_parents``) gives :func:`verify_ring`'s readout and records. The
    pool is not written; every window must fit the ring (where :func:`verify_ring` would
    commit a longer chain, a tree has no one path to commit).

    With the previous step's ``previous_ring_row_ids``, ``previous_num_accepted`` and
    ``previous_accepted_nodes`` (fold on load), that step's accepted path is first folded
    into the pool, as :func:`fold` does, and the tree runs from the folded state.

    Returns:
        The readout, ``[T, nv*V]`` float32.

    Raises:
        ValueError: ``parents`` that do not describe trees of the windows
            (``trees.check_parents``), previous paths out of the ring or out of order
            (``trees.check_path_nodes``), or only some of the three previous tables.
    """
    from .trees import check_parents, previous_path_given

    requests = _requests(input_row_offsets)
    check_parents(parents, [end - start for _, start, end in requests], ring.shape[2])
    if previous_path_given(previous_ring_row_ids, previous_num_accepted, previous_accepted_nodes):
        assert previous_ring_row_ids is not None and previous_num_accepted is not None
        fold(recurrent_state, ring, np.asarray(row_ids)[None], np.asarray(previous_ring_row_ids)[None],
             previous_num_accepted, gate=gate_of(decay), accepted_nodes=previous_accepted_nodes)
    return _record_windows(qkv, decay, beta, recurrent_state, ring, row_ids, ring_row_ids, input_row_offsets,
                           parents)


def fold_records(state: NDArray, keys: NDArray, deltas: NDArray, decays: NDArray) -> F32:
    """Applies records to one fp32 ``[nv, K, V]`` state: ``S = fma(k, u, S * d)`` in order.

    Args:
        state: ``[nv, K, V]`` float32.
        keys: ``[n, nv, K]``; deltas: ``[n, nv, V]``; decays: ``[n, nv]`` float32, or
            ``[n, nv, K]`` with per-channel gates.
    """
    state = _widen(state)
    for t in range(keys.shape[0]):
        state = fma_f32(keys[t][:, :, None], deltas[t][:, None, :], decayed(state, decays[t]))
    return state


def fold(
    recurrent_state: NDArray,
    ring: NDArray,
    row_ids: NDArray,
    ring_row_ids: NDArray,
    num_accepted: NDArray,
    *,
    gate: Gate = "head",
    accepted_nodes: NDArray | None = None,
) -> NDArray:
    """Folds the first ``num_accepted[b]`` records of every (layer, request), in place.

    The reference twin of :func:`gdfold_max.fold`, with the same row semantics: a
    request with 0 or more than RING_LEN accepted records is not read or written.
    (Layer, request) pairs are applied in row-table order. ``gate="channel"`` reads the
    records' K decays per value head (per-channel gates). With ``accepted_nodes``
    ``[batch, RING_LEN]`` (a path along a token tree, :mod:`gdfold_max.trees`) the records
    folded are ``accepted_nodes[b, :num_accepted[b]]``, in that order, instead of the
    first ones; ``trees.check_path_nodes`` refuses a path that names nodes out of the ring
    or out of order (whether it follows parent links needs the tree:
    ``trees.check_accepted_nodes``).

    Returns:
        ``recurrent_state``, folded.
    """
    _, nv, kd, vd = recurrent_state.shape
    _, nk, ring_len, _ = ring.shape
    group = nv // nk
    layout = RecordLayout(kd, vd, group, gate)
    deltas_at, decays_at = layout.delta_offset(0), layout.decay_offset(0)
    row_ids = np.asarray(row_ids)
    ring_row_ids = np.asarray(ring_row_ids)
    if accepted_nodes is not None:
        from .trees import check_path_nodes

        check_path_nodes(accepted_nodes, num_accepted, ring_len)
    for layer in range(row_ids.shape[0]):
        for b, accepted in enumerate(int(n) for n in np.asarray(num_accepted)):
            if accepted == 0 or accepted > ring_len:
                continue
            row, ring_row = int(row_ids[layer, b]), int(ring_row_ids[layer, b])
            picked = slice(None, accepted) if accepted_nodes is None else np.asarray(
                accepted_nodes[b, :accepted], np.int64)
            records = np.asarray(ring[ring_row][:, picked], np.float32)  # [nk, n, stride]
            keys = np.repeat(records[:, :, :kd], group, axis=0)  # [nv, n, K]
            deltas = records[:, :, deltas_at : deltas_at + group * vd]
            deltas = deltas.reshape(nk, accepted, group, vd).transpose(0, 2, 1, 3)
            width = layout.decay_length
            fields = records[:, :, decays_at : decays_at + group * width].reshape(nk, accepted, group, width)
            decays = fields.transpose(1, 0, 2, 3).reshape(accepted, nv, width)  # [n, nv, 1 or K]
            state = fold_records(
                recurrent_state[row],
                keys.transpose(1, 0, 2),
                deltas.reshape(nv, accepted, vd).transpose(1, 0, 2),
                decays[:, :, 0] if gate == "head" else decays,
            )
            recurrent_state[row] = _narrow_like(state, recurrent_state)
    return recurrent_state


__all__ = [
    "L2_EPS",
    "REDUCTION_LANES",
    "HeadShape",
    "fma_f32",
    "fold",
    "decayed",
    "fold_records",
    "gate_of",
    "inverse_norm",
    "lane_dot",
    "query_scale",
    "recurrence",
    "recurrence_layers",
    "verify_ring",
    "verify_tree",
]
