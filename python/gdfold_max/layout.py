"""The ring record layout, for Python (mirrors ``mojo/record_layout.mojo``).

For ring row ``r``, key head ``h`` and token ``t``, ``ring[r, h, t, :]`` holds:

======================  =======  ===============================================
offset                  length   content
======================  =======  ===============================================
``0``                   ``K``    raw key ``k_t`` of key head ``h``
``K + j*V``             ``V``    delta factor ``u_t`` of value head ``h*G + j``
``K + G*V + j``         ``1``    decay ``d_t`` (already exp'd) of value head ``h*G + j``
``K + G*(V+1)``..       --       padding up to the record stride, never read
======================  =======  ===============================================
"""

from __future__ import annotations

from dataclasses import dataclass

#: Record strides are whole multiples of this many floats (128 bytes).
STRIDE_ALIGNMENT = 32


@dataclass(frozen=True)
class RecordLayout:
    """Offsets of the fields of one ring record.

    Args:
        key_dim: K, the key head dimension.
        value_dim: V, the value head dimension.
        group_size: G = nv // nk, value heads per key head.

    Example:
        >>> layout = RecordLayout(key_dim=128, value_dim=128, group_size=2)
        >>> layout.elements, layout.min_stride
        (386, 416)
        >>> layout.delta_offset(1), layout.decay_offset(1)
        (256, 385)
    """

    key_dim: int
    value_dim: int
    group_size: int

    @property
    def key_offset(self) -> int:
        """Offset of the raw key."""
        return 0

    def delta_offset(self, group_slot: int) -> int:
        """Offset of the delta row of value head ``h*G + group_slot``."""
        return self.key_dim + group_slot * self.value_dim

    def decay_offset(self, group_slot: int) -> int:
        """Offset of the decay of value head ``h*G + group_slot``."""
        return self.key_dim + self.group_size * self.value_dim + group_slot

    @property
    def elements(self) -> int:
        """Floats a record needs before padding: ``K + G*(V+1)``."""
        return self.key_dim + self.group_size * (self.value_dim + 1)

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
