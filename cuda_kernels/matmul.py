"""The matmul family's entry points: ``out = x @ W^T`` (and its fused forms) as the engine calls it.

    out[m, n] = sum_k x[m, k] * bf16_to_f32(W[n, k])

x (M, K) float32 activations; W (N, K) uint16 bf16 bit patterns (one row per output feature, as nn.Linear
stores it); out (M, N) float32. Fused projections (Q, K and V as one weight; gate and up as one) are the
same op on row-concatenated weights. Twin: reference/matmul.py.

Two input precisions (the engine's matmul_precision): "fp32" multiplies x as it is (exactly: the tensor-core
kernels cut it into three bf16 pieces, gemm_tc.py); "bf16" (``bf16_inputs=True`` on every launcher; what
vLLM and HF transformers do, and the engine's default on the GPU) multiplies bf16(x), x rounded to the
nearest bf16 (ties to even). Either way every product is exact in fp32, so the kernels differ from
reference.matmul.matmul(x, W, bf16_inputs) only in the order of the fp32 sums.

The kernels, each file a ladder from its simplest correct version to the one the engine runs:
1. gemm_simt.matmul_naive: one thread per output, uncoalesced weight reads. The teaching baseline.
2. gemv.py, decode (M <= 8): gemv_warp (a warp per row), then gemv: 64-bit loads, each weight word read once
   for up to 8 rows of x, loads in flight, K split over warps, pipelined; the staged variant (GemvStaged);
   gated (SiLU*mul) and RoPE + KV-write epilogues.
3. gemm_simt.gemm: shared-memory tiled fp32 GEMM with a register tile per thread (no tensor cores).
4. gemm_tc.gemm_tc: tensor cores (mma.sync m16n8k16 bf16, fp32 accumulators), skinny split-K tiles for
   decode batches.
5. matmul_policy.py: which kernel runs for a shape (the policies); this module: the entry points that
   the engine calls, each taking the kernel the policies name.
6. gemm_pipelined.gemm_pipelined: x converted once into bf16 planes, both operands streamed into shared
   memory by cp.async several slabs ahead, ldmatrix fragments; gated and planes-out epilogues (mlp).
7. the same kernel with K split over blocks and skinny tiles, for decode batches above gemv's rows.
8. gemv_tc.gemv_tc: gemv's memory side (each weight word loaded once straight into registers, K split over
   the warps of a block) with the products on tensor cores, for decode batches of bf16 inputs above gemv's
   rows; gated and planes-out epilogues (mlp).
9. gemm_wgmma.gemm_wgmma (compute capability 9.0): the pipelined GEMM's cp.async staging, into swizzled
   shared memory, with the products on warpgroup tensor cores (wgmma); bf16 inputs, prefill sizes; gated and
   planes-out epilogues (mlp); its version 11 splits K over blocks for the larger decode batches.
10. gemm_tma.gemm_tma (compute capability 9.0, version 12): gemm_wgmma's products with the operands copied by
   the Tensor Memory Accelerator, one producer warp feeding the consumer warpgroups through mbarriers.
"""

from __future__ import annotations

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels import activation, gemm_pipelined, gemm_tma, gemm_wgmma, gemv_tc, rope
from cuda_kernels import matmul_policy as policy
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.gemm_simt import gemm
from cuda_kernels.gemm_tc import gemm_tc
from cuda_kernels.gemv import GemvConfig, gemv, gemv_rope
from cuda_kernels.launch import view
from cuda_kernels.matmul_args import check_args


# ---------------------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------------------

def _gemv_pick(x, weight) -> GemvConfig:
    """matmul_policy.gemv_config for x (M, K) @ weight^T (weight (N, K) uint16 or its (N, K/4) uint64 view)."""
    return policy.gemv_config(x.shape[0], weight.shape[0], x.shape[1])


def gated_matmul(x, weight, out, scratch, stream=0, bf16_inputs: bool = False, workspace=None,
                 split_workspace=None, planes_ready: bool = False):
    """out (M, F) <- silu(x @ gate^T) * (x @ up^T) for the fused weight [gate; up] (2F, K): at decode sizes
    one gemv with the SiLU*mul in its epilogue; where matmul would take gemm_pipelined (given a planes
    workspace; pipelined_plan), gemm_pipelined with the same epilogue; else matmul into scratch (at least
    (M, 2F) float32) and activation.silu_and_mul. planes_ready: as matmul's. Twin: reference.matmul.gated_matmul."""
    (M, K), N = x.shape, weight.shape[0]
    plan = workspace is not None and policy.pipelined_plan(M, N, K, bf16_inputs, True, split_workspace)
    wg_plan = workspace is not None and policy.wgmma_plan(M, N, K, bf16_inputs, split_workspace)
    if policy.uses_gemv(M, N):
        gemv(x, weight, out, stream, config=_gemv_pick(x, weight), bf16_inputs=bf16_inputs, gated=True)
    elif workspace is not None and policy.uses_gemv_tc(M, N, K, bf16_inputs):
        _tc(x, weight, out, workspace, stream, planes_ready, gated=True)
    elif wg_plan:
        check_args(x, weight, out, gated=True)
        _wgmma(x, weight, out, workspace, stream, planes_ready, wg_plan, split_workspace, gated=True)
    elif plan:
        check_args(x, weight, out, gated=True)
        gemm_pipelined.gemm_pipelined(x, weight, out, workspace, stream, bf16_inputs=bf16_inputs, gated=True,
                                      tile=plan[0], splits=plan[1], split_workspace=split_workspace,
                                      planes_ready=planes_ready)
    else:
        gate_up = _rows(scratch, x.shape[0])
        matmul(x, weight, gate_up, stream, bf16_inputs=bf16_inputs, workspace=workspace)
        activation.silu_and_mul(gate_up, out, stream)


def mlp(x, gate_up, down, out, act, scratch, stream=0, bf16_inputs: bool = False, workspace=None, act_planes=None,
        split_workspace=None, planes_ready: bool = False):
    """The gated MLP: out (M, H) <- act @ down^T, act = silu(x @ gate^T) * (x @ up^T) (M, F), for the fused
    [gate; up] (2F, H) and down (H, F). Where both GEMMs read planes (gemv_tc or gemm_pipelined, given the
    planes workspace for x and act_planes, uint16 (P * M, F) with P = gemm_pipelined.pieces(bf16_inputs)),
    the gated GEMM writes act straight as the bf16 planes the down GEMM multiplies: act never exists in fp32
    and no planes conversion runs between the two (act itself is not written). Else gated_matmul into act
    (at least (M, F) float32, scratch as gated_matmul takes it), then matmul. planes_ready: x's planes are
    in the workspace already (see matmul). Twin: reference.matmul.mlp."""
    M, N, K = check_args(x, gate_up, None)
    H, F = down.shape
    up_tc, down_tc = policy.uses_gemv_tc(M, N, K, bf16_inputs), policy.uses_gemv_tc(M, H, F, bf16_inputs)
    up_wg, down_wg = (not up_tc and policy.wgmma_plan(M, N, K, bf16_inputs, split_workspace),
                      not down_tc and policy.wgmma_plan(M, H, F, bf16_inputs, split_workspace))
    up_plan = not (up_tc or up_wg) and policy.pipelined_plan(M, N, K, bf16_inputs, True, split_workspace)
    down_plan = not (down_tc or down_wg) and policy.pipelined_plan(M, H, F, bf16_inputs, False, split_workspace)
    if workspace is None or act_planes is None or not (up_tc or up_wg or up_plan) or not (
            down_tc or down_wg or down_plan):
        gated_matmul(x, gate_up, act, scratch, stream, bf16_inputs=bf16_inputs, workspace=workspace,
                     split_workspace=split_workspace, planes_ready=planes_ready)
        matmul(act, down, out, stream, bf16_inputs=bf16_inputs, workspace=workspace, split_workspace=split_workspace)
        return
    if up_tc:
        _tc(x, gate_up, act_planes, workspace, stream, planes_ready, gated=True)
    elif up_wg:
        _wgmma(x, gate_up, act_planes, workspace, stream, planes_ready, up_wg, split_workspace, gated=True)
    else:
        gemm_pipelined.gemm_pipelined(x, gate_up, act_planes, workspace, stream, bf16_inputs=bf16_inputs, gated=True,
                                      tile=up_plan[0], splits=up_plan[1], split_workspace=split_workspace,
                                      planes_ready=planes_ready)
    if down_tc:
        gemv_tc.gemv_tc(act_planes, M, down, out, stream, config=policy.gemv_tc_config(M, H, F))
    elif down_wg:
        _warpgroup_gemm(view(act_planes, (M * F,)), M, down, out, stream, down_wg, split_workspace)
    else:
        planes = view(act_planes, (act_planes.shape[0] * act_planes.shape[1],))
        gemm_pipelined.gemm_planes(planes, M, down, out, stream, bf16_inputs=bf16_inputs, tile=down_plan[0],
                                   splits=down_plan[1], split_workspace=split_workspace)


def matmul_rope_kv_write(x, weight, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, scratch, stream=0,
                         bf16_inputs: bool = False, workspace=None, split_workspace=None, planes_ready: bool = False,
                         k_scale=1.0, v_scale=1.0):
    """The QKV projection, then RoPE and the KV-cache write (rope.rope_kv_write's outputs from qkv = x @ W^T;
    the caches in any format of kv_format, k_scale and v_scale the fp8 cache's scales):
    at decode sizes one gemv with the rotation and the cache write in its epilogue (gemv_rope: no qkv in
    memory, no RoPE kernel), where uses_gemv_tc says gemv_tc with the same epilogue, else matmul into scratch
    (at least (M, N) float32) and rope.rope_kv_write. planes_ready: as matmul's.
    Twin: reference.matmul.matmul_rope_kv_write."""
    (M, K), N = x.shape, weight.shape[0]
    if policy.uses_gemv(M, N):
        gemv_rope(x, weight, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, stream,
                  config=_gemv_pick(x, weight), bf16_inputs=bf16_inputs, k_scale=k_scale, v_scale=v_scale)
    elif workspace is not None and policy.uses_gemv_tc(M, N, K, bf16_inputs):
        gemv_tc.gemv_tc_rope(_x_plane(x, workspace, stream, planes_ready), M, weight, positions, cos, sin, k_cache,
                             v_cache, slot_mapping, q_out, stream, config=policy.gemv_tc_config(M, N, K),
                             k_scale=k_scale, v_scale=v_scale)
    else:
        qkv = _rows(scratch, x.shape[0])
        matmul(x, weight, qkv, stream, bf16_inputs=bf16_inputs, workspace=workspace, split_workspace=split_workspace,
               planes_ready=planes_ready)
        rope.rope_kv_write(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, stream, k_scale, v_scale)


def _x_plane(x, workspace, stream, planes_ready: bool):
    """The workspace holding x's bf16 plane for gemv_tc: converted into it first unless planes_ready."""
    if not planes_ready:
        gemm_pipelined.bf16_planes(x, workspace, stream, bf16_inputs=True)
    return workspace


def _tc(x, weight, out, workspace, stream, planes_ready: bool, gated: bool = False):
    """gemv_tc on x's bf16 plane in workspace (converted first unless planes_ready)."""
    gemv_tc.gemv_tc(_x_plane(x, workspace, stream, planes_ready), x.shape[0], weight, out, stream,
                    config=policy.gemv_tc_config(x.shape[0], weight.shape[0], x.shape[1]), gated=gated)


def _wgmma(x, weight, out, workspace, stream, planes_ready: bool, plan, split_workspace, gated: bool = False):
    """_warpgroup_gemm on x's bf16 plane in workspace (converted first unless planes_ready)."""
    _warpgroup_gemm(_x_plane(x, workspace, stream, planes_ready), x.shape[0], weight, out, stream, plan,
                    split_workspace, gated)


def _warpgroup_gemm(plane, m: int, weight, out, stream, plan, split_workspace, gated: bool = False):
    """gemm_wgmma in `plan` (wgmma_plan's (tile, splits)), or where uses_tma says gemm_tma in tma_plan's. A
    decode step captured in a CUDA graph finds its tensor maps made: the warm-up's walk of every shape class
    launches eagerly first (tinyvllm/warmup.py)."""
    if policy.uses_tma(m):
        tile, splits = policy.tma_plan(m, *weight.shape)
        gemm_tma.gemm_tma(plane, m, weight, out, stream, tile=tile, gated=gated, splits=splits,
                          split_workspace=split_workspace)
    else:
        gemm_wgmma.gemm_wgmma(plane, m, weight, out, stream, tile=plan[0], gated=gated, splits=plan[1],
                              split_workspace=split_workspace)


def _rows(scratch, m: int):
    """The first m rows of scratch; scratch itself when it has m (a slice is a new device array: tens of us)."""
    return scratch if scratch.shape[0] == m else scratch[:m]


def matmul(x, weight, out, stream=0, bf16_inputs: bool = False, workspace=None, split_workspace=None,
           planes_ready: bool = False):
    """out = x @ W^T: the launcher the engine calls, in the kernel that matmul_policy names: gemv for M <=
    GEMV_MAX_M (GEMV_WIDE_MAX_M for weights of GEMV_WIDE_N rows or more); given a workspace for x's bf16 planes
    (at least gemm_pipelined.workspace_size(M, K, bf16_inputs) uint16), gemv_tc where uses_gemv_tc says,
    gemm_wgmma or gemm_tma where wgmma_plan says, gemm_pipelined where pipelined_plan says (with a split
    workspace of split_workspace_sizes: every M above gemv's, K split for skinny M); gemm_tc for the rest.

    bf16_inputs (the engine's matmul_precision "bf16"): x is rounded to the nearest bf16 before it is
    multiplied, by whichever kernel runs. planes_ready: where gemm_pipelined runs, x's bf16 planes are in the
    workspace already (its producer wrote them; the other kernels read x itself).
    NOTE: in the simulator the engine takes gemm instead of gemm_tc: every emulated mma costs two block
    barriers over Python threads (gemm_tc's own tests still run there)."""
    if len(getattr(x, "shape", ())) == 2 and len(getattr(weight, "shape", ())) == 2 and policy.uses_gemv(
            x.shape[0], weight.shape[0]):
        gemv(x, weight, out, stream, config=_gemv_pick(x, weight), bf16_inputs=bf16_inputs)
        return
    M, N, K = check_args(x, weight, out)
    if workspace is not None and policy.uses_gemv_tc(M, N, K, bf16_inputs):
        _tc(x, weight, out, workspace, stream, planes_ready)
        return
    wg_plan = workspace is not None and policy.wgmma_plan(M, N, K, bf16_inputs, split_workspace)
    if wg_plan:
        _wgmma(x, weight, out, workspace, stream, planes_ready, wg_plan, split_workspace)
        return
    if SIMULATOR:
        gemm(x, weight, out, stream, tile=policy.GEMM_TILE, bf16_inputs=bf16_inputs)
        return
    plan = workspace is not None and policy.pipelined_plan(M, N, K, bf16_inputs, False, split_workspace)
    if plan:
        gemm_pipelined.gemm_pipelined(x, weight, out, workspace, stream, tile=plan[0], bf16_inputs=bf16_inputs,
                                      splits=plan[1], split_workspace=split_workspace, planes_ready=planes_ready)
    else:
        gemm_tc(x, weight, out, stream, tile=policy.gemm_tc_tile(M, N, K, bf16_inputs), bf16_inputs=bf16_inputs)
