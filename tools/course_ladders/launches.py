"""Chapter 12 (launch overhead: CUDA graphs and programmatic dependent launch): one decode-step-like sequence
of small kernels, issued four ways, checked against reference/ and (on a GPU) timed per step and per kernel.

The sequence is a batch-1 decode step of the 1B model without its attention (chapter 8 times that, and its
kernels would tie this ladder to the KV-cache layout): the engine's own launchers, in the engine's order,

    embedding -> 16 x [ RMSNorm (fused with the residual add after layer 0) -> matmul 2048 x 2048 (where
    attention and the O projection stand) -> residual + RMSNorm -> gate/up matmul 16384 x 2048 with SiLU*mul
    -> down matmul 2048 x 8192 ] -> residual + RMSNorm

that is 2 + 5 x 16 = 82 kernels, the matmuls the engine's batch-1 gemvs, bf16 inputs (the GPU default). All
16 layers read their own device copy of one layer's weights (1.75 GB in all: each layer's bytes come from
DRAM, as in a step) while the reference multiplies by that layer's weights 16 times.

The rungs:
- 12a: launched from Python with Numba's own syntax, kernel[grid, block, stream](*args), for every kernel.
- 12b: launched from Python with cuda_kernels/launch.py (one cuLaunchKernelEx from a packed buffer), as the
  engine launches its prefill steps; programmatic dependent launch off.
- 12c: the same launches captured once into a CUDA graph (tinyvllm/cuda_graph.py) and replayed with one
  driver call; PDL off (TINYVLLM_PDL=0 while capturing).
- 12d: the graph captured with PDL on, as the engine's decode steps are (sm_90 and later; below, 12c again).

Every rung's output must equal the reference's (relative error of the final row under 1e-2) and, bit for bit,
12a's: a graph replays the very launches it captured. In Numba's simulator there is no driver to capture
with: there 12c and 12d run their recorded launches eagerly (what they check is the recording function, not
the graph), and nothing is timed. On a GPU each rung runs REPEATS steps between two CUDA events on one
stream; an eager step's time is then set by how fast Python issues its launches, a graph's by the GPU.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
from numba import cuda

from cuda_kernels import embedding, gemv, launch, matmul_policy, rmsnorm
from cuda_kernels.compat import SIMULATOR
from reference import embedding as ref_embedding
from reference import matmul as ref_matmul
from reference import rmsnorm as ref_rmsnorm
from reference.bf16 import f32_to_bf16
from tools.course_ladders.common import Step
from tools.kernel_benchmarks.common import Case

# (L, H, F, V): layers, hidden size, MLP width, rows of the embedding table (one row is read per step)
SHAPES = {"real": (16, 2048, 8192, 256), "tiny": (2, 32, 24, 16)}
EPS = 1e-5
REPEATS = 20          # steps timed per rung on a GPU
BF16_INPUTS = True    # the engine's default matmul precision on the GPU
TOLERANCE = 1e-2      # relative error (2-norm) of the final row against the reference


def launches_per_step(layers: int) -> int:
    """Kernels one step launches: the embedding, five per layer, the final norm."""
    return 2 + 5 * layers


# NOTE: in the simulator, a gemv of 8 warps a block over 4 blocks costs about a second (each CUDA thread is a
# Python thread): there every gemv takes one warp per block of 4 rows (256 threads instead of 1,024).
SIM_GEMV = gemv.GemvConfig(1, 4, 1, 1)


def _gemv(x, weight, out, stream, gated=False):
    """The engine's batch-1 matmul: gemv with matmul_policy.gemv_config's pick on a GPU (called directly: in the
    simulator the engine's matmul takes the tiled GEMM instead)."""
    config = SIM_GEMV if SIMULATOR else matmul_policy.gemv_config(1, weight.shape[0], x.shape[1])
    gemv.gemv(x, weight, out, stream, config=config, bf16_inputs=BF16_INPUTS, gated=gated)


class DecodeLikeStep:
    """The buffers and weights of the sequence, and `record(stream)`, which launches it once."""

    def __init__(self, real: bool):
        self.layers, h, f, v = SHAPES["real" if real else "tiny"]
        rng = np.random.default_rng(12)
        scale = np.float32(0.02)
        self.table = f32_to_bf16(rng.standard_normal((v, h), dtype=np.float32))
        self.norms = f32_to_bf16(1 + 0.1 * rng.standard_normal((3, h), dtype=np.float32))  # in, post, final
        self.o = f32_to_bf16(rng.standard_normal((h, h), dtype=np.float32) * scale)
        self.gate_up = f32_to_bf16(rng.standard_normal((2 * f, h), dtype=np.float32) * scale)
        self.down = f32_to_bf16(rng.standard_normal((h, f), dtype=np.float32) * scale)
        self.ids = np.array([int(rng.integers(0, v))], np.int32)
        self.d_ids, self.d_table, self.d_norms = (cuda.to_device(a) for a in (self.ids, self.table, self.norms))
        self.d_norm = [self.d_norms[i] for i in range(3)]   # made once: a slice is a new array object
        # one device copy of the layer's weights per layer: a step reads every layer's bytes from DRAM
        self.d_layers = [tuple(cuda.to_device(w) for w in (self.o, self.gate_up, self.down))
                         for _ in range(self.layers)]
        self.residual, self.h, self.x = (cuda.device_array((1, h), np.float32) for _ in range(3))
        self.act = cuda.device_array((1, f), np.float32)
        self.out = cuda.device_array((1, h), np.float32)
        self._want = None
        self.bytes_moved = float(self.layers * (self.o.nbytes + self.gate_up.nbytes + self.down.nbytes)
                                 + self.norms.nbytes + self.table.nbytes // v)

    def record(self, stream) -> None:
        """Launch the step's kernels on `stream` (the engine's launchers; every buffer preallocated)."""
        embedding.embedding(self.d_ids, self.d_table, self.residual, stream)
        for layer, (o, gate_up, down) in enumerate(self.d_layers):
            if layer == 0:
                rmsnorm.rmsnorm(self.residual, self.d_norm[0], EPS, self.h, stream)
            else:
                rmsnorm.fused_add_rmsnorm(self.x, self.residual, self.d_norm[0], EPS, self.h, stream)
            _gemv(self.h, o, self.x, stream)
            rmsnorm.fused_add_rmsnorm(self.x, self.residual, self.d_norm[1], EPS, self.h, stream)
            _gemv(self.h, gate_up, self.act, stream, gated=True)
            _gemv(self.act, down, self.x, stream)
        rmsnorm.fused_add_rmsnorm(self.x, self.residual, self.d_norm[2], EPS, self.out, stream)

    def reference(self) -> np.ndarray:
        """The same step in NumPy (reference/), the final normed row (1, H); computed once."""
        if self._want is None:
            self._want = self._reference()
        return self._want

    def _reference(self) -> np.ndarray:
        residual = ref_embedding.embedding(self.ids, self.table)
        x = None
        for layer in range(self.layers):
            if layer == 0:
                h = ref_rmsnorm.rmsnorm(residual, self.norms[0], EPS)
            else:
                h, residual = ref_rmsnorm.fused_add_rmsnorm(x, residual, self.norms[0], EPS)
            x = ref_matmul.matmul(h, self.o, BF16_INPUTS)
            h, residual = ref_rmsnorm.fused_add_rmsnorm(x, residual, self.norms[1], EPS)
            act = ref_matmul.gated_matmul(h, self.gate_up, BF16_INPUTS)
            x = ref_matmul.matmul(act, self.down, BF16_INPUTS)
        return ref_rmsnorm.fused_add_rmsnorm(x, residual, self.norms[2], EPS)[0]


@contextlib.contextmanager
def _replaced_submit(submit):
    """launch.submit replaced for the duration (the hook launch.py offers to tools that watch launches)."""
    original = launch.submit
    launch.submit = submit(original)
    try:
        yield
    finally:
        launch.submit = original


def _counting(counter: list):
    def wrap(original):
        def submit(*args):
            counter[0] += 1
            original(*args)
        return submit
    return wrap


def _numba_syntax(original):
    """Every launch through Numba's kernel[grid, block, stream, shared](*args) (the simulator's launch already
    is: there it changes nothing)."""
    if SIMULATOR:
        return original

    def submit(kernel, grid, block, stream, args, shared, dependent):
        if launch._preparing[0]:
            return original(kernel, grid, block, stream, args, shared, dependent)
        arrays = tuple(a.array.view(a.dtype).reshape(a.shape) if isinstance(a, launch.view) else a for a in args)
        kernel[grid, block, stream or 0, shared](*arrays)
    return submit


@contextlib.contextmanager
def _pdl(on: bool):
    """Programmatic dependent launch on or off for the launches made inside (TINYVLLM_PDL, read once and
    cached by launch.pdl_enabled: the cache is cleared on the way in and out)."""
    before = os.environ.get("TINYVLLM_PDL")
    os.environ["TINYVLLM_PDL"] = "1" if on else "0"
    launch.pdl_enabled.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TINYVLLM_PDL", None)
        else:
            os.environ["TINYVLLM_PDL"] = before
        launch.pdl_enabled.cache_clear()


class _Rung:
    """One way of issuing the step: `once()` issues it on the rung's stream, inside `context()`."""

    def __init__(self, seq: DecodeLikeStep, mode: str, first: dict):
        self.seq, self.mode, self.first = seq, mode, first
        self.eager = mode in ("numba", "launch")
        self.stream = 0 if SIMULATOR else cuda.stream()
        self.graph = None

    def context(self) -> contextlib.ExitStack:
        """Numba's launch syntax for 12a; PDL off for the eager rungs (a graph's is set when it is captured)."""
        stack = contextlib.ExitStack()
        if self.mode == "numba":
            stack.enter_context(_replaced_submit(_numba_syntax))
        if self.eager:
            stack.enter_context(_pdl(False))
        return stack

    def once(self) -> None:
        if self.eager or SIMULATOR:   # no graphs in the simulator: the recording function, launched eagerly
            self.seq.record(self.stream)
            return
        if self.graph is None:
            from tinyvllm.cuda_graph import CUDAGraph

            self.seq.record(self.stream)   # every kernel compiled (or loaded) before the capture
            self.stream.synchronize()
            with _pdl(self.mode == "graph+pdl"):
                self.graph = CUDAGraph(self.seq.record, self.stream)
        self.graph.replay()

    def launch(self, stream) -> None:
        with self.context():
            self.once()

    def check(self) -> None:
        counter = [0]
        with self.context(), _replaced_submit(_counting(counter)):
            self.once()
        if self.eager or SIMULATOR:
            expected = launches_per_step(self.seq.layers)
            assert counter[0] == expected, f"{counter[0]} launches, expected {expected}"
        if self.stream:
            self.stream.synchronize()
        got = self.seq.out.copy_to_host()
        want = self.seq.reference()
        error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert error < TOLERANCE, f"relative error {error:.2e} against reference/"
        if "out" in self.first:
            assert np.array_equal(got, self.first["out"]), "not bit for bit the first rung's output"
        else:
            self.first["out"] = got

    def time(self) -> float:
        """Seconds per step: REPEATS steps between two CUDA events on the rung's stream (a GPU only)."""
        with self.context():
            self.once()   # warm: compiled, captured, replayed once
            start, stop = cuda.event(), cuda.event()
            start.record(self.stream)
            for _ in range(REPEATS):
                self.once()
            stop.record(self.stream)
            stop.synchronize()
        return cuda.event_elapsed_time(start, stop) / 1e3 / REPEATS


def launch_steps(real: bool) -> list[Step]:
    seq = DecodeLikeStep(real)
    first: dict = {}
    n = launches_per_step(seq.layers)
    sim = " (simulator: no graph capture, its launches run eagerly)" if SIMULATOR else ""
    rungs = [
        ("12a Numba launch syntax", f"{n} launches from Python, kernel[grid, block, stream](*args)", "numba"),
        ("12b launch.py", "one cuLaunchKernelEx per kernel from a packed buffer, no PDL", "launch"),
        ("12c CUDA graph", "captured once, replayed with one driver call, no PDL" + sim, "graph"),
        ("12d CUDA graph + PDL", "each kernel starts while the one before it ends (sm_90+)" + sim, "graph+pdl"),
    ]
    steps = []
    for version, idea, mode in rungs:
        rung = _Rung(seq, mode, first)
        steps.append(Step(version, idea, Case("launches", version, rung.launch, rung.check,
                                              bytes_moved=seq.bytes_moved), timer=rung.time, launches=n))
    return steps
