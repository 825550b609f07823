"""The covering set of fold shapes the op is tested on.

Each distinct (state dtype, K, V, RING_LEN) is one graph compile, so the set is small:
every value the tests must cover appears at least once, not every product of them.
"""

from __future__ import annotations

from functools import cache

from gdfold_max.cases import FoldCase, random_fold_case, spec_decode_case

# name -> random_fold_case keyword arguments
MATRIX: dict[str, dict] = {
    "fp32-K64-G2-R4": dict(state_dtype="float32", key_dim=64, value_dim=64, num_value_heads=4, num_key_heads=2,
                           ring_len=4, layers=3, batch=5, stride_pad=32),
    "bf16-K128-G4-R2": dict(state_dtype="bfloat16", key_dim=128, value_dim=128, num_value_heads=8, num_key_heads=2,
                            ring_len=2, layers=2, batch=4),
    "fp32-K128-G1-R8": dict(state_dtype="float32", key_dim=128, value_dim=128, num_value_heads=2, num_key_heads=2,
                            ring_len=8, layers=2, batch=4),
}

# Real verify steps (numpy reference verify), on the shapes compiled above.
SPEC_DECODE: dict[str, dict] = {
    "fp32-K64-G2-R4": dict(state_dtype="float32", key_dim=64, value_dim=64, num_value_heads=4, num_key_heads=2,
                           ring_len=4, verify_width=3, layers=3, batch=4, num_accepted=[4, 0, 1, 3]),
    "bf16-K128-G4-R2": dict(state_dtype="bfloat16", key_dim=128, value_dim=128, num_value_heads=8,
                            num_key_heads=2, ring_len=2, verify_width=1, layers=2, batch=3, num_accepted=[2, 1, 0]),
}


@cache
def matrix_case(name: str) -> FoldCase:
    return random_fold_case(seed=sum(map(ord, name)), **MATRIX[name])


@cache
def spec_case(name: str) -> FoldCase:
    return spec_decode_case(seed=7, **SPEC_DECODE[name])
