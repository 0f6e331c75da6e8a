"""The epilogues the GEMV kernels fuse (gemv.py: gemv, gemv_rope and the staged gemv; gemv_tc.py): which row
of W each row of a group of weight rows is, and what a group writes from its totals.

    ""            out[m, n] = (x @ W^T)[m, n]                             out (M, N) float32
    "gated"       out[m, j] = silu(g_j) * u_j, W = [gate; up] (2F, K)     out (M, F) float32
    "gated_planes" the same, stored as bf16(silu(g_j) * u_j)              out (M, F) uint16 bf16 bits: the bf16
                  plane that the next GEMM (the down projection) multiplies
    "rope"        what rope.rope_kv_write writes from qkv = x @ W^T, W the fused QKV weight (heads of head_dim
                  rows): the rotated q, and the rotated K and the V of each token into its cache slot, in the
                  cache's format (kv_format.codec's encode, a compile-time choice)

with g_j, u_j the totals of gate row j and up row F + j. A paired epilogue (all but "") takes a group of R
weight rows as R/2 pairs, row r with row r + R/2 of the group: "gated" pairs gate row j with up row F + j,
"rope" rows i and i + head_dim/2 of a head, the two halves RoPE rotates together. So one kernel computes both
totals of a pair and writes the result: no (M, 2F) or qkv intermediate, no SiLU or RoPE kernel. Twins:
reference.matmul.matmul, gated_matmul and matmul_rope_kv_write.
"""

import functools

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels import activation, kv_format
from cuda_kernels.primitives import f32_to_bf16
from numba import cuda


@functools.lru_cache(maxsize=None)
def epilogue_rows(rows: int, pairing: str, head_dim: int, fmt: str = "bf16"):
    """(weight_row, store_inputs, store): the device functions by which a gemv kernel (or gemv_tc's) maps a
    group of `rows` weight rows to the weight and writes their results, for a pairing ("", "gated",
    "gated_planes" or "rope": the module docstring).

    weight_row(n0, r, N): the weight row of row r of the group starting at n0 (a multiple of rows), clamped
    to a valid one (the caller skips the store for it). store(dst, m, j, a, b, pre): write output j of
    activation row m from its row total a (paired: the totals a and b of pair j); dst holds the arrays
    written, pre = store_inputs(dst, m, j) what else the store reads (rope: cos, sin and the slot). Those
    are step inputs and constants, never written by a kernel of the step, so a kernel may read them before
    its PDL wait (cuda_kernels/pdl.py, rule 2) and keep the dependent loads out of its tail."""
    R = rows
    RH = R // 2                             # paired: pairs per group
    GATED, ROPE = pairing in ("gated", "gated_planes"), pairing == "rope"
    PAIRED = GATED or ROPE
    HALF = head_dim // 2
    encode = kv_format.codec(fmt)[0]   # the KV cache's format (rope)

    @cuda.jit(device=True, inline=True)
    def weight_row(n0, r, N):
        """n0 + r, or paired, row r % (R/2) of pair n0 / 2 + r % (R/2) (its first row for r < R/2, else its
        second): gated, gate row p or up row F + p (N = 2F); rope, row i or i + d/2 of head h for pair
        p = h d/2 + i."""
        if not PAIRED:
            return min(n0 + r, N - 1)
        pair = min(n0 // 2 + r % RH, N // 2 - 1)
        if GATED:
            return pair + (r // RH) * (N // 2)
        return (pair // HALF) * (2 * HALF) + pair % HALF + (r // RH) * HALF

    # One store (and its inputs) per epilogue, picked below.
    @cuda.jit(device=True, inline=True)
    def no_inputs(dst, m, j):
        return 0

    @cuda.jit(device=True, inline=True)
    def store_row(dst, m, j, a, b, pre):
        dst[0][m, j] = a

    @cuda.jit(device=True, inline=True)
    def store_gated(dst, m, j, a, b, pre):
        dst[0][m, j] = activation.silu(a) * b

    @cuda.jit(device=True, inline=True)
    def store_gated_planes(dst, m, j, a, b, pre):
        dst[0][m, j] = f32_to_bf16(activation.silu(a) * b)

    @cuda.jit(device=True, inline=True)
    def rope_inputs(dst, m, j):
        """(cos, sin) of pair j at row m's position, and row m's cache slot."""
        q_out, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale = dst
        pos, i = positions[m], j % HALF
        return cos[pos, i], sin[pos, i], slot_mapping[m]

    @cuda.jit(device=True, inline=True)
    def store_rope(dst, m, j, a, b, pre):
        q_out, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale = dst
        c, s, slot = pre
        head, i = j // HALF, j % HALF
        num_heads, num_kv_heads = q_out.shape[1], k_cache.shape[2]
        if head < num_heads + num_kv_heads:
            # rope_kv_write's rotation, the same expressions
            a, b = a * c - b * s, b * c + a * s
        if head < num_heads:
            q_out[m, head, i] = a
            q_out[m, head, i + HALF] = b
        elif slot >= 0:
            block, offset = slot // k_cache.shape[1], slot % k_cache.shape[1]
            if head < num_heads + num_kv_heads:
                k_cache[block, offset, head - num_heads, i] = encode(a, k_scale)
                k_cache[block, offset, head - num_heads, i + HALF] = encode(b, k_scale)
            else:
                v_cache[block, offset, head - num_heads - num_kv_heads, i] = encode(a, v_scale)
                v_cache[block, offset, head - num_heads - num_kv_heads, i + HALF] = encode(b, v_scale)

    if ROPE:
        return weight_row, rope_inputs, store_rope
    if pairing == "gated_planes":
        return weight_row, no_inputs, store_gated_planes
    return weight_row, no_inputs, store_gated if GATED else store_row
