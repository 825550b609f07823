"""The record layout's offsets tile a record as the design says."""

from __future__ import annotations

import pytest

from gdfold_max.layout import RecordLayout, min_record_stride, record_elements


@pytest.mark.parametrize(("k", "v", "g"), [(128, 128, 2), (64, 64, 1), (128, 128, 4), (8, 8, 3)])
def test_offsets_tile_the_record(k: int, v: int, g: int) -> None:
    layout = RecordLayout(k, v, g)
    assert layout.key_offset == 0
    assert [layout.delta_offset(j) for j in range(g)] == [k + j * v for j in range(g)]
    assert layout.decay_offset(0) == layout.delta_offset(g - 1) + v
    assert layout.decay_offset(g - 1) + 1 == layout.elements == record_elements(k, v, g)
    stride = min_record_stride(k, v, g)
    assert stride % 32 == 0 and stride - 32 < layout.elements <= stride

