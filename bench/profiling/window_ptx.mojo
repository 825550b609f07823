"""Compiles the GPU window kernel for an H100/H200 (sm_90a) on any machine, no GPU
needed, and prints the PTX of each instantiation below after a `// window kernel:` line.
bench/profiling/window_registers.sh feeds each to ptxas for its registers and spills, the figures
that decide how many blocks an SM holds (window_blocks_per_sm).

`_compile_code` is MAX 26.7's own (underscored) entry to the GPU compiler: the API this
tool relies on may move in later versions.
"""

from max.gpu.host.compile import _compile_code, get_gpu_target
from mojo.window_gpu import windows_gpu_kernel
from mojo.window_gpu_latency import windows_gpu_latency_kernel


def emit[
    state_dtype: DType,
    K: Int,
    FOLD_PREVIOUS: Bool,
    COLUMN_TILE: Int,
    RECORD: Bool = True,
    CHANNEL: Bool = False,
]():
    print(
        "// window kernel:", state_dtype, "K = V =", K,
        "fold on load" if FOLD_PREVIOUS else ("verify" if RECORD else "forward"), "tile", COLUMN_TILE,
        "per-channel gates" if CHANNEL else "",
    )
    print(
        _compile_code[
            windows_gpu_kernel[state_dtype, K, K, 4, RECORD, FOLD_PREVIOUS, COLUMN_TILE, CHANNEL],
            target=get_gpu_target["sm_90a"](),
        ]().asm
    )


def emit_latency[
    state_dtype: DType, K: Int, RECORD: Bool, FOLD_PREVIOUS: Bool, CV: Int, CHANNEL: Bool = False
]():
    print(
        "// window kernel:", "latency path,", state_dtype, "K = V =", K,
        "fold on load" if FOLD_PREVIOUS else ("verify" if RECORD else "forward"),
        CV, "columns per thread", "per-channel gates" if CHANNEL else "",
    )
    print(
        _compile_code[
            windows_gpu_latency_kernel[
                state_dtype, K, K, 4, RECORD, FOLD_PREVIOUS, CV, CHANNEL
            ],
            target=get_gpu_target["sm_90a"](),
        ]().asm
    )


def main():
    emit_latency[DType.float32, 128, True, True, 4]()
    emit_latency[DType.float32, 128, True, True, 2]()
    emit_latency[DType.float32, 128, False, False, 4]()
    emit_latency[DType.bfloat16, 128, True, True, 4]()
    emit_latency[DType.float32, 256, True, True, 2]()
    emit_latency[DType.float32, 128, True, True, 4, True]()
    emit_latency[DType.float32, 128, False, False, 4, True]()
    emit_latency[DType.bfloat16, 128, True, True, 4, True]()
    emit[DType.float32, 128, True, 64]()
    emit[DType.float32, 128, False, 64]()
    emit[DType.bfloat16, 128, True, 64]()
    emit[DType.bfloat16, 128, False, 64, False]()
    emit[DType.bfloat16, 128, True, 128]()
    emit[DType.float32, 256, True, 64]()
    # The throughput kernel with per-channel gates: each op, fp32 and bf16, at K = 128;
    # at K = 256 the verify (the fold on load's static shared memory is over 48 KiB).
    emit[DType.float32, 128, True, 64, True, True]()
    emit[DType.float32, 128, False, 64, True, True]()
    emit[DType.float32, 128, False, 64, False, True]()
    emit[DType.bfloat16, 128, True, 64, True, True]()
    emit[DType.bfloat16, 128, False, 64, True, True]()
    emit[DType.bfloat16, 128, False, 64, False, True]()
    emit[DType.float32, 256, False, 64, True, True]()
