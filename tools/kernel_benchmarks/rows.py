"""Benchmark cases for the row kernels (embedding, RMSNorm, RoPE + KV write, SiLU-and-mul) at 1B shapes."""

import numpy as np
from numba import cuda

from cuda_kernels import activation, embedding, rmsnorm, rope
from reference import activation as ref_activation
from reference import embedding as ref_embedding
from reference import rmsnorm as ref_rmsnorm
from reference import rope as ref_rope
from reference.bf16 import f32_to_bf16
from reference.kv_cache import allocate_kv_cache
from tools.kernel_benchmarks.common import Case

H, HQ, HKV, D, FFN, VOCAB = 2048, 32, 8, 64, 8192, 128256


def _close(got, want, rtol, atol=1e-6):
    np.testing.assert_allclose(got.copy_to_host(), want, rtol=rtol, atol=atol)


def cases() -> list[Case]:
    rng = np.random.default_rng(0)
    out = []
    for t in (1, 1024):
        x = rng.standard_normal((t, H), dtype=np.float32)
        r = rng.standard_normal((t, H), dtype=np.float32)
        w = f32_to_bf16(rng.standard_normal(H, dtype=np.float32))
        dx, dr, dw, dout = cuda.to_device(x), cuda.to_device(r), cuda.to_device(w), cuda.device_array((t, H), np.float32)

        def run_norm(stream, dx=dx, dw=dw, dout=dout):
            rmsnorm.rmsnorm(dx, dw, 1e-5, dout, stream)

        def check_norm(x=x, w=w, dout=dout):
            rmsnorm.rmsnorm(cuda.to_device(x), cuda.to_device(w), 1e-5, dout)
            _close(dout, ref_rmsnorm.rmsnorm(x, w, 1e-5), 1e-5)

        out.append(Case("rows", f"rmsnorm {t}x{H}", run_norm, check_norm, bytes_moved=2 * x.nbytes + w.nbytes))

        def run_fused(stream, dx=dx, dr=dr, dw=dw, dout=dout):
            rmsnorm.fused_add_rmsnorm(dx, dr, dw, 1e-5, dout, stream)

        def check_fused(x=x, r=r, w=w, dout=dout):
            res = cuda.to_device(r)
            rmsnorm.fused_add_rmsnorm(cuda.to_device(x), res, cuda.to_device(w), 1e-5, dout)
            want, want_res = ref_rmsnorm.fused_add_rmsnorm(x, r, w, 1e-5)
            _close(dout, want, 1e-5)
            _close(res, want_res, 0, 0)

        out.append(Case("rows", f"fused_add_rmsnorm {t}x{H}", run_fused, check_fused,
                        bytes_moved=4 * x.nbytes + w.nbytes))

        gate_up = rng.standard_normal((t, 2 * FFN), dtype=np.float32)
        dgu, dact = cuda.to_device(gate_up), cuda.device_array((t, FFN), np.float32)

        def run_act(stream, dgu=dgu, dact=dact):
            activation.silu_and_mul(dgu, dact, stream)

        def check_act(gate_up=gate_up, dgu=dgu, dact=dact):
            activation.silu_and_mul(dgu, dact)
            _close(dact, ref_activation.silu_and_mul(gate_up), 1e-6)

        out.append(Case("rows", f"silu_and_mul {t}x{FFN}", run_act, check_act, bytes_moved=1.5 * gate_up.nbytes))

        table = f32_to_bf16(rng.standard_normal((VOCAB, H), dtype=np.float32))
        ids = rng.integers(0, VOCAB, t).astype(np.int32)
        dtable, dids, demb = cuda.to_device(table), cuda.to_device(ids), cuda.device_array((t, H), np.float32)

        def run_emb(stream, dids=dids, dtable=dtable, demb=demb):
            embedding.embedding(dids, dtable, demb, stream)

        def check_emb(ids=ids, table=table, demb=demb, dids=dids, dtable=dtable):
            embedding.embedding(dids, dtable, demb)
            _close(demb, ref_embedding.embedding(ids, table), 0, 0)

        out.append(Case("rows", f"embedding {t}x{H}", run_emb, check_emb, bytes_moved=t * H * (2 + 4)))

        cos, sin = ref_rope.rope_tables(D, 8192, 500000.0)
        qkv = rng.standard_normal((t, (HQ + 2 * HKV) * D), dtype=np.float32)
        pos = np.arange(t, dtype=np.int32)
        block = 16
        nblocks = -(-t // block)
        slots = np.arange(t, dtype=np.int32)
        dqkv, dpos, dcos, dsin, dslots = (cuda.to_device(a) for a in (qkv, pos, cos, sin, slots))
        kc = cuda.to_device(allocate_kv_cache(nblocks, block, HKV, D))
        vc = cuda.to_device(allocate_kv_cache(nblocks, block, HKV, D))
        dq = cuda.device_array((t, HQ, D), np.float32)

        def run_rope(stream, dqkv=dqkv, dpos=dpos, dcos=dcos, dsin=dsin, kc=kc, vc=vc, dslots=dslots, dq=dq):
            rope.rope_kv_write(dqkv, dpos, dcos, dsin, kc, vc, dslots, dq, stream)

        def check_rope(qkv=qkv, pos=pos, cos=cos, sin=sin, slots=slots, nblocks=nblocks, run=run_rope, dq=dq,
                       kc=kc, vc=vc):
            k_ref, v_ref = allocate_kv_cache(nblocks, block, HKV, D), allocate_kv_cache(nblocks, block, HKV, D)
            q_ref = ref_rope.rope_kv_write(qkv, pos, cos, sin, k_ref, v_ref, slots, HQ)
            run(0)
            _close(dq, q_ref, 0, 1e-5)
            assert np.array_equal(vc.copy_to_host(), v_ref)
            assert np.mean(kc.copy_to_host() == k_ref) > 0.99

        out.append(Case("rows", f"rope_kv_write {t} tokens", run_rope, check_rope,
                        bytes_moved=qkv.nbytes + t * HQ * D * 4 + 2 * t * HKV * D * 2))
    return out
