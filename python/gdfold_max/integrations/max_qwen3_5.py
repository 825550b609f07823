"""gdfold_max inside MAX's own Qwen3.5 speculative pipeline.

MAX 26.7's MTP speculative decoding of Qwen3.5 (``unified_mtp_qwen3_5``) rolls each
Gated DeltaNet layer back with a verify that records into a ring
(``qwen3_5.layers.gated_deltanet``, ``gated_delta_recurrence_verify_ring_fwd``) and a
fold of the accepted records (``unified_mtp_qwen3_5.state_rollback.fold_state_pools``,
one ``gated_delta_state_fold`` per device). Both modules bind those op names when they
are imported, so switching means rebinding the names there.

* :func:`patched` (or :func:`install` / :func:`uninstall`) routes the pipeline's fold to
  :func:`gdfold_max.state_fold` on every device. The fold is bit-identical to MAX's, and
  it also runs on the CPU, where MAX's has no kernel. With ``verify=True`` the layers'
  verify runs :func:`gdfold_max.verify_ring` too: its ring records and pools are then
  those of our verify, bit for bit, and its readout differs from MAX's in the last bits
  (our documented order of the sums over K; MAX's is not documented). With
  ``forward=True`` the layers' plain steps (``gated_delta_recurrence_fwd``: a decoding
  step of one token per request, and on GPUs below SM100 a prefill too) run
  :func:`gdfold_max.recurrence`, with the same distance to MAX's. While installed,
  our kernel package is among MAX's default custom extensions
  (``max.graph.default_custom_extensions``), since MAX's pipelines build their graphs
  without naming any.
* :class:`FusedGatedDeltaNet` is MAX's ``GatedDeltaNet`` with our verify that folds the
  previous step's records as it loads the state. It needs two ring rows per request and
  the previous step's counts, which MAX's own state bookkeeping does not keep:
  :mod:`gdfold_max.integrations.max_qwen3_5_serve` keeps them and serves it inside
  MAX's MTP pipeline (``max serve --custom-architectures``); a caller that keeps them
  itself calls the layer directly.

The conv window's rollback (``replay_conv_pools``) stays MAX's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any

from max.dtype import DType
from max.graph import BufferValue, TensorType, TensorValue, default_custom_extensions_scope, ops

from ..ops.checks import static_size
from ..ops.fold import state_fold, when_no_drafts
from ..ops.kernels import kernels_path
from ..ops.window import recurrence, verify_or_forward, verify_ring

try:
    from max.pipelines.architectures.qwen3_5.layers import gated_deltanet
    from max.pipelines.architectures.unified_mtp_qwen3_5 import state_rollback
except ImportError as error:
    raise ImportError(
        f"MAX's Qwen3.5 pipeline does not import ({error}); it needs MAX's serve extra:"
        " pip install 'gdfold_max[max-pipelines]'"
    ) from error

#: Where MAX binds each op name this module routes: (module, name).
FOLD_SITE: tuple[ModuleType, str] = (state_rollback, "gated_delta_state_fold")
VERIFY_SITE: tuple[ModuleType, str] = (gated_deltanet, "gated_delta_recurrence_verify_ring_fwd")
FORWARD_SITE: tuple[ModuleType, str] = (gated_deltanet, "gated_delta_recurrence_fwd")
SITES = {"fold": FOLD_SITE, "verify": VERIFY_SITE, "forward": FORWARD_SITE}

_lock = threading.RLock()
#: The names MAX bound, kept while one of ours stands in their place.
_originals: dict[str, Any] = {}
#: While installed: holds our kernels among MAX's default custom extensions. MAX's
#: pipelines build their graphs without ``custom_extensions``, so a graph they build while
#: we are installed finds our kernels only there.
_kernels: ExitStack | None = None


def _key(site: tuple[ModuleType, str]) -> str:
    return f"{site[0].__name__}.{site[1]}"


def _route(site: tuple[ModuleType, str], ours: Any | None) -> None:
    """Binds ``ours`` at ``site``, or MAX's own name again where ``ours`` is None."""
    module, name = site
    key = _key(site)
    if ours is None:
        if key in _originals:
            setattr(module, name, _originals.pop(key))
        return
    _originals.setdefault(key, getattr(module, name))
    setattr(module, name, ours)


def _register_kernels(register: bool) -> None:
    """Adds our kernel package to MAX's default custom extensions, or takes it out."""
    global _kernels
    if register and _kernels is None:
        stack = ExitStack()
        stack.enter_context(default_custom_extensions_scope(kernels_path()))
        _kernels = stack
    elif not register and _kernels is not None:
        _kernels.close()
        _kernels = None


def install(*, verify: bool = False, forward: bool = False) -> None:
    """Routes MAX's Qwen3.5 fold (``fold_state_pools``, every device) to
    :func:`gdfold_max.state_fold`, with ``verify=True`` the Gated DeltaNet layers'
    verify to :func:`verify_like_max`, and with ``forward=True`` their plain steps to
    :func:`forward_like_max`; every graph built from then on links our kernels, also one
    built without ``custom_extensions`` as MAX's pipelines build theirs. Calling it again
    replaces the earlier choice."""
    with _lock:
        _route(FOLD_SITE, state_fold)
        _route(VERIFY_SITE, verify_like_max if verify else None)
        _route(FORWARD_SITE, forward_like_max if forward else None)
        _register_kernels(True)


def uninstall() -> None:
    """Puts MAX's own op names back, and takes our kernels out of the graphs built from
    then on."""
    with _lock:
        for site in SITES.values():
            _route(site, None)
        _register_kernels(False)


def installed() -> dict[str, bool]:
    """Which of MAX's names are routed to ours now: ``{"fold": ..., "verify": ...,
    "forward": ...}``."""
    with _lock:
        return {what: _key(site) in _originals for what, site in SITES.items()}


@contextmanager
def patched(*, verify: bool = False, forward: bool = False) -> Iterator[None]:
    """:func:`install` for the ``with`` block; on the way out, also after an exception,
    every name is bound as it was before the block (MAX's, or an outer install's).

    Graphs built inside the block use our ops; a graph built and compiled before keeps
    what it was built with."""
    with _lock:
        before = {site: getattr(site[0], site[1]) for site in SITES.values()}
        originals = dict(_originals)
        install(verify=verify, forward=forward)
    try:
        yield
    finally:
        with _lock:
            for (module, name), value in before.items():
                setattr(module, name, value)
            _originals.clear()
            _originals.update(originals)
            # Our kernels stay registered exactly while our fold is routed.
            _register_kernels(_key(FOLD_SITE) in _originals)


def verify_like_max(
    qkv_conv_output: TensorValue,
    decay_per_token: TensorValue,
    beta_per_token: TensorValue,
    recurrent_state: BufferValue,
    ring: BufferValue,
    slot_idx: TensorValue,
    ring_slot_idx: TensorValue,
    input_row_offsets: TensorValue,
    verify_width: TensorValue,
) -> TensorValue:
    """Our verify with the arguments and the width rule of MAX's
    ``gated_delta_recurrence_verify_ring_fwd``: at a verify width of 0 there is nothing
    to roll back, so the window lands on the pool (our forward) and no record is
    written; otherwise each token records into the ring and the pool is only read."""
    def forward() -> TensorValue:
        return recurrence(qkv_conv_output, decay_per_token, beta_per_token, recurrent_state, slot_idx,
                          input_row_offsets)

    def record() -> TensorValue:
        return verify_ring(qkv_conv_output, decay_per_token, beta_per_token, recurrent_state, ring, slot_idx,
                           ring_slot_idx, input_row_offsets)

    return _by_width(verify_width, qkv_conv_output, recurrent_state, forward, record)


def forward_like_max(
    qkv_conv_output: TensorValue,
    decay_per_token: TensorValue,
    beta_per_token: TensorValue,
    recurrent_state: BufferValue,
    slot_idx: TensorValue,
    input_row_offsets: TensorValue,
) -> TensorValue:
    """Our forward with the arguments of MAX's ``gated_delta_recurrence_fwd`` (MAX's
    layer passes them by these names): every request's tokens run and its pool row is
    committed."""
    return recurrence(qkv_conv_output, decay_per_token, beta_per_token, recurrent_state, slot_idx,
                      input_row_offsets)


def fused_verify(previous_ring_row_id: TensorValue, previous_num_accepted: TensorValue
                 ) -> Callable[..., TensorValue]:
    """MAX's verify signature, bound to the previous step's ring rows and counts: the
    previous records fold as the state loads, then the window runs (at a verify width
    of 0, the fold and then our forward). A width known when the graph is built picks
    one side then; a symbolic one is read by the op as it runs (:func:`verify_or_forward`),
    so the layer adds no branch to the graph."""
    def verify(qkv_conv_output: TensorValue, decay_per_token: TensorValue, beta_per_token: TensorValue,
               recurrent_state: BufferValue, ring: BufferValue, slot_idx: TensorValue, ring_slot_idx: TensorValue,
               input_row_offsets: TensorValue, verify_width: TensorValue) -> TensorValue:
        def either() -> TensorValue:
            return verify_or_forward(qkv_conv_output, decay_per_token, beta_per_token, recurrent_state, ring,
                                     slot_idx, ring_slot_idx, input_row_offsets, previous_ring_row_id,
                                     previous_num_accepted, verify_width)

        def forward() -> TensorValue:
            state_fold(recurrent_state, ring, ops.unsqueeze(slot_idx, 0), ops.unsqueeze(previous_ring_row_id, 0),
                       previous_num_accepted)
            return recurrence(qkv_conv_output, decay_per_token, beta_per_token, recurrent_state, slot_idx,
                              input_row_offsets)

        def record() -> TensorValue:
            return verify_ring(qkv_conv_output, decay_per_token, beta_per_token, recurrent_state, ring, slot_idx,
                               ring_slot_idx, input_row_offsets, previous_ring_row_ids=previous_ring_row_id,
                               previous_num_accepted=previous_num_accepted)

        # verify_or_forward takes head gates; per-channel ones branch in the graph.
        return _by_width(verify_width, qkv_conv_output, recurrent_state, forward, record,
                         either if decay_per_token.rank == 2 else None)

    return verify


def _by_width(verify_width: TensorValue, qkv: TensorValue, recurrent_state: BufferValue,
              forward: Callable[[], TensorValue], record: Callable[[], TensorValue],
              either: Callable[[], TensorValue] | None = None) -> TensorValue:
    """``forward()`` at a verify width of 0, ``record()`` at any other: chosen when the
    graph is built where the width is static, and as it runs where it is symbolic, by
    ``either()`` (one op that reads the width itself) where given, else by a branch in
    the graph."""
    if verify_width.rank != 1:
        raise ValueError(f"verify_width: expected rank 1 [K], got rank {verify_width.rank}")
    width = static_size(verify_width.shape[0])
    if width == 0:
        return forward()
    if width is not None:
        return record()
    if either is not None:
        return either()
    readout = TensorType(DType.float32, [qkv.shape[0], recurrent_state.shape[1] * recurrent_state.shape[3]],
                         recurrent_state.device)
    return when_no_drafts(verify_width, [readout], forward, record)[0]


class FusedGatedDeltaNet(gated_deltanet.GatedDeltaNet):
    """MAX's ``GatedDeltaNet`` whose verify folds the previous step's accepted records
    as it loads the state (:func:`gdfold_max.verify_ring` with fold on load), so the
    separate fold launches nothing: a decoding step reads and writes the state once.

    Called as MAX's layer is, plus, on a verify (``ring`` and ``verify_width`` given),
    ``previous_ring_row_id`` (``[batch]``: the ring rows the previous step recorded
    into) and ``previous_num_accepted`` (``[batch]``: how many of those records each
    request keeps; 0, or a count past RING_LEN, folds nothing). ``ring.row_id`` must name
    other rows: keep two ring rows per request and alternate between steps. At a verify
    width of 0 the previous records fold and the window lands on the pool.

    Where the caller cannot pass them (MAX's ``Qwen3_5LinearAttentionBlock`` calls its
    shards with fixed keywords), the same pair may be bound on the layer as
    :attr:`fused_previous` while the graph is built; the keywords win when given.

    The pools equal, bit for bit, those of our fold followed by our verify; everything
    else in the layer (projections, conv, norm) is MAX's.
    """

    #: ``(previous_ring_row_id, previous_num_accepted)`` for a call without them, or None.
    fused_previous: tuple[TensorValue, TensorValue] | None = None

    def __call__(self, *args: Any, previous_ring_row_id: TensorValue | None = None,
                 previous_num_accepted: TensorValue | None = None, **kwargs: Any) -> TensorValue:
        names = ("x", "conv_pool", "conv_row_id", "recurrent_pool", "recurrent_row_id", "input_row_offsets",
                 "replay_capture", "ring", "verify_width")
        given = dict(zip(names, args, strict=False)) | kwargs
        if given.get("verify_width") is None or given.get("ring") is None:
            return super().__call__(*args, **kwargs)
        if previous_ring_row_id is None and previous_num_accepted is None and self.fused_previous is not None:
            previous_ring_row_id, previous_num_accepted = self.fused_previous
        if previous_ring_row_id is None or previous_num_accepted is None:
            raise ValueError("previous_ring_row_id, previous_num_accepted: a fused verify needs the previous"
                             " step's ring rows and accepted counts")
        # The layer looks its verify up in its module as the graph is built: bind ours,
        # with this step's tables, for the duration of the call.
        with _lock:
            before = getattr(*VERIFY_SITE)
            setattr(*VERIFY_SITE, fused_verify(previous_ring_row_id, previous_num_accepted))
            try:
                return super().__call__(*args, **kwargs)
            finally:
                setattr(*VERIFY_SITE, before)
