"""Shared memory of one block of the GPU window kernel, counted as
``mojo/window_gpu_staging.mojo`` counts it (``window_static_bytes``,
``window_tile_bytes``), so that a column tile no SM can hold is refused with a clear
error when the graph is built, not when MAX compiles the kernel.
tests/test_window_shared_memory.py runs the kernel's own count beside this one.

>>> static_bytes(128, 64, fold_on_load=True), tile_bytes(4, 128, 64)
(22952, 33792)
"""

from __future__ import annotations

from max.dtype import DType

from ..layout import REDUCTION_LANES

# The kernel's constants (mojo/window_gpu_staging.mojo, mojo/bulk_copy.mojo).
WINDOW_CHUNK = 4
TOKEN_SCALARS = 4
COPY_FLOATS = 4
PLAN_FIELDS = 6
PLAN_SLOTS = 2
OUTBOX_ROWS_PER_TOKEN = 2
SWIZZLE_BYTES = 128
SWIZZLE_ALIGNMENT = 1024
#: Static shared memory one block may use, and static plus dynamic (H100/H200).
BLOCK_STATIC_LIMIT = 48 * 1024
BLOCK_SHARED_MAX = 227 * 1024


def _permuted_pitch(key_dim: int) -> int:
    vectors = -(-(key_dim // REDUCTION_LANES) // COPY_FLOATS)
    return (vectors + 1 if vectors % 2 == 0 else vectors) * COPY_FLOATS


def _lane_major_floats(key_dim: int) -> int:
    return REDUCTION_LANES * _permuted_pitch(key_dim)


def _outbox_in_record_keys(key_dim: int, column_tile: int, *, fold_on_load: bool) -> bool:
    outbox = OUTBOX_ROWS_PER_TOKEN * WINDOW_CHUNK * column_tile
    return fold_on_load and WINDOW_CHUNK * _lane_major_floats(key_dim) >= outbox


def static_bytes(key_dim: int, column_tile: int, *, fold_on_load: bool, channel: bool = False) -> int:
    """Tokens, records, the units' ids and their requests' ids (two buffers as they
    arrive, one lane-major; the record keys arrive in one), and the outbox of
    readout and delta rows where it does not share the record keys' buffer. Per-channel
    gates add the K decays of each token (and record) as they arrive and lane-major.

    >>> static_bytes(128, 64, fold_on_load=True, channel=True)
    34600
    """
    lane_major = _lane_major_floats(key_dim)
    natural = key_dim + 2 * COPY_FLOATS
    floats = 5 * 4
    if fold_on_load:
        floats += WINDOW_CHUNK * natural + 2 * WINDOW_CHUNK * (column_tile + 1)
        floats += WINDOW_CHUNK * lane_major
    if channel:
        floats += 2 * WINDOW_CHUNK * natural + WINDOW_CHUNK * lane_major
        if fold_on_load:
            floats += WINDOW_CHUNK * natural + WINDOW_CHUNK * lane_major
    if not _outbox_in_record_keys(key_dim, column_tile, fold_on_load=fold_on_load):
        floats += OUTBOX_ROWS_PER_TOKEN * WINDOW_CHUNK * column_tile
    floats += 2 * WINDOW_CHUNK * (2 * natural + column_tile + TOKEN_SCALARS)
    floats += WINDOW_CHUNK * 2 * lane_major
    floats += PLAN_FIELDS * PLAN_SLOTS + PLAN_SLOTS
    return 4 * floats


def tile_bytes(state_size: int, key_dim: int, column_tile: int) -> int:
    """The staged state tile: dense tensor boxes where a tile row is whole 128-byte
    rows (with room for the swizzle's alignment), else rows padded by 16 bytes."""
    if column_tile * state_size % SWIZZLE_BYTES == 0:
        return key_dim * column_tile * state_size + SWIZZLE_ALIGNMENT
    return key_dim * (column_tile + 16 // state_size) * state_size


def check_column_tile_fits(state_dtype: DType, key_dim: int, column_tile: int, *, fold_on_load: bool,
                           channel: bool = False) -> None:
    """Raises ``ValueError`` naming ``column_tile`` unless one block fits an SM.

    >>> check_column_tile_fits(DType.float32, 256, 256, fold_on_load=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: column_tile: 256 columns of a K=256 float32 state need 59816 bytes of static shared memory ...
    >>> check_column_tile_fits(DType.float32, 192, 256, fold_on_load=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: column_tile: 256 columns of a K=192 float32 state need 234248 bytes of shared memory ...
    >>> check_column_tile_fits(DType.float32, 256, 64, fold_on_load=True, channel=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: column_tile: 64 columns of a K=256 float32 state with per-channel gates need 61224 bytes ...
    """
    what = f"column_tile: {column_tile} columns of a K={key_dim} {state_dtype.name} state"
    if channel:
        what += " with per-channel gates"
    fixed = static_bytes(key_dim, column_tile, fold_on_load=fold_on_load, channel=channel)
    if fixed > BLOCK_STATIC_LIMIT:
        raise ValueError(f"{what} need {fixed} bytes of static shared memory per GPU block for the tokens and"
                         f" records, at most {BLOCK_STATIC_LIMIT}: name a narrower tile")
    total = fixed + tile_bytes(state_dtype.size_in_bytes, key_dim, column_tile)
    if total > BLOCK_SHARED_MAX:
        raise ValueError(f"{what} need {total} bytes of shared memory per GPU block, at most {BLOCK_SHARED_MAX}"
                         " fit: name a narrower tile")
