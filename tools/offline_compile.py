"""Compile every kernel the CUDA runner launches for an H200 (sm_90) and assemble it with ptxas, without a GPU.

    python3 tools/offline_compile.py [--cuda-home /usr/local/cuda] [--block-size 16]
    python3 tools/offline_compile.py --attention-warps   # the fast decode attention's warp bound
    python3 tools/offline_compile.py --gemv 3072,2048=staged,8,4 2048,2048=staged,4,4

GPU time is scarce and CI has no GPU, while the simulator never compiles a kernel: a kernel that types in
the simulator can still fail to compile for the device (a libdevice function that does not exist, an
intrinsic with a wrong signature), or compile into register spills. This tool finds those on any machine
that has the CUDA toolkit's compiler parts (NVVM with libdevice, and ptxas): it builds a one-layer
Llama-3.2-1B-shaped CUDA runner on fake device arrays and runs a sampled prefill step and greedy decode
steps at batch 1, 8, 16, 64, 128 and 256 with every launch intercepted. Each kernel is compiled by Numba to PTX
for compute capability 9.0, with the target options it was declared with, and assembled by `ptxas -v`; a table of
registers, spills and shared memory per kernel is printed. Nothing executes, so nothing is checked for
correctness: that is what the GPU test profile is for.

--gemv N,K=CONFIG (as tools/profile_step.py takes it, e.g. `--gemv 3072,2048=staged,8,4`) compiles the
runner's steps with gemv's configuration for those weight shapes overridden: a configuration the policy does
not pick yet can be checked for spills before a GPU run.

--sass NAME disassembles every compiled kernel whose name contains NAME (`nvdisasm`, from the CUDA toolkit or
PyPI's nvidia-cuda-nvdisasm: --nvdisasm PATH) and counts its instructions: in all, and in each loop (a backward
branch's body), by opcode. An instruction-bound kernel can so be trimmed and compared before and after
without a GPU (docs/performance.md, "Fewer instructions per key tile").

--attention-warps compiles the fast decode attention (paged_attention's direct and split kernels) at the
most warps its launcher accepts, for head sizes 8-128, GQA groups 1-8 and both lanes-per-key settings, and
checks that registers x threads fit the SM's 65,536 registers (else the launch fails on the GPU).

NOTE: this reaches into numba-cuda internals (tested with 0.30.4): the device query, the list of supported
compute capabilities, the libdevice location, the launch path and stream conversion are replaced.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from cuda_kernels import compat  # noqa: E402,F401  (the numpy shim before numba.cuda)
from numba import cuda, typeof  # noqa: E402

CC = (9, 0)
OPTIONS = ("launch_bounds", "fastmath", "max_registers", "lineinfo", "debug", "opt")


class FakeDeviceArray:
    """What the launchers and the runner use of a device array, over a host array that is never read."""

    def __init__(self, array: np.ndarray):
        self.host = array

    shape = property(lambda self: self.host.shape)
    dtype = property(lambda self: self.host.dtype)
    size = property(lambda self: self.host.size)
    ndim = property(lambda self: self.host.ndim)
    strides = property(lambda self: self.host.strides)

    def copy_to_host(self, out=None, stream=0):
        return self.host.copy() if out is None else out

    def copy_to_device(self, array, stream=0):
        pass

    def is_c_contiguous(self):
        return self.host.flags.c_contiguous

    def view(self, dtype):
        return FakeDeviceArray(self.host.view(dtype))

    def reshape(self, *shape):
        return FakeDeviceArray(self.host.reshape(*shape))

    def __getitem__(self, key):
        return FakeDeviceArray(self.host[key])

    def __len__(self):
        return len(self.host)


class FakeStream:
    handle = 0

    def synchronize(self):
        pass


class FakeEvent:
    def record(self, stream=0):
        pass

    def synchronize(self):
        pass


class FakeCopy:
    """tinyvllm.cuda_driver.PinnedCopy without a driver: copies nothing."""

    def __init__(self, host, device, stream):
        self.stream = stream

    def to_device(self, nbytes):
        pass

    def to_host(self, nbytes):
        pass


def install(cuda_home: Path, report: list) -> None:
    """Point Numba at cuda_home's libdevice for cc 9.0 and turn launches into compile + ptxas."""
    import numba.cuda.cudadrv.driver as driver
    import numba.cuda.cudadrv.nvrtc as nvrtc
    import numba.cuda.cudadrv.nvvm as nvvm
    import numba.cuda.dispatcher as dispatcher

    libdevice = cuda_home / "nvvm" / "libdevice" / "libdevice.10.bc"
    ptxas = cuda_home / "bin" / "ptxas"
    for path in (libdevice, ptxas):
        if not path.exists():
            raise SystemExit(f"offline_compile: {path} not found (--cuda-home must hold NVVM's libdevice and ptxas)")

    class Device:
        compute_capability = CC

    dispatcher.get_current_device = lambda: Device()
    nvrtc.get_supported_ccs = lambda: ((7, 5), (8, 0), CC)
    nvvm.get_libdevice = lambda: str(libdevice)
    nvvm.open_libdevice = lambda: libdevice.read_bytes()
    driver._to_core_stream = dispatcher._to_core_stream = lambda stream: stream

    from numba.core import types
    from numba.np import numpy_support

    from cuda_kernels import launch as kernel_launch

    def numba_type(a):
        if isinstance(a, FakeDeviceArray):
            return typeof(a.host)
        if isinstance(a, kernel_launch.view):   # a C-contiguous view of a fake array
            return types.Array(numpy_support.from_dtype(a.dtype), len(a.shape), "C")
        return typeof(a)

    def compile_kernel(kernel, grid, block, args):
        signature = tuple(numba_type(a) for a in args)
        options = {k: v for k, v in kernel.targetoptions.items() if k in OPTIONS}
        # NOTE: for the architecture-specific target, sm_90a, as numba-cuda compiles on a device of compute
        # capability 9.0 (gemm_wgmma's instructions exist there only)
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(*CC, "a"), **options)
        report.append((kernel.py_func.__name__, tuple(grid), tuple(block), assemble(ptxas, ptx)))

    def dims(value):
        return (value,) if isinstance(value, int) else tuple(value)

    # both launch paths: Numba's syntax, and cuda_kernels.launch (which would call the driver)
    dispatcher._LaunchConfiguration.__call__ = lambda config, *args: compile_kernel(
        config.dispatcher, config.griddim, config.blockdim, args)
    kernel_launch.submit = lambda kernel, grid, block, stream, args, shared, dependent: compile_kernel(
        kernel, dims(grid), dims(block), args)
    from cuda_kernels import pdl

    pdl._device_supports = lambda: True  # the griddepcontrol instructions exist on sm_90
    from cuda_kernels import wgmma

    wgmma.device_has_wgmma = lambda: True   # the target is compute capability 9.0: the engine takes gemm_wgmma
    from cuda_kernels import tma

    # a tensor map is 128 bytes the driver encodes (gemm_tma): a fake one types as the real one does
    tma.tensor_map = tma.tensor_map_to_end = lambda *a, **k: FakeDeviceArray(np.zeros(16, np.uint64))
    cuda.to_device = lambda array, *a, **k: FakeDeviceArray(np.asarray(array))
    cuda.device_array = lambda shape, dtype=np.float64, *a, **k: FakeDeviceArray(np.zeros(shape, dtype))
    cuda.pinned_array = lambda shape, dtype=np.float64, *a, **k: np.zeros(shape, dtype)
    cuda.stream = lambda *a, **k: FakeStream()
    cuda.event = lambda *a, **k: FakeEvent()
    import tinyvllm.cuda_driver

    tinyvllm.cuda_driver.PinnedCopy = FakeCopy  # before the runner's modules import it


def one_layer_weights(config) -> dict[str, np.ndarray]:
    """Zero bf16 weights with the shapes of one layer of `config` (contents do not matter: nothing runs)."""
    from tinyvllm.weights import expected_shapes

    return {name: np.zeros(shape, np.uint16) for name, shape in expected_shapes(config).items()}


def run_steps(block_size: int, matmul_precision: str, kv_cache_dtype: str = "bf16") -> None:
    from tinyvllm.config import ModelConfig
    from tinyvllm.cuda_runner import CUDARunner
    from tinyvllm.random_model import PRESETS
    from tinyvllm.sampling_params import SamplingParams
    from tinyvllm.scheduler import ScheduledSequence
    from tinyvllm.sequence import Sequence

    config = ModelConfig.from_dict({**PRESETS["llama-3.2-1b"], "num_hidden_layers": 1,
                                    "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    runner = CUDARunner(config, one_layer_weights(config), block_size, 256, 8192, num_blocks=4096,
                        enforce_eager=True, matmul_precision=matmul_precision, kv_cache_dtype=kv_cache_dtype)

    def scheduled(length, new_tokens, temperature):
        seq = Sequence("x", list(range(length)), SamplingParams(temperature=temperature, top_k=5), 0)
        seq.block_table = list(range(-(-(length + 1) // block_size)))
        seq.num_computed_tokens = length - new_tokens
        return ScheduledSequence(seq, new_tokens)

    runner.execute([scheduled(100, 100, 0.7), scheduled(30, 30, 0.0)])      # prefill, sampled
    runner.execute([scheduled(320, 320, 0.0)])   # a prefill of matmul_policy.WGMMA_MIN_M rows or more: gemm_wgmma
    for batch in (1, 8, 16, 64, 128, 256):   # decode, greedy: gemv, then the split-K GEMMs of each tile
        runner.execute([scheduled(3000, 1, 0.0) for _ in range(batch)])


def assemble(ptxas: Path, ptx: str, check: bool = False) -> subprocess.CompletedProcess:
    """`ptxas -v` on the PTX for its own target (sm_90a where numba-cuda compiled for it: a kernel using wgmma);
    the register, spill and shared-memory report is in stderr, the cubin's bytes in .cubin (b"" on failure)."""
    arch = re.search(r"\.target (sm_\w+)", ptx)[1]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        done = subprocess.run([str(ptxas), f"-arch={arch}", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                              capture_output=True, text=True, check=check)
        cubin = Path(tmp) / "k.cubin"
        done.cubin = cubin.read_bytes() if cubin.exists() else b""
        return done


_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_counts(nvdisasm: Path, cubin: bytes) -> tuple[Counter, list[Counter]]:
    """Opcode counts of a cubin's SASS (count_sass of nvdisasm's listing)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cubin").write_bytes(cubin)
        return count_sass(subprocess.run([str(nvdisasm), "-c", f"{tmp}/k.cubin"], capture_output=True, text=True,
                                         check=True).stdout.splitlines())


def count_sass(lines: list[str]) -> tuple[Counter, list[Counter]]:
    """Opcode counts (predicates and modifiers dropped) of an nvdisasm listing: of the whole kernel, and of each
    loop (from a label to the backward branch that returns to it), in the order the loops end."""
    labels = {m[1]: i for i, line in enumerate(lines) if (m := re.match(r"\s*\.(L_x_\d+):", line))}

    def ops(a: int, b: int) -> Counter:
        return Counter(m[1] for line in lines[a:b] if (m := _SASS_OP.search(line)))

    loops = [ops(labels[m[1]], i + 1) for i, line in enumerate(lines)
             if (m := re.search(r"BRA\s+`\(\.(L_x_\d+)\)", line)) and labels.get(m[1], i) < i]
    return ops(0, len(lines)), loops


def print_sass(name: str, nvdisasm: Path, cubin: bytes) -> None:
    """A kernel's instruction counts (sass_counts), the 12 most frequent opcodes of each."""
    def line(counts: Counter) -> str:
        return f"{sum(counts.values()):,} instructions: " + ", ".join(f"{op} {n}" for op, n in counts.most_common(12))

    total, loops = sass_counts(nvdisasm, cubin)
    print(f"{name}: {line(total)}")
    for n, loop in enumerate(loops):
        print(f"  loop {n}: {line(loop)}")


def ptxas_registers(ptxas: Path, ptx: str) -> int:
    return int(re.search(r"Used (\d+) registers", assemble(ptxas, ptx, check=True).stderr)[1])


def attention_warps(ptxas: Path, block_size: int, kv_formats=("bf16",)) -> int:
    """The fast decode attention at paged_attention's largest accepted warp count: does the block fit the
    register file? Returns the number of configurations that do not."""
    from numba import types

    from cuda_kernels import paged_attention_gqa as pa

    registers_per_sm = 65536
    print("| KV format | head_dim | group | lanes/key | warps | kernel | registers | registers x threads |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    bad = 0
    f32_3d, u64_2d, i32_2d = types.float32[:, :, ::1], types.uint64[:, ::1], types.int32[:, ::1]
    # (q, k_rows, v_rows, block_tables, context_lens, scale, v_scale, out, planes)
    direct_sig = (f32_3d, u64_2d, u64_2d, i32_2d, types.int32[::1], types.float32, types.float32, f32_3d,
                  types.uint16[::1])
    split_sig = direct_sig[:7] + (types.int64, types.float32[:, :, :, ::1], types.float32[:, :, ::1],
                                  types.float32[:, :, ::1])
    for fmt in kv_formats:
        for d in (8, 40, 64, 128):
            for group in (1, 2, 3, 4, 5, 7, 8):
                for lanes in (4, 8):
                    warps = pa.fast_warps(d, group, lanes, most=pa.FAST_WARPS_BY_FORMAT[fmt])
                    # the direct kernel as the engine's bf16 decode runs it: writing the O projection's plane too
                    kernels = pa._gqa_kernels(d, block_size, 8, group, lanes, warps, fmt, 1)
                    for name, kernel, sig in zip(("direct", "split"), kernels, (direct_sig, split_sig)):
                        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=CC)
                        regs = ptxas_registers(ptxas, ptx)
                        used = regs * warps * 32
                        bad += used > registers_per_sm
                        flag = "" if used <= registers_per_sm else " **too many**"
                        print(f"| {fmt} | {d} | {group} | {lanes} | {warps} | {name} | {regs} | {used:,}{flag} |",
                              flush=True)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda-home", type=Path, default=Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--attention-warps", action="store_true",
                        help="check the fast decode attention's largest warp count against the register file")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["bf16"], choices=("bf16", "fp32", "fp8"),
                        help="the KV formats of the runner's steps, or with --attention-warps those whose kernels "
                             "to check (default bf16)")
    parser.add_argument("--gemv", nargs="+", default=[], metavar="N,K=CONFIG",
                        help="gemv configurations for these weight shapes instead of gemv_config's")
    parser.add_argument("--matmul-precision", choices=("fp32", "bf16"), default="bf16",
                        help="the runner's matmul inputs (default bf16, the CUDA engine's default)")
    parser.add_argument("--sass", metavar="NAME",
                        help="also count the SASS instructions of kernels whose name contains NAME, per loop")
    parser.add_argument("--nvdisasm", type=Path, help="nvdisasm for --sass (default: the CUDA home's)")
    args = parser.parse_args()
    nvdisasm = args.nvdisasm or args.cuda_home / "bin" / "nvdisasm"
    if args.sass and not nvdisasm.exists():
        raise SystemExit(f"offline_compile: --sass needs nvdisasm: {nvdisasm} not found (--nvdisasm PATH; PyPI's "
                         f"nvidia-cuda-nvdisasm ships one)")
    report: list = []
    install(args.cuda_home, report)
    if args.attention_warps:
        return 1 if attention_warps(args.cuda_home / "bin" / "ptxas", args.block_size, args.kv_cache_dtype) else 0
    from tools.profile_step import gemv_override, with_gemv_configs

    for fmt in args.kv_cache_dtype:
        with_gemv_configs(lambda: run_steps(args.block_size, args.matmul_precision, fmt),
                          dict(gemv_override(t) for t in args.gemv))
    print("| kernel | grid | block | registers | spill stores / loads (bytes) | shared memory (bytes) |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    failed, seen, sass = 0, set(), []
    for name, grid, block, done in report:
        if done.returncode:
            failed += 1
            print(f"| {name} | {grid} | {block} | ptxas FAILED: {done.stderr.strip()[-300:]} | | |")
            continue
        info = done.stderr
        registers = re.search(r"Used (\d+) registers", info)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        smem = re.search(r"(\d+) bytes smem", info)
        row = (name, registers and registers[1], spills and f"{spills[1]} / {spills[2]}", smem[1] if smem else "0")
        if row not in seen:  # the same compiled kernel at other grids adds nothing
            seen.add(row)
            print(f"| {name} | {grid} | {block} | {row[1]} | {row[2]} | {row[3]} |")
            if args.sass and args.sass in name:
                sass.append((f"{name} (grid {grid}, block {block}, {row[1]} registers)", done.cubin))
    for label, cubin in sass:
        print_sass(label, nvdisasm, cubin)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
