"""Operand checks that the ops share. They run before an op writes anything."""

from std.utils import IndexList

from .record_layout import RECORD_VEC, channel_record_elements, record_elements


def check_head_dims[K: Int, V: Int, RING_LEN: Int]():
    comptime assert K % 8 == 0 and 8 <= K <= 256, "K must be a multiple of 8 up to 256"
    comptime assert V % 8 == 0 and 8 <= V <= 256, "V must be a multiple of 8 up to 256"
    comptime assert 1 <= RING_LEN <= 32, "RING_LEN must be in 1..32"


def check_pool[K: Int, V: Int](state_dims: IndexList[4]) raises:
    if state_dims[2] != K or state_dims[3] != V:
        raise Error(
            t"recurrent_state: expected [rows, nv, {K}, {V}], got last dims"
            t" [{state_dims[2]}, {state_dims[3]}]"
        )


def check_pool_and_ring[
    K: Int, V: Int, RING_LEN: Int
](state_dims: IndexList[4], ring_dims: IndexList[4]) raises:
    """Raises unless the pool and the ring agree with each other and with K, V, RING_LEN.
    """
    check_head_dims[K, V, RING_LEN]()
    check_pool[K, V](state_dims)
    var num_value_heads = state_dims[1]
    var num_key_heads = ring_dims[1]
    if num_key_heads < 1 or num_value_heads % num_key_heads != 0:
        raise Error(
            t"ring: key heads ({num_key_heads}) must divide the state's value"
            t" heads ({num_value_heads})"
        )
    if ring_dims[2] != RING_LEN:
        raise Error(t"ring: expected RING_LEN {RING_LEN}, got {ring_dims[2]}")
    var needed = record_elements[K, V](num_value_heads // num_key_heads)
    if ring_dims[3] < needed:
        raise Error(
            t"ring: record stride {ring_dims[3]} is smaller than K + G*(V+1) ="
            t" {needed}"
        )
    if ring_dims[3] % RECORD_VEC != 0:
        raise Error(
            t"ring: record stride {ring_dims[3]} is not a multiple of"
            t" {RECORD_VEC} floats (16 bytes)"
        )


def check_channel_record_stride[
    K: Int, V: Int
](num_value_heads: Int, num_key_heads: Int, record_stride: Int) raises:
    """Raises unless a record of the stride holds per-channel gates' K decays per value
    head (K + G*(V+K) floats)."""
    var needed = channel_record_elements[K, V](num_value_heads // num_key_heads)
    if record_stride < needed:
        raise Error(
            t"ring: record stride {record_stride} is smaller than K + G*(V+K) ="
            t" {needed}, what per-channel records need"
        )


def check_ids(
    ids: Pointer[UInt32, ImmutAnyOrigin], count: Int, limit: Int, name: StaticString
) raises:
    """Raises on the first id at or past `limit` (host tables only)."""
    for i in range(count):
        var id = Int(ids[unsafe_offset=i])
        if id >= limit:
            raise Error(
                t"{name}: id {id} at flat index {i} is out of range (must be"
                t" < {limit})"
            )


