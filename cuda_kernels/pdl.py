"""Programmatic dependent launch (PDL): a kernel starts while the kernel before it in the stream finishes.

Without PDL, kernel B in a stream (or in a CUDA graph captured from one) starts only after kernel A has
completed and its writes are visible. The SMs then sit idle for B's launch, and B's first memory requests
still need a full DRAM round trip. A batch-1 decode step is about 165 such boundaries, each costing about as much
as a small kernel's own work. On sm_90 and later, PDL overlaps that:

- A executes ``launch_dependents()`` (griddepcontrol.launch_dependents). Once every block of A has executed it
  or exited, the GPU may schedule B's blocks on whatever SM resources are free, while A still runs.
- B is launched with the programmatic-stream-serialization attribute (``launch(kernel, grid, block, stream,
  *args, dependent=True)``, cuda_kernels/launch.py). Before B touches memory that an earlier kernel writes,
  B executes ``grid_wait()`` (griddepcontrol.wait). The wait returns when every grid B depends on has
  completed, with its writes visible.

So the code before the wait overlaps A's tail (and possibly earlier kernels: A itself may not have passed its
own wait yet): there, a kernel may read only what no kernel still running can write, and it must not write
anything. The gemv issues its first weight loads before the wait; decode attention reads the step inputs
(block tables, context lengths) and the K/V of keys older than the step; the other kernels wait first and
gain the launch latency.

Rules for a kernel launched with dependent=True:
1. Every block executes grid_wait() before it exits, including blocks with nothing to do. A grid completes
   only after all its blocks do. So if each launched kernel waited for its predecessor, the chain is
   transitive: when B's wait returns, A has completed, and A's own wait means everything before A has too.
2. Before the wait: no write, and no read of anything a kernel of the same step writes (weights, and inputs
   copied in before the step, are fine: the graph starts after the copy).
A kernel launched the ordinary way may still call both functions: grid_wait() then returns at once, and
launch_dependents() only lets a PDL-launched successor start early.

The device functions compile to the two instructions on compute capability 9.0 and later, and to nothing
below 9.0 (where `launch` also launches the ordinary way). In the simulator they are no-ops: it runs one
launch at a time. TINYVLLM_PDL=0 turns the attribute off (for A/B measurements); the instructions stay.
`enabled()` says whether dependent launches get the attribute.

`producer_consumer` is the smallest example of the rules: a slow producer kernel, then a PDL-launched
consumer that waits before it reads the producer's output. The tests use it.
"""

from __future__ import annotations

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import PDL_MIN_CC, launch
from cuda_kernels.launch import pdl_enabled as enabled  # noqa: F401  (re-exported: the PDL switch)
from numba import cuda

if SIMULATOR:
    def grid_wait():
        """No-op in the simulator: launches run one after another."""

    def launch_dependents():
        """No-op in the simulator."""

else:
    from functools import lru_cache

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @lru_cache(maxsize=None)
    def _device_supports() -> bool:
        return tuple(cuda.get_current_device().compute_capability) >= PDL_MIN_CC

    def _griddepcontrol(op: str):
        @intrinsic
        def emit(typingctx):
            def codegen(context, builder, signature, args):
                # NOTE: decided when the kernel compiles: the PTX instruction exists from sm_90 on only.
                if _device_supports():
                    # a memory clobber, so that the compiler moves no load or store across it
                    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f"griddepcontrol.{op};", "~{memory}",
                                       side_effect=True)
                    builder.call(asm, [])
                return context.get_dummy_value()

            return types.none(), codegen

        return emit

    _wait_asm = _griddepcontrol("wait")
    _trigger_asm = _griddepcontrol("launch_dependents")

    @cuda.jit(device=True, inline=True)
    def grid_wait():
        """Wait until the grids this one depends on have completed and their writes are visible."""
        _wait_asm()

    @cuda.jit(device=True, inline=True)
    def launch_dependents():
        """Allow the next PDL-launched grid of the stream to start once every block of this grid got here."""
        _trigger_asm()


# ---------------------------------------------------------------------------------------------------------
# kernels: the example pair


@cuda.jit
def _slow_fill(a, spins):
    """a[i] = i after `spins` dependent multiply-adds, slow enough that a consumer which did not wait would
    read a's old contents."""
    launch_dependents()
    grid_wait()
    i = cuda.grid(1)
    acc = 0.0
    for _ in range(spins):
        acc = acc * 0.999 + 1.0
    if i < a.size:
        a[i] = i + acc * 0.0


@cuda.jit
def _add_one(a, b):
    launch_dependents()
    grid_wait()   # a comes from the kernel before: no read of it above this line
    i = cuda.grid(1)
    if i < a.size:
        b[i] = a[i] + 1


# ---------------------------------------------------------------------------------------------------------
# launchers


def producer_consumer(a, b, spins, stream=0):
    """a[i] <- i (slowly), then b <- a + 1 launched as a dependent: b == arange + 1 however early it starts.
    a, b: float32 device arrays of the same size."""
    blocks = -(-a.size // 256)
    launch(_slow_fill, blocks, 256, stream, a, spins)
    launch(_add_one, blocks, 256, stream, a, b, dependent=True)
