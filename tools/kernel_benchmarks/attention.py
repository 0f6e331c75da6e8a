"""Benchmark cases for the attention kernels at Llama-3.2-1B shapes (32 query heads, 8 KV heads, head_dim 64).

Decode is bandwidth-bound: bytes_moved is the K and V the kernel must read (2 x sum of contexts x Hkv x d x
2 bytes). Prefill is compute-bound: flops = 4 * Hq * d * (causal query-key pairs), the two matrix products.
engine_decode_case (tools/bench.py's kernels workload) is the decode call of the engine, at any model's heads.
"""

import numpy as np
from numba import cuda

from cuda_kernels import (attention, attention_policy, attention_tc, attention_tc_pipelined, paged_attention,
                          paged_attention_gqa)
from reference import paged_attention as ref
from reference.bf16 import bf16_to_f32
from reference.kv_format import kv_encode
from tools.kernel_benchmarks.common import Case

HQ, HKV, D, BLOCK = 32, 8, 64, 16
SCALE = 1 / np.sqrt(D)
F32_EPS = float(np.finfo(np.float32).eps)


def _random_bf16(rng, shape):
    """Random normal values as bf16 bit patterns (truncated: benchmark data, not a rounding test)."""
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def _paged_cache(rng, contexts, block=BLOCK, hkv=HKV, d=D):
    """K and V pools (Hkv heads of d) holding every context, through a random permutation of the blocks; block
    tables."""
    blocks = [-(-c // block) for c in contexts]
    perm = rng.permutation(sum(blocks)).astype(np.int32)
    tables = np.full((len(contexts), max(blocks)), -1, np.int32)
    start = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = perm[start:start + n]
        start += n
    shape = (sum(blocks), block, hkv, d)
    return _random_bf16(rng, shape), _random_bf16(rng, shape), tables


def _atol(q_per_seq, k_cache, v_cache, tables, contexts, scale=SCALE):
    """The test suite's tolerance (tests/kernels/test_attention_kernels.py: attention_atol), on this data."""
    smag, vmax = 0.0, 0.0
    group, d = q_per_seq[0].shape[1] // k_cache.shape[2], k_cache.shape[3]
    for q, table, ctx in zip(q_per_seq, tables, contexts):
        k, v = ref.gather_kv(k_cache, v_cache, table, ctx)
        ka = np.repeat(np.abs(k), group, axis=1).transpose(1, 2, 0)
        smag = max(smag, scale * float((np.abs(q).transpose(1, 0, 2) @ ka).max()))
        vmax = max(vmax, float(np.abs(v).max()))
    return vmax * F32_EPS * (16 * (1 + smag) + 4 * np.sqrt(d) * smag + 8 * np.sqrt(max(contexts)))


def _checker(out, expected):
    """check(run) -> a Case's check: out poisoned with NaN, run on the default stream, then compared with
    expected() = (reference result, atol), computed once, by the first check that needs it."""
    computed = []

    def check(run):
        def check_one():
            out.copy_to_device(np.full(out.shape, np.nan, np.float32))
            run(0)
            if not computed:
                computed.append(expected())
            want, atol = computed[0]
            np.testing.assert_allclose(out.copy_to_host(), want, atol=atol, rtol=4 * F32_EPS)
        return check_one
    return check


def _decode_cases(rng, batch, context, partition_size=None, block=BLOCK, fast_only=False):
    """v1, split-K (partition_size keys per partition) and the fast kernel (with its workspace and split
    policy, at 8 and 4 lanes per key) on one batch. bytes_moved is the K/V each must read at least."""
    contexts = [context] * batch
    k_cache, v_cache, tables = _paged_cache(rng, contexts, block)
    q = rng.standard_normal((batch, HQ, D), dtype=np.float32)
    lens = np.array(contexts, np.int32)
    dq, dk, dv, dt, dl = (cuda.to_device(a) for a in (q, k_cache, v_cache, tables, lens))
    out = cuda.device_array((batch, HQ, D), np.float32)
    workspace = cuda.device_array(
        max(1, attention_policy.decode_workspace_size(batch, HQ, HKV, D, tables.shape[1])), np.float32)
    kv_bytes = 2 * batch * context * HKV * D * 2
    check = _checker(out, lambda: (ref.paged_attention(q, k_cache, v_cache, tables, lens, SCALE),
                                   _atol([q[s:s + 1] for s in range(batch)], k_cache, v_cache, tables, contexts)))

    def run_v1(stream):
        paged_attention.paged_attention_v1(dq, dk, dv, dt, dl, SCALE, out, stream)

    def run_split(stream):
        paged_attention.paged_attention_split(dq, dk, dv, dt, dl, SCALE, out, *work, partition_size, stream)

    def run_fast(lanes, warps, blocks):
        def run(stream):
            paged_attention_gqa.paged_attention(dq, dk, dv, dt, dl, SCALE, out, stream, lanes_per_key=lanes,
                                                warps=warps, partition_blocks=blocks, workspace=workspace)
        return run

    shape = f"batch {batch} x context {context}, {HQ}/{HKV} heads, d {D}, block {block}"
    cases = []
    for lanes in (8, 4):   # the policy's warps and split at each lanes per key
        warps = attention_policy.decode_warps_policy(batch, HQ, HKV, D, lanes)
        parts, blocks = attention_policy.decode_partitions(batch, HQ, HKV, tables.shape[1], warps)
        policy = f"{warps} warps, " + (f"{parts} partitions of {blocks * block} keys" if parts > 1 else "no split")
        run = run_fast(lanes, warps, blocks)
        cases.append(Case("attention", f"paged_attention (fast, {lanes} lanes/key, {policy}) {shape}", run,
                          check(run), bytes_moved=kv_bytes))
    if fast_only:
        return cases
    work = [cuda.device_array(shape, np.float32)
            for shape in paged_attention.split_workspace_shapes(batch, HQ, D, context, partition_size)]
    return cases + [
        Case("attention", f"paged_attention_v1 {shape}", run_v1, check(run_v1), bytes_moved=kv_bytes),
        Case("attention", f"paged_attention_split (partition {partition_size}) + reduce {shape}", run_split,
             check(run_split), bytes_moved=kv_bytes)]


def engine_decode_case(batch, context, heads=(HQ, HKV, D), block=BLOCK, kv_cache_dtype="bf16") -> Case:
    """Decode attention as the engine runs it (tinyvllm/cuda_runner.py): attention_policy.decode_attention
    with a workspace, so paged_attention in the policy's lanes, warps and split, for `batch` sequences of
    `context` cached tokens with heads = (Hq, Hkv, d) and KV blocks of `block` tokens; tables as wide as the
    context (for 4,096 tokens in blocks of 16, also the width bucket of the engine's decode graph).
    bytes_moved: the K and V read, in the cache's format (kv_cache_dtype: bf16, fp32 or fp8, whose scales are
    the engine's, 1.0)."""
    hq, hkv, d = heads
    rng = np.random.default_rng(0)
    contexts = [context] * batch
    k_cache, v_cache, tables = _paged_cache(rng, contexts, block, hkv, d)
    if kv_cache_dtype != "bf16":   # the same values, stored in the format
        k_cache, v_cache = (kv_encode(bf16_to_f32(c), kv_cache_dtype) for c in (k_cache, v_cache))
    itemsize = k_cache.dtype.itemsize
    q = rng.standard_normal((batch, hq, d), dtype=np.float32)
    lens, scale = np.array(contexts, np.int32), np.float32(d ** -0.5)
    dq, dk, dv, dt, dl = (cuda.to_device(a) for a in (q, k_cache, v_cache, tables, lens))
    out = cuda.device_array((batch, hq, d), np.float32)
    width = tables.shape[1]
    workspace = cuda.device_array(max(1, attention_policy.decode_workspace_size(batch, hq, hkv, d, width)),
                                  np.float32)

    def launch(stream):
        attention_policy.decode_attention(dq, dk, dv, dt, dl, scale, out, stream, workspace=workspace)

    check = _checker(out, lambda: (ref.paged_attention(q, k_cache, v_cache, tables, lens, scale),
                                   _atol([q[s:s + 1] for s in range(batch)], k_cache, v_cache, tables, contexts,
                                         scale)))

    # the configuration decode_attention picks from the same shapes
    lanes, warps, blocks = attention_policy.decode_config(batch, hq, hkv, d, width)
    parts = -(-width // blocks)
    split = f"{parts} partitions of {blocks * block} keys" if parts > 1 else "no split"
    name = "PagedAttention decode" + ("" if kv_cache_dtype == "bf16" else f" ({kv_cache_dtype} KV cache)")
    return Case("attention", name, launch, check(launch), bytes_moved=2 * batch * context * hkv * d * itemsize,
                shape=f"batch {batch} x context {context}, {hq}/{hkv} heads, d {d}, block {block}"
                + ("" if kv_cache_dtype == "bf16" else f", {kv_cache_dtype}"),
                config=f"paged_attention: {lanes} lanes/key, {warps} warps, {split}")


def _prefill_cases(rng, chunks, naive=False, tc_configs=None):
    """Prefill of sequences given as (new tokens, cached prefix) pairs: the two tensor-core kernels (attention_tc
    and the pipelined one, each in its policy's configuration), the SIMT flash kernel, and the naive one if
    asked; with tc_configs ((warps, keys per tile) pairs), the two tensor-core kernels at each of those only."""
    q_lens = [n for n, _ in chunks]
    contexts = [n + cached for n, cached in chunks]
    k_cache, v_cache, tables = _paged_cache(rng, contexts)
    tokens = sum(q_lens)
    q = rng.standard_normal((tokens, HQ, D), dtype=np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array(contexts, np.int32)
    dq, dk, dv, dt, dcu, dl = (cuda.to_device(a) for a in (q, k_cache, v_cache, tables, cu, lens))
    out = cuda.device_array((tokens, HQ, D), np.float32)
    # causal (query, key) pairs: query i of a chunk after `cached` keys sees cached + i + 1 keys
    flops = 4 * HQ * D * sum(n * cached + n * (n + 1) // 2 for n, cached in chunks)
    check = _checker(out, lambda: (ref.prefill_attention(q, k_cache, v_cache, tables, cu, lens, SCALE),
                                   _atol([q[cu[s]:cu[s + 1]] for s in range(len(chunks))], k_cache, v_cache,
                                         tables, contexts)))

    def runner(launcher, **options):
        def run(stream):
            launcher(dq, dk, dv, dt, dcu, dl, SCALE, out, max(q_lens), stream, **options)
        return run

    if len(chunks) == 1 and chunks[0][1] == 0:
        layout = f"{tokens} tokens, 1 sequence"
    elif all(cached == 0 for _, cached in chunks):
        layout = f"{len(chunks)} x {q_lens[0]} tokens"
    else:
        layout = " + ".join(f"{n} tokens after {cached} cached" for n, cached in chunks)
    shape = f"{layout}, {HQ}/{HKV} heads, d {D}"
    kernels = (("prefill_attention_tc", attention_tc.prefill_attention_tc),
               ("prefill_attention_tc_pipelined", attention_tc_pipelined.prefill_attention_tc_pipelined))
    if tc_configs:
        variants = [(f"{name} ({w} warps, {k}-key tiles) {shape}", runner(launcher, warps=w, keys_per_tile=k))
                    for w, k in tc_configs for name, launcher in kernels]
    else:
        configs = (attention_policy.prefill_tc_config(D), attention_policy.prefill_pipelined_config(D))
        variants = [(f"{name} ({w} warps, {k}-key tiles) {shape}", runner(launcher, warps=w, keys_per_tile=k))
                    for (name, launcher), (w, k) in zip(kernels, configs)]
        flash_warps, rows = attention_policy.prefill_flash_config(D)
        variants.append((f"prefill_attention (flash, fp32 SIMT) {shape}",
                         runner(attention.prefill_attention, warps=flash_warps, rows=rows)))
    if naive:
        variants.append((f"prefill_attention_naive {shape}", runner(attention.prefill_attention_naive)))
    return [Case("attention", name, run, check(run), flops=flops) for name, run in variants]


def cases() -> list[Case]:
    rng = np.random.default_rng(0)
    return (_decode_cases(rng, 64, 4096, 512) + _decode_cases(rng, 1, 8192, 512)
            + _decode_cases(rng, 256, 1024, 512) + _decode_cases(rng, 64, 4096, block=32, fast_only=True)
            + _prefill_cases(rng, [(1024, 0)], naive=True) + _prefill_cases(rng, [(256, 0)] * 4)
            + _prefill_cases(rng, [(512, 512)]))


# (batch, context, table width in blocks): decode-graph shapes (the runner pads tables to a width bucket)
SWEEP_SHAPES = [(1, 128, 32), (1, 256, 32), (1, 384, 32), (4, 256, 32), (16, 256, 32), (64, 256, 32),
                (1, 2048, 128), (64, 512, 64)]
SWEEP_WARPS = (2, 4, 8, 11)
SWEEP_PARTITION_BLOCKS = (1, 2, 4, 8, 16, 32)


def policy_sweep(shapes=SWEEP_SHAPES, lanes_options=(8,)):
    """Cases of the fast kernel at every (lanes per key, warps, KV blocks per partition) of the sweep on each
    shape, tables as wide as a decode graph's bucket (the split policy sees the width, not the context).
    A partition as wide as the table is the one-pass kernel; narrower ones add the reduce kernel."""
    rng = np.random.default_rng(0)
    cases = []
    for batch, context, width in shapes:
        k_cache, v_cache, tables = _paged_cache(rng, [context] * batch)
        tables = np.pad(tables, ((0, 0), (0, width - tables.shape[1])))   # block 0: valid, never read
        q = rng.standard_normal((batch, HQ, D), dtype=np.float32)
        lens = np.full(batch, context, np.int32)
        dq, dk, dv, dt, dl = (cuda.to_device(a) for a in (q, k_cache, v_cache, tables, lens))
        out = cuda.device_array((batch, HQ, D), np.float32)
        workspace = cuda.device_array(batch * HQ * width * (D + 2), np.float32)   # room for any split
        expected = (ref.paged_attention(q, k_cache, v_cache, tables, lens, SCALE),
                    _atol([q[s:s + 1] for s in range(batch)], k_cache, v_cache, tables, [context] * batch))
        check = _checker(out, lambda expected=expected: expected)
        configs = [(lanes, warps, blocks) for lanes in lanes_options for warps in SWEEP_WARPS
                   if warps <= paged_attention_gqa.fast_warps(D, HQ // HKV, lanes)
                   for blocks in SWEEP_PARTITION_BLOCKS if blocks <= width]
        for lanes, warps, blocks in configs:
            def run(stream, lanes=lanes, warps=warps, blocks=blocks, dq=dq, dk=dk, dv=dv, dt=dt, dl=dl,
                    out=out, workspace=workspace):
                paged_attention_gqa.paged_attention(dq, dk, dv, dt, dl, SCALE, out, stream,
                                                    workspace=workspace, partition_blocks=blocks,
                                                    lanes_per_key=lanes, warps=warps)

            parts = -(-width // blocks)
            cases.append(Case("attention", f"batch {batch} x context {context}, table {width} blocks: "
                              f"{lanes} lanes/key, {warps} warps, {parts} partitions of {blocks} blocks",
                              run, check(run), bytes_moved=2 * batch * context * HKV * D * 2))
    return cases


PREFILL_SWEEP = ((4, 64), (4, 32), (8, 64), (2, 64))   # (warps, keys per tile)


def main() -> None:
    """--policy-sweep: time the fast decode kernel over lanes per key, warps and partitions (for
    attention_policy's decode policies; --shapes and --lanes choose what it sweeps).
    --prefill-sweep: time both tensor-core prefill kernels (attention_tc and the pipelined one) over (warps, keys
    per tile) on a 1,024-token prompt and on 4 x 256 (for attention_policy.prefill_tc_config and
    prefill_pipelined_config)."""
    import argparse

    from tools.kernel_benchmarks.common import checked_time

    parser = argparse.ArgumentParser(description=main.__doc__)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--policy-sweep", action="store_true")
    which.add_argument("--prefill-sweep", action="store_true")
    parser.add_argument("--shapes", nargs="+", metavar="BATCH,CONTEXT,WIDTH",
                        help="--policy-sweep's shapes (table width in KV blocks); default SWEEP_SHAPES")
    parser.add_argument("--lanes", nargs="+", type=int, default=[8], choices=(4, 8),
                        help="--policy-sweep's lanes per key (default 8)")
    args = parser.parse_args()
    if args.policy_sweep:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SWEEP_SHAPES
        cases = policy_sweep(shapes, tuple(args.lanes))
    else:
        rng = np.random.default_rng(0)
        cases = [case for chunks in ([(1024, 0)], [(256, 0)] * 4)
                 for case in _prefill_cases(rng, chunks, tc_configs=PREFILL_SWEEP)]
    print("| case | time (us) | TFLOP/s or GB/s |")
    print("| --- | ---: | ---: |")
    for case in cases:
        seconds = checked_time(case)
        if isinstance(seconds, str):
            print(f"| {case.name} | {seconds} | |", flush=True)
        else:
            rate = (f"{case.flops / seconds / 1e12:.1f} TFLOP/s" if case.flops
                    else f"{case.bytes_moved / seconds / 1e9:,.0f} GB/s")
            print(f"| {case.name} | {seconds * 1e6:,.1f} | {rate} |", flush=True)


if __name__ == "__main__":
    main()
