"""The gated MLP activation: out[t, j] = silu(gate[t, j]) * up[t, j], silu(g) = g / (1 + exp(-g)).

gate_up (T, 2F) float32 is the fused gate/up projection output (gate in columns [0, F), up in [F, 2F));
out (T, F) float32.

Thread mapping: a 1-D grid-stride loop over the T * F outputs; thread k computes element (k // F, k % F),
so a warp reads 32 consecutive gate values and 32 consecutive up values (coalesced).

Versions: v1 only. At decode sizes the engine runs the same expression in the gate/up gemv's epilogue
(matmul.gated_matmul) instead of this kernel.
"""

import math
from functools import lru_cache

from numba import cuda, float32

from cuda_kernels import pdl
from cuda_kernels.launch import launch

THREADS = 256
MAX_BLOCKS = 1024

# largest t with exp(t) finite in fp32 (ln of the fp32 maximum is 88.7228...)
EXP_MAX_ARG = float32(88.72)

# ---------------------------------------------------------------------------------------------------------
# device helpers


@cuda.jit(device=True)
def silu(g):
    """g / (1 + exp(-g)) in fp32. NOTE: for g < -88.72 exp(-g) is inf in fp32 and g / inf = -0, the correct
    limit; it is written out because the simulator's Python exp raises OverflowError instead of giving inf."""
    e = math.exp(-g) if -g <= EXP_MAX_ARG else float32(math.inf)
    return g / (float32(1) + e)


# ---------------------------------------------------------------------------------------------------------
# kernels


@lru_cache(maxsize=None)
def _silu_and_mul_kernel():
    @cuda.jit
    def silu_and_mul_kernel(gate_up, out):
        pdl.launch_dependents()
        pdl.grid_wait()
        f = out.shape[1]
        for k in range(cuda.grid(1), out.shape[0] * f, cuda.gridsize(1)):
            t, j = k // f, k % f
            out[t, j] = silu(gate_up[t, j]) * gate_up[t, f + j]

    return silu_and_mul_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers


def silu_and_mul(gate_up, out, stream=0):
    """out (T, F) <- silu(gate_up[:, :F]) * gate_up[:, F:], gate_up (T, 2F) float32."""
    if gate_up.ndim != 2 or gate_up.dtype.name != "float32" or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected (T, 2F) float32, got {tuple(gate_up.shape)} {gate_up.dtype}")
    expected = (gate_up.shape[0], gate_up.shape[1] // 2)
    if out.shape != expected or out.dtype.name != "float32":
        raise ValueError(f"out: expected {expected} float32, got {tuple(out.shape)} {out.dtype}")
    n = expected[0] * expected[1]
    if n:
        blocks = min(MAX_BLOCKS, -(-n // THREADS))
        launch(_silu_and_mul_kernel(), blocks, THREADS, stream, gate_up, out, dependent=True)
