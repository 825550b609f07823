"""Graph-level functions for the recurrence over token windows: ``verify_ring`` (with
or without fold on load), ``verify_tree`` (each window a token tree; on a GPU, the
latency kernel) and ``recurrence``, the plain forward.

A graph that calls these must be built with ``custom_extensions=[kernels_path()]``
(``gdfold_max.ops.kernels``). The arithmetic runs in one fixed, documented order (see
``reference``), so the numpy reference reproduces the readout, the records and the pool
bit for bit.
"""

from __future__ import annotations

import re
from typing import TypedDict

from max.driver import Accelerator, accelerator_count
from max.dtype import DType
from max.graph import BufferValue, DeviceRef, Dim, TensorType, TensorValue, ops

from ..layout import Gate
from ..trees import previous_path_given
from .checks import check_tree_table_shape, parent_table, pool_dims, ring_parameters, row_table, shape_text, static_size
from .fold import fold_tiling
from .kernels import (
    CHANNEL_OP_SUFFIX,
    RECURRENCE_OP_NAME,
    VERIFY_FOLD_ON_LOAD_OP_NAME,
    VERIFY_OP_NAME,
    VERIFY_OR_FORWARD_OP_NAME,
    VERIFY_TREE_FOLD_ON_LOAD_OP_NAME,
    VERIFY_TREE_OP_NAME,
)
from .shared_memory import check_column_tile_fits

#: Value columns one GPU block owns, at most. A block stages a K x tile slice of the
#: state in dynamic shared memory; at K=128 and an fp32 pool, 64 columns (128 threads
#: of 4 columns x 8 reduction lanes) let three blocks share an SM.
PREFERRED_COLUMN_TILE = 64

#: Threads of a GPU warp. A block of the window kernel holds two threads per column,
#: and its warps must each be whole or the block's only one (see _check_column_tile).
WARP_THREADS = 32

#: ``requests_per_block`` passed to the op when the caller names none: the op then
#: sizes the grid to the blocks the GPU holds at once, and they work through the units
#: (one request on one column tile of one head), claiming them where they run more
#: than two each.
AUTOMATIC_REQUESTS_PER_BLOCK = 0

#: The GPU kernels a window op can run, as the op's ``GPU_PATH`` parameter: the latency
#: kernel (one warp per request on one narrow column slab, its state in registers) and
#: the throughput kernel (resident blocks that work through many units, overlapping
#: one's copies with another's arithmetic). Both give the same bits. ``"auto"`` picks at
#: run time from the launch's units of work and tokens (``mojo/window_launch.mojo``): the
#: latency kernel for one-token windows (no more tokens than requests) of up to two of its
#: warps an SM, one request at Qwen3-Next's or Kimi-Linear's heads, where it led on an
#: H100 by 1.02x to 1.16x; else the throughput kernel, faster for longer windows at every
#: batch measured (``LATENCY_WARPS_PER_SM`` is 0). With per-channel gates (``[T, nv, K]``
#: decays) the same (the throughput kernel was 1.28x to 1.92x the latency kernel with
#: them at a window of 4, batches 1 to 256, on an H100), but the latency kernel where the
#: throughput kernel's staging does not fit an SM at the default tile (a large K with a
#: fold on load: K = 256, and from K = 208 at a 64-column tile).
GPU_PATHS = {"auto": 0, "latency": 1, "throughput": 2}
#: The warps a tree verify's unit may share its leaves among (``verify_tree``'s
#: ``leaf_warps``; mojo/window_launch.mojo, tree_leaves_shared).
TREE_LEAF_WARPS = 4


def check_gpu_path(gpu_path: str) -> None:
    """Raises ``ValueError`` unless ``gpu_path`` is one of :data:`GPU_PATHS`."""
    if gpu_path not in GPU_PATHS:
        raise ValueError(f"gpu_path: {gpu_path!r} must be one of {', '.join(map(repr, GPU_PATHS))}")


def check_leaf_warps(leaf_warps: int, gpu_path: str = "auto") -> None:
    """Raises ``ValueError`` unless ``leaf_warps`` is 1 or :data:`TREE_LEAF_WARPS`, and
    1 on the throughput path (its blocks share no leaves), and unless ``gpu_path`` is
    one of :data:`GPU_PATHS`."""
    check_gpu_path(gpu_path)
    if leaf_warps not in (1, TREE_LEAF_WARPS):
        raise ValueError(f"leaf_warps: {leaf_warps!r} must be 1 or {TREE_LEAF_WARPS}")
    if leaf_warps != 1 and gpu_path == "throughput":
        raise ValueError(f"leaf_warps: {leaf_warps!r} shares leaves on the latency kernel only; gpu_path"
                         " 'throughput' takes 1")


class WindowTiling(TypedDict, total=False):
    """The GPU keywords of :func:`verify_ring` and :func:`recurrence`."""

    column_tile: int | None
    requests_per_block: int | None
    gpu_path: str


def _tile_makes_whole_warps(tile: int) -> bool:
    """Whether a block of ``2 * tile`` threads is whole warps, or one warp at most.
    The kernel stages a unit's q, k and record keys a warp at a time, each warp on one
    kind of unit; a block of 48 threads (24 columns) split its second warp between
    kinds, and the kernel never finished on an H200."""
    threads = 2 * tile
    return threads % WARP_THREADS == 0 or WARP_THREADS % threads == 0


def default_column_tile(value_dim: int) -> int:
    """The GPU column tile used when the caller names none: the widest that divides V,
    up to 64 columns, among 4, 8, 16 and the multiples of 16 (_check_column_tile). On
    an H200 64 was fastest at K = 128 and at K = 256 alike
    (bench/results/window-tuning-log-h200-2026-11-29-to-12-01.txt).

    >>> default_column_tile(128), default_column_tile(96), default_column_tile(40)
    (64, 48, 8)
    >>> default_column_tile(256)
    64
    """
    tile = min(PREFERRED_COLUMN_TILE, value_dim)
    while value_dim % tile != 0 or tile % 4 != 0 or not _tile_makes_whole_warps(tile):
        tile -= 4
    return tile


def _check_column_tile(value_dim: int, column_tile: int | None) -> int:
    tile = default_column_tile(value_dim) if column_tile is None else column_tile
    if tile < 4 or tile % 4 != 0 or value_dim % tile != 0 or not _tile_makes_whole_warps(tile):
        raise ValueError(f"column_tile: {tile} must be 4, 8, 16 or a multiple of 16, and divide V={value_dim}")
    return tile


def gpu_tiling(state_dtype: DType, key_dim: int, value_dim: int, column_tile: int | None,
               requests_per_block: int | None, *, fold_on_load: bool = False,
               gpu_path: str = "auto", channel: bool = False) -> dict[str, int]:
    """The window ops' GPU parameters, checked (the CPU path ignores them): the tile
    must divide V, one block's shared memory must fit an SM, and the path is one of
    :data:`GPU_PATHS`."""
    check_gpu_path(gpu_path)
    if requests_per_block is not None and requests_per_block < 1:
        raise ValueError(f"requests_per_block: {requests_per_block} must be at least 1")
    requests = AUTOMATIC_REQUESTS_PER_BLOCK if requests_per_block is None else requests_per_block
    tile = _check_column_tile(value_dim, column_tile)
    if channel and gpu_path == "auto" and column_tile is None:
        # Per-channel gates stage their K decays too: where the throughput kernel's
        # staging does not fit an SM at the default tile (a large K with a fold on load:
        # from K = 208 at a 64-column tile, K = 256 at any), "auto" takes the latency
        # kernel, whose launch then does not compile the other. A tile the caller names
        # is checked as it is for "throughput".
        try:
            check_column_tile_fits(state_dtype, key_dim, tile, fold_on_load=fold_on_load, channel=True)
        except ValueError:
            gpu_path = "latency"
    else:
        check_column_tile_fits(state_dtype, key_dim, tile, fold_on_load=fold_on_load,
                               channel=channel and gpu_path != "latency")
    return {"COLUMN_TILE": tile, "REQUESTS_PER_BLOCK": requests, "GPU_PATH": GPU_PATHS[gpu_path]}


#: The GPU window kernel's instructions (tensor-box copies, mbarriers) are sm_90's; it
#: was tuned and tested on an H200.
WINDOW_GPU_ARCHITECTURE = re.compile(r"sm_9\d")


def check_window_device(device: DeviceRef) -> None:
    """Refuses, when the graph is built, a GPU the window kernel does not run on: an
    NVIDIA Hopper GPU (sm_90) or the CPU. A GPU this process cannot see is left to the
    op, which checks the device again before it enqueues anything.

    Raises:
        ValueError: naming ``recurrent_state``'s device and its architecture.
    """
    if not device.is_gpu() or device.id >= accelerator_count():
        return
    gpu = Accelerator(device.id)
    if gpu.api != "cuda" or not WINDOW_GPU_ARCHITECTURE.fullmatch(gpu.architecture_name.rstrip("a")):
        raise ValueError(
            f"recurrent_state: lives on GPU {device.id} ({gpu.api} {gpu.architecture_name}); the GPU verify and"
            " forward need an NVIDIA Hopper GPU (sm_90: H100, H200). Build the graph for the CPU instead."
        )


def check_qkv_width(width: int, num_value_heads: int, key_dim: int, value_dim: int,
                    num_key_heads: int | None = None) -> None:
    """Raises unless ``width == 2*nk*K + nv*V``; without ``num_key_heads``, for some nk dividing nv."""
    if num_key_heads is not None:
        expected = 2 * num_key_heads * key_dim + num_value_heads * value_dim
        if width != expected:
            raise ValueError(f"qkv: width {width} differs from 2*nk*K + nv*V = {expected}")
        return
    rest = width - num_value_heads * value_dim
    if rest <= 0 or rest % (2 * key_dim) != 0 or num_value_heads % (rest // (2 * key_dim)) != 0:
        raise ValueError(
            f"qkv: width {width} is not 2*nk*{key_dim} + nv*{value_dim} with nk dividing nv={num_value_heads}"
        )


def _check_token_inputs(qkv: TensorValue, decay: TensorValue, beta: TensorValue, num_value_heads: Dim,
                        key_dim: int) -> Gate:
    """Checks q, k, v, the decays and the betas; returns the gate the decay's shape names:
    ``"head"`` for ``[T, nv]``, ``"channel"`` (per-channel gates) for ``[T, nv, K]``."""
    for name, value in (("qkv", qkv), ("decay", decay), ("beta", beta)):
        if value.dtype != DType.float32:
            raise ValueError(f"{name}: dtype {value.dtype.name} is unsupported (float32)")
        if value.rank != 2 and not (name == "decay" and value.rank == 3):
            expected = "rank 2 [T, nv] or rank 3 [T, nv, K]" if name == "decay" else "rank 2"
            raise ValueError(f"{name}: expected {expected}, got shape {shape_text(list(value.shape))}")
    tokens = [static_size(v.shape[0]) for v in (qkv, decay, beta)]
    known = {t for t in tokens if t is not None}
    if len(known) > 1:
        raise ValueError(
            f"decay, beta: token counts {tokens[1]} and {tokens[2]} must equal qkv's {tokens[0]}"
        )
    heads = static_size(num_value_heads)
    for name, value in (("decay", decay), ("beta", beta)):
        width = static_size(value.shape[1])
        if heads is not None and width is not None and width != heads:
            expected = f"[T, nv={heads}]" if value.rank == 2 else f"[T, nv={heads}, K={key_dim}]"
            raise ValueError(f"{name}: expected {expected}, got shape {shape_text(list(value.shape))}")
    if decay.rank == 2:
        return "head"
    decays = static_size(decay.shape[2])
    if decays != key_dim:
        raise ValueError(f"decay: per-channel gates need [T, nv, K={key_dim}] (static K), got shape"
                         f" {shape_text(list(decay.shape))}")
    return "channel"


def _check_vector(name: str, value: TensorValue) -> TensorValue:
    if value.rank != 1:
        raise ValueError(f"{name}: expected rank 1, got shape {shape_text(list(value.shape))}")
    return row_table(name, value)


def _previous_tables(previous_ring_row_ids: TensorValue, previous_num_accepted: TensorValue) -> list[TensorValue]:
    """The previous step's ring rows and counts, checked: what a fold on load reads."""
    return [_check_vector("previous_ring_row_ids", previous_ring_row_ids),
            _check_vector("previous_num_accepted", previous_num_accepted)]


def _window_op(name: str, qkv: TensorValue, recurrent_state: BufferValue, operands: list[TensorValue | BufferValue],
               parameters: dict[str, int]) -> TensorValue:
    """Runs window op ``name`` in place on the pool and the ring among ``operands``;
    returns its readout, ``[T, nv*V]`` float32 on the pool's device."""
    readout = TensorType(DType.float32, [qkv.shape[0], recurrent_state.shape[1] * parameters["V"]],
                         recurrent_state.device)
    return ops.inplace_custom(name, recurrent_state.device, operands, out_types=[readout],
                              parameters=parameters)[0].tensor


def _check_verify_operands(qkv: TensorValue, decay: TensorValue, beta: TensorValue, recurrent_state: BufferValue,
                           ring: BufferValue, row_ids: TensorValue, ring_row_ids: TensorValue,
                           input_row_offsets: TensorValue) -> tuple[dict[str, int], Gate, list[TensorValue]]:
    """What :func:`verify_ring` and :func:`verify_tree` check alike: the tokens, the pool
    and the ring, qkv's width, the row tables. Returns the op's K, V and RING_LEN, the
    gate, and the row tables as the op reads them."""
    key_dim, _ = pool_dims(list(recurrent_state.shape), recurrent_state.dtype)
    gate = _check_token_inputs(qkv, decay, beta, recurrent_state.shape[1], key_dim)
    parameters = ring_parameters(list(recurrent_state.shape), recurrent_state.dtype, list(ring.shape), ring.dtype,
                                 gate)
    nv, nk, width = (static_size(d) for d in (recurrent_state.shape[1], ring.shape[1], qkv.shape[1]))
    if nv is not None and nk is not None and width is not None:
        check_qkv_width(width, nv, parameters["K"], parameters["V"], nk)
    tables = [
        _check_vector("row_ids", row_ids),
        _check_vector("ring_row_ids", ring_row_ids),
        _check_vector("input_row_offsets", input_row_offsets),
    ]
    return parameters, gate, tables


def verify_ring(
    qkv: TensorValue,
    decay: TensorValue,
    beta: TensorValue,
    recurrent_state: BufferValue,
    ring: BufferValue,
    row_ids: TensorValue,
    ring_row_ids: TensorValue,
    input_row_offsets: TensorValue,
    *,
    previous_ring_row_ids: TensorValue | None = None,
    previous_num_accepted: TensorValue | None = None,
    column_tile: int | None = None,
    requests_per_block: int | None = None,
    gpu_path: str = "auto",
) -> TensorValue:
    """Runs each request's verify window, recording into the ring; returns the readout.

    Request ``b`` owns tokens ``input_row_offsets[b] : input_row_offsets[b+1]``. Token
    ``i`` of its window writes record ``i`` of ring row ``ring_row_ids[b]`` (the raw
    key, the delta factors, the decays; see ``layout``). The pool is only read, except
    that a window longer than RING_LEN cannot be recorded: that request commits its pool
    row itself and writes no record.

    With ``previous_ring_row_ids`` and ``previous_num_accepted``, the verify first folds
    the previous step's records into the state as it loads it (``S = fma(k, u, S*d)``
    over the first ``previous_num_accepted[b]`` records of ring row
    ``previous_ring_row_ids[b]``, as :func:`gdfold_max.state_fold` would) and writes the
    folded state back, so a decoding step touches each state element once. The result
    equals, bit for bit, a fold followed by a plain verify. The rows it records into
    must differ from the rows it folds from: give each request two ring rows and
    alternate.

    Per token and value head, in fp32 with one rounding per operation:
    ``S = S * d``; ``kv = S^T k``; ``u = (beta * fma(-kv, 1/|k|, v)) * (1/|k|)``;
    ``S = fma(k, u, S)``; ``o = S^T (q * (1/|q| * 1/sqrt(K)))``, where
    ``1/|x| = 1 / sqrt(sum(x*x) + 1e-6)``. Every sum over K runs on 8 lanes (lane ``p``
    chains fmas over ``i = p, p+8, ...``), then adds lanes ``(p, p+4)``, ``(p, p+2)``,
    ``(p, p+1)``.

    Args:
        qkv: ``[T, 2*nk*K + nv*V]`` float32: q, then k, then v of every token.
        decay: ``[T, nv]`` float32 decays, already exp'd; or ``[T, nv, K]`` for per-channel
            gates (Kimi Delta Attention: state row i of a head decays by the i-th, and the
            records hold K decays per value head, ``layout.RecordLayout(..., gate="channel")``;
            on the GPU ``"auto"`` picks the kernel as for one decay per head
            (:data:`GPU_PATHS`), or the latency kernel where the throughput kernel's staging
            does not fit an SM at the default tile; ``"latency"`` and ``"throughput"`` force
            either).
        beta: ``[T, nv]`` float32 gates.
        recurrent_state: ``[rows, nv, K, V]`` float32 or bfloat16 pool buffer.
        ring: ``[ring_rows, nk, RING_LEN, stride]`` float32 ring buffer.
        row_ids: ``[B]`` pool row of each request (integers, cast to uint32).
        ring_row_ids: ``[B]`` ring row each request records into.
        input_row_offsets: ``[B+1]`` token offsets, from 0 to T.
        previous_ring_row_ids: ``[B]``, fold on load: ring rows of the previous step.
        previous_num_accepted: ``[B]``, fold on load: records to fold per request (0 or
            more than RING_LEN fold nothing).
        column_tile: GPU only: value columns one block owns (4, 8, 16 or a multiple of 16
            that divides V).
        requests_per_block: GPU only: the units of work (one request on one column
            tile of one head) a block runs in turn, on average: the grid holds
            units / requests_per_block blocks, which claim units as they go where
            they run more than two each (default: as many blocks as the GPU holds at
            once).
        gpu_path: GPU only: ``"auto"`` (default) picks the kernel at run time from the
            batch and shape (today always the throughput kernel, the faster at every
            batch measured); ``"latency"`` or ``"throughput"`` forces one (see
            :data:`GPU_PATHS`). Every path gives the same bits; ``column_tile`` and
            ``requests_per_block`` shape the throughput kernel only.

    Returns:
        The readout, ``[T, nv*V]`` float32.

    Raises:
        ValueError: at graph-build time, for a bad rank, dtype or static shape. At run
            time on the CPU, for a bad id, bad offsets, or a ring row both folded from
            and recorded into, before anything is written. On the GPU, a request with
            an out-of-range id is skipped and its readout is NaN.
    """
    name, operands, parameters = _verify_op(qkv, decay, beta, recurrent_state, ring, row_ids, ring_row_ids,
                                            input_row_offsets, previous_ring_row_ids, previous_num_accepted,
                                            column_tile, requests_per_block, gpu_path)
    return _window_op(name, qkv, recurrent_state, operands, parameters)


def _verify_op(qkv: TensorValue, decay: TensorValue, beta: TensorValue, recurrent_state: BufferValue,
               ring: BufferValue, row_ids: TensorValue, ring_row_ids: TensorValue, input_row_offsets: TensorValue,
               previous_ring_row_ids: TensorValue | None, previous_num_accepted: TensorValue | None,
               column_tile: int | None, requests_per_block: int | None, gpu_path: str
               ) -> tuple[str, list[TensorValue | BufferValue], dict[str, int]]:
    """:func:`verify_ring`'s op, checked: its name, operands and parameters."""
    parameters, gate, tables = _check_verify_operands(qkv, decay, beta, recurrent_state, ring, row_ids,
                                                      ring_row_ids, input_row_offsets)
    check_window_device(recurrent_state.device)
    value_dim = parameters["V"]
    name = VERIFY_OP_NAME
    tiling = gpu_tiling(recurrent_state.dtype, parameters["K"], value_dim, column_tile, requests_per_block,
                        fold_on_load=previous_ring_row_ids is not None, gpu_path=gpu_path,
                        channel=gate == "channel")
    if (previous_ring_row_ids is None) != (previous_num_accepted is None):
        raise ValueError("previous_ring_row_ids, previous_num_accepted: give both for fold on load, or neither")
    if previous_ring_row_ids is not None and previous_num_accepted is not None:
        name = VERIFY_FOLD_ON_LOAD_OP_NAME
        tables += _previous_tables(previous_ring_row_ids, previous_num_accepted)
    op_parameters: dict[str, int] = {"K": parameters["K"], "V": value_dim, "RING_LEN": parameters["RING_LEN"]}
    if gate == "channel":
        name += CHANNEL_OP_SUFFIX
    op_parameters.update(tiling)
    return name, [qkv, decay, beta, recurrent_state, ring, *tables], op_parameters


def verify_or_forward(
    qkv: TensorValue,
    decay: TensorValue,
    beta: TensorValue,
    recurrent_state: BufferValue,
    ring: BufferValue,
    row_ids: TensorValue,
    ring_row_ids: TensorValue,
    input_row_offsets: TensorValue,
    previous_ring_row_ids: TensorValue,
    previous_num_accepted: TensorValue,
    verify_width: TensorValue,
    *,
    column_tile: int | None = None,
    requests_per_block: int | None = None,
    gpu_path: str = "auto",
) -> TensorValue:
    """:func:`verify_ring` with fold on load where ``verify_width`` has a nonzero length,
    and where its length is 0 the fold of the previous records
    (:func:`gdfold_max.state_fold` over ``previous_ring_row_ids`` as a one-layer table)
    and then :func:`recurrence`, which commits the pool and records nothing: what a
    speculative step does on a verify and on a step without drafts (a prefill). The
    length is read on the host as the op runs (op ``gdfold_verify_or_forward``), so a
    graph whose draft width is symbolic needs no branch; the bits are those of the ops
    named. Head gates (``decay`` ``[T, nv]``).

    Args:
        qkv, decay, beta, recurrent_state, ring, row_ids, ring_row_ids, input_row_offsets,
        previous_ring_row_ids, previous_num_accepted, column_tile, requests_per_block,
            gpu_path: as for :func:`verify_ring` with fold on load.
        verify_width: MAX's verify width operand (``max.nn.state_space.verify_width_operand``):
            a rank-1 int64 tensor on the host whose length is the draft width.

    Returns:
        The readout, ``[T, nv*V]`` float32.

    Raises:
        ValueError: as :func:`verify_ring` does; for per-channel gates; for a
            ``verify_width`` that is not a rank-1 int64 tensor on the host.
    """
    if decay.rank != 2:
        raise ValueError(f"decay: verify_or_forward takes head gates ([T, nv]), got shape"
                         f" {shape_text(list(decay.shape))}")
    if verify_width.rank != 1 or verify_width.dtype != DType.int64 or not verify_width.device.is_cpu():
        raise ValueError(f"verify_width: expected a rank-1 int64 tensor on the host, got {verify_width.dtype.name}"
                         f" {shape_text(list(verify_width.shape))} on {verify_width.device}")
    # The verify with fold on load's operands and parameters, then the width.
    _, operands, parameters = _verify_op(qkv, decay, beta, recurrent_state, ring, row_ids, ring_row_ids,
                                         input_row_offsets, previous_ring_row_ids, previous_num_accepted,
                                         column_tile, requests_per_block, gpu_path)
    # The fold at a width of 0 stages up to RING_LEN records a block.
    parameters |= fold_tiling(parameters["K"], parameters["V"], recurrent_state.dtype, ring_len=parameters["RING_LEN"])
    return _window_op(VERIFY_OR_FORWARD_OP_NAME, qkv, recurrent_state, [*operands, verify_width], parameters)


def verify_tree(
    qkv: TensorValue,
    decay: TensorValue,
    beta: TensorValue,
    recurrent_state: BufferValue,
    ring: BufferValue,
    row_ids: TensorValue,
    ring_row_ids: TensorValue,
    input_row_offsets: TensorValue,
    parents: TensorValue,
    *,
    previous_ring_row_ids: TensorValue | None = None,
    previous_num_accepted: TensorValue | None = None,
    previous_accepted_nodes: TensorValue | None = None,
    leaf_warps: int = 1,
    gpu_path: str = "auto",
    column_tile: int | None = None,
) -> TensorValue:
    """Runs each request's window as a token tree, recording into the ring; returns every
    node's readout. On the CPU, or on an NVIDIA Hopper GPU on the latency kernel (one
    warp a request's 16-column slab of a value head) or, with ``gpu_path="throughput"``,
    on the throughput kernel's blocks (a block a request's ``column_tile`` columns of a
    value head, its warps sharing each node's staged inputs).

    The window's tokens are the tree's nodes in topological order (``gdfold_max.trees``):
    node ``i`` of request ``b`` steps from the fp32 state of node ``parents[b, i]`` (for
    -1, the pool's state) in :func:`verify_ring`'s order of arithmetic, and writes record
    ``i`` of ring row ``ring_row_ids[b]`` as :func:`verify_ring` does. So node ``i``'s
    readout is the forward's over its root path, bit for bit, and folding the records of
    an accepted path (:func:`gdfold_max.state_fold` with ``accepted_nodes``) equals the
    forward over that path's tokens. A chain (``trees.chain_parents``) gives
    :func:`verify_ring`'s readout and records. The pool is not written, and every window
    must fit the ring (a tree has no one path to commit instead). Ops
    ``gdfold_verify_tree`` and, per-channel, ``gdfold_verify_tree_channel``.

    With ``previous_ring_row_ids``, ``previous_num_accepted`` and
    ``previous_accepted_nodes`` (fold on load; ops ``gdfold_verify_tree_fold_on_load``
    and ``..._channel``), the previous step's accepted path, records
    ``previous_accepted_nodes[b, :previous_num_accepted[b]]`` of ring row
    ``previous_ring_row_ids[b]`` in that order, is first folded into the pool as the fold
    along a path does, written back, and the tree runs from the folded state. Rows that
    are recorded into must differ from those folded from, as for :func:`verify_ring`.

    Args:
        qkv, decay, beta, recurrent_state, ring, row_ids, ring_row_ids, input_row_offsets:
            as for :func:`verify_ring` (``decay`` ``[T, nv, K]``: per-channel gates).
        parents: ``[batch, RING_LEN]`` integer table (int32; other integer dtypes are
            cast, an entry int32 cannot hold or below -1 becoming -2, a parent refused):
            node ``i``'s parent, -1 or an earlier node of its window. Entries past a
            window are not read.
        previous_ring_row_ids: ``[B]``, fold on load: ring rows of the previous step.
        previous_num_accepted: ``[B]``, fold on load: nodes of the previous path (0 or
            more than RING_LEN fold nothing).
        previous_accepted_nodes: ``[batch, RING_LEN]`` integer table (cast to uint32),
            fold on load: the previous path's nodes, in increasing order; entries past
            ``previous_num_accepted[b]`` are not read.
        leaf_warps: GPU only, 1 (default) or :data:`TREE_LEAF_WARPS`: with 4, where the
            launch is small enough for every unit's four warps to be resident at once
            (up to 2 units an SM), a unit (a request's slab of one value head) is four
            warps: the first steps the inner nodes and hands each parent's state over
            in shared memory, the other three step its leaves from it, a third each, so
            a unit's chain of steps is its inner nodes; larger launches run one warp a
            unit. The same bits either way; which is faster is for ``bench-step --tree``
            to say, and 1 stays the default until it has. Only on the latency kernel.
        gpu_path: GPU only: ``"auto"`` (default) and ``"latency"`` run the latency
            kernel, ``"throughput"`` the throughput kernel's blocks
            (mojo/window_gpu_tree.mojo). Each follows the reference's order of
            arithmetic; ``"throughput"`` is new, its GPU tests
            (``tests/test_window_tree.py``) are what vouch for its bits, and ``"auto"``
            does not take it (docs/design.md).
        column_tile: GPU only, ``gpu_path="throughput"``: value columns a block owns (4,
            8, 16 or a multiple of 16 that divides V; default as for :func:`verify_ring`).

    Returns:
        The readout, ``[T, nv*V]`` float32.

    Raises:
        ValueError: at graph-build time, for a bad rank, dtype or static shape, for only
            some of the three previous tables, a ``leaf_warps`` other than 1 or 4 (or
            other than 1 with ``gpu_path="throughput"``), an unknown ``gpu_path``, a
            ``column_tile`` that does not divide V, or a GPU that is not a Hopper. At run
            time on the CPU, before anything is written: a bad id or offsets, a window
            longer than RING_LEN, a parent that is not -1 or an earlier node of its
            window, a previous path with a node past the ring or out of order, a ring row
            both folded from and recorded into. On the GPU these tables are not read on
            the host: the kernel never follows a bad one, but skips that request before
            any load (its readout NaN; its ring records and pool row not written), as
            :func:`verify_ring` does for a bad id.
    """
    check_window_device(recurrent_state.device)
    check_leaf_warps(leaf_warps, gpu_path)
    parameters, gate, tables = _check_verify_operands(qkv, decay, beta, recurrent_state, ring, row_ids,
                                                      ring_row_ids, input_row_offsets)
    ring_len = parameters["RING_LEN"]
    tile = _check_column_tile(parameters["V"], column_tile)
    check_tree_table_shape("parents", list(parents.shape), row_ids.shape[0], ring_len)
    tables.append(parent_table("parents", parents))
    name = VERIFY_TREE_OP_NAME
    if previous_path_given(previous_ring_row_ids, previous_num_accepted, previous_accepted_nodes):
        assert previous_ring_row_ids is not None and previous_num_accepted is not None
        assert previous_accepted_nodes is not None
        name = VERIFY_TREE_FOLD_ON_LOAD_OP_NAME
        check_tree_table_shape("previous_accepted_nodes", list(previous_accepted_nodes.shape),
                               row_ids.shape[0], ring_len)
        tables += [*_previous_tables(previous_ring_row_ids, previous_num_accepted),
                   row_table("previous_accepted_nodes", previous_accepted_nodes)]
    if gate == "channel":
        name += CHANNEL_OP_SUFFIX
    return _window_op(name, qkv, recurrent_state, [qkv, decay, beta, recurrent_state, ring, *tables],
                      {"K": parameters["K"], "V": parameters["V"], "RING_LEN": ring_len, "COLUMN_TILE": tile,
                       "GPU_PATH": GPU_PATHS[gpu_path], "LEAF_WARPS": leaf_warps})


def recurrence(
    qkv: TensorValue,
    decay: TensorValue,
    beta: TensorValue,
    recurrent_state: BufferValue,
    row_ids: TensorValue,
    input_row_offsets: TensorValue,
    *,
    column_tile: int | None = None,
    requests_per_block: int | None = None,
    gpu_path: str = "auto",
) -> TensorValue:
    """Runs the recurrence over each request's tokens and commits its pool row.

    The same arithmetic as :func:`verify_ring`, so running it over the accepted tokens
    alone equals, bit for bit, a verify followed by the fold.

    Args:
        qkv: ``[T, 2*nk*K + nv*V]`` float32 (nk follows from the width).
        decay: ``[T, nv]`` float32, or ``[T, nv, K]`` for per-channel gates.
        beta: ``[T, nv]`` float32.
        recurrent_state: ``[rows, nv, K, V]`` float32 or bfloat16 pool buffer, updated
            in place.
        row_ids: ``[B]`` pool row of each request.
        input_row_offsets: ``[B+1]`` token offsets, from 0 to T.
        column_tile: GPU only: value columns one block owns.
        requests_per_block: GPU only: units of work (a request on one column tile of one
            value head) per block, as in :func:`verify_ring`.
        gpu_path: GPU only: which kernel runs, as in :func:`verify_ring`.

    Returns:
        The readout, ``[T, nv*V]`` float32.

    Example:
        >>> from max.graph import BufferType, DeviceRef, Graph
        >>> from gdfold_max import kernels_path
        >>> cpu = DeviceRef.CPU()
        >>> with Graph("forward", input_types=[
        ...         TensorType(DType.float32, ["T", 2 * 1 * 64 + 2 * 64], cpu),
        ...         TensorType(DType.float32, ["T", 2], cpu),
        ...         TensorType(DType.float32, ["T", 2], cpu),
        ...         BufferType(DType.float32, [4, 2, 64, 64], cpu),
        ...         TensorType(DType.uint32, ["B"], cpu),
        ...         TensorType(DType.uint32, ["B1"], cpu)],
        ...         custom_extensions=[kernels_path()]) as graph:
        ...     qkv, decay, beta, pool, rows, offsets = graph.inputs
        ...     out = recurrence(qkv.tensor, decay.tensor, beta.tensor, pool.buffer, rows.tensor, offsets.tensor)
        ...     graph.output(out)
        >>> out.shape
        [Dim('T'), Dim(128)]
    """
    key_dim, value_dim = pool_dims(list(recurrent_state.shape), recurrent_state.dtype)
    check_window_device(recurrent_state.device)
    gate = _check_token_inputs(qkv, decay, beta, recurrent_state.shape[1], key_dim)
    nv, width = static_size(recurrent_state.shape[1]), static_size(qkv.shape[1])
    if nv is not None and width is not None:
        check_qkv_width(width, nv, key_dim, value_dim)
    op_parameters: dict[str, int] = {"K": key_dim, "V": value_dim}
    op_parameters.update(gpu_tiling(recurrent_state.dtype, key_dim, value_dim, column_tile, requests_per_block,
                                    gpu_path=gpu_path, channel=gate == "channel"))
    tables = [_check_vector("row_ids", row_ids), _check_vector("input_row_offsets", input_row_offsets)]
    return _window_op(RECURRENCE_OP_NAME + (CHANNEL_OP_SUFFIX if gate == "channel" else ""), qkv, recurrent_state,
                      [qkv, decay, beta, recurrent_state, *tables], op_parameters)
