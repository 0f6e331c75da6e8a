"""End-to-end benchmark of tinyvllm, with Hugging Face transformers on the same workloads in the same run.

    python3 tools/bench.py latency|throughput|prefill|kernels|all [more workloads] [--sweep B1,B2,...] [options]
    python3 tools/bench.py all --sweep 1,16,64,256 --json out.json --markdown out.md --plot sweep.png
    python3 tools/bench.py --sweep 1,16,64,256          # the sweep alone
    python3 tools/bench.py latency prefill throughput kernels --matmul-precision bf16   # issue 5's five targets
    python3 tools/bench.py all --quick --preset tiny --backend cpu      # a smoke run in seconds

The model is a Llama-3.2-1B-shaped checkpoint with random bf16 weights (tinyvllm.random_model, seed 0,
made in a few seconds in a temporary directory or --model-dir), or any model given with --model. Every
request is greedy with ignore_eos, so each produces exactly the tokens asked for. Workloads:

- latency: batch 1, a 128-token random prompt, 256 new tokens. Decode tokens/s = 255 / (time of the last
  token - time of the first; for the peer, from a streamer that timestamps each token), best of a few runs
  (one for the slow eager peer); also the fraction of the bandwidth roofline: a decode step
  at batch 1 reads every weight once (the tied embedding as the LM head; an untied embedding table only
  one row), so the limit is the copy bandwidth / weight bytes per token. The copy bandwidth is a
  device-to-device copy measured on the GPU at the start of the run (1 GiB, read and write counted), or
  --bandwidth-gbs when given; without a GPU, the H200's 4,250 GB/s of shared GPU.md, said so in the
  output. KV-cache reads (a few MB at this context) are left out.
- throughput: 256 requests (seed 0), random prompt ids in [0, 10000), prompt and output lengths uniform in
  [100, 1024] -> output tokens/s over the wall time of one `LLM.generate`, for the continuous and the
  static scheduler.
- prefill: one 1,024-token prompt, max_tokens=1: time to first token, best of a few runs.
- kernels: issue 5's single-kernel targets, each kernel launched alone as the engine launches it, on the
  model's shapes: the five batch-1 decode GEMVs (QKV with its RoPE + KV-write epilogue, O, gate/up with its
  SiLU*mul epilogue, down, the LM head; the default gemv config, the run's --matmul-precision), each
  weight cold in L2 (every launch reads the next of 256 MiB of weight copies), and decode PagedAttention
  over batch 64 x context 4,096 with the engine's default policy. Each is checked against the NumPy
  reference, then timed as a CUDA graph of 50 launches (tools/kernel_benchmarks/common.py): GB/s of
  weight + x + out, and of K and V read, against 3,500 and 3,000 GB/s (issue 5's targets, set for the H200
  and Llama-3.2-1B). Skipped on the cpu backend, except in Numba's CUDA simulator, where it runs with any
  shapes (the time is then one eager launch of Python threads: a smoke run).
- --sweep B1,B2,...: output tokens/s against batch size. At batch size B, 2*B requests with a 128-token
  prompt and output lengths uniform in [128, 384] (mean 256) run on an engine with max_num_seqs=B, for each
  scheduler: static batching holds a batch until its longest member ends, continuous batching refills the
  freed slots, so the two differ only when lengths vary and requests wait. The peer runs the first B of
  those requests as one static batch (`generate` with max_new_tokens = the longest of them) and is credited
  with the tokens those requests asked for, as static batching is; one batch stands for the rest, which
  keeps the peer's share of the run bounded. The points are plotted (PNG) when matplotlib is importable.

Kernels compile, and decode CUDA graphs are captured, on first use, so every engine is warmed up before
timing: the decode batch passes through every size from max_num_seqs down to 1 at every context-length
octave its jobs will reach (see warm_up). Prefix caching is off, so a repeated prompt is prefilled again.

The peer (when torch and transformers are importable and --no-peer is not given; neither is ever a
tinyvllm dependency) loads the same model directory in bf16 on cuda if available, else the CPU:
latency with `cache_implementation="static"` (generate then compiles the model with torch.compile) and
eager; throughput with `generate_batch` (transformers' continuous batching with a paged cache), which takes
one max_new_tokens for all requests, so each request asks for the mean of the workload's output lengths,
and only the first --peer-requests requests run (both stated in the output); it is timed from the first
request's admission to the last one's end where the results carry those times (generate_batch sets up its
cache and CUDA graphs before admitting requests), else by the wall clock (said in the JSON). Prefill runs
eagerly, logits of the last token only. generate_batch runs last: some transformers versions leave the
model on paged attention after it. A peer measurement that fails is recorded as an error and the run goes
on; a transformers without generate_batch gets a note instead of the throughput row.

GPU memory: tinyvllm and the peer share one GPU, so tinyvllm runs first, each engine in turn taking
--gpu-memory-utilization (default 0.5) of the card and freeing it (its arrays dropped, numba's deferred
deallocations flushed) before the next engine, the kernels workload (about 2 GB at the 1B shapes, freed
the same way) or the peer starts. 0.5 leaves room should a release fall short; the free memory after each
release is logged.

Results go to --json (every number, the configuration, device, date, versions and the command line) and
--markdown (a table ready for BENCHMARKS.md, also printed), both rewritten after every measurement so
that a run cut short keeps what it measured; --plot (default bench_sweep.png) gets the sweep. With the
defaults, `all --sweep 1,16,64,256` with the peer is meant to fit in about 10 minutes on an H200 (kernels:
13 s on an H100, most of it making random weights and checking them; `latency prefill throughput kernels`
with the peer took 223 s there); --quick shrinks every workload for
smoke runs (kernels: batch 2 x context 256 and 1 MiB of weight copies; with --preset tiny about 30 s in the
simulator).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import inspect
import json
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# the repository root: for tools.kernel_benchmarks (the kernels workload), and for tinyvllm when run from a
# source checkout without installing
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WORKLOADS = ("latency", "throughput", "prefill", "kernels")
PEER_WORKLOADS = ("latency", "throughput", "prefill")  # the HF peer has no single kernels to set beside ours
SCHEDULERS = ("continuous", "static")
# Requests per sweep point, in units of the batch size: a second wave is what lets continuous batching refill.
SWEEP_WAVES = 2
# Issue 5's targets for single kernels, in GB/s (set for the H200 and the Llama-3.2-1B shapes)
GEMV_TARGET_GBS = 3500.0        # decode GEMV at batch 1, weight + x + out, every weight cold in L2
ATTENTION_TARGET_GBS = 3000.0   # decode PagedAttention at batch 64 x context 4,096, K and V read
H200_COPY_GBS = 4250.0          # the roofline's bandwidth where no GPU can measure it (shared GPU.md)


@dataclass(frozen=True)
class Sizes:
    """The shape of every workload (lengths in tokens; ranges inclusive)."""

    latency_prompt: int = 128
    latency_new: int = 256
    num_requests: int = 256
    prompt_lens: tuple[int, int] = (100, 1024)
    output_lens: tuple[int, int] = (100, 1024)
    token_high: int = 10000          # prompt ids are drawn from [0, min(token_high, vocab size))
    prefill_prompt: int = 1024
    sweep_prompt: int = 128
    sweep_output_lens: tuple[int, int] = (128, 384)
    runs: int = 3                    # timed runs of latency and prefill (best kept); HF eager latency runs once
    attention_batch: int = 64        # kernels: decode PagedAttention's sequences
    attention_context: int = 4096    # and their cached tokens (at most the model's max_position_embeddings)
    # kernels: the weight copies each GEMV cycles through, so that every launch reads its weight cold from DRAM
    # (tools/kernel_benchmarks/matmul.py's COLD_BYTES: 5x the H200's 50 MB L2)
    cold_bytes: int = 256 << 20

    def max_context(self, job: str) -> int:
        """The longest prompt + output a job's requests reach."""
        return {"latency": self.latency_prompt + self.latency_new, "prefill": self.prefill_prompt + 1,
                "throughput": self.prompt_lens[1] + self.output_lens[1],
                "sweep": self.sweep_prompt + self.sweep_output_lens[1]}[job]


QUICK = Sizes(latency_prompt=32, latency_new=32, num_requests=16, prompt_lens=(16, 128), output_lens=(16, 64),
              prefill_prompt=256, sweep_prompt=32, sweep_output_lens=(16, 48), runs=2, attention_batch=2,
              attention_context=256, cold_bytes=1 << 20)


@dataclass
class BenchConfig:
    workloads: list[str]
    sizes: Sizes = Sizes()
    model: Path | None = None            # an existing model directory; None: make a random one
    preset: str = "llama-3.2-1b"
    model_dir: Path | None = None        # where to make it (None: a temporary directory)
    backend: str = "auto"
    schedulers: list[str] = field(default_factory=lambda: list(SCHEDULERS))
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.5
    matmul_precision: str = "fp32"       # tinyvllm's matmul inputs: fp32 (exact) or bf16 (as the peer's)
    bandwidth_gbs: float | None = None   # the roofline's copy bandwidth; None: measured on the GPU
    peer: bool = True
    peer_requests: int = 64
    sweep: list[int] = field(default_factory=list)
    seed: int = 0
    command: str = ""


_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[bench {time.perf_counter() - _START:7.1f} s] {message}", file=sys.stderr, flush=True)


# -- workloads -------------------------------------------------------------------------------------------

def random_prompt(rng: np.random.Generator, length: int, high: int) -> list[int]:
    return rng.integers(0, high, length).tolist()


def random_requests(rng: np.random.Generator, n: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                    high: int) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs, lengths uniform in the inclusive ranges."""
    plens = rng.integers(prompt_lens[0], prompt_lens[1] + 1, n)
    olens = rng.integers(output_lens[0], output_lens[1] + 1, n)
    return [(random_prompt(rng, int(p), high), int(o)) for p, o in zip(plens, olens)]


def sweep_requests(sizes: Sizes, batch: int, seed: int, high: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng([seed, 3, batch])
    lens = (sizes.sweep_prompt, sizes.sweep_prompt)
    return random_requests(rng, SWEEP_WAVES * batch, lens, sizes.sweep_output_lens, high)


def weight_bytes_per_token(config) -> int:
    """Bytes of bf16 weights one batch-1 decode step reads: all of them, less an untied embedding table."""
    from tinyvllm.weights import expected_shapes

    shapes = expected_shapes(config)
    if not config.tie_word_embeddings:
        del shapes["model.embed_tokens.weight"]  # only the looked-up row is read
    return 2 * sum(int(np.prod(s)) for s in shapes.values())


# -- tinyvllm ----------------------------------------------------------------------------------------------

def greedy(max_tokens: int):
    from tinyvllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class TinyEngine:
    """One tinyvllm LLM (one scheduler, one max_num_seqs); close() gives its device memory back."""

    def __init__(self, cfg: BenchConfig, model_dir: Path, scheduler: str, max_num_seqs: int):
        from tinyvllm import LLM

        self.llm = LLM(model_dir, backend=cfg.backend, scheduler=scheduler, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=cfg.max_num_batched_tokens,
                       gpu_memory_utilization=cfg.gpu_memory_utilization, enable_prefix_caching=False,
                       matmul_precision=cfg.matmul_precision)
        self.backend = self.llm.engine.runner.name

    def close(self) -> str:
        """Drop the engine and free its device memory; returns a line on the device memory left free."""
        self.llm = None
        return free_device_memory(self.backend)


def free_device_memory(backend: str) -> str:
    """Collect what the caller dropped and flush numba's deferred frees; returns a line on the memory left free."""
    gc.collect()
    if backend != "cuda":
        return "host memory released"
    from cuda_kernels.compat import SIMULATOR
    from numba import cuda

    if SIMULATOR:  # no device memory, and no deferred frees
        return "simulated device memory released"
    context = cuda.current_context()
    context.deallocations.clear()
    free, total = context.get_memory_info()
    return f"GPU memory free after release: {free / 2**30:.1f} of {total / 2**30:.1f} GiB"


def warm_up(llm, rng: np.random.Generator, num_seqs: int, max_context: int, high: int) -> float:
    """Compile every kernel and meet every decode shape the timed runs will; returns the seconds it took.

    The CUDA engine captures a decode step as a CUDA graph the first time its (batch size, context length)
    bucket occurs. So for each context-length octave from max_context down, a "pacer" request whose context
    ends near that length runs beside num_seqs - 1 short ones with output lengths 2, 3, ...: the decode
    batch shrinks through every size from num_seqs to 1 while the pacer sets the context length.
    """
    start = time.perf_counter()
    context = max_context
    while True:
        prompts = [random_prompt(rng, max(context - num_seqs, 1), high)]
        prompts += [random_prompt(rng, int(n), high) for n in rng.integers(8, 65, num_seqs - 1)]
        # after the prefill, num_seqs decode steps: all of them, then one fewer each step, the pacer last alone
        llm.generate(prompts, [greedy(num_seqs + 1)] + [greedy(i + 2) for i in range(num_seqs - 1)], use_tqdm=False)
        if context <= 64:
            return time.perf_counter() - start
        context //= 2


def tv_latency(llm, prompt: list[int], new_tokens: int, runs: int) -> dict:
    rates, ttfts = [], []
    for _ in range(runs):
        out = llm.generate([prompt], [greedy(new_tokens)], use_tqdm=False)[0]
        n, m = len(out.outputs[0].token_ids), out.metrics
        rates.append((n - 1) / (m["last_token_time"] - m["first_token_time"]))
        ttfts.append((m["first_token_time"] - m["arrival_time"]) * 1e3)
    return {"prompt_tokens": len(prompt), "new_tokens": n, "decode_tok_s": max(rates), "runs_decode_tok_s": rates,
            "ttft_ms_of_best": ttfts[int(np.argmax(rates))]}


def tv_prefill(llm, prompt: list[int], runs: int) -> dict:
    """TTFT of `prompt`, best of `runs` after one untimed prefill of it: the tile policies pick kernels by the
    number of tokens, so warm_up's prompts, of other lengths, may not have compiled this one's."""
    llm.generate([prompt], [greedy(1)], use_tqdm=False)
    ttfts = []
    for _ in range(runs):
        out = llm.generate([prompt], [greedy(1)], use_tqdm=False)[0]
        ttfts.append((out.metrics["first_token_time"] - out.metrics["arrival_time"]) * 1e3)
    return {"prompt_tokens": len(prompt), "new_tokens": len(out.outputs[0].token_ids), "ttft_ms": min(ttfts),
            "runs_ttft_ms": ttfts}


def tv_batch(llm, requests: list[tuple[list[int], int]]) -> dict:
    """All requests through one generate(); output tokens/s over its wall time."""
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], [greedy(n) for _, n in requests], use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p, _ in requests)
    return {"requests": len(requests), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "requested_output_tokens": sum(n for _, n in requests), "elapsed_s": elapsed,
            "output_tok_s": output_tokens / elapsed, "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
            "preemptions": sum(o.metrics["preemptions"] for o in outs)}


def engine_plan(cfg: BenchConfig) -> list[tuple[tuple[str, int], list[tuple[str, int | None]]]]:
    """Which jobs run on which engine (scheduler, max_num_seqs), so that each engine is built once.

    Latency and prefill run at batch 1, where the schedulers do the same thing: on the first scheduler only.
    """
    plan: dict[tuple[str, int], list[tuple[str, int | None]]] = {}
    for i, scheduler in enumerate(cfg.schedulers):
        jobs = plan.setdefault((scheduler, cfg.max_num_seqs), [])
        jobs += [(w, None) for w in ("latency", "prefill") if i == 0 and w in cfg.workloads]
        if "throughput" in cfg.workloads:
            jobs.append(("throughput", None))
    for batch in cfg.sweep:
        for scheduler in cfg.schedulers:
            plan.setdefault((scheduler, batch), []).append(("sweep", batch))
    return [(key, jobs) for key, jobs in plan.items() if jobs]


def run_tinyvllm(cfg: BenchConfig, model_dir: Path, vocab: int, results: dict, emit) -> None:
    for (scheduler, num_seqs), jobs in engine_plan(cfg):
        record(results, f"tinyvllm {scheduler} engine (max_num_seqs {num_seqs})",
               lambda: run_engine(cfg, model_dir, vocab, scheduler, num_seqs, jobs, results, emit))


def run_engine(cfg, model_dir, vocab, scheduler, num_seqs, jobs, results, emit) -> str:
    """Build one engine, warm it up, run its jobs, and free it."""
    high, ours = min(cfg.sizes.token_high, vocab), results["tinyvllm"]
    max_context = max(cfg.sizes.max_context(job) for job, _ in jobs)
    engine = TinyEngine(cfg, model_dir, scheduler, num_seqs)
    try:
        ours["backend"] = engine.backend
        seconds = warm_up(engine.llm, np.random.default_rng([cfg.seed, 9]), num_seqs, max_context, high)
        ours.setdefault("warmup_s", {})[f"{scheduler}/{num_seqs}"] = seconds
        log(f"tinyvllm: {scheduler} engine (max_num_seqs {num_seqs}, {engine.backend}) warmed up in {seconds:.1f} s")
        for job, batch in jobs:
            record(results, f"tinyvllm {job} {scheduler}" + (f" batch {batch}" if batch else ""),
                   lambda: tinyvllm_job(cfg, engine.llm, job, scheduler, batch, high, ours))
            emit(results)
    finally:
        released = engine.close()
    return f"done; {released}"


def tinyvllm_job(cfg, llm, job, scheduler, batch, high, ours) -> str:
    s = cfg.sizes
    if job == "latency":
        prompt = random_prompt(np.random.default_rng([cfg.seed, 1]), s.latency_prompt, high)
        r = ours["latency"] = tv_latency(llm, prompt, s.latency_new, s.runs)
        r["roofline_fraction"] = r["decode_tok_s"] / ours["roofline_tok_s"]
        return f"{r['decode_tok_s']:.1f} decode tok/s ({r['roofline_fraction']:.0%} of the roofline)"
    if job == "prefill":
        prompt = random_prompt(np.random.default_rng([cfg.seed, 2]), s.prefill_prompt, high)
        r = ours["prefill"] = tv_prefill(llm, prompt, s.runs)
        return f"TTFT {r['ttft_ms']:.2f} ms"
    if job == "throughput":
        requests = random_requests(np.random.default_rng(cfg.seed), s.num_requests, s.prompt_lens,
                                   s.output_lens, high)
        r = ours.setdefault("throughput", {})[scheduler] = tv_batch(llm, requests)
        return f"{r['output_tok_s']:.0f} output tok/s"
    r = ours.setdefault("sweep", {}).setdefault(scheduler, {})[str(batch)] = tv_batch(
        llm, sweep_requests(s, batch, cfg.seed, high))
    return f"{r['output_tok_s']:.0f} output tok/s"


def record(results: dict, name: str, job) -> None:
    """Run one measurement; a failure is logged with its traceback and recorded, and the run goes on."""
    try:
        log(f"{name}: {job()}")
    except Exception as exc:  # one failed measurement must not cost the others in a single device call
        traceback.print_exc()
        results["errors"].append({"job": name, "error": f"{type(exc).__name__}: {exc}"})
        log(f"{name}: FAILED ({type(exc).__name__}: {exc})")


# -- tinyvllm's kernels, one at a time -----------------------------------------------------------------------

def kernels_unavailable(backend: str) -> str | None:
    """Why the kernels workload cannot run here, or None. It times the CUDA engine's kernels: on a GPU, or in
    Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) on any backend, slowly (a smoke run of the plumbing)."""
    from cuda_kernels import compat
    from tinyvllm.runners import choose_backend

    if compat.SIMULATOR or choose_backend(backend) == "cuda":
        return None
    return f"kernels not measured: the cpu backend (--backend {backend}) has no GPU kernels to time"


def kernel_cases(cfg: BenchConfig, config) -> list[tuple[float, object]]:
    """(target GB/s, tools.kernel_benchmarks.common.Case) for each kernel of the workload, on the model's shapes."""
    from tinyvllm.engine import EngineOptions
    from tools.kernel_benchmarks import attention, matmul

    s, block = cfg.sizes, EngineOptions.block_size   # the block size TinyEngine's engines get: the default
    gemvs = matmul.engine_decode_cases(config, cfg.matmul_precision == "bf16", s.cold_bytes, block)
    heads = (config.num_heads, config.num_kv_heads, config.head_dim)
    context = min(s.attention_context, config.max_position_embeddings)
    attn = attention.engine_decode_case(s.attention_batch, context, heads, block)
    return [(GEMV_TARGET_GBS, case) for case in gemvs] + [(ATTENTION_TARGET_GBS, attn)]


def kernel_row(case, target_gbs: float, seconds: float | str) -> dict:
    """A case's record: what ran, and its time and GB/s against the target, or why its check failed."""
    row = {"name": case.name, "shape": case.shape, "config": case.config, "bytes": case.bytes_moved,
           "target_gb_s": target_gbs}
    if isinstance(seconds, str):  # checked_time's report of a failed check (or launch)
        return {**row, "check": seconds}
    gb_s = case.bytes_moved / seconds / 1e9
    return {**row, "check": "passed", "time_us": seconds * 1e6, "gb_s": gb_s, "met": gb_s >= target_gbs}


def run_kernels(cfg: BenchConfig, config, results: dict, emit) -> str:
    """The kernels workload, or the reason it is skipped; its device arrays are freed before the peer starts."""
    ours = results["tinyvllm"]
    reason = kernels_unavailable(cfg.backend)
    if reason is not None:
        ours["kernels"] = {"skipped": reason}
        return reason
    from cuda_kernels.compat import SIMULATOR
    from tinyvllm.device import gpu_status

    if SIMULATOR:
        # Simulated CUDA threads are Python threads: switching between them more often makes their barriers
        # much cheaper (as tests/conftest.py does).
        sys.setswitchinterval(5e-4)
    ours.setdefault("backend", "cuda")  # when no engine ran before
    ours["kernels"] = {"device": gpu_status()[1], "cold_bytes": cfg.sizes.cold_bytes, "cases": []}
    time_kernels(cfg, config, results, emit)
    # the cases, whose closures hold every device array they use, went with time_kernels' frame
    rows = ours["kernels"]["cases"]
    return f"{sum('time_us' in row for row in rows)} of {len(rows)} kernels timed; {free_device_memory('cuda')}"


def time_kernels(cfg: BenchConfig, config, results: dict, emit) -> None:
    """Each case checked against reference/, then timed (tools/kernel_benchmarks/common.checked_time), into
    results["tinyvllm"]["kernels"]["cases"]; a failed check is a recorded error."""
    from tools.kernel_benchmarks.common import checked_time

    rows = results["tinyvllm"]["kernels"]["cases"]
    for target, case in kernel_cases(cfg, config):
        row = kernel_row(case, target, checked_time(case))
        rows.append(row)
        if "time_us" in row:
            log(f"kernels: {row['name']}: {row['time_us']:,.1f} us, {row['gb_s']:,.0f} GB/s "
                f"({row['gb_s'] / target:.0%} of the {target:,.0f} target)")
        else:
            results["errors"].append({"job": f"tinyvllm kernels: {row['name']}", "error": row["check"]})
            log(f"kernels: {row['name']}: {row['check']}")
        emit(results)


# -- the peer: Hugging Face transformers ---------------------------------------------------------------------

def peer_unavailable() -> str | None:
    """Why the HF peer cannot run here, or None when torch and transformers import."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"HF transformers peer not measured: torch and transformers are not importable here ({exc})"
    return None


class _TokenClock:
    """A generate() streamer that timestamps each new token (the first put() is the prompt)."""

    def __init__(self, sync):
        self.sync = sync
        self.times: list[float] = []

    def put(self, value) -> None:
        self.sync()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFPeer:
    """HF transformers on the same model directory, bf16, on cuda when available."""

    def __init__(self, model_dir: Path):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.version = transformers.__version__
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(self.device).eval()

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def _ids(self, prompts: list[list[int]]):
        return self.torch.tensor(prompts, device=self.device)

    def _generate(self, ids, new_tokens: int, **kwargs):
        with self.torch.inference_mode():
            return self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)

    def latency(self, prompt: list[int], new_tokens: int, runs: int, static: bool) -> dict:
        """Decode tokens/s from per-token timestamps; the static cache is compiled on the warm-up runs."""
        ids = self._ids([prompt])
        extra = {"cache_implementation": "static"} if static else {}
        for _ in range(2 if static else 1):  # static: the first run compiles; CUDA graphs are recorded after
            self._generate(ids, new_tokens if static else 8, **extra)
        rates = []
        for _ in range(runs):
            clock = _TokenClock(self.sync)
            out = self._generate(ids, new_tokens, streamer=clock, **extra)
            tokens = clock.times[1:]
            rates.append((len(tokens) - 1) / (tokens[-1] - tokens[0]))
        return {"mode": "static cache + torch.compile" if static else "eager", "prompt_tokens": len(prompt),
                "new_tokens": out.shape[1] - len(prompt), "decode_tok_s": max(rates), "runs_decode_tok_s": rates}

    def prefill(self, prompt: list[int], runs: int) -> dict:
        ids = self._ids([prompt])
        times = []
        with self.torch.inference_mode():
            for i in range(2 + runs):
                self.sync()
                start = time.perf_counter()
                self.model(ids, logits_to_keep=1)
                self.sync()
                if i >= 2:  # two warm-up passes
                    times.append((time.perf_counter() - start) * 1e3)
        return {"mode": "eager, last-token logits", "prompt_tokens": len(prompt), "ttft_ms": min(times),
                "runs_ttft_ms": times}

    def static_batch(self, requests: list[tuple[list[int], int]]) -> dict:
        """One static batch (equal prompt lengths) run to its longest member; credited with the asked tokens."""
        ids = self._ids([p for p, _ in requests])
        longest, asked = max(n for _, n in requests), sum(n for _, n in requests)
        self._generate(ids, 4)
        self.sync()
        start = time.perf_counter()
        out = self._generate(ids, longest)
        self.sync()
        elapsed = time.perf_counter() - start
        return {"mode": "eager generate, one static batch", "batch": len(requests), "new_tokens": longest,
                "generated_tokens": int(out.shape[0] * (out.shape[1] - ids.shape[1])),
                "output_tokens": asked, "elapsed_s": elapsed, "output_tok_s": asked / elapsed}

    def continuous_batch(self, prompts: list[list[int]], new_tokens: int) -> dict:
        """generate_batch (continuous batching); time from the first request's arrival to the last one's end.

        Its signature changed across 5.x (progress_bar defaulted to True, warmup appeared later): only the
        arguments every version takes are passed, and progress_bar where it exists.
        """
        from transformers import GenerationConfig

        quiet = "progress_bar" in inspect.signature(self.model.generate_batch).parameters
        options = {"progress_bar": False} if quiet else {}

        def run(batch, n):
            # NOTE: not under inference_mode: generate_batch serves from a background thread, where the mode
            # (thread-local) is off, and transformers 5.17 then fails on the inference tensors this thread made
            # ("Inplace update to inference tensor outside InferenceMode"); it disables gradients itself.
            config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
            return list(self.model.generate_batch(batch, generation_config=config, **options).values())

        run(prompts[:8], 16)
        start = time.perf_counter()
        outs = run(prompts, new_tokens)
        wall = time.perf_counter() - start
        # generate_batch sets up its cache (and captures CUDA graphs) before it admits requests: where the
        # results carry their admission and end times, time the serving only.
        stamped = all(getattr(o, "created_time", -1) > 0 and getattr(o, "lifespan", (-1, -1))[1] > 0 for o in outs)
        elapsed = max(o.lifespan[1] for o in outs) - min(o.created_time for o in outs) if stamped else wall
        output_tokens = sum(len(o.generated_tokens) for o in outs)
        if output_tokens == 0:
            raise RuntimeError(f"generate_batch returned no tokens for {len(prompts)} requests (their errors are in "
                               "transformers' log above)")
        return {"mode": "generate_batch (continuous batching, paged cache)", "requests": len(prompts),
                "finished_requests": len(outs), "new_tokens_each": new_tokens,
                "prompt_tokens": sum(map(len, prompts)), "output_tokens": output_tokens,
                "requested_output_tokens": new_tokens * len(prompts), "elapsed_s": elapsed, "wall_s": wall,
                "timed_by": "request timestamps (setup excluded)" if stamped else "wall clock (includes setup)",
                "output_tok_s": output_tokens / elapsed}


def run_peer(cfg: BenchConfig, model_dir: Path, vocab: int, results: dict, emit) -> str:
    """The requested workloads through HF transformers, on the same prompts (same seeds) as tinyvllm's."""
    reason = peer_unavailable()
    if reason is not None:
        results["peer"] = {"skipped": reason}
        return reason
    s, high = cfg.sizes, min(cfg.sizes.token_high, vocab)
    log("HF transformers: loading the model")
    peer = HFPeer(model_dir)
    theirs = results["peer"] = {"name": "HF transformers", "version": peer.version, "device": peer.device}
    if peer.device == "cuda":
        theirs["gpu"] = peer.torch.cuda.get_device_name()

    def latency(static):
        prompt = random_prompt(np.random.default_rng([cfg.seed, 1]), s.latency_prompt, high)
        r = peer.latency(prompt, s.latency_new, s.runs if static else 1, static)
        r["roofline_fraction"] = r["decode_tok_s"] / results["tinyvllm"]["roofline_tok_s"]
        theirs.setdefault("latency", {})["static" if static else "eager"] = r
        return f"{r['decode_tok_s']:.1f} decode tok/s ({r['mode']})"

    def prefill():
        r = theirs["prefill"] = peer.prefill(
            random_prompt(np.random.default_rng([cfg.seed, 2]), s.prefill_prompt, high), s.runs)
        return f"TTFT {r['ttft_ms']:.2f} ms"

    def throughput():
        if not hasattr(peer.model, "generate_batch"):
            note = f"transformers {peer.version} has no generate_batch: throughput peer not measured"
            theirs.setdefault("notes", []).append(note)
            return note
        requests = random_requests(np.random.default_rng(cfg.seed), s.num_requests, s.prompt_lens,
                                   s.output_lens, high)[:cfg.peer_requests]
        new_tokens = round(float(np.mean([n for _, n in requests])))
        r = theirs["throughput"] = peer.continuous_batch([p for p, _ in requests], new_tokens)
        r["subsample"] = (f"the first {len(requests)} of {s.num_requests} requests, {new_tokens} new tokens each "
                          "(the mean of their output lengths: generate_batch takes one max_new_tokens)")
        r["subsample_short"] = f"{len(requests)} of {s.num_requests} requests, {new_tokens} new each"
        return f"{r['output_tok_s']:.0f} output tok/s ({r['subsample']}; timed by {r['timed_by']})"

    def sweep(batch):
        r = theirs.setdefault("sweep", {})[str(batch)] = peer.static_batch(
            sweep_requests(s, batch, cfg.seed, high)[:batch])
        return f"{r['output_tok_s']:.0f} output tok/s"

    jobs = []
    if "latency" in cfg.workloads:
        jobs += [("latency static", lambda: latency(True)), ("latency eager", lambda: latency(False))]
    if "prefill" in cfg.workloads:
        jobs.append(("prefill", prefill))
    jobs += [(f"sweep {b}", lambda b=b: sweep(b)) for b in cfg.sweep]
    if "throughput" in cfg.workloads:  # last: some transformers versions leave the model on paged attention
        jobs.append(("throughput", throughput))
    for name, job in jobs:
        record(results, f"HF {name}", job)
        emit(results)
    return "done"


# -- the run -------------------------------------------------------------------------------------------------

def versions() -> dict:
    import tinyvllm

    found = {"python": platform.python_version(), "tinyvllm": tinyvllm.__version__}
    for package in ("numpy", "numba", "numba-cuda", "torch", "transformers", "matplotlib"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
        ok = commit.returncode == 0 and dirty.returncode == 0
        found["git_commit"] = (commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")) if ok else None
    except (OSError, subprocess.SubprocessError):
        found["git_commit"] = None
    return found


def device_name(backend: str | None) -> str:
    if backend == "cuda":
        from tinyvllm.device import gpu_status

        return gpu_status()[1]
    return f"CPU ({platform.processor() or platform.machine()})"


def roofline_bandwidth(cfg: BenchConfig) -> tuple[float, str]:
    """(GB/s, where it comes from) for the batch-1 roofline: --bandwidth-gbs, else a device-to-device copy
    measured now on the GPU the engine will use, else (no GPU) the H200's copy rate from shared GPU.md."""
    if cfg.bandwidth_gbs is not None:
        return cfg.bandwidth_gbs, "given with --bandwidth-gbs"
    from cuda_kernels.compat import SIMULATOR
    from tinyvllm.runners import choose_backend

    if SIMULATOR or choose_backend(cfg.backend) != "cuda":
        return H200_COPY_GBS, "not measured (no GPU here): the H200's device copy in GPU.md"
    from tools.kernel_benchmarks.common import copy_bandwidth_gbs

    try:
        gbs = copy_bandwidth_gbs()
    except Exception as exc:  # a yardstick that failed must not cost the measurements
        traceback.print_exc()
        return H200_COPY_GBS, f"the copy failed ({type(exc).__name__}: {exc}): the H200's device copy in GPU.md"
    finally:
        log(f"copy buffers dropped; {free_device_memory('cuda')}")
    return gbs, "a device-to-device copy measured in this run"


def run_bench(cfg: BenchConfig, emit=lambda results: None) -> dict:
    """Every requested measurement; `emit(results)` is called after each one (to save partial results)."""
    from tinyvllm.config import ModelConfig

    started = time.perf_counter()
    now = datetime.datetime.now(datetime.timezone.utc)
    results = {"command": cfg.command, "date": now.isoformat(timespec="seconds"),
               "config": {**dataclasses.asdict(cfg), "model": str(cfg.model) if cfg.model else None,
                          "model_dir": str(cfg.model_dir) if cfg.model_dir else None},
               "versions": versions(), "errors": [], "tinyvllm": {}}
    if cfg.model is not None:
        model_dir, model = cfg.model, {"dir": str(cfg.model), "made": False}
    else:
        from tinyvllm.random_model import llama32_tokenizer_path, make_random_model

        model_dir = cfg.model_dir
        tokenizer = llama32_tokenizer_path() if cfg.preset == "llama-3.2-1b" else None
        start = time.perf_counter()
        make_random_model(model_dir, cfg.preset, seed=0, tokenizer_json=tokenizer)
        model = {"dir": str(model_dir), "made": True, "preset": cfg.preset, "seed": 0,
                 "made_in_s": time.perf_counter() - start}
        log(f"made the random {cfg.preset} model in {model['made_in_s']:.1f} s")
    config = ModelConfig.from_dir(model_dir)
    model["weight_bytes_per_token"] = weight_bytes_per_token(config)
    results["model"] = model
    if "latency" in cfg.workloads:  # the roofline is latency's yardstick, and the peer's
        gbs, source = roofline_bandwidth(cfg)
        log(f"roofline bandwidth: {gbs:,.0f} GB/s, {source}")
        results["tinyvllm"].update(bandwidth_gbs=gbs, bandwidth_source=source,
                                   roofline_tok_s=gbs * 1e9 / model["weight_bytes_per_token"])
    run_tinyvllm(cfg, model_dir, config.vocab_size, results, emit)
    if "kernels" in cfg.workloads:  # after the engines, before the peer: one user of the GPU at a time
        record(results, "tinyvllm kernels", lambda: run_kernels(cfg, config, results, emit))
    results["device"] = device_name(results["tinyvllm"].get("backend"))
    if not cfg.peer:
        results["peer"] = {"skipped": "HF transformers peer not measured: --no-peer"}
    elif not cfg.sweep and not set(cfg.workloads) & set(PEER_WORKLOADS):
        results["peer"] = {"skipped": "HF transformers peer not measured: it has no single kernels to time"}
    else:
        record(results, "HF transformers", lambda: run_peer(cfg, model_dir, config.vocab_size, results, emit))
    results["wall_s"] = time.perf_counter() - started
    emit(results)
    return results


# -- reporting ---------------------------------------------------------------------------------------------

def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _shortfall(r: dict) -> str:
    """A warning for a run that produced fewer tokens than it asked for (failed or cut-short requests)."""
    missing = r["requested_output_tokens"] - r["output_tokens"]
    return f"; {missing:,} tokens MISSING" if missing else ""


def _get(d: dict, *keys):
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def markdown(results: dict) -> str:
    """A section ready for BENCHMARKS.md: context lines, the main table, the sweep table."""
    cfg, ours, theirs = results["config"], results["tinyvllm"], results.get("peer", {})
    s, v, model = cfg["sizes"], results["versions"], results["model"]
    what = f"random {model['preset']} model (seed {model['seed']})" if model["made"] else f"model {model['dir']}"
    lines = [
        f"{what}, bf16, greedy, ignore_eos; tinyvllm {ours.get('backend', '?')} backend "
        f"(matmul precision {cfg.get('matmul_precision', 'fp32')}) on "
        f"{results.get('device', '?')}; {results['date'][:10]}; tinyvllm {v['tinyvllm']} "
        f"(commit {v['git_commit']}), numba {v['numba']}, numba-cuda {v['numba-cuda']}, numpy {v['numpy']}.",
        f"Command: `{results['command']}`",
    ]
    rows = []  # workload, metric, tinyvllm, peer, tinyvllm speedup

    def speedup(mine, peer, lower_is_better=False):
        if mine is None or peer is None:
            return ""
        return f"{(peer / mine if lower_is_better else mine / peer):.2f}x"

    lat, peer_lat = ours.get("latency"), theirs.get("latency", {})
    if lat or peer_lat:
        mine = lat and lat["decode_tok_s"]
        cell = f"{_rate(mine)} ({lat['roofline_fraction']:.0%} of roofline)" if lat else "-"
        for peer in [peer_lat[m] for m in ("static", "eager") if m in peer_lat] or [None]:
            rows.append([f"latency: batch 1, prompt {s['latency_prompt']}, {s['latency_new']} new", "decode tok/s",
                         cell, f"{_rate(peer['decode_tok_s'])} ({peer['mode']})" if peer else "-",
                         speedup(mine, peer and peer["decode_tok_s"])])
    tp, peer_tp = ours.get("throughput", {}), theirs.get("throughput")
    if tp or peer_tp:
        for i, scheduler in enumerate(cfg["schedulers"]):
            mine = tp[scheduler]["output_tok_s"] if scheduler in tp else None
            peer = peer_tp["output_tok_s"] if peer_tp and i == 0 else None  # continuous batching: the first row
            rows.append([f"throughput: {s['num_requests']} requests, prompts {s['prompt_lens'][0]}-"
                         f"{s['prompt_lens'][1]}, outputs {s['output_lens'][0]}-{s['output_lens'][1]}",
                         f"output tok/s, {scheduler}", _rate(mine) + _shortfall(tp[scheduler]) if mine else "-",
                         f"{_rate(peer)} (generate_batch, {peer_tp['subsample_short']}{_shortfall(peer_tp)})"
                         if peer else "", speedup(mine, peer)])
    pre, peer_pre = ours.get("prefill"), theirs.get("prefill")
    if pre or peer_pre:
        mine, peer = pre and pre["ttft_ms"], peer_pre and peer_pre["ttft_ms"]
        rows.append([f"prefill: {s['prefill_prompt']}-token prompt", "time to first token (ms)",
                     f"{mine:.2f}" if mine else "-", f"{peer:.2f} ({peer_pre['mode']})" if peer else "-",
                     speedup(mine, peer, lower_is_better=True)])
    if rows:
        peer_name = (f"HF transformers {theirs['version']} ({theirs['device']}, torch {v['torch']})"
                     if "version" in theirs else "HF transformers")
        lines += ["", f"| workload | metric | tinyvllm | {peer_name} | tinyvllm speedup |",
                  "| --- | --- | ---: | ---: | ---: |"]
        for above, row in zip([None] + rows, rows):  # a workload, metric or value repeated from above is blank
            lines.append("| " + " | ".join("" if above and j < 3 and c == above[j] else c
                                           for j, c in enumerate(row)) + " |")
    if lat:
        lines += ["", f"Roofline: {_bytes(model['weight_bytes_per_token'])} of weights per token at "
                  f"{ours['bandwidth_gbs']:,.0f} GB/s ({ours['bandwidth_source']}) = "
                  f"{ours['roofline_tok_s']:,.0f} tok/s at batch 1."]
    notes = [theirs["skipped"]] if "skipped" in theirs else theirs.get("notes", [])
    if notes:
        lines += [""] + [f"{note}." for note in notes]
    if cfg["sweep"]:
        lines += ["", f"Output tokens/s against batch size: at batch size B, {SWEEP_WAVES}*B requests, prompt "
                  f"{s['sweep_prompt']}, outputs uniform in {s['sweep_output_lens'][0]}-{s['sweep_output_lens'][1]},"
                  " tinyvllm max_num_seqs=B; HF: the first B requests as one static batch run to its longest.", "",
                  "| batch size | " + " | ".join(f"tinyvllm {sc}" for sc in cfg["schedulers"]) + " | HF static batch |",
                  "| ---: |" + " ---: |" * (len(cfg["schedulers"]) + 1)]
        for b in cfg["sweep"]:
            cells = [_get(ours, "sweep", sc, str(b), "output_tok_s") for sc in cfg["schedulers"]]
            cells.append(_get(theirs, "sweep", str(b), "output_tok_s"))
            lines.append(f"| {b} | " + " | ".join(_rate(c) if c else "-" for c in cells) + " |")
    lines += kernels_markdown(results)
    lines += [f"\nFAILED: {e['job']}: {e['error']}" for e in results["errors"]]
    return "\n".join(lines) + "\n"


def kernels_markdown(results: dict) -> list[str]:
    """The kernels workload's table (its lines, each after a blank one), or the reason it was skipped."""
    kernels = results["tinyvllm"].get("kernels")
    if not kernels:
        return []
    if "skipped" in kernels:
        return ["", f"{kernels['skipped']}."]
    lines = ["", f"Single kernels as the engine launches them, on {kernels['device']}, matmul precision "
             f"{results['config']['matmul_precision']}; each checked against reference/ before it was timed. "
             f"GEMV: batch 1, the weight cold in L2 ({_bytes(kernels['cold_bytes'])} of weight copies cycled "
             "through), GB/s = (weight + x + out) / time; PagedAttention: GB/s = K and V read / time. Targets: "
             "issue 5's, for the H200 and Llama-3.2-1B shapes.", "",
             "| kernel | shape | call: kernel (config) | time (us) | GB/s | target GB/s | status |",
             "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for row in kernels["cases"]:
        if "time_us" in row:
            status = f"{'met' if row['met'] else 'not met'} ({row['gb_s'] / row['target_gb_s']:.0%})"
            cells = [f"{row['time_us']:,.1f}", f"{row['gb_s']:,.0f}", f"{row['target_gb_s']:,.0f}", status]
        else:
            cells = [row["check"], "", f"{row['target_gb_s']:,.0f}", "not measured"]
        lines.append("| " + " | ".join([row["name"], row["shape"], row["config"], *cells]) + " |")
    return lines


def plot_sweep(results: dict, path: Path) -> str:
    """Output tokens/s against batch size, one line per scheduler and one for the peer; returns what it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: no plot"
    schedulers = results["config"]["schedulers"]
    series = [(f"tinyvllm {sc}", _get(results, "tinyvllm", "sweep", sc) or {}) for sc in schedulers]
    series.append(("HF transformers, static batch", _get(results, "peer", "sweep") or {}))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for label, points in series:
        xs = sorted(int(b) for b in points)
        if xs:
            ax.plot(xs, [points[str(b)]["output_tok_s"] for b in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    batches = results["config"]["sweep"]
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size (max_num_seqs / static batch)")
    ax.set_ylabel("output tokens/s")
    model = results["model"]
    name = f"random {model['preset']}" if model["made"] else Path(model["dir"]).name
    ax.set_title(f"{name}, {results.get('device', '')}, {results['date'][:10]}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


# -- command line ------------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> tuple[BenchConfig, argparse.Namespace]:
    from tinyvllm.random_model import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # no `choices`: argparse (3.11) rejects an empty list against them
    p.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                   help="latency, throughput, prefill, kernels or all (none: only the --sweep)")
    p.add_argument("--model", type=Path, help="an existing model directory (default: make a random one)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.2-1b", help="random model shape")
    p.add_argument("--model-dir", type=Path, help="where to make the random model (default: a temporary dir)")
    p.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--scheduler", choices=(*SCHEDULERS, "both"), default="both",
                   help="for throughput and the sweep (default both)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="of the card, per tinyvllm engine (default 0.5: the peer shares the GPU later in the run)")
    p.add_argument("--matmul-precision", choices=("fp32", "bf16"), default="fp32",
                   help="tinyvllm's matmul inputs: fp32 (default, exact) or rounded to bf16 (as vLLM and HF do)")
    p.add_argument("--bandwidth-gbs", type=float,
                   help="the copy bandwidth of the roofline (default: a device-to-device copy measured at the "
                        f"start; without a GPU, {H200_COPY_GBS:,.0f}: the H200's)")
    p.add_argument("--no-peer", action="store_true", help="skip HF transformers")
    p.add_argument("--peer-requests", type=int, default=64,
                   help="requests of the throughput workload the HF peer runs (default 64: bounded time)")
    p.add_argument("--sweep", type=lambda text: [int(b) for b in text.split(",")], default=[], metavar="B1,B2,...",
                   help="batch sizes for output tokens/s against batch size")
    p.add_argument("--plot", type=Path, default=Path("bench_sweep.png"), help="PNG of the sweep")
    p.add_argument("--quick", action="store_true", help="small workloads, for smoke runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument("--markdown", type=Path, help="write the table here (it is also printed)")
    a = p.parse_args(argv)
    workloads = list(WORKLOADS) if "all" in a.workloads else [w for w in WORKLOADS if w in a.workloads]
    unknown = [w for w in a.workloads if w not in (*WORKLOADS, "all")]
    if unknown:
        p.error(f"unknown workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)}, all")
    if not a.workloads and not a.sweep:
        p.error(f"name a workload ({', '.join(WORKLOADS)}, all) or give --sweep")
    if (any(b < 1 for b in a.sweep) or a.peer_requests < 1 or a.max_num_seqs < 1
            or (a.bandwidth_gbs is not None and not a.bandwidth_gbs > 0)):
        p.error("--sweep batch sizes, --peer-requests, --max-num-seqs and --bandwidth-gbs must be positive")
    return BenchConfig(workloads=workloads, sizes=QUICK if a.quick else Sizes(), model=a.model, preset=a.preset,
                       model_dir=a.model_dir, backend=a.backend,
                       schedulers=list(SCHEDULERS) if a.scheduler == "both" else [a.scheduler],
                       max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                       gpu_memory_utilization=a.gpu_memory_utilization, bandwidth_gbs=a.bandwidth_gbs,
                       matmul_precision=a.matmul_precision,
                       peer=not a.no_peer, peer_requests=a.peer_requests, sweep=a.sweep, seed=a.seed,
                       command=shlex.join(["python3", "tools/bench.py", *argv])), a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, args = parse_args(argv)

    def emit(results):
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        if args.markdown:
            args.markdown.write_text(markdown(results))

    with tempfile.TemporaryDirectory(prefix="tinyvllm-bench-") as tmp:
        if cfg.model is None and cfg.model_dir is None:
            cfg.model_dir = Path(tmp) / cfg.preset
        results = run_bench(cfg, emit)
    if cfg.sweep:
        results["plot"] = plot_sweep(results, args.plot)
        log(results["plot"])
        emit(results)
    print(markdown(results))
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
