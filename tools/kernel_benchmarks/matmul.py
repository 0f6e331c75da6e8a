"""Benchmark cases for cuda_kernels/matmul.py at Llama-3.2-1B shapes (x @ W^T, W bf16 in nn.Linear layout).

- gemv at M = 1 for each of the five weights and at M = 8 (decode): bandwidth-bound, so bytes_moved is the
  weight plus x and out (the weight is read once per launch at M <= 8);
- gemm at M = 1024 (a 1024-token prefill chunk) for QKV, gate/up and down: flops = 2 M N K;
- gemm_tc (tensor cores, bf16x3) at M = 256 and 1024 for QKV, gate/up, down and the LM head, with the
  launcher's tile choice and the other of its two tiles as a labelled variant; flops = 2 M N K (the useful, or
  effective, flops: the bf16x3 split issues 3 mma per product, so the tensor cores do 3x that work);
- matmul_naive at M = 1 on the O projection, the teaching baseline, for comparison;
- a few labelled variants (gemv rows per warp, a 128 x 128 gemm tile) to re-tune the defaults on the GPU.
Inputs are random (NumPy, fixed seed) and live on the device; every launch writes a preallocated `out`.

tools/bench_kernels.py rates TFLOP/s against the fp32 FMA peak; for the tensor-core cases run this module,
``python -m tools.kernel_benchmarks.matmul``, which times the gemm_tc cases alone and also gives the fraction
of the measured mma.sync peak (359 TFLOP/s, GPU.md) and of its third, the bf16x3 ceiling.
"""

from __future__ import annotations

import numpy as np

from cuda_kernels import compat  # noqa: F401  (the numpy shim before numba.cuda, for `python -m` runs)
from cuda_kernels import matmul as mm
from numba import cuda
from reference.bf16 import bf16_to_f32, f32_to_bf16
from reference.matmul import matmul as reference_matmul
from tools.kernel_benchmarks.common import Case, time_launch

# (name, N, K) of the Llama-3.2-1B projections
WEIGHTS = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
           ("lm_head", 128256, 2048)]
EPS = float(np.finfo(np.float32).eps)
MMA_PEAK_TFLOPS = 359.0   # mma.sync m16n8k16 bf16 in a register-only loop (GPU.md)
TC_WEIGHTS = ("qkv", "gate_up", "down", "lm_head")


def _check_close(out, x, w):
    """out == x @ W^T within the fp32 summation error (as in tests/kernels/test_matmul_kernels.py)."""
    got = out.copy_to_host()
    want = reference_matmul(x, w)
    magnitude = np.abs(x) @ np.abs(bf16_to_f32(w)).T
    bound = 4 * EPS * np.sqrt(x.shape[1]) * magnitude + 2 * EPS * np.abs(want) + 1e-30
    err = np.abs(got - want)
    if not (err <= bound).all():  # NaN fails too
        i = np.unravel_index(np.argmax(np.where(err <= bound, 0, 1 + err / bound)), got.shape)
        raise AssertionError(f"{int((~(err <= bound)).sum())} outputs off; worst at {i}: "
                             f"got {got[i]}, want {want[i]}")


def _case(label, launcher, x, w, dx, dw, compute_bound, **kwargs):
    """A case for one launcher: x (M, K) and w (N, K) on the host (for the check) and on the device."""
    (m, k), n = x.shape, w.shape[0]
    dout = cuda.device_array((m, n), np.float32)

    def launch(stream):
        launcher(dx, dw, dout, stream, **kwargs)

    def check():
        dout.copy_to_device(np.full((m, n), np.nan, np.float32))  # a kernel that skips an output must fail
        launch(0)
        cuda.synchronize()
        _check_close(dout, x, w)

    name = f"{launcher.__name__} {label} {m}x{k} @ {n}x{k}^T"
    if compute_bound:
        return Case("matmul", name, launch, check, flops=2.0 * m * n * k)
    return Case("matmul", name, launch, check, bytes_moved=dw.nbytes + dx.nbytes + dout.nbytes)


def cases(tensor_core_only: bool = False) -> list[Case]:
    rng = np.random.default_rng(0)
    xs = {}  # (m, k) -> (host x, device x), shared by the cases

    def activations(m, k):
        if (m, k) not in xs:
            x = rng.standard_normal((m, k), dtype=np.float32)
            xs[m, k] = (x, cuda.to_device(x))
        return xs[m, k]

    out = []
    for wname, n, k in WEIGHTS:
        w = f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02))
        dw = cuda.to_device(w)
        if wname in TC_WEIGHTS:
            for m in (256, 1024):
                x, dx = activations(m, k)
                chosen = mm.gemm_tc_tile(m, n)
                out.append(_case(f"{wname} (tile {tuple(chosen)})", mm.gemm_tc, x, w, dx, dw, True))
                other = mm.GEMM_TC_SMALL_TILE if chosen == mm.GEMM_TC_TILE else mm.GEMM_TC_TILE
                label = f"{wname} (variant: tile {tuple(other)})"
                out.append(_case(label, mm.gemm_tc, x, w, dx, dw, True, tile=other))
        if tensor_core_only:
            continue
        for m in (1, 8):
            x, dx = activations(m, k)
            out.append(_case(wname, mm.gemv, x, w, dx, dw, False))
        if wname in ("qkv", "gate_up", "down"):
            x, dx = activations(1024, k)
            out.append(_case(wname, mm.gemm, x, w, dx, dw, True))
        if wname == "qkv":
            x, dx = activations(1024, k)
            tile = mm.GemmTile(128, 128, 8, 8, 8)
            label = f"{wname} (variant: tile {tuple(tile)})"
            out.append(_case(label, mm.gemm, x, w, dx, dw, True, tile=tile))
        if wname == "o":
            x, dx = activations(1, k)
            out.append(_case(wname, mm.matmul_naive, x, w, dx, dw, False))
        if wname == "gate_up":
            x, dx = activations(1, k)
            for config in (mm.GemvConfig(4, 1), mm.GemvConfig(4, 4), mm.GemvConfig(8, 2)):
                out.append(_case(f"{wname} (variant: {config})", mm.gemv, x, w, dx, dw, False, config=config))
    return out


def main() -> None:
    """Time the gemm_tc cases; print effective TFLOP/s and the fractions of the mma.sync peak."""
    print("| case | time (us) | TFLOP/s (2MNK/t) | % of mma peak (359) | % of bf16x3 ceiling (359/3) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for case in cases(tensor_core_only=True):
        case.check()
        seconds = time_launch(case.launch)
        tflops = case.flops / seconds / 1e12
        peak = 100 * tflops / MMA_PEAK_TFLOPS
        print(f"| {case.name} | {seconds * 1e6:,.1f} | {tflops:.1f} | {peak:.1f}% | {3 * peak:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
