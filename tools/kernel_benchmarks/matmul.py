"""Benchmark cases for the matmul family (cuda_kernels/matmul.py and its kernels) at Llama-3.2-1B shapes
(x @ W^T, W bf16 in nn.Linear layout).

- gemv at M = 1 for each of the five weights and at M = 8 (decode): bandwidth-bound, so bytes_moved is the
  weight plus x and out (the weight is read once per launch at M <= 8);
- gemm at M = 1024 (a 1024-token prefill chunk) for QKV, gate/up and down: flops = 2 M N K;
- gemm_tc (tensor cores) at M = 16, 32, 64, 128, 256 and 1024 for QKV, O, gate/up, down and the LM head, in
  fp32 mode (bf16x3: 3 mma per product) and with bf16_inputs (1 mma), with the policy's tile
  (mp.gemm_tc_tile); flops = 2 M N K (the useful, or effective, flops), bytes_moved = W + x + out (what
  bounds the skinny M). With ``--sweep`` every candidate tile of TC_CANDIDATES[M] is timed too, as a
  labelled variant, so one GPU run compares the policy's choice with its alternatives;
- matmul_naive at M = 1 on the O projection, the teaching baseline, for comparison;
- a few labelled variants (gemv rows per warp, a 128 x 128 gemm tile) to re-tune the defaults on the GPU.
- engine_decode_cases (tools/bench.py's kernels workload): the five M = 1 matmuls of any model config as the
  engine calls them (QKV with its RoPE epilogue, gate/up with its SiLU*mul one), cold, in the run's precision.
Inputs are random (NumPy, fixed seed) and live on the device; every launch writes a preallocated `out`.

tools/bench_kernels.py rates TFLOP/s against the fp32 FMA peak; for the tensor-core cases run this module,

    python -m tools.kernel_benchmarks.matmul [--sweep] [--m 16 32 ...] [--weights qkv down ...]
    python -m tools.kernel_benchmarks.matmul --pipelined [--m 64 256 1024]

(--pipelined: gemm_pipelined, the cp.async + ldmatrix kernel, in each of its candidate tiles, next to
gemm_tc's policy tile)

which times the gemm_tc cases alone and also gives GB/s of weight read and the fraction of the measured
mma.sync peak (359 TFLOP/s, docs/performance.md) that the mma work reaches (3x the useful flops in fp32 mode).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from cuda_kernels import compat  # noqa: F401  (the numpy shim before numba.cuda, for `python -m` runs)
from cuda_kernels import gemm_pipelined as gp
from cuda_kernels import gemm_simt as simt
from cuda_kernels import gemm_tc as tc
from cuda_kernels import gemv as gv
from cuda_kernels import gemm_tma as gtma
from cuda_kernels import gemm_wgmma as gw
from cuda_kernels import gemv_tc as gt
from cuda_kernels import matmul as mm
from cuda_kernels import matmul_policy as mp
from cuda_kernels.launch import OPT_IN_SHARED_LIMIT
from numba import cuda
from reference.bf16 import bf16_to_f32, f32_to_bf16, round_to_bf16
from reference.kv_cache import allocate_kv_cache
from reference.matmul import matmul as reference_matmul
from reference.matmul import matmul_rope_kv_write as reference_matmul_rope_kv_write
from reference.rope import rope_tables
from reference.tolerance import dot_tolerance, gated_bound, rope_bounds
from tools.kernel_benchmarks.common import Case, checked_time

# (name, N, K) of the Llama-3.2-1B projections
WEIGHTS = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
           ("lm_head", 128256, 2048)]
EPS = float(np.finfo(np.float32).eps)
MMA_PEAK_TFLOPS = 359.0   # mma.sync m16n8k16 bf16 in a register-only loop (docs/performance.md)
TC_WEIGHTS = ("qkv", "o", "gate_up", "down", "lm_head")
TC_MS = (16, 32, 64, 128, 256, 1024)
_SKINNY = (*mp.GEMM_TC_SKINNY_TILES[16], mp.GEMM_TC_SKINNY_DEEP_TILE, *mp.GEMM_TC_SKINNY_TILES[32])
_PREFILL = (mp.GEMM_TC_TILE, mp.GEMM_TC_SMALL_TILE, mp.GEMM_TC_TILE._replace(stages=2),
            mp.GEMM_TC_SMALL_TILE._replace(stages=2))
# Tiles worth timing at each M (--sweep): the 16-row tiles only where M <= 16 (more rows would be re-read
# per 16), the 32-row ones up to 128, the prefill tiles from 64; two-stage variants of the 16 x 16 and the
# prefill tiles. A tile that does not fit in shared memory in a mode (the two-stage 128 x 128 in fp32) is
# skipped there.
# The 32-row tiles with fp32 mode's occupancy bound too (in both modes), to measure what it buys.
_BOUND32 = tuple(t._replace(min_blocks=mp.SKINNY32_FP32_MIN_BLOCKS) for t in mp.GEMM_TC_SKINNY_TILES[32])
TC_CANDIDATES = {
    16: (*_SKINNY[:4], tc.GemmTcTile(16, 16, 128, 16, 8, 4, 2), mp.GEMM_TC_SMALL_TILE),
    32: (*_SKINNY[4:], mp.GEMM_TC_SKINNY_TILES[16][-1], *_BOUND32),
    64: (*_SKINNY[4:], *_BOUND32, _PREFILL[1]),
    128: (*_SKINNY[4:], *_BOUND32, *_PREFILL[:2]),
    256: (mp.GEMM_TC_SKINNY_TILES[32][0], _BOUND32[0], *_PREFILL),
    1024: _PREFILL,
}


_last_reference: dict = {}
_last_gated: dict = {}


def _reference(x, w, bf16_inputs):
    """(x @ W^T, |x| @ |W|^T) of the reference, x rounded to bf16 if asked; the last pair is kept, because the
    tile variants of one shape come one after another (an LM head at M = 1024 costs seconds on the CPU)."""
    key = (id(x), id(w), bf16_inputs)
    if key not in _last_reference:
        _last_reference.clear()
        xr = round_to_bf16(x) if bf16_inputs else x
        _last_reference[key] = (reference_matmul(xr, w), np.abs(xr) @ np.abs(bf16_to_f32(w)).T)
    return _last_reference[key]


def _check_close(out, x, w, bf16_inputs=False):
    """out == x @ W^T within the fp32 summation error (as in tests/kernels/test_matmul_kernels.py)."""
    got = out.copy_to_host()
    want, magnitude = _reference(x, w, bf16_inputs)
    bound = dot_tolerance(x.shape[1], magnitude) + 2 * EPS * np.abs(want)
    err = np.abs(got - want)
    if not (err <= bound).all():  # NaN fails too
        i = np.unravel_index(np.argmax(np.where(err <= bound, 0, 1 + err / bound)), got.shape)
        raise AssertionError(f"{int((~(err <= bound)).sum())} outputs off; worst at {i}: "
                             f"got {got[i]}, want {want[i]}")


def _case(label, launcher, x, w, dx, dw, compute_bound, **kwargs):
    """A case for one launcher: x (M, K) and w (N, K) on the host (for the check) and on the device.
    compute_bound: rate it by flops; None: by flops and bytes (gemm_tc, whose M spans both regimes)."""
    (m, k), n = x.shape, w.shape[0]
    dout = cuda.device_array((m, n), np.float32)

    def launch(stream):
        launcher(dx, dw, dout, stream, **kwargs)

    def check():
        dout.copy_to_device(np.full((m, n), np.nan, np.float32))  # a kernel that skips an output must fail
        launch(0)
        cuda.synchronize()
        _check_close(dout, x, w, kwargs.get("bf16_inputs", False))

    name = f"{launcher.__name__} {label} {m}x{k} @ {n}x{k}^T"
    if compute_bound is None:
        return Case("matmul", name, launch, check, flops=2.0 * m * n * k,
                    bytes_moved=dw.nbytes + dx.nbytes + dout.nbytes)
    if compute_bound:
        return Case("matmul", name, launch, check, flops=2.0 * m * n * k)
    return Case("matmul", name, launch, check, bytes_moved=dw.nbytes + dx.nbytes + dout.nbytes)


def _tile_label(tile) -> str:
    return "x".join(map(str, tile))


def cases(tensor_core_only: bool = False, sweep: bool = False, ms=TC_MS, weights=None) -> list[Case]:
    """All matmul cases (tensor_core_only: the gemm_tc ones); sweep adds every TC_CANDIDATES tile as a variant;
    ms and weights narrow the gemm_tc cases to those M and weight names."""
    rng = np.random.default_rng(0)
    xs = {}  # (m, k) -> (host x, device x), shared by the cases

    def activations(m, k):
        if (m, k) not in xs:
            x = rng.standard_normal((m, k), dtype=np.float32)
            xs[m, k] = (x, cuda.to_device(x))
        return xs[m, k]

    out = []
    for wname, n, k in WEIGHTS:
        if weights and wname not in weights:
            continue
        w = f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02))
        dw = cuda.to_device(w)
        if wname in TC_WEIGHTS:
            for m in ms:
                x, dx = activations(m, k)
                for bf16 in (False, True):
                    chosen = mp.gemm_tc_tile(m, n, k, bf16)
                    mode = "bf16" if bf16 else "fp32"
                    out.append(_case(f"{wname} {mode} (tile {_tile_label(chosen)})", tc.gemm_tc, x, w, dx, dw,
                                     None, tile=chosen, bf16_inputs=bf16))
                    for tile in TC_CANDIDATES.get(m, ()) if sweep else ():
                        if tile == chosen or tc.gemm_tc_shared_bytes(tile, bf16) > tc.GEMM_TC_MAX_SHARED:
                            continue
                        out.append(_case(f"{wname} {mode} (variant: tile {_tile_label(tile)})", tc.gemm_tc,
                                         x, w, dx, dw, None, tile=tile, bf16_inputs=bf16))
        if tensor_core_only:
            continue
        for m in (1, 8):
            x, dx = activations(m, k)
            out.append(_case(wname, gv.gemv, x, w, dx, dw, False, config=mp.gemv_config(m, n, k)))
        if wname in ("qkv", "gate_up", "down"):
            x, dx = activations(1024, k)
            out.append(_case(wname, simt.gemm, x, w, dx, dw, True))
        if wname == "qkv":
            x, dx = activations(1024, k)
            tile = simt.GemmTile(128, 128, 8, 8, 8)
            label = f"{wname} (variant: tile {tuple(tile)})"
            out.append(_case(label, simt.gemm, x, w, dx, dw, True, tile=tile))
        if wname == "o":
            x, dx = activations(1, k)
            out.append(_case(wname, simt.matmul_naive, x, w, dx, dw, False))
        if wname == "gate_up":
            x, dx = activations(1, k)
            for config in (gv.GemvConfig(4, 1), gv.GemvConfig(4, 4), gv.GemvConfig(8, 2)):
                out.append(_case(f"{wname} (variant: {config})", gv.gemv, x, w, dx, dw, False, config=config))
    return out


def pipelined_cases(ms=(64, 128, 256, 512, 1024), weights=None, tiles=mp.PIPELINED_CANDIDATES) -> list[Case]:
    """gemm_pipelined (the planes kernel included, as the engine runs it) in every tile of `tiles` that fits,
    next to gemm_tc's policy tile, both modes, at each M; the LM head only up to M = 256 (the engine computes
    logits for sampled rows only)."""
    rng = np.random.default_rng(2)
    out, xs = [], {}
    for wname, n, k in WEIGHTS:
        if weights and wname not in weights:
            continue
        w = f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02))
        dw = cuda.to_device(w)
        for m in ms:
            if wname == "lm_head" and m > 256:
                continue
            if (m, k) not in xs:
                x = rng.standard_normal((m, k), dtype=np.float32)
                xs[m, k] = (x, cuda.to_device(x), cuda.device_array(gp.workspace_size(m, k, False), np.uint16))
            x, dx, workspace = xs[m, k]
            for bf16 in (False, True):
                mode = "bf16" if bf16 else "fp32"
                chosen = mp.gemm_tc_tile(m, n, k, bf16)
                out.append(_case(f"{wname} {mode} (tile {_tile_label(chosen)})", tc.gemm_tc, x, w, dx, dw, None,
                                 tile=chosen, bf16_inputs=bf16))
                policy = mp.pipelined_tile(m, n, k, bf16)
                for tile in (policy, *(t for t in tiles if t != policy)):
                    if gp.shared_bytes(tile, bf16) > OPT_IN_SHARED_LIMIT:
                        continue

                    # NOTE: workspace bound now: the cases run after the loop has moved on to other shapes
                    def gemm_pipelined(x_, w_, out_, stream, tile=tile, bf16_inputs=bf16, workspace=workspace):
                        gp.gemm_pipelined(x_, w_, out_, workspace, stream, tile=tile, bf16_inputs=bf16_inputs)

                    label = "tile" if tile == policy else "variant: tile"
                    out.append(_case(f"{wname} {mode} ({label} {_tile_label(tile)})", gemm_pipelined, x, w, dx, dw,
                                     None, bf16_inputs=bf16))
    return out


# gemv configurations worth timing (--gemv): (warps, rows per warp, unroll, k_split[, pipelined]); the first
# version's (4, 2, 1, 1), the policy's four at M = 1, the earlier policies' (8, 2, 4, 4), (8, 4, 2, 4) and
# (4, 4, 2, 2), and neighbours
GEMV_CANDIDATES = [gv.GemvConfig(), mp.GEMV_WIDE, mp.GEMV_SPLIT, mp.GEMV_SPLIT_SMALL, mp.GEMV_LONG_K] + [
    gv.GemvConfig(*c) for c in ((8, 2, 4, 4), (8, 4, 2, 4), (4, 4, 2, 2), (8, 2, 4, 2), (16, 2, 2, 8), (4, 2, 2, 2),
                                (16, 2, 2, 4), (8, 2, 1, 4), (4, 2, 8, 1), (8, 2, 4, 1), (4, 4, 4, 4), (8, 2, 8, 4),
                                (8, 4, 4, 4), (8, 2, 4, 4, True), (4, 2, 4, 2, True))]
# the few of them timed at M > 1 as well (M rows share each weight read there)
GEMV_CANDIDATES_M = GEMV_CANDIDATES[:4] + [gv.GemvConfig(8, 1, 2, 4), gv.GemvConfig(4, 2, 4, 2, True)]
# the staged gemv (rows_per_block, warps), timed where its tile fits a block's shared memory: 16 rows halve
# the x reads per weight byte of 8 (K = 2048: a 64 KB tile); 2-8 rows for K = 8192
GEMV_STAGED_CANDIDATES = [gv.GemvStaged(*c) for c in ((8, 4), (4, 4), (8, 2), (4, 2), (8, 8), (16, 4), (16, 8),
                                                       (2, 4), (2, 8), (4, 8), (8, 16))]
COLD_BYTES = 256 << 20   # weight copies cycled through per timed graph: 5x the H200's 50 MB L2


def cold_cases(ms=(1, 2, 4, 8), weights=None, configs=GEMV_CANDIDATES, configs_m=GEMV_CANDIDATES_M,
               staged=GEMV_STAGED_CANDIDATES) -> list[Case]:
    """Decode-sized matmuls with the weight cold in L2, as in a real step (each layer's weights are read once
    per step, 2.47 GB in all): every launch of the timed graph reads the next of enough copies of the weight
    to overflow L2. gemv in each of `configs` at M = 1 and of `configs_m` above, and in each `staged`
    configuration whose tile fits (M = 1 and 2), plus gemm_tc's policy tile at the same M (the engine's
    alternative above GEMV_MAX_M) and at M = 16. bytes_moved: one weight + x + out."""
    rng = np.random.default_rng(1)
    out = []
    for wname, n, k, w, copies in _cold_weights(rng, weights, COLD_BYTES):
        for m in sorted(set(ms) | {16}):
            x = rng.standard_normal((m, k), dtype=np.float32)
            dx, dout = cuda.to_device(x), cuda.device_array((m, n), np.float32)
            runs = [("gemm_tc", tc.gemm_tc, {"tile": mp.gemm_tc_tile(m, n, k)})] if m > 1 else []
            runs += [(f"gemv {tuple(c)}", gv.gemv, {"config": c})
                     for c in (configs if m == 1 else configs_m if m <= 8 else ())]
            runs += [(f"gemv staged {tuple(c)}", gv.gemv, {"config": c}) for c in (staged if m <= 2 else ())
                     if gv.gemv_staged_shared_bytes(c, m, k) <= OPT_IN_SHARED_LIMIT]
            for label, launcher, kwargs in runs:
                out.append(_cold_case(f"{label} {wname} cold {m}x{k} @ {n}x{k}^T", launcher, x, w, dx, copies,
                                      dout, kwargs))
    return out


def _cold_weights(rng, weights, cold_bytes):
    """(name, N, K, host bf16 weight, its device copies) for each of WEIGHTS (or those named): enough copies
    that cycling through them overflows L2 (cold_bytes in all)."""
    for wname, n, k in WEIGHTS:
        if weights and wname not in weights:
            continue
        w = f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02))
        yield wname, n, k, w, [cuda.to_device(w) for _ in range(max(1, -(-cold_bytes // w.nbytes)))]


def _cold_case(name, launcher, x, w, dx, copies, dout, kwargs) -> Case:
    turn = [0]

    def launch(stream):
        launcher(dx, copies[turn[0] % len(copies)], dout, stream, **kwargs)
        turn[0] += 1

    def check():
        dout.copy_to_device(np.full(dout.shape, np.nan, np.float32))
        launcher(dx, copies[0], dout, 0, **kwargs)
        cuda.synchronize()
        _check_close(dout, x, w, kwargs.get("bf16_inputs", False))

    return Case("matmul", name, launch, check, bytes_moved=w.nbytes + dx.nbytes + dout.nbytes)


SKINNY_MS = (16, 32, 64, 128)


def skinny_variants(m: int, n: int, k: int, bf16_inputs: bool) -> list[tuple[gp.PipelinedTile, int]]:
    """(tile, splits) worth timing against the skinny plan at (m, n, k): the plan, half and twice its splits,
    and its tile with 64 weight rows a block, and with 3 and 6 stages (each with its own plan's splits)."""
    tile, splits = mp.skinny_plan(m, n, k, bf16_inputs)
    tiles = [tile, tile._replace(bn=64), tile._replace(stages=3), tile._replace(stages=6)]
    out = [(tile, splits), (tile, max(1, splits // 2)), (tile, splits * 2)]
    out += [mp.skinny_plan(m, n, k, bf16_inputs, tile=t) for t in tiles[1:]]
    valid = []
    for t, s in out:
        if (t, s) not in valid and s in gp.valid_splits(t, k) and gp.shared_bytes(t, bf16_inputs) <= OPT_IN_SHARED_LIMIT:
            valid.append((t, s))
    return valid


def skinny_cases(ms=SKINNY_MS, weights=None, bf16_inputs: bool = True, cold_bytes: int = COLD_BYTES) -> list[Case]:
    """Decode batches above gemv's rows with each weight cold in L2 (as cold_cases): the engine's matmul without
    a split workspace (gemm_tc, or gemm_pipelined's unsplit tile from PIPELINED_MIN_M), with one (the skinny
    plan: gemm_pipelined with K split over blocks), and skinny_variants of the plan. x's bf16 planes are
    converted in every launch, as matmul does. gate/up is timed as a plain product (the gated epilogue reads
    the same weight). bytes_moved: the weight, x and out."""
    rng = np.random.default_rng(5)
    out = []
    for wname, n, k, w, copies in _cold_weights(rng, weights, cold_bytes):
        for m in ms:
            x = rng.standard_normal((m, k), dtype=np.float32)
            dx, dout = cuda.to_device(x), cuda.device_array((m, n), np.float32)
            planes = cuda.device_array(gp.workspace_size(m, k, bf16_inputs), np.uint16)
            variants = skinny_variants(m, n, k, bf16_inputs)
            size_p = max(gp.split_partials_size(t, m, n, s) for t, s in variants)
            size_c = max(gp.split_counters_size(t, m, n) for t, _ in variants)
            split_ws = (cuda.device_array(size_p, np.float32), cuda.to_device(np.zeros(size_c, np.int32)))
            mode = "bf16" if bf16_inputs else "fp32"
            runs = [("matmul, no split workspace", mm.matmul, {"workspace": planes}),
                    ("matmul, skinny plan", mm.matmul, {"workspace": planes, "split_workspace": split_ws})]
            for tile, splits in variants[1:]:
                def pipelined(x_, w_, out_, stream, tile=tile, splits=splits, bf16_inputs=bf16_inputs, planes=planes,
                              split_ws=split_ws):
                    gp.gemm_pipelined(x_, w_, out_, planes, stream, tile=tile, bf16_inputs=bf16_inputs, splits=splits,
                                      split_workspace=split_ws)
                runs.append((f"variant: tile {_tile_label(tile)}, {splits} splits", pipelined, {}))
            for label, launcher, kwargs in runs:
                case = _cold_case(f"{wname} {mode} cold {m}x{k} @ {n}x{k}^T ({label})", launcher, x, w, dx, copies,
                                  dout, {"bf16_inputs": bf16_inputs, **kwargs})
                out.append(replace(case, shape=f"{wname} {m}x{k} @ {n}x{k}^T", config=label))
    return out


# gemv_tc configurations worth timing against the skinny plan, by n8 tiles (gt.n_tiles: M = 16, 32, 64), as
# GemvTcConfig(k_warps, row_warps, unroll, pipelined, row_tiles). One row tile a warp: those that were the
# fastest or second-fastest gemv_tc at some weight and M in the first sweep (docs/performance.md, "gemv_tc";
# (4, 2, 4), (2, 4, 4) and (1, 4, 8) never were). Two and four row tiles a warp (x read once per 32 or 64
# weight rows instead of 16): mostly 8 K parts (what filled the SMs with one tile), never over 256 threads a
# block (so that 255 registers a thread still fit the register file), and unroll x row tiles smaller where the
# accumulators (4 x n8 tiles x row tiles a lane) take the registers: ptxas (sm_90, offline) compiled each in
# at most 255 registers without spills (at 8 n8 tiles, two row tiles with unroll 4 and four with unroll 2
# spilled; of the one-tile ones (4, 1, 4, pipelined) spills a few bytes there, as it did before row tiles).
# A full sweep compiles 66 kernels (11 configurations x 3 n8 tile counts, plain and gated) and times 180 cases.
_GEMV_TC_ONE_TILE = (gt.GemvTcConfig(4, 1, 4), gt.GemvTcConfig(8, 1, 2), gt.GemvTcConfig(8, 1, 4),
                     gt.GemvTcConfig(8, 1, 2, True), gt.GemvTcConfig(4, 1, 8), gt.GemvTcConfig(4, 1, 4, True))
GEMV_TC_CANDIDATES = {
    2: _GEMV_TC_ONE_TILE + (gt.GemvTcConfig(8, 1, 4, False, 2), gt.GemvTcConfig(8, 1, 2, True, 2),
                            gt.GemvTcConfig(8, 1, 2, False, 4), gt.GemvTcConfig(8, 1, 1, False, 4),
                            gt.GemvTcConfig(4, 1, 4, False, 4)),
    4: _GEMV_TC_ONE_TILE + (gt.GemvTcConfig(8, 1, 2, False, 2), gt.GemvTcConfig(8, 1, 4, False, 2),
                            gt.GemvTcConfig(8, 1, 2, True, 2), gt.GemvTcConfig(8, 1, 1, False, 4),
                            gt.GemvTcConfig(8, 1, 2, False, 4)),
    8: _GEMV_TC_ONE_TILE + (gt.GemvTcConfig(8, 1, 2, False, 2), gt.GemvTcConfig(8, 1, 2, True, 2),
                            gt.GemvTcConfig(8, 1, 1, True, 2), gt.GemvTcConfig(4, 1, 2, False, 2),
                            gt.GemvTcConfig(8, 1, 1, False, 4)),
}


def _gemv_tc_label(config: gt.GemvTcConfig) -> str:
    """k_warps x row_warps x unroll x pipelined (the first sweep's labels), and the row tiles where several."""
    label = "x".join(map(str, config[:4]))
    return label if config.row_tiles == 1 else f"{label}, {config.row_tiles} row tiles"


def gemv_tc_cases(ms=(16, 32, 64), weights=None, configs=None, cold_bytes: int = COLD_BYTES) -> list[Case]:
    """Decode batches with bf16 inputs and each weight cold in L2, x's bf16 plane ready (as the engine's norms
    write it): gemm_pipelined's skinny plan (gemm_planes, K split over blocks) against gemv_tc in each
    configuration (configs, or GEMV_TC_CANDIDATES at M's n8 tiles; one a block cannot run at M is left out).
    gate/up runs gated (silu(gate) * up, what the engine runs); the rest plain."""
    rng = np.random.default_rng(6)
    out = []
    for wname, n, k, w, copies in _cold_weights(rng, weights, cold_bytes):
        gated = wname == "gate_up"
        cols = n // 2 if gated else n
        for m in ms:
            x = rng.standard_normal((m, k), dtype=np.float32)
            planes = cuda.to_device(f32_to_bf16(x).ravel())
            dout = cuda.device_array((m, cols), np.float32)
            tile, splits = mp.skinny_plan(m, n, k, True, gated)
            split_ws = (cuda.device_array(max(1, gp.split_partials_size(tile, m, n, splits, gated)), np.float32),
                        cuda.to_device(np.zeros(gp.split_counters_size(tile, m, n, gated), np.int32)))

            def skinny(dx, w_, out_, stream, m=m, tile=tile, splits=splits, split_ws=split_ws, gated=gated):
                gp.gemm_planes(dx, m, w_, out_, stream, tile=tile, bf16_inputs=True, gated=gated, splits=splits,
                               split_workspace=split_ws)
            runs = [(f"skinny plan {_tile_label(tile)}, {splits} splits", skinny)]
            for config in configs or GEMV_TC_CANDIDATES[gt.n_tiles(m)]:
                config = gt.GemvTcConfig(*config)
                try:
                    gt.check_config(config, gt.n_tiles(m))
                except ValueError:
                    continue

                def tc_gemv(dx, w_, out_, stream, m=m, config=config, gated=gated):
                    gt.gemv_tc(dx, m, w_, out_, stream, config=config, gated=gated)
                runs.append((f"gemv_tc {_gemv_tc_label(config)}", tc_gemv))
            out += [_planes_case(wname, label, launcher, x, w, planes, copies, dout, gated) for label, launcher in runs]
    return out


def _planes_case(wname, label, launcher, x, w, planes, copies, dout, gated) -> Case:
    """A case for a launcher(planes, weight, out, stream) of x's bf16 plane (the engine's bf16 inputs), cycling
    through the weight's device copies; checked against the reference (gated: silu(gate) * up) first."""
    (m, k), n = x.shape, w.shape[0]
    turn = [0]

    def launch(stream):
        launcher(planes, copies[turn[0] % len(copies)], dout, stream)
        turn[0] += 1

    def check():
        dout.copy_to_device(np.full(dout.shape, np.nan, np.float32))
        launcher(planes, copies[0], dout, 0)
        cuda.synchronize()
        if gated:
            _check_gated(dout.copy_to_host(), x, w, True)
        else:
            _check_close(dout, x, w, True)

    return Case("matmul", f"{wname} {m}x{k} @ {n}x{k}^T ({label})", launch, check, bytes_moved=w.nbytes,
                flops=2.0 * m * n * k, shape=f"{wname} {m}", config=label)


# gemm_wgmma tiles worth timing (--wgmma): the policy's two, the synchronous rung, more stages, 64 rows a block,
# and larger blocks, which load fewer operand bytes from L2 per product (three or four warpgroups sharing each W
# slab, or 192 columns a warpgroup: 111-164 registers, no spills, ptxas offline)
WGMMA_CANDIDATES = (mp.WGMMA_TILE, mp.WGMMA_TWO_BLOCK_TILE, gw.WgmmaTile(128, 128, 4),
                    gw.WgmmaTile(128, 128, 5, overlap=True), gw.WgmmaTile(64, 128, 4, overlap=True),
                    gw.WgmmaTile(192, 128, 4, overlap=True), gw.WgmmaTile(256, 128, 3, overlap=True),
                    mp.WGMMA_TALL_TILE, gw.WgmmaTile(192, 192, 4, overlap=True))


def wgmma_cases(ms=(192, 256, 300, 1024), weights=None, tiles=WGMMA_CANDIDATES) -> list[Case]:
    """Prefill GEMMs with bf16 inputs, x's bf16 plane ready (as the engine's norms write it): gemm_pipelined in
    its policy's tile (gemm_planes) against gemm_wgmma in each of `tiles` (the policy's pick first); gate/up
    gated (silu(gate) * up, as the engine runs it), the rest plain, the LM head left out (the engine runs it
    on the sampled rows only). Needs a GPU of compute capability 9.0 (or the simulator, on tiny shapes)."""
    rng = np.random.default_rng(7)
    out = []
    for wname, n, k, w, copies in _cold_weights(rng, [w for w in weights or TC_WEIGHTS if w != "lm_head"], 0):
        gated = wname == "gate_up"
        for m in ms:
            x = rng.standard_normal((m, k), dtype=np.float32)
            planes = cuda.to_device(f32_to_bf16(x).ravel())
            dout = cuda.device_array((m, n // 2 if gated else n), np.float32)
            ptile = mp.pipelined_tile(m, n, k, True)
            policy = mp.wgmma_tile(m, n)

            def pipelined(dx, w_, out_, stream, m=m, tile=ptile, gated=gated):
                gp.gemm_planes(dx, m, w_, out_, stream, tile=tile, bf16_inputs=True, gated=gated)
            runs = [(f"gemm_pipelined {_tile_label(ptile)}", pipelined)]
            for tile in (policy, *(t for t in tiles if t != policy)):
                def wgmma(dx, w_, out_, stream, m=m, tile=tile, gated=gated):
                    gw.gemm_wgmma(dx, m, w_, out_, stream, tile=tile, gated=gated)
                label = "policy" if tile == policy else "variant"
                runs.append((f"gemm_wgmma {label} {_tile_label(tile)}", wgmma))
            out += [_planes_case(wname, label, launcher, x, w, planes, copies, dout, gated) for label, launcher in runs]
    return out


# gemm_tma tiles worth timing (--tma): two consumer warpgroups of 64 x 256 (the usual Hopper tile), of 64 x 128
# with more stages, four of 64 x 128, and one warpgroup (decode batches)
TMA_CANDIDATES = (gtma.TmaTile(128, 256, 4), gtma.TmaTile(128, 128, 6), gtma.TmaTile(256, 128, 4),
                  gtma.TmaTile(128, 256, 3), gtma.TmaTile(64, 256, 5), gtma.TmaTile(64, 128, 8))
# at decode batches (--tma with M < matmul_policy.WGMMA_MIN_M) the tiles of one, two and (above 128 rows) four
# consumer warpgroups
TMA_DECODE_CANDIDATES = (gtma.TmaTile(64, 128, 8), gtma.TmaTile(64, 256, 5), gtma.TmaTile(128, 128, 6),
                         gtma.TmaTile(256, 128, 4))


def tma_split_plans(m: int, n: int, k: int) -> list[tuple[gtma.TmaTile, int]]:
    """(tile, splits) of gemm_tma worth timing for x (m, k) @ W (n, k)^T: at prefill sizes (m >= WGMMA_MIN_M)
    every TMA_CANDIDATES tile unsplit; at decode sizes every TMA_DECODE_CANDIDATES tile with K split for about
    one block per SM (matmul_policy.split_count, as gemm_wgmma's split plan), and at half that count."""
    if m >= mp.WGMMA_MIN_M:
        return [(t, 1) for t in TMA_CANDIDATES]
    slabs, plans = -(-k // gtma.TILE_K), []
    for t in TMA_DECODE_CANDIDATES:
        if t.bm > 2 * max(m, 64):
            continue   # (most of the tile's rows past M)
        splits = mp.split_count(gtma.tiles(t, m, n), slabs, mp.WGMMA_MIN_SPLIT_SLABS)
        for s_ in dict.fromkeys((splits, max(1, splits // 2))):
            plans.append((t, s_))
    return plans


def tma_cases(ms=(64, 128, 256, 1024), weights=None, cold_bytes: int = COLD_BYTES) -> list[Case]:
    """What the engine runs (its matmul dispatch: gated_matmul for gate/up, x's bf16 plane ready as its norms
    write it) against gemm_tma in each of tma_split_plans, bf16 inputs, each weight cold in L2. Every weight
    copy's tensor map is made in the check, before the timed graph is captured. Needs a GPU of compute
    capability 9.0."""
    rng = np.random.default_rng(9)
    out = []
    for wname, n, k, w, copies in _cold_weights(rng, [w for w in weights or TC_WEIGHTS if w != "lm_head"],
                                                cold_bytes):
        gated = wname == "gate_up"
        for m in ms:
            x = rng.standard_normal((m, k), dtype=np.float32)
            dx, planes = cuda.to_device(x), cuda.to_device(f32_to_bf16(x).ravel())
            dout = cuda.device_array((m, n // 2 if gated else n), np.float32)
            scratch = cuda.device_array((m, n), np.float32)
            plans = tma_split_plans(m, n, k)
            sizes_p, sizes_c = mp.split_workspace_sizes([(n, k, gated)], True)
            size_p = max([sizes_p] + [gtma.split_partials_size(t, m, n, s_) for t, s_ in plans])
            size_c = max([sizes_c] + [gtma.tiles(t, m, n) for t, _ in plans])
            split_ws = (cuda.device_array(max(1, size_p), np.float32), cuda.to_device(np.zeros(size_c, np.int32)))

            def engine(planes_, w_, out_, stream, dx=dx, scratch=scratch, gated=gated, ws=split_ws):
                if gated:
                    mm.gated_matmul(dx, w_, out_, scratch, stream, bf16_inputs=True, workspace=planes_,
                                    split_workspace=ws, planes_ready=True)
                else:
                    mm.matmul(dx, w_, out_, stream, bf16_inputs=True, workspace=planes_, split_workspace=ws,
                              planes_ready=True)
            runs = [("engine's matmul", engine)]
            for t, s_ in plans:
                def tma(dx_, w_, out_, stream, m=m, tile=t, splits=s_, gated=gated, ws=split_ws):
                    gtma.gemm_tma(dx_, m, w_, out_, stream, tile=tile, gated=gated, splits=splits, split_workspace=ws)
                runs.append((f"gemm_tma {_tile_label(t)}, {s_} splits", tma))
            for label, launcher in runs:
                case = _planes_case(wname, label, launcher, x, w, planes, copies, dout, gated)
                out.append(replace(case, check=_making_maps(case.check, launcher, planes, copies, dout)))
    return out


def _making_maps(check, launcher, planes, copies, dout):
    """check, after one eager launch on every weight copy (gemm_tma makes each copy's tensor map there, which
    the timed graph's capture could not)."""
    def run():
        for copy in copies:
            launcher(planes, copy, dout, 0)
        cuda.synchronize()
        check()
    return run


def wgmma_split_variants(m: int, n: int, k: int) -> list[tuple[gw.WgmmaTile, int]]:
    """(tile, splits) of gemm_wgmma worth timing for a decode batch of m rows: the split plan (policy first),
    half and twice its splits, the 64-row tile against the 128-row one (and at m > 128, matmul_policy.WGMMA_TALL_TILE:
    four warpgroups), each at its own plan's splits, and the plan's tile in its two-block form."""
    tile, splits = mp.wgmma_split_plan(m, n, k)
    out = [(tile, splits), (tile, max(1, splits // 2)), (tile, splits * 2)]
    others = [gw.WgmmaTile(64, 128, 4, overlap=True), mp.WGMMA_TILE, mp.WGMMA_TWO_BLOCK_TILE]
    if m > 128:
        others.append(mp.WGMMA_TALL_TILE)
    out += [mp.wgmma_split_plan(m, n, k, tile=t) for t in others]
    valid = []
    for t, s in out:
        if (t, s) not in valid and s in gw.valid_splits(k):
            valid.append((t, s))
    return valid


def wgmma_split_cases(ms=(16, 32, 64, 128, 192, 256), weights=None, cold_bytes: int = COLD_BYTES) -> list[Case]:
    """Decode batches with bf16 inputs and each weight cold in L2, x's bf16 plane ready (as the engine's norms
    write it): what the engine ran before gemm_wgmma's split plan (gemv_tc where uses_gemv_tc says, else
    gemm_pipelined's skinny plan up to PIPELINED_SKINNY_MAX_M rows and its policy tile above) against gemm_wgmma
    in each of wgmma_split_variants. gate/up runs gated (silu(gate) * up, what the engine runs); the rest
    plain. Needs a GPU of compute capability 9.0 (or the simulator, on tiny shapes)."""
    rng = np.random.default_rng(8)
    out = []
    for wname, n, k, w, copies in _cold_weights(rng, weights, cold_bytes):
        gated = wname == "gate_up"
        for m in ms:
            x = rng.standard_normal((m, k), dtype=np.float32)
            planes = cuda.to_device(f32_to_bf16(x).ravel())
            dout = cuda.device_array((m, n // 2 if gated else n), np.float32)
            variants = wgmma_split_variants(m, n, k)
            if m <= mp.PIPELINED_SKINNY_MAX_M:
                ptile, psplits = mp.skinny_plan(m, n, k, True, gated)
            else:
                ptile, psplits = mp.pipelined_tile(m, n, k, True), 1
            size_p = max([gp.split_partials_size(ptile, m, n, psplits, gated)]
                         + [gw.split_partials_size(t, m, n, s_) for t, s_ in variants])
            size_c = max([gp.split_counters_size(ptile, m, n, gated)] + [gw.tiles(t, m, n) for t, _ in variants])
            split_ws = (cuda.device_array(size_p, np.float32), cuda.to_device(np.zeros(size_c, np.int32)))
            if mp.uses_gemv_tc(m, n, k, True):
                config = mp.gemv_tc_config(m, n, k)

                def before(dx, w_, out_, stream, m=m, config=config, gated=gated):
                    gt.gemv_tc(dx, m, w_, out_, stream, config=config, gated=gated)
                runs = [(f"before: gemv_tc {_gemv_tc_label(config)}", before)]
            else:
                def before(dx, w_, out_, stream, m=m, tile=ptile, splits=psplits, gated=gated, ws=split_ws):
                    gp.gemm_planes(dx, m, w_, out_, stream, tile=tile, bf16_inputs=True, gated=gated, splits=splits,
                                   split_workspace=ws)
                runs = [(f"before: gemm_pipelined {_tile_label(ptile)}, {psplits} splits", before)]
            for i, (tile, splits) in enumerate(variants):
                def wgmma(dx, w_, out_, stream, m=m, tile=tile, splits=splits, gated=gated, ws=split_ws):
                    gw.gemm_wgmma(dx, m, w_, out_, stream, tile=tile, gated=gated, splits=splits, split_workspace=ws)
                label = "policy" if i == 0 else "variant"
                runs.append((f"gemm_wgmma {label} {_tile_label(tile)}, {splits} splits", wgmma))
            out += [_planes_case(wname, label, launcher, x, w, planes, copies, dout, gated) for label, launcher in runs]
    return out


def engine_decode_cases(config, bf16_inputs: bool = False, cold_bytes: int = COLD_BYTES,
                        block_size: int = 16) -> list[Case]:
    """The five batch-1 decode matmuls of a model as the engine launches them (tinyvllm/cuda_runner.py at
    M = 1), on the shapes of `config` (a tinyvllm ModelConfig), in the engine's matmul precision (bf16_inputs:
    "bf16") and with its default policy, each weight cold in L2 as in cold_cases (cold_bytes of copies, cycled
    through):

    - QKV: matmul_rope_kv_write, i.e. gemv_rope: the fused QKV gemv with RoPE and the KV-cache write as its
      epilogue (one token's rotated q written, its rotated K and its V stored in a cache slot);
    - O, down and the LM head: matmul, i.e. gemv;
    - gate/up: gated_matmul (mlp's first half), i.e. gemv with gated=True: out (1, F) = silu(gate) * up.
    Each gemv takes gemv_config(1, N, K); a case's `config` names the call, its kernel and that pick. In the
    simulator the dispatchers keep M = 1 off gemv (GEMV_MAX_M = 0) and run gemm (and the RoPE or SiLU kernel
    after it): `config` says so there.
    bytes_moved: the weight, x and what the call writes (out; for QKV q and the bf16 K and V)."""
    rng = np.random.default_rng(4)

    def inputs(n, k):
        """x (1, k) and a bf16 weight (n, k), on the host (for the check) and on the device (x; the copies)."""
        x = rng.standard_normal((1, k), dtype=np.float32)
        w = f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02))
        return x, w, cuda.to_device(x), [cuda.to_device(w) for _ in range(max(1, -(-cold_bytes // w.nbytes)))]

    h, f = config.hidden_size, config.intermediate_size
    return [_rope_case(config, block_size, bf16_inputs, *inputs(config.q_size + 2 * config.kv_size, h)),
            _plain_case("O", bf16_inputs, *inputs(h, config.q_size)),
            _gated_case(bf16_inputs, *inputs(2 * f, h)),
            _plain_case("down", bf16_inputs, *inputs(h, f)),
            _plain_case("LM head", bf16_inputs, *inputs(config.vocab_size, h))]


def _engine_kernel(n: int, k: int, gemv_name: str, simulator_path: str) -> str:
    """The kernel the engine's matmul dispatch runs for x (1, k) @ W (n, k)^T, with gemv_config's pick."""
    if mp.uses_gemv(1, n):
        config = mp.gemv_config(1, n, k)
        return f"{gemv_name} {type(config).__name__}{tuple(config)}"
    return f"{simulator_path} (the simulator's M = 1 path)"


def _plain_case(name, bf16_inputs, x, w, dx, copies) -> Case:
    """O, down or the LM head as the engine runs it: matmul, checked as every plain case is (_check_close)."""
    n, k = w.shape
    case = _cold_case(f"GEMV: {name}", mm.matmul, x, w, dx, copies, cuda.device_array((1, n), np.float32),
                      {"bf16_inputs": bf16_inputs})
    return replace(case, shape=f"1x{k} @ {n}x{k}^T", config="matmul: " + _engine_kernel(n, k, "gemv", "gemm"))


def _gated_case(bf16_inputs, x, w, dx, copies) -> Case:
    """gate/up as matmul.mlp runs it: gated_matmul into out (1, F), checked against reference.gated_matmul."""
    n, k = w.shape
    out, scratch = cuda.device_array((1, n // 2), np.float32), cuda.device_array((1, n), np.float32)

    def gated_matmul(x_, w_, out_, stream, bf16_inputs):
        mm.gated_matmul(x_, w_, out_, scratch, stream, bf16_inputs=bf16_inputs)

    case = _cold_case("GEMV: gate/up + SiLU*mul", gated_matmul, x, w, dx, copies, out, {"bf16_inputs": bf16_inputs})

    def check():
        out.copy_to_device(np.full(out.shape, np.nan, np.float32))  # a kernel that skips an output must fail
        case.launch(0)
        cuda.synchronize()
        _check_gated(out.copy_to_host(), x, w, bf16_inputs)

    return replace(case, check=check, shape=f"1x{k} @ {n}x{k}^T -> 1x{n // 2}",
                   config="gated_matmul: " + _engine_kernel(n, k, "gemv gated", "gemm + silu_and_mul"))


def _rope_case(config, block_size, bf16_inputs, x, w, dx, copies) -> Case:
    """QKV as the engine runs it: matmul_rope_kv_write for one token at the model's last position (position 0
    would rotate nothing), its K and V into one slot of a one-block cache poisoned with NaN; checked against
    reference.matmul.matmul_rope_kv_write."""
    n, k = w.shape
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    positions = np.array([config.max_position_embeddings - 1], np.int32)
    slots = np.array([block_size - 1], np.int32)
    cos, sin = rope_tables(d, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    cache = allocate_kv_cache(1, block_size, hkv, d)
    dpos, dcos, dsin, dslots, dk, dv = (cuda.to_device(a) for a in (positions, cos, sin, slots, cache, cache))
    q_out, scratch = cuda.device_array((1, hq, d), np.float32), cuda.device_array((1, n), np.float32)

    def matmul_rope_kv_write(x_, w_, q_out_, stream, bf16_inputs):
        mm.matmul_rope_kv_write(x_, w_, dpos, dcos, dsin, dk, dv, dslots, q_out_, scratch, stream,
                                bf16_inputs=bf16_inputs)

    case = _cold_case("GEMV: QKV + RoPE + KV write", matmul_rope_kv_write, x, w, dx, copies, q_out,
                      {"bf16_inputs": bf16_inputs})

    def check():
        q_out.copy_to_device(np.full(q_out.shape, np.nan, np.float32))
        dk.copy_to_device(cache)
        dv.copy_to_device(cache)
        case.launch(0)
        cuda.synchronize()
        k_ref, v_ref = cache.copy(), cache.copy()
        q_ref = reference_matmul_rope_kv_write(x, w, positions, cos, sin, k_ref, v_ref, slots, hq, bf16_inputs)
        slot = (0, block_size - 1)
        _check_rope((q_out.copy_to_host()[0], dk.copy_to_host()[slot], dv.copy_to_host()[slot]),
                    (q_ref[0], k_ref[slot], v_ref[slot]), x, w, bf16_inputs)

    return replace(case, check=check, bytes_moved=case.bytes_moved + 2 * hkv * d * 2, shape=f"1x{k} @ {n}x{k}^T",
                   config="matmul_rope_kv_write: " + _engine_kernel(n, k, "gemv_rope", "gemm + rope_kv_write"))


def _check_gated(got, x, w, bf16_inputs):
    """got (M, F) == silu(x @ gate^T) * (x @ up^T) for W = [gate; up], within reference.tolerance.gated_bound
    (the kernel tests' bound; the last one is kept, as _reference keeps its pair: a sweep checks every
    configuration on the same x and W one after another)."""
    key = (id(x), id(w), bf16_inputs)
    if key not in _last_gated:
        _last_gated.clear()
        _last_gated[key] = gated_bound(x, w, bf16_inputs)
    want, bound = _last_gated[key]
    np.testing.assert_array_less(np.abs(got - want), bound, err_msg="gated gemv")  # NaN fails too


def _check_rope(got, want, x, w, bf16_inputs):
    """got, want: (q (Hq, d), K (Hkv, d) bf16, V (Hkv, d) bf16) of one token, from the kernel and from
    reference.matmul.matmul_rope_kv_write, within reference.tolerance.rope_bounds (the kernel tests' bounds):
    Q and K rotated, V not; a stored K or V one bf16 rounding more."""
    hq, hkv, d = want[0].shape[0], want[1].shape[0], want[0].shape[1]
    tol, rotated = (b[0] for b in rope_bounds(x, w, d, bf16_inputs))   # (Hq + 2 Hkv, d): the one token
    for name, g, r, b in zip("qKV", got, want, (rotated[:hq], rotated[hq:hq + hkv], tol[hq + hkv:])):
        if name != "q":
            g, r = bf16_to_f32(g), bf16_to_f32(r)
            b = b + 2.0 ** -7 * np.abs(r)
        np.testing.assert_array_less(np.abs(g - r), b, err_msg=f"gemv_rope: {name}")


RATES = {"weight GB/s": lambda case, seconds: f"{case.bytes_moved / seconds / 1e9:,.0f}",
         "TFLOP/s": lambda case, seconds: f"{case.flops / seconds / 1e12:.0f}"}


def _print_rates(cases, rates: list[str]) -> None:
    """A markdown table: per case (checked first) its time and each of `rates` (names of RATES), or its failure."""
    print("| case | time (us) | " + " | ".join(rates) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in rates) + " |")
    for case in cases:
        seconds = checked_time(case)
        cell = seconds if isinstance(seconds, str) else " | ".join(
            [f"{seconds * 1e6:,.1f}"] + [RATES[rate](case, seconds) for rate in rates])
        print(f"| {case.name} | {cell} |", flush=True)


def main() -> None:
    """Time the gemm_tc cases; print effective TFLOP/s, weight GB/s and the fraction of the mma.sync peak."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time every candidate tile (TC_CANDIDATES)")
    parser.add_argument("--m", type=int, nargs="+", default=list(TC_MS), help="M values (default: all)")
    parser.add_argument("--weights", nargs="+", choices=TC_WEIGHTS, help="weights (default: all)")
    parser.add_argument("--gemv", action="store_true",
                        help="instead: decode matmuls (M <= 8, and 16) with cold weights, every GEMV_CANDIDATES "
                             "config and gemm_tc's tile")
    parser.add_argument("--pipelined", action="store_true",
                        help="instead: gemm_pipelined in each candidate tile next to gemm_tc (M from 64)")
    parser.add_argument("--skinny", action="store_true",
                        help="instead: decode batches (M = 16-128, or --m) with cold weights: the engine's matmul "
                             "with and without the split-K skinny plan, and variants of the plan")
    parser.add_argument("--fp32", action="store_true", help="--skinny in fp32 mode (default: bf16 inputs)")
    parser.add_argument("--gemv-tc", action="store_true",
                        help="instead: decode batches (M = 16, 32, 64, or --m up to 64) with cold weights and bf16 "
                             "inputs: the skinny plan against gemv_tc in each of GEMV_TC_CANDIDATES (one, two and "
                             "four row tiles a warp)")
    parser.add_argument("--wgmma", action="store_true",
                        help="instead: prefill GEMMs (M = 192, 256, 300, 1024, or --m from 129) with bf16 inputs: "
                             "gemm_pipelined's policy tile against gemm_wgmma in each of WGMMA_CANDIDATES")
    parser.add_argument("--wgmma-split", action="store_true",
                        help="instead: decode batches (M = 16-256, or --m from 9 to 256) with cold weights and bf16 "
                             "inputs: the kernel the engine ran before against gemm_wgmma's split plans "
                             "(wgmma_split_variants)")
    parser.add_argument("--tma", action="store_true",
                        help="instead: the engine's matmul against gemm_tma in each of tma_split_plans (M = 64, 128, "
                             "256, 1024, or --m; decode sizes with K split), weights cold, bf16 inputs "
                             "(TINYVLLM_TMA=0: the engine's prefill plans on gemm_wgmma)")
    args = parser.parse_args()
    if args.tma:
        _print_rates(tma_cases(args.m if args.m != list(TC_MS) else (64, 128, 256, 1024), args.weights),
                     ["weight GB/s", "TFLOP/s"])
        return
    if args.wgmma:
        _print_rates(wgmma_cases([m for m in args.m if m > 128] or (192, 256, 300, 1024), args.weights), ["TFLOP/s"])
        return
    if args.wgmma_split:
        _print_rates(wgmma_split_cases([m for m in args.m if 8 < m < mp.WGMMA_MIN_M] or (16, 32, 64, 128, 192, 256),
                                       args.weights), ["weight GB/s", "TFLOP/s"])
        return
    if args.gemv_tc:
        _print_rates(gemv_tc_cases([m for m in args.m if 8 < m <= 64] or (16, 32, 64), args.weights), ["weight GB/s"])
        return
    if args.skinny:
        print("| case | time (us) | weight GB/s |")
        print("| --- | ---: | ---: |")
        ms = [m for m in args.m if 8 < m <= mp.PIPELINED_SKINNY_MAX_M] or SKINNY_MS
        for case in skinny_cases(ms, args.weights, bf16_inputs=not args.fp32):
            seconds = checked_time(case)
            if isinstance(seconds, str):
                print(f"| {case.name} | {seconds} | |", flush=True)
                continue
            n, k = (int(v) for v in case.shape.split(" @ ")[1].split("^T")[0].split("x"))
            print(f"| {case.name} | {seconds * 1e6:,.1f} | {2 * n * k / seconds / 1e9:,.0f} |", flush=True)
        return
    if args.gemv:
        print("| case | time (us) | GB/s (W + x + out) |")
        print("| --- | ---: | ---: |")
        for case in cold_cases(ms=[m for m in args.m if m <= 8] or (1,), weights=args.weights):
            seconds = checked_time(case)
            if isinstance(seconds, str):
                print(f"| {case.name} | {seconds} | |", flush=True)
                continue
            print(f"| {case.name} | {seconds * 1e6:,.1f} | {case.bytes_moved / seconds / 1e9:,.0f} |", flush=True)
        return
    print("| case | time (us) | TFLOP/s (2MNK/t) | GB/s (W + x + out) | % of mma peak (359), mma work |")
    print("| --- | ---: | ---: | ---: | ---: |")
    chosen = (pipelined_cases([m for m in args.m if m >= 64], args.weights) if args.pipelined else
              cases(tensor_core_only=True, sweep=args.sweep, ms=args.m, weights=args.weights))
    for case in chosen:
        seconds = checked_time(case)
        if isinstance(seconds, str):
            print(f"| {case.name} | {seconds} | | | |", flush=True)
            continue
        tflops = case.flops / seconds / 1e12
        work = 1 if " bf16 " in case.name else 3   # mma issued per useful product
        print(f"| {case.name} | {seconds * 1e6:,.1f} | {tflops:.1f} | {case.bytes_moved / seconds / 1e9:,.0f} | "
              f"{100 * work * tflops / MMA_PEAK_TFLOPS:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
