"""Chapters 3 (row kernels) and 4 (RoPE and the KV-cache write) against reference/.

Chapter 3 at T = 1024 rows of the 1B model's hidden size 2048 (a prefill chunk: bandwidth-bound; at T = 1
these kernels are a chain of memory latencies, timed inside the decode step by tools/profile_step.py).
Chapter 4 at one decode token: the QKV projection then RoPE and the cache write, as two kernels and fused.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from cuda_kernels import activation, embedding, gemv, matmul_policy, rmsnorm, rope
from reference import activation as ref_activation
from reference import embedding as ref_embedding
from reference import rmsnorm as ref_rmsnorm
from reference.bf16 import bf16_to_f32, f32_to_bf16
from reference.kv_cache import allocate_kv_cache
from reference.matmul import bf16_planes, matmul_rope_kv_write
from reference.rope import rope_tables
from reference.tolerance import rope_bounds
from tools.course_ladders.common import Step
from tools.kernel_benchmarks.common import Case

# (T, H, F, V): rows, hidden size, MLP width, vocabulary
ROW_SHAPES = {"real": (1024, 2048, 8192, 128256), "tiny": (3, 40, 24, 50)}
# (Hq, Hkv, d, K): the 1B model's heads and hidden size
ROPE_SHAPES = {"real": (32, 8, 64, 2048), "tiny": (2, 1, 8, 24)}
EPS = 1e-5


def _close(got, want, rtol, atol=0.0):
    np.testing.assert_allclose(got.copy_to_host(), want, rtol=rtol, atol=atol)


def row_steps(real: bool) -> list[Step]:
    t, h, f, v = ROW_SHAPES["real" if real else "tiny"]
    rng = np.random.default_rng(3)
    x, r = rng.standard_normal((t, h), dtype=np.float32), rng.standard_normal((t, h), dtype=np.float32)
    w = f32_to_bf16(rng.standard_normal(h, dtype=np.float32))
    table = f32_to_bf16(rng.standard_normal((v, h), dtype=np.float32))
    ids = rng.integers(0, v, t).astype(np.int32)
    gate_up = rng.standard_normal((t, 2 * f), dtype=np.float32)
    dx, dw, dtable, dids, dgu = (cuda.to_device(a) for a in (x, w, table, ids, gate_up))
    out, act = cuda.device_array((t, h), np.float32), cuda.device_array((t, f), np.float32)
    residual = cuda.device_array((t, h), np.float32)
    planes = cuda.device_array(t * h, np.uint16)

    def run_embedding(stream):
        embedding.embedding(dids, dtable, out, stream)

    def check_embedding():
        run_embedding(0)
        _close(out, ref_embedding.embedding(ids, table), 0)

    def run_norm(stream):
        rmsnorm.rmsnorm(dx, dw, EPS, out, stream)

    def check_norm():
        run_norm(0)
        _close(out, ref_rmsnorm.rmsnorm(x, w, EPS), 1e-5, 1e-6)

    def run_fused(stream):
        rmsnorm.fused_add_rmsnorm(dx, residual, dw, EPS, out, stream)

    def check_fused():
        residual.copy_to_device(r)
        run_fused(0)
        want, want_residual = ref_rmsnorm.fused_add_rmsnorm(x, r, w, EPS)
        _close(out, want, 1e-5, 1e-6)
        _close(residual, want_residual, 0)

    def run_planes(stream):
        rmsnorm.rmsnorm(dx, dw, EPS, out, stream, planes=planes, bf16_inputs=True)

    def check_planes():
        run_planes(0)
        # the planes are exactly the bf16 rounding of the kernel's own fp32 result
        assert np.array_equal(planes.copy_to_host(), bf16_planes(out.copy_to_host(), True).ravel())
        _close(out, ref_rmsnorm.rmsnorm(x, w, EPS), 1e-5, 1e-6)

    def run_act(stream):
        activation.silu_and_mul(dgu, act, stream)

    def check_act():
        run_act(0)
        _close(act, ref_activation.silu_and_mul(gate_up), 1e-6, 1e-6)

    row_bytes = x.nbytes
    return [
        Step("3a embedding", "one block per token copies a bf16 row, widened", Case(
            "rows", "embedding", run_embedding, check_embedding, bytes_moved=t * h * (2 + 4))),
        Step("3b rmsnorm", "one block per row; a block reduction of the squares", Case(
            "rows", "rmsnorm", run_norm, check_norm, bytes_moved=2 * row_bytes + w.nbytes)),
        Step("3c fused_add_rmsnorm", "the residual add in the same pass over the row", Case(
            "rows", "fused_add_rmsnorm", run_fused, check_fused, bytes_moved=4 * row_bytes + w.nbytes)),
        Step("3d rmsnorm + bf16 planes", "also writes the next GEMM's bf16 input (no conversion kernel)", Case(
            "rows", "rmsnorm planes", run_planes, check_planes, bytes_moved=2.5 * row_bytes + w.nbytes)),
        Step("3e silu_and_mul", "silu(gate) * up, elementwise", Case(
            "rows", "silu_and_mul", run_act, check_act, bytes_moved=1.5 * gate_up.nbytes)),
    ]


def rope_steps(real: bool) -> list[Step]:
    hq, hkv, d, k = ROPE_SHAPES["real" if real else "tiny"]
    n = (hq + 2 * hkv) * d
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, k), dtype=np.float32)
    w = f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02))
    cos, sin = rope_tables(d, 4096, 500000.0)
    positions, slots = np.array([4000], np.int32), np.array([5], np.int32)
    cache = allocate_kv_cache(1, 16, hkv, d)
    dx, dw, dpos, dcos, dsin, dslots = (cuda.to_device(a) for a in (x, w, positions, cos, sin, slots))
    dk, dv = cuda.to_device(cache), cuda.to_device(cache)
    q_out, qkv = cuda.device_array((1, hq, d), np.float32), cuda.device_array((1, n), np.float32)
    config = matmul_policy.gemv_config(1, n, k)

    def run_two(stream):
        gemv.gemv(dx, dw, qkv, stream, config=config)
        rope.rope_kv_write(qkv, dpos, dcos, dsin, dk, dv, dslots, q_out, stream)

    def run_fused(stream):
        gemv.gemv_rope(dx, dw, dpos, dcos, dsin, dk, dv, dslots, q_out, stream, config=config)

    def check(run):
        def check_run():
            dk.copy_to_device(cache)
            dv.copy_to_device(cache)
            run(0)
            k_ref, v_ref = cache.copy(), cache.copy()
            q_ref = matmul_rope_kv_write(x, w, positions, cos, sin, k_ref, v_ref, slots, hq)
            tol, bound = rope_bounds(x, w, d)
            assert np.all(np.abs(q_out.copy_to_host() - q_ref) <= bound[:, :hq]), "q"
            for got, want, part in ((dk, k_ref, bound[0, hq:hq + hkv]), (dv, v_ref, tol[0, hq + hkv:])):
                g, r = bf16_to_f32(got.copy_to_host()[0, 5]), bf16_to_f32(want[0, 5])
                assert np.all(np.abs(g - r) <= part + 2.0 ** -7 * np.abs(r)), "K or V"
        return check_run

    weight_bytes = w.nbytes + x.nbytes + q_out.size * 4 + 2 * hkv * d * 2
    return [Step("4a gemv, then rope_kv_write", "two kernels: qkv goes to memory and back", Case(
                 "rope", "two kernels", run_two, check(run_two), bytes_moved=weight_bytes)),
            Step("4b gemv_rope", "RoPE and the cache write in the QKV gemv's epilogue", Case(
                 "rope", "fused", run_fused, check(run_fused), bytes_moved=weight_bytes))]
