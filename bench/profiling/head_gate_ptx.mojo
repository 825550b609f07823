"""Prints the sm_90a PTX of the head-gate GPU kernels (the fold, the latency window
kernel on each of its paths, the throughput window kernel), each after a `// kernel:`
line. same_ptx.sh compares it between two versions of mojo/: a change that leaves it
identical leaves the head-gate kernels' speed and bits as they were.

`_compile_code` is MAX 26.7's own (underscored) entry to the GPU compiler.
"""

from max.gpu.host.compile import _compile_code, get_gpu_target
from mojo.fold_gpu import fold_gpu_kernel
from mojo.window_gpu import windows_gpu_kernel
from mojo.window_gpu_latency import windows_gpu_latency_kernel


def main():
    comptime t = get_gpu_target["sm_90a"]()
    print("// kernel: fold, float32, tile 128 x 8")
    print(_compile_code[fold_gpu_kernel[DType.float32, 128, 128, 4, 128, 8], target=t]().asm)
    print("// kernel: fold, bfloat16, tile 128 x 16")
    print(_compile_code[fold_gpu_kernel[DType.bfloat16, 128, 128, 4, 128, 16], target=t]().asm)
    print("// kernel: latency, float32, fold on load, 4 columns")
    print(_compile_code[windows_gpu_latency_kernel[DType.float32, 128, 128, 4, True, True, 4], target=t]().asm)
    print("// kernel: latency, float32, verify, 4 columns")
    print(_compile_code[windows_gpu_latency_kernel[DType.float32, 128, 128, 4, True, False, 4], target=t]().asm)
    print("// kernel: latency, bfloat16, forward, 4 columns")
    print(_compile_code[windows_gpu_latency_kernel[DType.bfloat16, 128, 128, 4, False, False, 4], target=t]().asm)
    print("// kernel: latency, float32, fold on load, 2 columns")
    print(_compile_code[windows_gpu_latency_kernel[DType.float32, 128, 128, 4, True, True, 2], target=t]().asm)
    print("// kernel: throughput, float32, fold on load, tile 64")
    print(_compile_code[windows_gpu_kernel[DType.float32, 128, 128, 4, True, True, 64], target=t]().asm)
    print("// kernel: throughput, bfloat16, verify, tile 64")
    print(_compile_code[windows_gpu_kernel[DType.bfloat16, 128, 128, 4, True, False, 64], target=t]().asm)
