"""The fold for graphs: ``state_fold`` and its GPU tiling.

A graph that calls it must be built with ``custom_extensions=[kernels_path()]``
(``gdfold_max.ops.kernels``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from max.dtype import DType
from max.graph import BufferValue, Dim, TensorType, TensorValue, ops

from ..layout import Gate, check_gate
from .checks import check_tree_table_shape, ring_parameters, row_table, shape_text, static_size
from .kernels import FOLD_CHANNEL_OP_NAME, FOLD_OP_NAME, FOLD_PATH_CHANNEL_OP_NAME, FOLD_PATH_OP_NAME

#: Preferred GPU tiling per state dtype, (KEY_DIM_TILE, ROWS_PER_THREAD), measured on an H200 at
#: Qwen3-Next shapes (bench/tuning/tune_tiles.py). fp32: (64, 8) is 4.5% faster than (128, 8) at
#: batch 1 and 1.2-1.4% slower at batches 64 and 256 (bench/results/fold-tiles-h200-2026-12-01.txt);
#: one graph serves every batch, so the default favours the small batches of speculative decoding.
#: bf16: (128, 16), the fastest of seven tilings at batches 1 and 64
#: (bench/results/fold-tiles-h200-2026-11-29.txt).
#: A thread keeps ROWS_PER_THREAD 16-byte state vectors in flight: 128 bytes for fp32, 256 for bf16.
PREFERRED_TILING = {DType.float32: (64, 8), DType.bfloat16: (128, 16)}


def default_tiling(key_dim: int, state_dtype: DType) -> tuple[int, int]:
    """The (key_dim_tile, rows_per_thread) used when the caller names none.

    The preferred tile is halved until it divides K (K is a multiple of 8).

    >>> default_tiling(128, DType.float32), default_tiling(96, DType.bfloat16)
    ((64, 8), (32, 16))
    """
    tile, rows = PREFERRED_TILING.get(state_dtype, (64, 8))
    while key_dim % tile != 0:
        tile //= 2
    return tile, min(rows, tile)


#: Threads one GPU block may hold (CUDA's limit, and MAX's on every GPU it supports).
MAX_BLOCK_THREADS = 1024

#: Static shared memory one GPU block may hold without an opt-in (CUDA's limit).
MAX_STATIC_SHARED_BYTES = 48 * 1024


def fold_shared_bytes(ring_len: int, key_dim_tile: int, value_dim: int, gate: Gate) -> int:
    """Shared memory of one fold block, as ``mojo/fold_gpu.mojo`` stages a request's records:
    each record's key tile, delta row and decays (one, or the tile's with per-channel gates),
    each buffer 16-byte aligned.

    >>> fold_shared_bytes(16, 128, 256, "channel"), fold_shared_bytes(32, 128, 256, "head")
    (32768, 49280)
    """
    decays = key_dim_tile if gate == "channel" else 1
    return sum(-(-4 * ring_len * floats // 16) * 16 for floats in (key_dim_tile, value_dim, decays))


def fold_block_threads(state_dtype: DType, value_dim: int, key_dim_tile: int, rows_per_thread: int) -> int:
    """Threads of one fold block, as ``mojo/fold_gpu.mojo`` launches it: a 16-byte state
    vector per column thread, ``key_dim_tile / rows_per_thread`` row threads.

    >>> fold_block_threads(DType.float32, 128, 64, 8), fold_block_threads(DType.bfloat16, 128, 128, 1)
    (256, 2048)
    """
    return value_dim // (16 // state_dtype.size_in_bytes) * (key_dim_tile // rows_per_thread)


def fold_tiling(key_dim: int, value_dim: int, state_dtype: DType, key_dim_tile: int | None = None,
                rows_per_thread: int | None = None, *, ring_len: int = 1, gate: Gate = "head") -> dict[str, int]:
    """The fold's GPU tiling, checked (the CPU path ignores it): the tile divides K, the
    rows divide the tile, a block holds at most ``MAX_BLOCK_THREADS`` threads, and the
    records it stages (``ring_len`` of them) fit ``MAX_STATIC_SHARED_BYTES``. The default
    tile is halved until they do: at RING_LEN 32 and V = 256 the preferred tiles stage more
    (``fold_shared_bytes``); up to RING_LEN 16 it never needs to.

    >>> fold_tiling(256, 256, DType.bfloat16, ring_len=16), fold_tiling(256, 256, DType.bfloat16, ring_len=32)
    ({'KEY_DIM_TILE': 128, 'ROWS_PER_THREAD': 16}, {'KEY_DIM_TILE': 64, 'ROWS_PER_THREAD': 16})

    Raises:
        ValueError: naming ``key_dim_tile`` or ``rows_per_thread`` and the bad value.
    """
    default_tile, default_rows = default_tiling(key_dim, state_dtype)
    while default_tile > 4 and fold_shared_bytes(ring_len, default_tile, value_dim, gate) > MAX_STATIC_SHARED_BYTES:
        default_tile //= 2
    tile = default_tile if key_dim_tile is None else key_dim_tile
    if tile < 4 or tile % 4 != 0 or key_dim % tile != 0:
        raise ValueError(f"key_dim_tile: {tile} must be a multiple of 4 that divides K={key_dim}")
    rows = min(default_rows, tile) if rows_per_thread is None else rows_per_thread
    if rows < 1 or tile % rows != 0:
        raise ValueError(f"rows_per_thread: {rows} must divide key_dim_tile={tile}")
    threads = fold_block_threads(state_dtype, value_dim, tile, rows)
    if threads > MAX_BLOCK_THREADS:
        raise ValueError(
            f"key_dim_tile, rows_per_thread: ({tile}, {rows}) makes GPU blocks of {threads} threads"
            f" (V={value_dim}, {state_dtype.name} pool); at most {MAX_BLOCK_THREADS}: raise rows_per_thread"
            " or lower key_dim_tile"
        )
    staged = fold_shared_bytes(ring_len, tile, value_dim, gate)
    if staged > MAX_STATIC_SHARED_BYTES:
        raise ValueError(
            f"key_dim_tile: {tile} stages {staged} bytes of records in a GPU block (RING_LEN {ring_len}, V={value_dim},"
            f" {gate} gates); at most {MAX_STATIC_SHARED_BYTES}: lower key_dim_tile"
        )
    return {"KEY_DIM_TILE": tile, "ROWS_PER_THREAD": rows}


def fold_parameters(
    state_shape: Sequence[Dim | int],
    state_dtype: DType,
    ring_shape: Sequence[Dim | int],
    ring_dtype: DType,
    key_dim_tile: int | None = None,
    rows_per_thread: int | None = None,
    gate: Gate = "head",
) -> dict[str, int]:
    """Checks static pool and ring shapes and the tiling; returns the fold op's
    compile-time parameters.

    Raises:
        ValueError: naming the argument, the bad value and what was expected.
    """
    parameters = ring_parameters(state_shape, state_dtype, ring_shape, ring_dtype, gate)
    return parameters | fold_tiling(parameters["K"], parameters["V"], state_dtype, key_dim_tile, rows_per_thread,
                                    ring_len=parameters["RING_LEN"], gate=gate)


def check_table_shapes(
    row_ids: Sequence[Dim | int], ring_row_ids: Sequence[Dim | int], num_accepted: Sequence[Dim | int]
) -> None:
    """Checks the row tables' ranks, and that their known sizes agree.

    Raises:
        ValueError: naming the table, its shape and what was expected.
    """
    if len(row_ids) != 2:
        raise ValueError(f"row_ids: expected rank 2 [num_layers, batch], got shape {shape_text(row_ids)}")
    if len(ring_row_ids) != 2:
        raise ValueError(f"ring_row_ids: expected rank 2 [num_layers, batch], got shape {shape_text(ring_row_ids)}")
    if len(num_accepted) != 1:
        raise ValueError(f"num_accepted: expected rank 1 [batch], got shape {shape_text(num_accepted)}")
    for axis in range(2):
        a, b = static_size(row_ids[axis]), static_size(ring_row_ids[axis])
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"ring_row_ids: shape {shape_text(ring_row_ids)} differs from row_ids {shape_text(row_ids)}"
            )
    batch, count = static_size(row_ids[1]), static_size(num_accepted[0])
    if batch is not None and count is not None and batch != count:
        raise ValueError(f"num_accepted: length {count} differs from the batch {batch} of row_ids")


def state_fold(
    recurrent_state: BufferValue,
    ring: BufferValue,
    row_ids: TensorValue,
    ring_row_ids: TensorValue,
    num_accepted: TensorValue,
    verify_width: TensorValue | None = None,
    *,
    key_dim_tile: int | None = None,
    rows_per_thread: int | None = None,
    gate: Gate = "head",
    accepted_nodes: TensorValue | None = None,
) -> None:
    """Folds the accepted ring records into the live state pool, for all layers at once.

    A drop-in for ``max.nn.state_space.gated_delta_state_fold`` (same argument order),
    registered as ``gdfold_state_fold``. For every layer ``l`` and request ``b`` it
    applies, in order, the first ``num_accepted[b]`` records of ring row
    ``ring_row_ids[l, b]`` to pool row ``row_ids[l, b]``:
    ``S = fma(k_t, u_t, S * d_t)``, rounded once per step in fp32 (a bf16 pool is
    widened at the load and rounded to nearest even once at the store).

    Args:
        recurrent_state: ``[rows, nv, K, V]`` float32 or bfloat16 buffer, folded in place.
            K and V static, multiples of 8 up to 256.
        ring: ``[ring_rows, nk, RING_LEN, stride]`` float32 buffer; RING_LEN static in
            1..32; ``stride >= K + G*(V+1)`` with ``G = nv // nk``, a multiple of 4.
        row_ids: ``[num_layers, batch]`` integer pool rows (cast to uint32).
        ring_row_ids: ``[num_layers, batch]`` integer ring rows (cast to uint32).
        num_accepted: ``[batch]`` integer count of records to fold per request. 0 and
            counts past RING_LEN leave the request's rows unread and unwritten.
        verify_width: optional, as MAX's ``verify_width_operand``: a rank-1 tensor
            whose length is the verify's draft width (only its length is read). At a
            width of 0 the verify wrote no records (it committed the state itself), so
            nothing is folded: a static length of 0 adds nothing to the graph, and a
            symbolic length is read when the graph runs, as MAX's own fold does.
        key_dim_tile: GPU only: key rows a block keeps in registers (divides K);
            default from :func:`default_tiling`.
        rows_per_thread: GPU only: key rows each thread keeps (divides the tile).
        gate: ``"head"`` (one decay per value head) or ``"channel"`` (per-channel
            gates: K decays per value head, ``S[i, j] = fma(k[i], u[j], S[i, j] * d[i])``,
            records as ``layout.RecordLayout(..., gate="channel")``), on the CPU and
            the GPU.
        accepted_nodes: optional ``[batch, RING_LEN]`` integer table (cast to uint32)
            of accepted paths along token trees (``gdfold_max.trees``): request ``b``
            folds records ``accepted_nodes[b, :num_accepted[b]]`` in that order instead
            of the first ``num_accepted[b]``, through ``gdfold_state_fold_path`` (or
            ``gdfold_state_fold_path_channel``). A path names nodes 0 to RING_LEN - 1 in
            increasing order (its topological order); entries past ``num_accepted[b]``
            are not read. ``arange(RING_LEN)`` rows fold what the chain's fold folds,
            bit for bit.

    Raises:
        ValueError: at graph-build time, for a bad rank, dtype or static shape, naming
            the argument. At run time on the CPU, the op raises for a row id out of
            range before it writes anything; on the GPU, an out-of-range id makes the
            kernel skip that (layer, request) and fold every other one. A path with a
            node past the ring (a negative entry saturates past it) or out of order is
            refused in the same way on the CPU; on the GPU that request is skipped in
            every layer, its rows not read or written.

    Example:
        >>> from max.graph import BufferType, DeviceRef, Graph, TensorType
        >>> from gdfold_max import kernels_path
        >>> cpu = DeviceRef.CPU()
        >>> with Graph("fold", input_types=[
        ...         BufferType(DType.float32, [8, 4, 64, 64], cpu),
        ...         BufferType(DType.float32, [8, 2, 4, 224], cpu),
        ...         TensorType(DType.uint32, [3, 2], cpu),
        ...         TensorType(DType.uint32, [3, 2], cpu),
        ...         TensorType(DType.uint32, [2], cpu)],
        ...         custom_extensions=[kernels_path()]) as graph:
        ...     state_fold(*graph.inputs)
        ...     graph.output()
    """
    width = None
    if verify_width is not None:
        if verify_width.rank != 1:
            raise ValueError(f"verify_width: expected rank 1 [K], got shape {shape_text(list(verify_width.shape))}")
        width = static_size(verify_width.shape[0])
        if width == 0:
            return
    check_gate(gate)
    parameters = fold_parameters(
        list(recurrent_state.shape),
        recurrent_state.dtype,
        list(ring.shape),
        ring.dtype,
        key_dim_tile,
        rows_per_thread,
        gate,
    )
    check_table_shapes(list(row_ids.shape), list(ring_row_ids.shape), list(num_accepted.shape))
    operands = [
        recurrent_state,
        ring,
        row_table("row_ids", row_ids),
        row_table("ring_row_ids", ring_row_ids),
        row_table("num_accepted", num_accepted),
    ]
    if accepted_nodes is None:
        name = FOLD_CHANNEL_OP_NAME if gate == "channel" else FOLD_OP_NAME
    else:
        check_tree_table_shape("accepted_nodes", list(accepted_nodes.shape), row_ids.shape[1], parameters["RING_LEN"])
        operands.append(row_table("accepted_nodes", accepted_nodes))
        name = FOLD_PATH_CHANNEL_OP_NAME if gate == "channel" else FOLD_PATH_OP_NAME

    def fold_records() -> None:
        ops.inplace_custom(name, recurrent_state.device, operands, parameters=parameters)

    if verify_width is not None and width is None:
        when_no_drafts(verify_width, None, lambda: None, fold_records)
    else:
        fold_records()


def when_no_drafts(verify_width: TensorValue, out_types: Sequence[TensorType] | None,
                   no_drafts: Callable[[], Any], drafts: Callable[[], Any]) -> list[TensorValue]:
    """Runs ``no_drafts`` or ``drafts`` as the graph runs, by the length of a
    ``verify_width`` operand whose length is symbolic: a shape, read on the host, so the
    choice costs no device synchronisation. Both return values of ``out_types``."""
    width = ops.shape_to_tensor(verify_width.shape)[0]
    return list(ops.cond(ops.equal(width, 0), out_types, no_drafts, drafts) or [])
