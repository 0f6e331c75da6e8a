"""bf16 planes: an fp32 array as the bf16 pieces the tensor-core GEMMs multiply, written by the kernel that
produces the array, so that no conversion kernel runs between it and the GEMM.

    planes[p * size + i] = piece p of x.flat[i],   x of `size` elements

With bf16 inputs (the engine's matmul_precision "bf16") one piece, x rounded to the nearest bf16 (ties to
even); else three, the bf16x3 split (mma.split_bf16x3: hi + mid + lo == x exactly). It is the layout
gemm_pipelined.bf16_planes writes and every GEMM that reads planes takes (gemv_tc, gemm_pipelined,
gemm_wgmma, gemm_tma); twin: reference.matmul.bf16_planes. Producers: rmsnorm (the QKV and gate/up inputs),
the decode attention (the O projection's input) and bf16_planes itself.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, uint16

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels.launch import view
from cuda_kernels.mma import split_bf16x3
from cuda_kernels.primitives import f32_to_bf16


def pieces(bf16_inputs: bool) -> int:
    """bf16 planes of x: 1 (x rounded) with bf16_inputs, else 3 (the bf16x3 split)."""
    return 1 if bf16_inputs else 3


@functools.lru_cache(maxsize=None)
def planes_store(count: int):
    """The device function store(planes, size, i, v): element i of a `size`-element fp32 output, v, written as
    its `count` bf16 planes (1 or 3, see the module docstring); for count 0 nothing (the stores compile away,
    so a kernel without a planes output may pass any array)."""

    @cuda.jit(device=True, inline=True)
    def store(planes, size, i, v):
        if count == 1:
            planes[i] = f32_to_bf16(v)
        elif count == 3:
            hi, mid, lo = split_bf16x3(v)
            planes[i] = uint16(hi)
            planes[size + i] = uint16(mid)
            planes[2 * size + i] = uint16(lo)

    return store


def planes_output(planes, out, bf16_inputs: bool) -> tuple[int, object]:
    """(count, the kernel's planes argument) for a launcher whose kernel writes out (float32, C-contiguous)
    and, given `planes` (a 1-D uint16 workspace), out's bf16 planes too: pieces(bf16_inputs) of them. Without
    planes, (0, out's own bytes seen as uint16): the kernel takes the argument but never writes it."""
    size = int(np.prod(out.shape))
    if planes is None:
        return 0, view(out, (2 * size,), np.uint16)
    count = pieces(bf16_inputs)
    if planes.dtype != np.uint16 or len(planes.shape) != 1 or planes.shape[0] < count * size:
        raise ValueError(f"planes: expected a 1-D uint16 workspace of at least {count * size} elements "
                         f"({count} bf16 planes of {size}), got {tuple(planes.shape)} {planes.dtype}")
    return count, planes
