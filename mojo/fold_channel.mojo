"""The `gdfold_state_fold_channel` custom op: the fold with per-channel gates (Kimi Delta
Attention), where each record holds K decays per value head and state row i decays by
the i-th: `S[i, j] = fma(k[i], u[j], S[i, j] * d[i])`.

The CPU path only, for now: on a GPU the op raises before it launches anything (and the
graph API refuses such a graph when it is built).
"""

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext

from .fold import check_shapes
from .fold_cpu import fold_cpu
from .operand_checks import check_channel_record_stride, check_ids


@extensibility.register("gdfold_state_fold_channel")
struct StateFoldChannel:
    """Advances the live state pool over the accepted per-channel records of every
    (layer, request)."""

    @staticmethod
    def execute[
        target: StaticString, K: Int, V: Int, RING_LEN: Int
    ](
        recurrent_state: _MutableInputTensor[rank=4, ...],
        ring: _MutableInputTensor[dtype=DType.float32, rank=4, ...],
        row_ids: InputTensor[dtype=DType.uint32, rank=2, ...],
        ring_row_ids: InputTensor[dtype=DType.uint32, rank=2, ...],
        num_accepted: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime state_dtype = recurrent_state.dtype
        comptime assert (
            state_dtype == DType.float32 or state_dtype == DType.bfloat16
        ), "recurrent_state must be float32 or bfloat16"
        # The head-gate checks (the tiling is the CPU's: one tile of K rows).
        check_shapes[K, V, RING_LEN, K, 1](
            recurrent_state.shape(),
            ring.shape(),
            row_ids.shape(),
            ring_row_ids.shape(),
            num_accepted.dim_size(0),
        )
        var num_value_heads = recurrent_state.dim_size(1)
        var num_key_heads = ring.dim_size(1)
        var record_stride = ring.dim_size(3)
        check_channel_record_stride[K, V](num_value_heads, num_key_heads, record_stride)
        comptime if target == "cpu":
            var num_layers = row_ids.dim_size(0)
            var batch = row_ids.dim_size(1)
            if num_layers * batch == 0:
                return
            check_ids(row_ids.unsafe_ptr(), num_layers * batch, recurrent_state.dim_size(0), "row_ids")
            check_ids(ring_row_ids.unsafe_ptr(), num_layers * batch, ring.dim_size(0), "ring_row_ids")
            fold_cpu[state_dtype, K, V, RING_LEN, True](
                recurrent_state.unsafe_ptr(),
                ring.unsafe_ptr(),
                row_ids.unsafe_ptr(),
                ring_row_ids.unsafe_ptr(),
                num_accepted.unsafe_ptr(),
                num_layers,
                batch,
                num_value_heads,
                num_key_heads,
                record_stride,
            )
        else:
            raise Error(
                t"gdfold_state_fold_channel: per-channel gates have no {target} path yet;"
                t" run the fold on the CPU"
            )
