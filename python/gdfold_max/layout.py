"""The ring record layout, for Python (mirrors ``mojo/record_layout.mojo``), and the
kernels' reduction lane count (``REDUCTION_LANES``).

For ring row ``r``, key head ``h`` and token ``t``, ``ring[r, h, t, :]`` holds:

======================  =======  ===============================================
offset                  length   content
======================  =======  ===============================================
``0``                   ``K``    raw key ``k_t`` of key head ``h``
``K + j*V``             ``V``    delta factor ``u_t`` of value head ``h*G + j``
``K + G*V + j``         ``1``    decay ``d_t`` (already exp'd) of value head ``h*G + j``
``K + G*(V+1)``..       --       padding up to the record stride, never read
======================  =======  ===============================================

With per-channel gates (``gate="channel"``, Kimi Delta Attention) the decay of value head
``h*G + j`` is a vector of K decays, one per key row, at ``K + G*V + j*K``, and a record
needs ``K + G*(V+K)`` floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Record strides are whole multiples of this many floats (128 bytes).
STRIDE_ALIGNMENT = 32

#: Every reduction over K runs on this many lanes, lane ``p`` over ``i = p, p+8, ...``
#: (``REDUCTION_LANES`` in ``mojo/recurrence_math.mojo``; ``reference.lane_dot``): the
#: order of the sums, and the lane-major order the GPU window kernel stages keys in.
REDUCTION_LANES = 8

#: How a value head's state decays per token: one scalar per head (Gated DeltaNet), or
#: one decay per key row (per-channel gates, Kimi Delta Attention).
Gate = Literal["head", "channel"]
GATES: tuple[Gate, ...] = ("head", "channel")


def check_gate(gate: str) -> None:
    """Raises ``ValueError`` unless ``gate`` is ``"head"`` or ``"channel"``."""
    if gate not in GATES:
        raise ValueError(f"gate: {gate!r} is not 'head' or 'channel'")


@dataclass(frozen=True)
class RecordLayout:
    """Offsets of the fields of one ring record.

    Args:
        key_dim: K, the key head dimension.
        value_dim: V, the value head dimension.
        group_size: G = nv // nk, value heads per key head.
        gate: ``"head"`` (one decay per value head) or ``"channel"`` (K decays per
            value head).

    Example:
        >>> layout = RecordLayout(key_dim=128, value_dim=128, group_size=2)
        >>> layout.elements, layout.min_stride
        (386, 416)
        >>> layout.delta_offset(1), layout.decay_offset(1)
        (256, 385)
        >>> per_channel = RecordLayout(128, 128, 2, gate="channel")
        >>> per_channel.decay_offset(1), per_channel.decay_length, per_channel.elements, per_channel.min_stride
        (512, 128, 640, 640)
    """

    key_dim: int
    value_dim: int
    group_size: int
    gate: Gate = "head"

    def __post_init__(self) -> None:
        check_gate(self.gate)

    @property
    def key_offset(self) -> int:
        """Offset of the raw key."""
        return 0

    def delta_offset(self, group_slot: int) -> int:
        """Offset of the delta row of value head ``h*G + group_slot``."""
        return self.key_dim + group_slot * self.value_dim

    @property
    def decay_length(self) -> int:
        """Floats of one value head's decay: 1, or K with per-channel gates."""
        return self.key_dim if self.gate == "channel" else 1

    def decay_offset(self, group_slot: int) -> int:
        """Offset of the decay (or the K decays) of value head ``h*G + group_slot``."""
        return self.key_dim + self.group_size * self.value_dim + group_slot * self.decay_length

    @property
    def elements(self) -> int:
        """Floats a record needs before padding: ``K + G*(V+1)``, or ``K + G*(V+K)``."""
        return self.key_dim + self.group_size * (self.value_dim + self.decay_length)

    @property
    def min_stride(self) -> int:
        """The smallest valid record stride: ``elements`` rounded up to 32 floats."""
        return -(-self.elements // STRIDE_ALIGNMENT) * STRIDE_ALIGNMENT


def record_elements(key_dim: int, value_dim: int, group_size: int) -> int:
    """Floats a record needs before padding: ``K + G*(V+1)``.

    >>> record_elements(128, 128, 2)
    386
    """
    return RecordLayout(key_dim, value_dim, group_size).elements


def min_record_stride(key_dim: int, value_dim: int, group_size: int) -> int:
    """The smallest valid record stride, a multiple of 32 floats.

    >>> min_record_stride(128, 128, 2)
    416
    """
    return RecordLayout(key_dim, value_dim, group_size).min_stride
