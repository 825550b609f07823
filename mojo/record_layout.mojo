"""Where each field of a ring record lives.

A record holds, for one key head `h` and one token, the raw key (K floats), one
delta row per value head of the group (G rows of V floats) and one decay per value
head of the group (G floats), then padding up to the ring's record stride.
"""

# Floats per 16-byte record load. Record strides and K, V are multiples of 4 floats.
comptime RECORD_VEC = 4


@always_inline
def first_record_at[
    RING_LEN: Int
](ring_row: Int, num_key_heads: Int, key_head: Int, record_stride: Int) -> Int:
    """Where record 0 of key head `key_head` in ring row `ring_row` starts in the ring;
    record t follows at `t * record_stride`."""
    return (ring_row * num_key_heads + key_head) * RING_LEN * record_stride


@always_inline
def key_offset() -> Int:
    """Offset of the raw key inside a record."""
    return 0


@always_inline
def delta_offset[K: Int, V: Int](group_slot: Int) -> Int:
    """Offset of the delta row of the `group_slot`-th value head of the group."""
    return K + group_slot * V


@always_inline
def decay_offset[K: Int, V: Int](group_size: Int, group_slot: Int) -> Int:
    """Offset of the decay of the `group_slot`-th value head of the group."""
    return K + group_size * V + group_slot


@always_inline
def record_elements[K: Int, V: Int](group_size: Int) -> Int:
    """Floats a record needs before padding: key, G delta rows, G decays."""
    return K + group_size * (V + 1)


# Per-channel gates (Kimi Delta Attention): a value head's decay is K floats, one per key
# row, so the G decays of a record become G rows of K floats.


@always_inline
def channel_decay_offset[K: Int, V: Int](group_size: Int, group_slot: Int) -> Int:
    """Offset of the K decays of the `group_slot`-th value head, with per-channel gates."""
    return K + group_size * V + group_slot * K


@always_inline
def channel_record_elements[K: Int, V: Int](group_size: Int) -> Int:
    """Floats a per-channel record needs before padding: key, G delta rows, G decay rows."""
    return K + group_size * (V + K)
