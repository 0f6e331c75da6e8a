"""Chapter 14 (KV-cache formats): decode PagedAttention as the engine launches it (chapter 8's 8d, its own
policies), over one cache stored in each format of reference/kv_format.py: fp32, bf16 and fp8 e4m3 (the
engine's per-tensor scales, 1.0). The same random values are stored in each (tools/kernel_benchmarks/
attention.engine_decode_case, which tools/bench.py's kvcache workload times too); each rung is checked
against reference/paged_attention.py reading the same stored elements.

Bandwidth-bound: bytes_moved is the K and V read in the format (4, 2 or 1 bytes an element), so each rung has
its own roofline. Real shapes: batch 64 x 4,096 cached tokens, 32 query / 8 KV heads, d 64, blocks of 16.
"""

from __future__ import annotations

from tools.course_ladders.common import Step
from tools.kernel_benchmarks.attention import engine_decode_case

# (batch, context, (Hq, Hkv, d), block size): "real" the 1B model's heads, "tiny" what the simulator affords
SHAPES = {"real": (64, 4096, (32, 8, 64), 16), "tiny": (2, 40, (2, 1, 16), 4)}


def format_steps(real: bool) -> list[Step]:
    batch, context, heads, block = SHAPES["real" if real else "tiny"]
    rungs = [("14a fp32 cache", "4 bytes an element: K and V as computed, no rounding", "fp32"),
             ("14b bf16 cache (the default)", "2 bytes: 8 significant bits, nearest even; read by a shift",
              "bf16"),
             ("14c fp8 e4m3 cache", "1 byte: 4 significant bits, saturated at 448; read by cvt (sm_89+)", "fp8")]
    return [Step(version, idea, engine_decode_case(batch, context, heads, block, kv_cache_dtype=fmt))
            for version, idea, fmt in rungs]
