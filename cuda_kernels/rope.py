"""Rotary embeddings on Q and K, fused with the write of K and V into the paged KV cache.

For token t at position p = positions[t] and each head vector split in halves (x1, x2) of size d/2:

    out1[i] = x1[i] * cos[p, i] - x2[i] * sin[p, i]
    out2[i] = x2[i] * cos[p, i] + x1[i] * sin[p, i]

Inputs: qkv (T, (Hq + 2 Hkv) * d) float32, the fused projection output (query heads, then key heads, then
value heads); positions (T,) int; cos, sin (max_positions, d/2) float32 tables computed on the host in
float64 (reference/rope.py, llama3 scaling included), so no transcendental is evaluated here; slot_mapping
(T,) int, -1 for padding tokens. Outputs: q_out (T, Hq, d) float32 rotated; k_cache, v_cache
(num_blocks, block_size, Hkv, d) in the cache's format (cuda_kernels/kv_format.py: uint16 bf16 rounded to
nearest even, float32, or uint8 fp8 e4m3 of x / k_scale and x / v_scale), the rotated K and the V of token t
at flat slot slot_mapping[t].

Thread mapping: grid = (T,), one block per token. The block's threads stride over the (Hq + Hkv) * d/2
rotation pairs (thread j owns pair i = j % (d/2) of head j // (d/2): it reads x1[i] and x2[i] and writes
both outputs, so nothing is read after another thread wrote it) and then over the Hkv * d value entries.

Versions: v1 only. Fusing the cache write here saves a kernel launch and a round trip of K through memory.
At decode sizes the engine fuses this kernel's work into the QKV gemv's epilogue instead
(matmul.matmul_rope_kv_write); prefill steps run this kernel.
"""

from functools import lru_cache

from numba import cuda, uint32

from cuda_kernels import kv_format, pdl
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import launch

# NOTE: 512 threads on the GPU, so that one token's (Hq + Hkv) * d/2 rotation pairs take few passes (3 for
# the 1B model): at decode each pass is a memory round trip (see rmsnorm.py); the simulator keeps 128.
THREADS = 128 if SIMULATOR else 512

# ---------------------------------------------------------------------------------------------------------
# kernels


@lru_cache(maxsize=None)
def _rope_kv_write_kernel(num_heads: int, num_kv_heads: int, head_dim: int, fmt: str = "bf16"):
    half = head_dim // 2
    v_start = (num_heads + num_kv_heads) * head_dim
    encode = kv_format.codec(fmt)[0]

    # NOTE: unsigned 32-bit index arithmetic and while loops over an unsigned j (a token's row and the cache hold
    # far fewer than 2^32 elements; primitives' module docstring, "Index arithmetic"); the divisors are the
    # factory's constants (a shift and a mask for d = 64).
    HALF, D, HQ = uint32(half), uint32(head_dim), uint32(num_heads)
    PAIRS, V_SIZE = uint32((num_heads + num_kv_heads) * half), uint32(num_kv_heads * head_dim)
    V_START = uint32(v_start)

    @cuda.jit
    def rope_kv_write_kernel(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, k_scale, v_scale):
        pdl.launch_dependents()
        pdl.grid_wait()
        t = uint32(cuda.blockIdx.x)
        pos = uint32(positions[t])
        slot = slot_mapping[t]
        block_size = uint32(k_cache.shape[1])
        block, offset = uint32(slot) // block_size, uint32(slot) % block_size   # (used only where slot >= 0)
        step = uint32(cuda.blockDim.x)
        j = uint32(cuda.threadIdx.x)
        while j < PAIRS:
            head, i = j // HALF, j % HALF
            base = head * D  # Q heads first, then K heads, in the qkv row
            x1 = qkv[t, base + i]
            x2 = qkv[t, base + i + HALF]
            c = cos[pos, i]
            s = sin[pos, i]
            out1 = x1 * c - x2 * s
            out2 = x2 * c + x1 * s
            if head < HQ:
                q_out[t, head, i] = out1
                q_out[t, head, i + HALF] = out2
            elif slot >= 0:
                kv_head = head - HQ
                k_cache[block, offset, kv_head, i] = encode(out1, k_scale)
                k_cache[block, offset, kv_head, i + HALF] = encode(out2, k_scale)
            j = uint32(j + step)
        if slot >= 0:
            j = uint32(cuda.threadIdx.x)
            while j < V_SIZE:
                v_cache[block, offset, j // D, j % D] = encode(qkv[t, V_START + j], v_scale)
                j = uint32(j + step)

    return rope_kv_write_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers


def check_rope_args(positions, cos, sin, k_cache, v_cache, slot_mapping, q_out):
    """Validate rope_kv_write's arguments other than qkv (also those of gemv.gemv_rope, its fusion with the
    QKV projection); return (T, Hq, Hkv, d)."""
    if q_out.ndim != 3 or q_out.dtype.name != "float32":
        raise ValueError(f"q_out: expected (T, Hq, d) float32, got {tuple(q_out.shape)} {q_out.dtype}")
    t, hq, d = q_out.shape
    if k_cache.ndim != 4 or k_cache.dtype not in kv_format.DTYPES.values() or k_cache.shape[3] != d:
        raise ValueError(f"k_cache: expected (num_blocks, block_size, Hkv, {d}) uint16 (bf16), float32 (fp32) or "
                         f"uint8 (fp8), got {tuple(k_cache.shape)} {k_cache.dtype}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: expected {tuple(k_cache.shape)} {k_cache.dtype} (as k_cache), "
                         f"got {tuple(v_cache.shape)} {v_cache.dtype}")
    if d % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {d}")
    if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[1] != d // 2 or cos.dtype.name != "float32":
        raise ValueError(f"cos/sin: expected (max_positions, {d // 2}) float32 tables, got {tuple(cos.shape)}")
    for name, a in (("positions", positions), ("slot_mapping", slot_mapping)):
        if a.shape != (t,) or a.dtype.kind != "i":
            raise ValueError(f"{name}: expected ({t},) integer, got {tuple(a.shape)} {a.dtype}")
    return t, hq, k_cache.shape[2], d


def rope_kv_write(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, stream=0, k_scale=1.0,
                  v_scale=1.0):
    """Rotate Q into q_out (T, Hq, d); rotate K and write it with V into the cache at slot_mapping, in the
    cache's format (k_scale, v_scale: the fp8 cache's per-tensor scales)."""
    t, hq, hkv, d = check_rope_args(positions, cos, sin, k_cache, v_cache, slot_mapping, q_out)
    fmt = kv_format.format_of(k_cache)
    k_scale, v_scale = kv_format.check_scales(fmt, k_scale, v_scale)
    if qkv.shape != (t, (hq + 2 * hkv) * d) or qkv.dtype.name != "float32":
        raise ValueError(f"qkv: expected ({t}, {(hq + 2 * hkv) * d}) float32 for Hq={hq}, Hkv={hkv}, d={d}; "
                         f"got {tuple(qkv.shape)} {qkv.dtype}")
    if t:
        launch(_rope_kv_write_kernel(hq, hkv, d, fmt), t, THREADS, stream, qkv, positions, cos, sin, k_cache,
               v_cache, slot_mapping, q_out, k_scale, v_scale, dependent=True)
