"""Benchmark cases for cuda_kernels/gemv.py (decode matmul, small M) at Llama-3.2-1B shapes.

- gemv with the launcher's config (gemv_config) at M = 1 and M = 8 on the five weights (qkv, o, gate_up,
  down, lm_head): bandwidth-bound, so bytes_moved is the weight plus x and out (the weight is read once);
- the old matmul.gemv at M = 1 on the five weights (and M = 8 on qkv), side by side, while it exists;
- gemv_silu_mul on gate_up (weight [W_gate; W_up] 16384 x 2048 -> out (M, 8192)) at M = 1 and 8, with its
  one-knob config variants, and the unfused pair it replaces (gemv into (M, 16384), then
  activation.silu_and_mul) as one case of two launches;
- bf16_inputs=True on qkv and gate_up at M = 1 and 8 (x rounded to bf16 while it is staged);
- labelled config variants around the default (split_k, unroll, rows_per_warp, warps_per_block, k_chunk
  halved or doubled, one knob at a time) on qkv, down and gate_up, to re-tune gemv_config on the GPU.

    python tools/bench_kernels.py --family gemv       # these cases, with the other families' table format
    python -m tools.kernel_benchmarks.gemv --sweep    # every one-knob neighbour of the default on all five
                                                      # weights at M = 1, 2, 4, 8; prints the best per shape

Inputs are random (NumPy, fixed seed) and live on the device; every launch writes a preallocated `out`.
"""

from __future__ import annotations

import argparse

import numpy as np

from cuda_kernels import compat  # noqa: F401  (the numpy shim before numba.cuda, for `python -m` runs)
from cuda_kernels import activation
from cuda_kernels import gemv as gv
from cuda_kernels import matmul as mm
from numba import cuda
from reference.activation import silu_and_mul as reference_silu_and_mul
from reference.bf16 import bf16_to_f32, f32_to_bf16, round_to_bf16
from reference.matmul import matmul as reference_matmul
from tools.kernel_benchmarks.common import Case, time_launch

# (name, N, K) of the Llama-3.2-1B projections
WEIGHTS = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
           ("lm_head", 128256, 2048)]
VARIANT_WEIGHTS = ("qkv", "down", "gate_up")
EPS = float(np.finfo(np.float32).eps)


def _dots(x, w, bf16_inputs):
    xr = round_to_bf16(x) if bf16_inputs else x
    want = reference_matmul(xr, w)
    atol = 4 * EPS * np.sqrt(x.shape[1]) * (np.abs(xr) @ np.abs(bf16_to_f32(w)).T) + 1e-30
    return want, atol


def _fail_unless(ok, got, want):
    if not ok.all():  # NaN fails too
        i = np.unravel_index(np.argmax(~ok), got.shape)
        raise AssertionError(f"{int((~ok).sum())} outputs off; first at {i}: got {got[i]}, want {want[i]}")


def _check_gemv(got, x, w, bf16_inputs=False):
    """got == x @ W^T within the fp32 summation error (as tests/kernels/test_gemv_kernels.py)."""
    want, atol = _dots(x, w, bf16_inputs)
    _fail_unless(np.abs(got - want) <= atol + 2 * EPS * np.abs(want), got, want)


def _check_silu(got, x, w, bf16_inputs=False):
    """got == silu(x W_gate^T) * (x W_up^T) within the error of the two dots (as the tests)."""
    i = w.shape[0] // 2
    dots, atol = _dots(x, w, bf16_inputs)
    want = reference_silu_and_mul(dots)
    g, u, tg, tu = dots[:, :i], dots[:, i:], atol[:, :i], atol[:, i:]
    with np.errstate(over="ignore"):
        bound = 1.1 * tg * (np.abs(u) + tu) + np.abs(g / (1 + np.exp(-g))) * tu
    bound = bound + 8 * EPS * (np.abs(want) + bound) + 1e-30
    _fail_unless(np.abs(got - want) <= bound, got, want)


def _effective(config: gv.GemvConfig, m: int, k: int, silu: bool = False):
    """config as the launcher runs it (k_chunk as the words it stages), or None if it would be refused."""
    try:
        chunk_words, _ = gv.gemv_plan(config, m, k, k % 4 == 0, silu)
    except ValueError:
        return None
    return config._replace(k_chunk=chunk_words)


def neighbours(config: gv.GemvConfig, m: int, k: int, silu: bool = False) -> list[gv.GemvConfig]:
    """The valid configs one knob away from config (each knob halved or doubled; warps_per_block kept a
    multiple of split_k), without those the launcher would run exactly as another (k_chunk past K)."""
    out, seen = [], {_effective(config, m, k, silu)}
    for field in gv.GemvConfig._fields:
        for factor in (0.5, 2):
            value = int(getattr(config, field) * factor)
            c = config._replace(**{field: value})
            if field == "split_k":
                c = c._replace(warps_per_block=max(c.warps_per_block, value))
            effective = _effective(c, m, k, silu) if value >= 1 else None
            if effective is not None and effective not in seen:
                seen.add(effective)
                out.append(c)
    return out


class _Inputs:
    """Random x and weights, drawn once per shape and shared by the cases."""

    def __init__(self):
        self.rng = np.random.default_rng(0)
        self.xs, self.ws = {}, {}

    def x(self, m, k):
        if (m, k) not in self.xs:
            x = self.rng.standard_normal((m, k), dtype=np.float32)
            self.xs[m, k] = (x, cuda.to_device(x))
        return self.xs[m, k]

    def w(self, n, k):
        if (n, k) not in self.ws:
            w = f32_to_bf16(self.rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02))
            self.ws[n, k] = (w, cuda.to_device(w))
        return self.ws[n, k]


def _case(label, launcher, inputs, wname, n, k, m, fused=False, bf16_inputs=False, **kwargs):
    """A case: launcher(x, w, out, stream, **kwargs) on (m, k) x and the (n, k) weight wname."""
    x, dx = inputs.x(m, k)
    w, dw = inputs.w(n, k)
    n_out = n // 2 if fused else n
    dout = cuda.device_array((m, n_out), np.float32)
    if bf16_inputs:
        kwargs["bf16_inputs"] = True

    def launch(stream):
        launcher(dx, dw, dout, stream, **kwargs)

    def check():
        dout.copy_to_device(np.full((m, n_out), np.nan, np.float32))  # a kernel that skips an output fails
        launch(0)
        cuda.synchronize()
        (_check_silu if fused else _check_gemv)(dout.copy_to_host(), x, w, bf16_inputs)

    what = f"{m}x{k} @ {n}x{k}^T" + (f" -> silu*up {m}x{n_out}" if fused else "")
    name = f"{launcher.__name__} {wname}{' ' + label if label else ''} {what}"
    return Case("gemv", name, launch, check, bytes_moved=w.nbytes + x.nbytes + 4 * m * n_out)


def _unfused_case(inputs, m, n, k):
    """gemv into (m, n) then activation.silu_and_mul: the two launches gemv_silu_mul replaces."""
    x, dx = inputs.x(m, k)
    w, dw = inputs.w(n, k)
    dgu = cuda.device_array((m, n), np.float32)
    dout = cuda.device_array((m, n // 2), np.float32)

    def launch(stream):
        gv.gemv(dx, dw, dgu, stream)
        activation.silu_and_mul(dgu, dout, stream)

    def check():
        dout.copy_to_device(np.full((m, n // 2), np.nan, np.float32))
        launch(0)
        cuda.synchronize()
        _check_silu(dout.copy_to_host(), x, w)

    name = f"gemv + silu_and_mul gate_up (unfused, 2 launches) {m}x{k} @ {n}x{k}^T -> {m}x{n // 2}"
    # NOTE: the same minimum traffic as the fused case, so the GB/s columns compare directly
    return Case("gemv", name, launch, check, bytes_moved=w.nbytes + x.nbytes + 4 * m * n // 2)


def cases() -> list[Case]:
    inputs = _Inputs()
    old_gemv = getattr(mm, "gemv", None)  # the old kernel, until the engine drops it
    out = []
    for wname, n, k in WEIGHTS:
        for m in (1, 8):
            out.append(_case(f"(config {tuple(gv.gemv_config(m, n, k))})", gv.gemv, inputs, wname, n, k, m))
        if old_gemv is not None:
            for m in (1, 8) if wname == "qkv" else (1,):
                out.append(_case("(old matmul.gemv)", old_gemv, inputs, wname, n, k, m))
        if wname == "gate_up":
            for m in (1, 8):
                default = gv.gemv_config(m, n // 2, k, fused=True)
                out.append(_case(f"(config {tuple(default)})", gv.gemv_silu_mul, inputs, wname, n, k, m,
                                 fused=True))
                for config in neighbours(default, m, k, silu=True):
                    out.append(_case(f"(variant: {tuple(config)})", gv.gemv_silu_mul, inputs, wname, n, k, m,
                                     fused=True, config=config))
                out.append(_unfused_case(inputs, m, n, k))
                out.append(_case("(bf16_inputs)", gv.gemv_silu_mul, inputs, wname, n, k, m, fused=True,
                                 bf16_inputs=True))
        if wname in ("qkv", "gate_up"):
            for m in (1, 8):
                out.append(_case("(bf16_inputs)", gv.gemv, inputs, wname, n, k, m, bf16_inputs=True))
        if wname in VARIANT_WEIGHTS:
            for m in (1, 8):
                default = gv.gemv_config(m, n, k)
                for config in neighbours(default, m, k):
                    out.append(_case(f"(variant: {tuple(config)})", gv.gemv, inputs, wname, n, k, m,
                                     config=config))
    return out


def sweep_cases(ms=(1, 2, 4, 8)) -> list[tuple[tuple, gv.GemvConfig, Case]]:
    """(shape key, config, case) for the default and every one-knob neighbour, all five weights, each M."""
    inputs = _Inputs()
    out = []
    for wname, n, k in WEIGHTS:
        for m in ms:
            default = gv.gemv_config(m, n, k)
            for config in [default] + neighbours(default, m, k):
                label = f"({'default ' if config == default else ''}{tuple(config)})"
                out.append(((wname, m), config, _case(label, gv.gemv, inputs, wname, n, k, m, config=config)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="every one-knob neighbour of the default config")
    parser.add_argument("--m", type=int, action="append", help="only these M (repeatable; with --sweep)")
    args = parser.parse_args()
    from tools.bench_kernels import copy_bandwidth

    copy_gbs = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbs:,.0f} GB/s\n")
    print("| case | time (us) | GB/s | % of copy |")
    print("| --- | ---: | ---: | ---: |")
    entries = sweep_cases(tuple(args.m or (1, 2, 4, 8))) if args.sweep else [(None, None, c) for c in cases()]
    best = {}
    for key, config, case in entries:
        try:
            case.check()
            seconds = time_launch(case.launch)
        except Exception as exc:  # report and go on: one bad variant must not hide the others
            print(f"| {case.name} | FAILED: {type(exc).__name__}: {str(exc)[:80]} | | |", flush=True)
            continue
        gbs = case.bytes_moved / seconds / 1e9
        print(f"| {case.name} | {seconds * 1e6:,.1f} | {gbs:,.0f} | {100 * gbs / copy_gbs:.0f}% |", flush=True)
        if key is not None and (key not in best or seconds < best[key][0]):
            best[key] = (seconds, config, gbs)
    if best:
        print("\n| weight | M | best config | time (us) | GB/s | default |")
        print("| --- | ---: | --- | ---: | ---: | --- |")
        for (wname, m), (seconds, config, gbs) in best.items():
            n, k = next((n, k) for name, n, k in WEIGHTS if name == wname)
            default = gv.gemv_config(m, n, k)
            print(f"| {wname} | {m} | {tuple(config)} | {seconds * 1e6:,.1f} | {gbs:,.0f} | "
                  f"{'same' if config == default else tuple(default)} |")


if __name__ == "__main__":
    main()
