"""Chapters 7 (attention with online softmax: prefill) and 8 (the KV cache and decode: the PagedAttention
ladder) against reference/paged_attention.py, on the heads of Llama-3.2-1B (32 query heads, 8 KV heads,
head_dim 64, KV blocks of 16 tokens).

Chapter 7: one 1,024-token prompt (compute-bound: flops = 4 Hq d x the causal (query, key) pairs).
Chapter 8: decode at batch 64 x 4,096 cached tokens (bandwidth-bound: bytes_moved = the K and V read).
"""

from __future__ import annotations

from functools import partial

import numpy as np
from numba import cuda

from cuda_kernels import attention, attention_policy, attention_tc, attention_tc_pipelined, paged_attention
from reference import paged_attention as ref
from tools.course_ladders.common import FMA_PEAK_TFLOPS, MMA_PEAK_TFLOPS, Step
from tools.kernel_benchmarks.attention import _atol, _paged_cache
from tools.kernel_benchmarks.common import Case

F32_EPS = float(np.finfo(np.float32).eps)
# (Hq, Hkv, d, block size, contexts): "real" the 1B model's heads, "tiny" what the simulator affords
PREFILL_SHAPES = {"real": (32, 8, 64, 16, [1024]), "tiny": (2, 1, 16, 4, [9, 14])}
DECODE_SHAPES = {"real": (32, 8, 64, 16, [4096] * 64), "tiny": (2, 1, 16, 4, [9, 40])}


def _inputs(shape, queries_per_seq, seed):
    hq, hkv, d, block, contexts = shape
    rng = np.random.default_rng(seed)
    k_cache, v_cache, tables = _paged_cache(rng, contexts, block, hkv, d)
    q = rng.standard_normal((sum(queries_per_seq), hq, d), dtype=np.float32)
    return q, k_cache, v_cache, tables, np.array(contexts, np.int32)


def _case(name, run, out, want, atol, **sizes) -> Case:
    def check():
        out.copy_to_device(np.full(out.shape, np.nan, np.float32))   # a skipped output must fail
        run(0)
        np.testing.assert_allclose(out.copy_to_host(), want(), atol=atol, rtol=4 * F32_EPS)

    return Case("attention", name, run, check, **sizes)


def _once(compute):
    """compute(), evaluated on the first call only (the NumPy reference of a real shape takes seconds)."""
    memo = []

    def value():
        if not memo:
            memo.append(compute())
        return memo[0]
    return value


def prefill_steps(real: bool) -> list[Step]:
    shape = PREFILL_SHAPES["real" if real else "tiny"]
    hq, hkv, d, block, contexts = shape
    q, k_cache, v_cache, tables, lens = _inputs(shape, contexts, seed=7)
    cu = np.concatenate([[0], np.cumsum(contexts)]).astype(np.int32)
    scale = np.float32(d ** -0.5)
    dq, dk, dv, dt, dcu, dl = (cuda.to_device(a) for a in (q, k_cache, v_cache, tables, cu, lens))
    out = cuda.device_array(q.shape, np.float32)
    want = _once(lambda: ref.prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale))
    atol = _atol([q[cu[s]:cu[s + 1]] for s in range(len(contexts))], k_cache, v_cache, tables, contexts, scale)
    flops = 4 * hq * d * sum(n * (n + 1) // 2 for n in contexts)

    def runner(launcher):
        def run(stream):
            launcher(dq, dk, dv, dt, dcu, dl, scale, out, max(contexts), stream)
        return run

    warps, keys = attention_policy.prefill_tc_config(d)
    pipelined_warps, pipelined_keys = attention_policy.prefill_pipelined_config(d)
    flash_warps, rows = attention_policy.prefill_flash_config(d)
    rungs = [("7a prefill_attention_naive", "whole rows of scores in shared memory, three passes",
              attention.prefill_attention_naive, FMA_PEAK_TFLOPS),
             ("7b prefill_attention (flash)", "one pass, online softmax; K/V tiles shared by a block's rows",
              partial(attention.prefill_attention, warps=flash_warps, rows=rows), FMA_PEAK_TFLOPS),
             ("7c prefill_attention_tc", "both products on mma.sync; S and P stay in registers",
              partial(attention_tc.prefill_attention_tc, warps=warps, keys_per_tile=keys), MMA_PEAK_TFLOPS / 3),
             ("7d prefill_attention_tc_pipelined", "next K/V tile copied by cp.async while this one is multiplied; "
              "fragments by ldmatrix", partial(attention_tc_pipelined.prefill_attention_tc_pipelined,
                                                 warps=pipelined_warps, keys_per_tile=pipelined_keys),
              MMA_PEAK_TFLOPS / 3)]
    return [Step(version, idea, _case(version, runner(launcher), out, want, atol, flops=flops), peak)
            for version, idea, launcher, peak in rungs]


def decode_steps(real: bool) -> list[Step]:
    shape = DECODE_SHAPES["real" if real else "tiny"]
    hq, hkv, d, block, contexts = shape
    s = len(contexts)
    q, k_cache, v_cache, tables, lens = _inputs(shape, [1] * s, seed=8)
    scale = np.float32(d ** -0.5)
    dq, dk, dv, dt, dl = (cuda.to_device(a) for a in (q, k_cache, v_cache, tables, lens))
    out = cuda.device_array(q.shape, np.float32)
    want = _once(lambda: ref.paged_attention(q, k_cache, v_cache, tables, lens, scale))
    atol = _atol([q[i:i + 1] for i in range(s)], k_cache, v_cache, tables, contexts, scale)
    kv_bytes = 2 * sum(contexts) * hkv * d * 2
    partition = 512 if real else 16
    work = [cuda.device_array(w, np.float32)
            for w in paged_attention.split_workspace_shapes(s, hq, d, max(contexts), partition)]
    width = tables.shape[1]
    workspace = cuda.device_array(max(1, attention_policy.decode_workspace_size(s, hq, hkv, d, width)), np.float32)
    args = (dq, dk, dv, dt, dl, scale, out)
    rungs = [
        ("8a paged_attention_walk", "a warp per (sequence, head), one key at a time",
         lambda stream: paged_attention.paged_attention_walk(*args, stream)),
        ("8b paged_attention_v1", "tiles of 32 keys through shared memory, 8 loads in flight per lane",
         lambda stream: paged_attention.paged_attention_v1(*args, stream)),
        (f"8c split-K ({partition}-key partitions)", "partitions of the context in parallel, then a merge",
         lambda stream: paged_attention.paged_attention_split(*args, *work, partition, stream)),
        ("8d paged_attention (the engine's)", "a block per KV head serves its G query heads; K/V in registers",
         lambda stream: attention_policy.decode_attention(*args, stream, workspace=workspace)),
    ]
    return [Step(version, idea, _case(version, run, out, want, atol, bytes_moved=kv_bytes))
            for version, idea, run in rungs]
