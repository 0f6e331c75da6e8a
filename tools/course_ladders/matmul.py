"""Chapters 5 (GEMV, the decode matmul) and 6 (GEMM on tensor cores): the matmul ladders against
reference.matmul.matmul, on the QKV projection of Llama-3.2-1B (3072 x 2048 bf16) with weights cold in L2.

Chapter 5 at M = 1 (a batch-1 decode step): bandwidth-bound, bytes_moved = W + x + out.
Chapter 6 at M = 1024 (a 1,024-token prefill chunk): compute-bound, flops = 2 M N K.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from cuda_kernels import gemm_pipelined as gp
from cuda_kernels import gemm_simt as simt
from cuda_kernels import gemm_tc as tc
from cuda_kernels import gemm_tma as gtma
from cuda_kernels import gemm_wgmma as gw
from cuda_kernels import gemv as gv
from cuda_kernels import matmul_policy as mp
from cuda_kernels import wgmma
from reference.bf16 import f32_to_bf16
from cuda_kernels.compat import SIMULATOR
from tools.course_ladders.common import FMA_PEAK_TFLOPS, MMA_PEAK_TFLOPS, WGMMA_PEAK_TFLOPS, Step
from tools.kernel_benchmarks.matmul import COLD_BYTES, _cold_case

# (M, N, K) per size: "real" is the 1B model's QKV projection, "tiny" what the simulator affords
GEMV_SHAPES = {"real": (1, 3072, 2048), "tiny": (1, 40, 72)}
GEMM_SHAPES = {"real": (1024, 3072, 2048), "tiny": (20, 24, 48)}
# a decode batch (rungs 7 and 11: K split over blocks); the tiny K has two slabs of the simulator's tiles
SPLIT_SHAPES = {"real": (64, 3072, 2048), "tiny": (12, 24, 128)}


def _operands(shape, real: bool, seed: int):
    """x and W on the host, x and enough device copies of W to cycle through L2 (one in the simulator), and
    out on the device."""
    m, n, k = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02))
    copies = [cuda.to_device(w) for _ in range(max(1, -(-COLD_BYTES // w.nbytes)) if real else 1)]
    return x, w, cuda.to_device(x), copies, cuda.device_array((m, n), np.float32)


def _case(name, launcher, operands, **kwargs):
    x, w, dx, copies, dout = operands
    case = _cold_case(name, launcher, x, w, dx, copies, dout, kwargs)
    case.flops = 2.0 * x.shape[0] * w.shape[0] * x.shape[1]
    return case


def gemv_steps(real: bool) -> list[Step]:
    shape = GEMV_SHAPES["real" if real else "tiny"]
    m, n, k = shape
    ops = _operands(shape, real, seed=5)
    staged = gv.GemvStaged(16, 8) if real else gv.GemvStaged(4, 2)
    rungs = [
        ("1 matmul_naive", "one thread per output: no weight load is coalesced", simt.matmul_naive, {}),
        ("2a gemv_warp", "a warp per row: coalesced, but 2-byte loads, one in flight", gv.gemv_warp, {}),
        ("2b gemv GemvConfig()", "64-bit loads; 2 rows per warp share each x load", gv.gemv,
         {"config": gv.GemvConfig()}),
        ("2c gemv (4, 2, 4, 2)", "4 loads per row in flight, K split over 2 warps", gv.gemv,
         {"config": gv.GemvConfig(4, 2, 4, 2)}),
        (f"2d gemv {tuple(mp.gemv_config(m, n, k))}", "the engine's pick: the next pass's loads issued early",
         gv.gemv, {"config": mp.gemv_config(m, n, k)}),
        (f"2e gemv staged {tuple(staged)}", "weights in flight in shared memory, not registers", gv.gemv,
         {"config": staged}),
    ]
    return [Step(version, idea, _case(version, launcher, ops, **kwargs)) for version, idea, launcher, kwargs in rungs]


def gemm_steps(real: bool) -> list[Step]:
    shape = GEMM_SHAPES["real" if real else "tiny"]
    m, n, k = shape
    ops = _operands(shape, real, seed=6)
    tc_tile = tc.GemmTcTile() if real else tc.SIM_TILE
    steps = [Step("3 gemm (SIMT)", "shared-memory tiles, a 4 x 4 register tile per thread: fp32 FMAs",
                  _case("gemm", simt.gemm, ops, tile=simt.GemmTile() if real else mp.GEMM_TILE), FMA_PEAK_TFLOPS)]
    for bf16 in (False, True):
        mode, peak = ("bf16 inputs", MMA_PEAK_TFLOPS) if bf16 else ("fp32 (bf16x3)", MMA_PEAK_TFLOPS / 3)
        steps.append(Step(f"4 gemm_tc {mode}", "mma.sync tiles; slabs through registers, one in flight",
                          _case("gemm_tc", tc.gemm_tc, ops, tile=tc_tile, bf16_inputs=bf16), peak))
    for bf16 in (False, True):
        mode, peak = ("bf16 inputs", MMA_PEAK_TFLOPS) if bf16 else ("fp32 (bf16x3)", MMA_PEAK_TFLOPS / 3)
        workspace = cuda.device_array(gp.workspace_size(m, k, bf16), np.uint16)
        tile = mp.pipelined_tile(m, n, k, bf16) if real else gp.SIM_TILE

        def pipelined(x, w, out, stream, workspace=workspace, **kwargs):
            gp.gemm_pipelined(x, w, out, workspace, stream, **kwargs)

        steps.append(Step(f"6 gemm_pipelined {mode}", "x as bf16 planes once; cp.async several slabs ahead",
                          _case("gemm_pipelined", pipelined, ops, tile=tile, bf16_inputs=bf16), peak))
    if SIMULATOR or wgmma.device_has_wgmma():
        plane = cuda.device_array(m * k, np.uint16)
        for version, idea, tile in (
                ("9 gemm_wgmma bf16 inputs", "wgmma: 64 x 128 x 16 per instruction from swizzled shared memory",
                 gw.WgmmaTile(128, 128, 4) if real else gw.SIM_TILE),
                ("10 gemm_wgmma overlap", "a slab's wgmma run on through the next barrier",
                 mp.wgmma_tile(m, n) if real else gw.SIM_TILE._replace(overlap=True))):
            def run_wgmma(x, w, out, stream, tile=tile, plane=plane, bf16_inputs=True):
                gp.bf16_planes(x, plane, stream, bf16_inputs=True)
                gw.gemm_wgmma(plane, x.shape[0], w, out, stream, tile=tile)

            steps.append(Step(version, idea, _case("gemm_wgmma", run_wgmma, ops, bf16_inputs=True),
                              WGMMA_PEAK_TFLOPS))
        tma_tile = mp.tma_tile(m, n) if real else gtma.SIM_TILE

        def run_tma(x, w, out, stream, tile=tma_tile, plane=plane, bf16_inputs=True):
            gp.bf16_planes(x, plane, stream, bf16_inputs=True)
            gtma.gemm_tma(plane, x.shape[0], w, out, stream, tile=tile)

        steps.append(Step("12 gemm_tma", "TMA copies by a producer warp; stages handed over by mbarriers",
                          _case("gemm_tma", run_tma, ops, bf16_inputs=True), WGMMA_PEAK_TFLOPS))
    return steps + split_steps(real)


def split_steps(real: bool) -> list[Step]:
    """A decode batch of 64 rows (bandwidth-bound: the weight read once is the roofline): gemm_pipelined in its
    unsplit policy tile, then with K split over blocks (rung 7), and gemm_wgmma split (rung 11, Hopper)."""
    shape = SPLIT_SHAPES["real" if real else "tiny"]
    m, n, k = shape
    ops = _operands(shape, real, seed=7)
    workspace = cuda.device_array(gp.workspace_size(m, k, True), np.uint16)
    unsplit = mp.pipelined_tile(m, n, k, True) if real else gp.SIM_TILE
    tile, splits = mp.skinny_plan(m, n, k, True) if real else (gp.SIM_TILE, 2)
    plans = [("6 gemm_pipelined, M = 64", "the prefill kernel on a decode batch: 48 blocks stream W", gp, unsplit, 1),
             (f"7 gemm_pipelined split K x {splits}", "K split over blocks: the weight streams from every SM",
              gp, tile, splits)]
    if SIMULATOR or wgmma.device_has_wgmma():
        wg_tile, wg_splits = mp.wgmma_split_plan(m, n, k) if real else (gw.SIM_TILE, 2)
        plans.append((f"11 gemm_wgmma split K x {wg_splits}", "the same split with wgmma's products", gw, wg_tile,
                      wg_splits))
    partials = max(module.split_partials_size(t, m, n, s) for _, _, module, t, s in plans)
    counters = max(gw.tiles(t, m, n) if module is gw else gp.split_counters_size(t, m, n)
                   for _, _, module, t, _ in plans)
    split_ws = (cuda.device_array(partials, np.float32), cuda.to_device(np.zeros(counters, np.int32)))
    steps = []
    for version, idea, module, tile_, splits_ in plans:
        def run(x, w, out, stream, module=module, tile=tile_, splits=splits_, bf16_inputs=True):
            gp.bf16_planes(x, workspace, stream, bf16_inputs=True)
            if module is gw:
                gw.gemm_wgmma(workspace, m, w, out, stream, tile=tile, splits=splits, split_workspace=split_ws)
            else:
                gp.gemm_planes(workspace, m, w, out, stream, tile=tile, bf16_inputs=True, splits=splits,
                               split_workspace=split_ws)

        steps.append(Step(version, idea, _case(version, run, ops, bf16_inputs=True)))
    return steps
