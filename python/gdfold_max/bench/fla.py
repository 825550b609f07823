"""FLA's ``fused_recurrent_gated_delta_rule`` as an anchor of the step benchmark.

FLA (fla-core, Triton) is what vLLM's and SGLang's gated-delta decode builds on. It is
not a dependency of this package: this module imports ``torch`` and ``fla`` only when a
benchmark asks for them, and says what is missing otherwise.

Each layer's call takes the same windows and data as our verify: ``q, k [B, W, nk, K]``
and ``v [B, W, nv, V]`` split from ``qkv`` (q, then k, then v), ``g = log(decay)`` and
``beta`` ``[B, W, nv]``, scale ``1/sqrt(K)``, the keys and queries L2-normalised in the
kernel, the layer's pool rows as the initial state and the final state returned. A
step's 36 calls are captured in one CUDA graph and timed by replay, so Python's launch
costs do not count: per step (t_R - t_1) / (R - 1) over R replays back to back and one,
as for ours.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from max.dtype import DType

from .harness import FoldShape, best_seconds, per_link_from


def fla_missing() -> str:
    """Empty when torch (with CUDA) and FLA import; otherwise why FLA cannot run."""
    try:
        import torch
    except ImportError:
        return "torch does not import"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule  # noqa: F401
    except ImportError as error:
        return f"fla does not import ({error})"
    return ""


class FlaSteps:
    """FLA's forward over every layer of one step as a CUDA graph, replayed 1 and ``chain``
    times."""

    def __init__(self, shape: FoldShape, chain: int) -> None:
        self.shape, self.chain = shape, chain

    def prepare(self, host: dict[str, np.ndarray], batch: int, state_dtype: DType, repeats: int
                ) -> Callable[[], float]:
        """Uploads one step's data (from ``bench.step.step_host_inputs``), captures the
        graphs, and returns a function that times a step."""
        import torch
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        s = self.shape
        window = s.ring_len
        cuda = torch.device("cuda")
        qkv = torch.from_numpy(host["qkv"]).to(cuda)
        split = s.num_key_heads * s.key_dim
        q = qkv[:, :split].reshape(batch, window, s.num_key_heads, s.key_dim).contiguous()
        k = qkv[:, split : 2 * split].reshape(batch, window, s.num_key_heads, s.key_dim).contiguous()
        v = qkv[:, 2 * split :].reshape(batch, window, s.num_value_heads, s.value_dim).contiguous()
        g = torch.from_numpy(np.log(host["decay"])).to(cuda).reshape(batch, window, s.num_value_heads)
        beta = torch.from_numpy(host["beta"]).to(cuda).reshape(batch, window, s.num_value_heads)
        pool_dtype = torch.bfloat16 if state_dtype == DType.bfloat16 else torch.float32
        pool = torch.zeros(s.num_layers, batch, s.num_value_heads, s.key_dim, s.value_dim, dtype=pool_dtype,
                           device=cuda)
        scale = 1.0 / math.sqrt(s.key_dim)
        keep: list[Any] = []

        def step() -> None:
            for layer in range(s.num_layers):
                keep.append(fused_recurrent_gated_delta_rule(
                    q, k, v, g=g, beta=beta, scale=scale, initial_state=pool[layer], output_final_state=True,
                    use_qk_l2norm_in_kernel=True))
            keep.clear()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compiles the Triton kernel outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()

        def timed(steps: int) -> float:
            def run() -> None:
                for _ in range(steps):
                    graph.replay()
                torch.cuda.synchronize()

            return best_seconds(run, repeats)

        return lambda: per_link_from(timed, self.chain)
