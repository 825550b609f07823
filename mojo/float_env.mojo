"""IEEE subnormals on the CPU while a fold runs.

MAX's CPU worker threads run with subnormals flushed to zero (x86 MXCSR FTZ/DAZ,
AArch64 FPCR.FZ), which would make the CPU fold differ from the IEEE fused
multiply-add that the GPU path and the reference compute. A fold turns flushing off
for its own work and puts the thread's setting back afterwards.
"""

from std.memory import stack_allocation
from std.sys import CompilationTarget, llvm_intrinsic

# x86 MXCSR: flush-to-zero (results) and denormals-are-zero (inputs).
comptime MXCSR_FLUSH_BITS = (1 << 15) | (1 << 6)
# AArch64 FPCR: FZ, flush-to-zero (NEON marks an AArch64 target where MAX runs).
comptime FPCR_FLUSH_BITS = 1 << 24


@always_inline
def read_float_control() -> Int:
    """The calling thread's floating-point control word (0 where unknown)."""
    comptime if CompilationTarget.is_x86():
        var cell = stack_allocation[1, DType.int32]()
        llvm_intrinsic["llvm.x86.sse.stmxcsr", NoneType](cell)
        return Int(cell[unsafe_offset=0])
    elif CompilationTarget.has_neon():
        return Int(llvm_intrinsic["llvm.aarch64.get.fpcr", Int64]())
    else:
        return 0


@always_inline
def write_float_control(word: Int):
    comptime if CompilationTarget.is_x86():
        var cell = stack_allocation[1, DType.int32]()
        cell[unsafe_offset=0] = Int32(word)
        llvm_intrinsic["llvm.x86.sse.ldmxcsr", NoneType](cell)
    elif CompilationTarget.has_neon():
        llvm_intrinsic["llvm.aarch64.set.fpcr", NoneType](Int64(word))


@always_inline
def keep_subnormals() -> Int:
    """Turns subnormal flushing off; returns the control word to restore."""
    var saved = read_float_control()
    comptime if CompilationTarget.is_x86():
        write_float_control(saved & ~MXCSR_FLUSH_BITS)
    elif CompilationTarget.has_neon():
        write_float_control(saved & ~FPCR_FLUSH_BITS)
    return saved
