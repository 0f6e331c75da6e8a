"""End-to-end benchmark of tinyvllm, with a compiled PyTorch Llama and Hugging Face transformers on the same
workloads in the same run, against issue 29's goals.

    python3 tools/bench.py goals --json out.json --markdown out.md    # every row of the goal table, with peers
    python3 tools/bench.py all [--sweep 1,16,64,256] [options]        # goals + the single-kernel targets
    python3 tools/bench.py latency|throughput|prefill|static|step|startup|stalls|kernels|kvcache [more] [options]
    python3 tools/bench.py kvcache --no-peer --json kv.json --markdown kv.md   # issue 31's KV-format report
    python3 tools/bench.py --sweep 1,16,64,256          # the sweep alone
    python3 tools/bench.py all --quick --preset tiny --backend cpu      # a smoke run in seconds

The model is a Llama-3.2-1B-shaped checkpoint with random bf16 weights (tinyvllm.random_model, seed 0,
made in a few seconds in a temporary directory or --model-dir), or any model given with --model. Every
request is greedy with ignore_eos (stalls also samples), so each produces exactly the tokens asked for.
tinyvllm runs with the engine's defaults (matmul precision auto: bf16 on the GPU) unless options say
otherwise. Workloads:

- latency: batch 1, a 128-token random prompt, 256 new tokens. Decode tokens/s = 255 / (time of the last
  token - time of the first; for the peers, from per-token timestamps), best of a few runs
  (one for the slow eager peer); also the fraction of the bandwidth roofline: a decode step
  at batch 1 reads every weight once (the tied embedding as the LM head; an untied embedding table only
  one row), so the limit is the copy bandwidth / weight bytes per token. The copy bandwidth is a
  device-to-device copy measured on the GPU at the start of the run (1 GiB, read and write counted), or
  --bandwidth-gbs when given; without a GPU, the H200's 4,250 GB/s of shared GPU.md, said so in the
  output. KV-cache reads (a few MB at this context) are left out.
- throughput: 256 requests (seed 0), random prompt ids in [0, 10000), prompt and output lengths uniform in
  [100, 1024] -> output tokens/s over the wall time of one `LLM.generate`, for the continuous and the
  static scheduler (the goal is the continuous one's: the engine's default).
- prefill: one 1,024-token prompt, max_tokens=1: time to first token, best of a few runs.
- static: static batches (--static-batches, default 16, 64, 256) of 128-token random prompts, 256 new
  tokens each, on an engine with scheduler="static": output tokens/s = batch * 256 / the wall time of one
  `LLM.generate` (prefill included), best of a few runs.
- step: the decode step's GPU time at batch 1, 16 and 64 (256-token prompts), the plain CUDA graph the engine
  replays timed over 50 replays (tools/profile_step.step_times, one engine), and the ratios 16/1 and 64/1.
  Needs a GPU (the simulator captures no graphs).
- startup: `python -m tinyvllm generate --backend B --model DIR --max-tokens 1 --temperature 0 "Hello"`
  run twice, one process after the other, with a fresh kernel cache directory (TINYVLLM_KERNEL_CACHE) for the
  pair: the first compiles every kernel (cold), the second loads them (the goal's "second process"). Time
  from just before Popen to the first byte of the answer on stdout (read unbuffered), and to the exit.
  --startup-from-cache runs the second alone, on a copy of the kernel cache the workloads before it filled.
- stalls: an engine with the defaults is built; `cuda_kernels.launch.prepared()` (kernel signatures compiled
  or loaded) and `tinyvllm.cuda_graph.captures()` are read when the constructor returns ("ready"), then a
  varied workload runs through `LLMEngine.step` with each step timed: batches of 1, 3, 17, 64 and 200
  requests (prompts log-uniform in 5-3,000 tokens, the longest and shortest in each batch; outputs 16-64
  tokens; greedy and mixed greedy/sampled batches in turn), then single requests one after another (prompts
  3,000 down to 5 tokens, greedy and sampled). Reported: compiles and captures after ready (goal: 0), and the
  longest step (a compile or capture shows as one).
- kernels: issue 5's single-kernel targets, each kernel launched alone as the engine launches it, on the
  model's shapes: the five batch-1 decode GEMVs (QKV with its RoPE + KV-write epilogue, O, gate/up with its
  SiLU*mul epilogue, down, the LM head; the default gemv config, the run's matmul precision), each
  weight cold in L2 (every launch reads the next of 256 MiB of weight copies), and decode PagedAttention
  over batch 64 x context 4,096 with the engine's default policy. Each is checked against the NumPy
  reference, then timed as a CUDA graph of 50 launches (tools/kernel_benchmarks/common.py): GB/s of
  weight + x + out, and of K and V read, against 3,500 and 3,000 GB/s (issue 5's targets, set for the H200
  and Llama-3.2-1B). Skipped on the cpu backend, except in Numba's CUDA simulator, where it runs with any
  shapes (the time is then one eager launch of Python threads: a smoke run).
- --sweep B1,B2,...: output tokens/s against batch size. At batch size B, 2*B requests with a 128-token
  prompt and output lengths uniform in [128, 384] (mean 256) run on an engine with max_num_seqs=B, for each
  scheduler: static batching holds a batch until its longest member ends, continuous batching refills the
  freed slots, so the two differ only when lengths vary and requests wait. The HF peer runs the first B of
  those requests as one static batch (`generate` with max_new_tokens = the longest of them) and is credited
  with the tokens those requests asked for, as static batching is; one batch stands for the rest, which
  keeps the peer's share of the run bounded. The points are plotted (PNG) when matplotlib is importable.
- kvcache: issue 31's report on the KV cache's formats (--kv-formats, default bf16,fp8,fp32; each engine's
  format is otherwise --kv-cache-dtype, default bf16). Per format: the KV blocks (and tokens) an engine
  gets at gpu_memory_utilization 0.9 (an engine built without its warm-up, read, freed); decode
  PagedAttention at batch 64 x context 4,096 as the engine launches it (checked against the reference, timed
  as the kernels workload times it: us and GB/s of K and V read in the format); then an engine at
  --gpu-memory-utilization: the first-step logits of three random prompts (300, 37 and 9 tokens) and their
  greedy 32 tokens, and the throughput workload (continuous scheduler; its warm-up first). The logits and tokens of each format
  are compared with bf16's (the largest logit difference, in absolute terms and against the largest logit;
  the share of greedy tokens equal) and, when fp32 is among the formats, with fp32's (no KV rounding).
  Throughput is measured for --kv-throughput formats only (default bf16,fp8).
`goals` is latency, throughput, prefill, static, step, startup and stalls; `all` adds kernels (not kvcache).

Kernels compile, and decode CUDA graphs are captured, on first use unless the engine did so when it was
built, so every engine is warmed up before timing: the decode batch passes through every size from
max_num_seqs down to 1 at every context-length octave its jobs will reach (see warm_up). Prefix caching is
off (except in stalls, which runs the defaults), so a repeated prompt is prefilled again.

Peers (--peers, default torch,hf; each runs when torch, or torch and transformers, import; neither is ever
a tinyvllm dependency), on the same model directory, bf16, on cuda if available, else the CPU:
- torch: tools/torch_peer.py, a plain Llama with a static KV cache, prefill and decode compiled with
  torch.compile(mode="reduce-overhead") (CUDA graphs; decode attention over the filled part of the cache in
  64-position buckets): latency (batch 1, decode tokens/s timed as tinyvllm's), the static batches (output
  tokens/s with prefill included, as tinyvllm's static workload), the 1,024-token prefill (compiled and
  eager). Its mode and its agreement with its own eager step are recorded. Its decode step times at batch 1,
  16 and 64 (from those runs) stand beside the step ratios.
- hf: HF transformers: latency with `cache_implementation="static"` (generate then compiles the model with
  torch.compile) and eager; throughput with `generate_batch` (transformers' continuous batching with a paged
  cache), which takes one max_new_tokens for all requests, so each request asks for the mean of the
  workload's output lengths, and only the first --peer-requests requests run (both stated in the output);
  it is timed from the first request's admission to the last one's end where the results carry those times
  (generate_batch sets up its cache and CUDA graphs before admitting requests), else by the wall clock (said
  in the JSON). Prefill runs eagerly, logits of the last token only. Not at the static batches: each batch
  size is another torch.compile of generate (a minute each), and the torch peer covers them. generate_batch
  runs last: some transformers versions leave the model on paged attention after it. A transformers
  without generate_batch gets a note instead of the throughput row.
A peer measurement that fails is recorded as an error and the run goes on.

Order and GPU memory: tinyvllm and the peers share one GPU, so tinyvllm runs first (its engines, then step,
stalls, startup and kernels), each engine in turn taking --gpu-memory-utilization (default 0.5) of the card
and freeing it (its arrays dropped, numba's deferred deallocations flushed) before the next one; startup's
processes take the CLI's default share of what is free; then the torch peer, which gives its memory back
(torch's cache emptied), then HF. The free memory after each release is logged. Every workload and every
measurement in it records its own failure (with its traceback on stderr) and the run goes on.

Results go to --json (every number, the goal table, the configuration, device, date, versions and the
command line) and --markdown (the goal table and the tables ready for BENCHMARKS.md, also printed), both
rewritten after every measurement so that a run cut short keeps what it measured; --plot (default
bench_sweep.png) gets the sweep. --quick shrinks every workload for smoke runs (kernels: batch 2 x context
256 and 1 MiB of weight copies; with --preset tiny about 30 s in the simulator).

Run time of `goals` on one H100 or H200, with both peers (an estimate, not yet measured in one piece;
assumed: a fresh machine, so every kernel compiles once in this process and once more in startup's cold
process, 30-40 s each; an engine's own warm-up at construction under a minute; the bench's warm-up 10-20 s
per engine): making the model 10 s; the continuous engine (latency, prefill, throughput) 60-90 s; the
static engine (throughput, static batches) 60-90 s; step 30-60 s; stalls 40-70 s; startup 50-100 s (150 s on
an H100 on 2026-12-07, the cold process 142 s of it; --startup-from-cache leaves the cold process out); the
torch peer 150-250 s (torch.compile of the decode step at four batch sizes and of the prefill, 30-40 s each;
earlier measurements: `latency prefill throughput kernels` with HF took 223 s on an H100); HF 100-150 s.
In all about 8-12 minutes: on a 10-minute limit, run `goals --peers torch --startup-from-cache` and the HF
rows apart (`latency prefill throughput --peers hf`), or trim --static-batches. Results already measured
survive a cut (they are written after every measurement), so write --json and --markdown where a cut
run's files are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import inspect
import json
import os
import platform
import select
import shlex
import shutil
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

WORKLOADS = ("latency", "throughput", "prefill", "static", "step", "startup", "stalls", "kernels", "kvcache")
GOAL_WORKLOADS = WORKLOADS[:7]    # `goals`: every row of issue 29's goal table
ALL_WORKLOADS = WORKLOADS[:8]     # `all`: the goals and the kernels
KV_FORMATS = ("bf16", "fp8", "fp32")
PEERS = ("torch", "hf")
PEER_WORKLOADS = ("latency", "throughput", "prefill")   # what the HF peer measures (and --sweep)
TORCH_PEER_WORKLOADS = ("latency", "prefill", "static", "step")
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
    static_prompt: int = 128         # static: every prompt of a static batch, and the new tokens of each
    static_new: int = 256
    step_batches: tuple[int, ...] = (1, 16, 64)   # step: decode batches timed; ratios are against the first
    step_context: int = 256
    stall_batches: tuple[int, ...] = (1, 3, 17, 64, 200)   # stalls: one batch of requests each, in turn
    stall_prompt_lens: tuple[int, int] = (5, 3000)
    stall_new: int = 32              # stalls: outputs uniform in [stall_new / 2, 2 * stall_new]
    stall_singles: int = 4           # stalls: single requests one after another, after the batches
    startup_timeout_s: float = 300.0  # startup: one process's limit
    kv_prompts: tuple[int, ...] = (300, 37, 9)   # kvcache: the prompts whose logits and tokens are compared
    kv_new: int = 32                  # kvcache: greedy tokens per prompt

    def max_context(self, job: str) -> int:
        """The longest prompt + output a job's requests reach."""
        return {"latency": self.latency_prompt + self.latency_new, "prefill": self.prefill_prompt + 1,
                "throughput": self.prompt_lens[1] + self.output_lens[1],
                "sweep": self.sweep_prompt + self.sweep_output_lens[1],
                "static": self.static_prompt + self.static_new}[job]


QUICK = Sizes(latency_prompt=32, latency_new=32, num_requests=16, prompt_lens=(16, 128), output_lens=(16, 64),
              prefill_prompt=256, sweep_prompt=32, sweep_output_lens=(16, 48), runs=2, attention_batch=2,
              attention_context=256, cold_bytes=1 << 20, static_prompt=16, static_new=16, step_context=32,
              stall_batches=(1, 3, 5), stall_prompt_lens=(5, 100), stall_new=8, stall_singles=2, kv_prompts=(30, 7, 3),
              kv_new=8)


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
    matmul_precision: str = "auto"       # tinyvllm's matmul inputs: auto (the engine's default), fp32 or bf16
    kv_cache_dtype: str = "bf16"         # the KV cache's format of every engine but kvcache's
    kv_formats: list[str] = field(default_factory=lambda: list(KV_FORMATS))        # kvcache: the formats
    kv_throughput: list[str] = field(default_factory=lambda: ["bf16", "fp8"])     # kvcache: throughput for these
    bandwidth_gbs: float | None = None   # the roofline's copy bandwidth; None: measured on the GPU
    peer: bool = True                    # False (--no-peer): no peer at all
    peers: list[str] = field(default_factory=lambda: list(PEERS))   # which peers run (when peer is True)
    peer_requests: int = 64
    static_batches: list[int] = field(default_factory=lambda: [16, 64, 256])
    startup_from_cache: bool = False     # startup: one process on a copy of this run's kernel cache
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


def static_requests(cfg: BenchConfig, batch: int, high: int) -> list[tuple[list[int], int]]:
    """A static batch: `batch` random prompts of static_prompt tokens (seeded per batch), static_new new each."""
    rng = np.random.default_rng([cfg.seed, 4, batch])
    return [(random_prompt(rng, cfg.sizes.static_prompt, high), cfg.sizes.static_new) for _ in range(batch)]


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

    def __init__(self, cfg: BenchConfig, model_dir: Path, scheduler: str, max_num_seqs: int, **options):
        from tinyvllm import LLM

        options = {"gpu_memory_utilization": cfg.gpu_memory_utilization, "kv_cache_dtype": cfg.kv_cache_dtype,
                   **options}   # (kvcache's engines set these)
        self.llm = LLM(model_dir, backend=cfg.backend, scheduler=scheduler, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=cfg.max_num_batched_tokens, enable_prefix_caching=False,
                       matmul_precision=cfg.matmul_precision, **options)
        self.backend = self.llm.engine.runner.name
        self.matmul_precision = self.llm.engine.runner.matmul_precision   # what "auto" became

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


def tv_static(llm, requests: list[tuple[list[int], int]], runs: int) -> dict:
    """One static batch (the engine's static scheduler runs it whole), best of `runs` by output tokens/s."""
    results = [tv_batch(llm, requests) for _ in range(runs)]
    best = max(results, key=lambda r: r["output_tok_s"])
    return {**best, "batch": len(requests), "runs_output_tok_s": [r["output_tok_s"] for r in results]}


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
    The static batches run on a static-scheduler engine that holds the largest of them.
    """
    plan: dict[tuple[str, int], list[tuple[str, int | None]]] = {}
    for i, scheduler in enumerate(cfg.schedulers):
        jobs = plan.setdefault((scheduler, cfg.max_num_seqs), [])
        jobs += [(w, None) for w in ("latency", "prefill") if i == 0 and w in cfg.workloads]
        if "throughput" in cfg.workloads:
            jobs.append(("throughput", None))
    if "static" in cfg.workloads and cfg.static_batches:
        key = ("static", max(cfg.max_num_seqs, *cfg.static_batches))
        plan.setdefault(key, []).extend(("static", batch) for batch in cfg.static_batches)
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
        ours["backend"], ours["matmul_precision"] = engine.backend, engine.matmul_precision
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
    if job == "static":
        r = ours.setdefault("static", {})[str(batch)] = tv_static(llm, static_requests(cfg, batch, high), s.runs)
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


# -- tinyvllm's decode step, stalls and start -------------------------------------------------------------------

def gpu_unavailable(backend: str, what: str) -> str | None:
    """Why `what` cannot be measured here (it needs a real GPU: CUDA graphs, the CUDA engine's start), or None."""
    from cuda_kernels.compat import SIMULATOR
    from tinyvllm.runners import choose_backend

    if SIMULATOR or choose_backend(backend) != "cuda":
        return f"{what} not measured: it needs a GPU (backend {backend}{', simulator' if SIMULATOR else ''})"
    return None


def run_step(cfg: BenchConfig, model_dir: Path, results: dict) -> str:
    """Decode step GPU time per batch (tools/profile_step.step_times) and the ratios against the first batch."""
    ours = results["tinyvllm"]
    reason = gpu_unavailable(cfg.backend, "step")
    if reason is not None:
        ours["step"] = {"skipped": reason}
        return reason
    from tools.profile_step import step_times

    ours.setdefault("backend", "cuda")
    s = cfg.sizes
    times = step_times(model_dir, list(s.step_batches), s.step_context, cfg.matmul_precision)
    ours["step"] = step_summary({b: t["graph_s"] for b, t in times.items()}, s.step_context)
    for b, t in times.items():
        ours["step"]["batches"][str(b)]["graph_batch"] = t["graph_batch"]
    return f"{ours['step']['summary']}; {free_device_memory('cuda')}"


def step_summary(step_s: dict[int, float], context: int) -> dict:
    """Step times by batch and each one's ratio to the first (smallest) batch's."""
    base = step_s[min(step_s)]
    batches = {str(b): {"step_s": t, "ratio": t / base} for b, t in sorted(step_s.items())}
    summary = ", ".join(f"batch {b} {v['step_s'] * 1e3:.2f} ms ({v['ratio']:.2f}x)" for b, v in batches.items())
    return {"context": context, "batches": batches, "summary": summary}


def stall_phases(s: Sizes, seed: int, high: int) -> list[tuple[str, list[list[tuple[list[int], object]]]]]:
    """(name, waves): each wave a list of (prompt, SamplingParams) added together and run to the end. A batch of
    each size in s.stall_batches (prompts log-uniform over stall_prompt_lens with both ends present; greedy and
    mixed greedy/sampled batches in turn), then stall_singles single requests in a row, long prompts first."""
    from tinyvllm import SamplingParams

    rng = np.random.default_rng([seed, 5])
    low, high_len = s.stall_prompt_lens

    def params(sampled: bool, i: int):
        n = int(rng.integers(max(1, s.stall_new // 2), 2 * s.stall_new + 1))
        if sampled:
            return SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i, max_tokens=n, ignore_eos=True)
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    phases = []
    for k, batch in enumerate(s.stall_batches):
        lengths = np.exp(rng.uniform(np.log(low), np.log(high_len), batch)).astype(int)
        lengths[:2] = [high_len, low][:batch]
        mixed = k % 2 == 1
        wave = [(random_prompt(rng, int(n), high), params(mixed and i % 2 == 1, i)) for i, n in enumerate(lengths)]
        phases.append((f"batch {batch}, {'greedy and sampled' if mixed else 'greedy'}", [wave]))
    lengths = np.geomspace(high_len, low, s.stall_singles).round().astype(int)
    singles = [[(random_prompt(rng, int(n), high), params(i % 2 == 1, i))] for i, n in enumerate(lengths)]
    phases.append((f"{s.stall_singles} single requests in a row, prompts {high_len} down to {low}", singles))
    return phases


def timed_steps(engine, wave: list[tuple[list[int], object]]) -> list[float]:
    """Add the wave's requests and step the engine until it has none left; the wall time of every step."""
    for prompt, params in wave:
        engine.add_request(prompt, params, final_only=True)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def run_stalls(cfg: BenchConfig, model_dir: Path, vocab: int, results: dict, emit) -> str:
    """Compiles and graph captures after the engine is ready, over stall_phases, and the longest step."""
    from tinyvllm import LLM

    start = time.perf_counter()
    llm = LLM(model_dir, backend=cfg.backend, max_num_seqs=cfg.max_num_seqs,
              max_num_batched_tokens=cfg.max_num_batched_tokens, gpu_memory_utilization=cfg.gpu_memory_utilization,
              matmul_precision=cfg.matmul_precision)
    ready_s, backend = time.perf_counter() - start, llm.engine.runner.name
    results["tinyvllm"].setdefault("backend", backend)
    prepared, captured = setup_counts(backend)
    r = results["tinyvllm"]["stalls"] = {"backend": backend, "ready_s": ready_s, "prepared_at_ready": prepared,
                                         "captures_at_ready": captured, "phases": []}
    try:
        for name, waves in stall_phases(cfg.sizes, cfg.seed, min(cfg.sizes.token_high, vocab)):
            before, started = setup_counts(backend), time.perf_counter()
            steps = [t for wave in waves for t in timed_steps(llm.engine, wave)]
            after = setup_counts(backend)
            r["phases"].append({"phase": name, "requests": sum(map(len, waves)), "steps": len(steps),
                                "compiles": after[0] - before[0], "captures": after[1] - before[1],
                                "worst_step_s": max(steps), "wall_s": time.perf_counter() - started})
            log(f"stalls: {name}: {r['phases'][-1]['compiles']} compiles, {r['phases'][-1]['captures']} captures, "
                f"worst step {max(steps) * 1e3:,.1f} ms")
            r.update(stall_totals(r))
            emit(results)
    finally:
        llm = None
        released = free_device_memory(backend)
    return (f"ready in {r['ready_s']:.1f} s; after ready {r['compiles_after_ready']} compiles, "
            f"{r['captures_after_ready']} captures, worst step {r['worst_step_s'] * 1e3:,.1f} ms "
            f"({r['worst_step_phase']}); {released}")


def setup_counts(backend: str) -> tuple[int, int]:
    """(kernel signatures compiled or loaded, CUDA graphs captured) in this process so far; the cpu backend
    (the NumPy reference) has neither."""
    if backend != "cuda":
        return 0, 0
    from cuda_kernels import launch
    from tinyvllm.cuda_graph import captures

    return launch.prepared(), captures()


def stall_totals(r: dict) -> dict:
    """The phases' compiles and captures summed, and the longest step with its phase."""
    worst = max(r["phases"], key=lambda p: p["worst_step_s"])
    return {"compiles_after_ready": sum(p["compiles"] for p in r["phases"]),
            "captures_after_ready": sum(p["captures"] for p in r["phases"]),
            "worst_step_s": worst["worst_step_s"], "worst_step_phase": worst["phase"]}


def startup_command(backend: str, model_dir: Path) -> list[str]:
    return [sys.executable, "-m", "tinyvllm", "generate", "--backend", backend, "--model", str(model_dir),
            "--max-tokens", "1", "--temperature", "0", "Hello"]


def time_to_first_byte(argv: list[str], env: dict, timeout_s: float) -> dict:
    """Run argv; seconds from just before Popen to the first byte on its stdout and to its exit. A process that
    fails, prints nothing or outlives timeout_s (then killed) raises, with the end of its stderr."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env,
                                cwd=REPO, bufsize=0)
        deadline = start + timeout_s
        try:
            first = None
            ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
            if ready and os.read(proc.stdout.fileno(), 1):
                first = time.perf_counter()
            proc.communicate(timeout=max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        end = time.perf_counter()
        err.seek(0)
        tail = err.read()[-2000:].decode(errors="replace")
    problem = (f"did not finish within {timeout_s:.0f} s (killed)" if end > deadline
               else f"exited with {proc.returncode}" if proc.returncode else None if first else "printed nothing")
    if problem:
        raise RuntimeError(f"{shlex.join(argv)} {problem}; stderr ends:\n{tail}")
    return {"first_byte_s": first - start, "exit_s": end - start}


STARTUP_RUNS = ("first (cold kernel cache)", "second (kernels cached by the first)")
STARTUP_FROM_CACHE_RUN = "second (a copy of the kernel cache this run's engines filled)"


def run_startup(cfg: BenchConfig, model_dir: Path, results: dict) -> str:
    """The CLI's process start to first token, twice in a row on a fresh kernel cache (cold, then warm); with
    cfg.startup_from_cache once, on a copy of this process's kernel cache (cuda_kernels.kernel_cache.directory(),
    which the engines of the workloads before it filled): the goal's second process without the first's compiles."""
    from cuda_kernels import kernel_cache
    from tinyvllm.runners import choose_backend

    backend = choose_backend(cfg.backend)
    argv = startup_command(backend, model_dir)
    r = results["tinyvllm"]["startup"] = {"command": shlex.join(argv), "backend": backend, "runs": [],
                                          "from_cache": cfg.startup_from_cache}
    with tempfile.TemporaryDirectory(prefix="tinyvllm-kernel-cache-") as cache:
        labels = STARTUP_RUNS
        if cfg.startup_from_cache:
            source = kernel_cache.directory()
            if source is None or not source.is_dir() or not any(source.iterdir()):
                raise RuntimeError(f"startup: --startup-from-cache needs a kernel cache to copy, and "
                                   f"{source or 'none (TINYVLLM_KERNEL_CACHE=0)'} is not a directory holding one")
            shutil.copytree(source, cache, dirs_exist_ok=True)
            labels = (STARTUP_FROM_CACHE_RUN,)
        env = {**os.environ, "TINYVLLM_KERNEL_CACHE": cache,
               "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
        for label in labels:
            run = time_to_first_byte(argv, env, cfg.sizes.startup_timeout_s)
            r["runs"].append({"run": label, **run})
            log(f"startup: {label}: first token after {run['first_byte_s']:.1f} s, exit after {run['exit_s']:.1f} s")
    return ", ".join(f"{run['first_byte_s']:.1f} s" for run in r["runs"]) + " to the first token"


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
    gemvs = matmul.engine_decode_cases(config, cuda_precision(cfg) == "bf16", s.cold_bytes, block)
    heads = (config.num_heads, config.num_kv_heads, config.head_dim)
    context = min(s.attention_context, config.max_position_embeddings)
    attn = attention.engine_decode_case(s.attention_batch, context, heads, block)
    return [(GEMV_TARGET_GBS, case) for case in gemvs] + [(ATTENTION_TARGET_GBS, attn)]


def cuda_precision(cfg: BenchConfig) -> str:
    """The CUDA engine's matmul precision under this configuration (what "auto" means there)."""
    from tinyvllm.runners import AUTO_PRECISION

    return AUTO_PRECISION["cuda"] if cfg.matmul_precision == "auto" else cfg.matmul_precision


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
    from tinyvllm.device import gpu_status

    ours.setdefault("backend", "cuda")  # when no engine ran before
    ours["kernels"] = {"device": gpu_status()[1], "cold_bytes": cfg.sizes.cold_bytes,
                       "matmul_precision": cuda_precision(cfg), "cases": []}
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


# -- the KV cache's formats (issue 31) ---------------------------------------------------------------------------

def first_step_logits(llm, prompts: list[list[int]]) -> np.ndarray:
    """The logits (prompts, vocab) of one prefill step of the prompts, batched, on the engine's runner."""
    from tinyvllm.scheduler import ScheduledSequence
    from tinyvllm.sequence import Sequence

    engine = llm.engine
    seqs = [Sequence(f"logits-{i}", p, greedy(1), 0) for i, p in enumerate(prompts)]
    scheduled = []
    for seq in seqs:
        engine.block_manager.allocate(seq, seq.num_tokens)
        scheduled.append(ScheduledSequence(seq, seq.num_tokens))
    try:
        runner = engine.runner
        if runner.name == "cpu":   # (the cpu runner keeps no logits: its model's forward gives them)
            from tinyvllm.batch import pack

            return runner.model.forward(pack(scheduled, runner.block_size)[0], runner.kv)
        runner.execute(scheduled)
        return runner.logits[: len(prompts)].copy_to_host()
    finally:
        for seq in seqs:
            engine.block_manager.free_sequence(seq)


def kv_capacity(cfg: BenchConfig, model_dir: Path, fmt: str, utilization: float = 0.9) -> dict:
    """The KV blocks an engine of format fmt gets at this gpu_memory_utilization (built without its warm-up)."""
    engine = TinyEngine(cfg, model_dir, "continuous", cfg.max_num_seqs, kv_cache_dtype=fmt,
                        gpu_memory_utilization=utilization, warmup=False)
    runner = engine.llm.engine.runner
    blocks, block_size = runner.num_blocks, runner.block_size
    engine.close()
    return {"gpu_memory_utilization": utilization, "blocks": blocks, "block_size": block_size,
            "tokens": blocks * block_size}


def run_kvcache(cfg: BenchConfig, model_dir: Path, config, results: dict, emit) -> str:
    """issue 31's report (see the module docstring, kvcache)."""
    from tools.kernel_benchmarks import attention
    from tools.kernel_benchmarks.common import checked_time

    s, high = cfg.sizes, min(cfg.sizes.token_high, config.vocab_size)
    kv = results["tinyvllm"]["kvcache"] = {"formats": cfg.kv_formats, "capacity": {}, "attention": {},
                                           "logits": {}, "throughput": {}}
    results["tinyvllm"].setdefault("backend", "cuda")
    for fmt in cfg.kv_formats:
        record(results, f"kvcache capacity {fmt}",
               lambda: "{blocks} blocks = {tokens} tokens".format(**kv["capacity"].setdefault(
                   fmt, kv_capacity(cfg, model_dir, fmt))))
        emit(results)
    if kernels_unavailable(cfg.backend) is None:
        heads = (config.num_heads, config.num_kv_heads, config.head_dim)
        context = min(s.attention_context, config.max_position_embeddings)
        for fmt in cfg.kv_formats:
            def attention_row(fmt=fmt):
                case = attention.engine_decode_case(s.attention_batch, context, heads, 16, fmt)
                row = kv["attention"][fmt] = kernel_row(case, ATTENTION_TARGET_GBS, checked_time(case))
                if "time_us" not in row:
                    raise RuntimeError(row["check"])
                return f"{row['time_us']:,.1f} us, {row['gb_s']:,.0f} GB/s ({case.shape}; {case.config})"
            record(results, f"kvcache attention {fmt}", attention_row)
            emit(results)
    rng = np.random.default_rng([cfg.seed, 31])
    prompts = [random_prompt(rng, n, high) for n in s.kv_prompts]
    requests = random_requests(np.random.default_rng(cfg.seed), s.num_requests, s.prompt_lens, s.output_lens, high)
    outputs = {}
    for fmt in cfg.kv_formats:
        def engine_jobs(fmt=fmt):
            engine = TinyEngine(cfg, model_dir, "continuous", cfg.max_num_seqs, kv_cache_dtype=fmt)
            try:
                logits = first_step_logits(engine.llm, prompts)
                outs = engine.llm.generate(prompts, greedy(s.kv_new), use_tqdm=False)
                outputs[fmt] = (logits, [o.outputs[0].token_ids for o in outs])
                text = f"logits of {len(prompts)} prompts and their greedy tokens"
                if fmt in cfg.kv_throughput and "throughput" not in kv["throughput"].get(fmt, {}):
                    max_context = s.max_context("throughput")
                    warm_up(engine.llm, np.random.default_rng([cfg.seed, 9]), cfg.max_num_seqs, max_context, high)
                    r = kv["throughput"][fmt] = tv_batch(engine.llm, requests)
                    text += f"; throughput {r['output_tok_s']:.0f} output tok/s ({r['preemptions']} preemptions)"
                return text
            finally:
                engine.close()
        record(results, f"kvcache engine {fmt}", engine_jobs)
        emit(results)
    for base in ("bf16", "fp32"):
        if base not in outputs:
            continue
        ref_logits, ref_tokens = outputs[base]
        for fmt, (logits, toks) in outputs.items():
            if fmt == base:
                continue
            diff = float(np.abs(logits - ref_logits).max())
            same = sum(a == b for x, y in zip(toks, ref_tokens) for a, b in zip(x, y))
            kv["logits"][f"{fmt} vs {base}"] = {
                "max_abs_logit_diff": diff, "max_abs_logit": float(np.abs(ref_logits).max()),
                "relative": diff / float(np.abs(ref_logits).max()),
                "first_tokens_equal": int(sum(int(np.argmax(a)) == int(np.argmax(b))
                                              for a, b in zip(logits, ref_logits))),
                "greedy_tokens_equal": f"{same} of {sum(len(t) for t in ref_tokens)}",
                "prompts": [len(p) for p in prompts]}
    emit(results)
    return "; ".join(f"{k}: largest logit difference {v['max_abs_logit_diff']:.3g} ({v['relative']:.2%} of the "
                     f"largest logit), greedy tokens equal {v['greedy_tokens_equal']}"
                     for k, v in kv["logits"].items()) or "no logits compared"


def kvcache_markdown(results: dict) -> list[str]:
    """The kvcache workload's tables (each line after a blank one)."""
    kv = results["tinyvllm"].get("kvcache")
    if not kv:
        return []
    lines = ["", f"KV cache formats on {results.get('device', '?')}: capacity at gpu_memory_utilization 0.9, decode "
             "PagedAttention (GB/s of K and V read in the format), the throughput workload, and the quality "
             "cost (first-step logits of three random prompts; greedy 32 tokens each).", "",
             "| format | KV blocks at 0.9 | tokens | attention (us) | attention GB/s | throughput (output tok/s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for fmt in kv["formats"]:
        cap, att, thr = kv["capacity"].get(fmt, {}), kv["attention"].get(fmt, {}), kv["throughput"].get(fmt, {})
        cells = [f"{cap['blocks']:,}" if cap else "", f"{cap['tokens']:,}" if cap else "",
                 f"{att['time_us']:,.1f}" if "time_us" in att else att.get("check", ""),
                 f"{att['gb_s']:,.0f}" if "gb_s" in att else "",
                 f"{thr['output_tok_s']:,.0f}" if thr else ""]
        lines.append("| " + " | ".join([fmt, *cells]) + " |")
    if kv["logits"]:
        lines += ["", "| formats | largest logit difference | of the largest logit | first tokens equal | "
                  "greedy tokens equal |", "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {k} | {v['max_abs_logit_diff']:.4g} | {v['relative']:.3%} | {v['first_tokens_equal']} of "
                  f"{len(v['prompts'])} | {v['greedy_tokens_equal']} |" for k, v in kv["logits"].items()]
    return lines


# -- the peer: a compiled PyTorch Llama (tools/torch_peer.py) ---------------------------------------------------

def torch_peer_unavailable() -> str | None:
    """Why the PyTorch peer cannot run here, or None when torch imports."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        return f"PyTorch peer not measured: torch is not importable here ({exc})"
    return None


def run_torch_peer(cfg: BenchConfig, model_dir: Path, vocab: int, results: dict, emit) -> str:
    """The torch peer on tinyvllm's prompts (same seeds): latency, static batches, step times, prefill."""
    reason = torch_peer_unavailable()
    if reason is not None:
        results["torch_peer"] = {"skipped": reason}
        return reason
    import torch

    from tools.torch_peer import TorchPeer, describe

    s, high = cfg.sizes, min(cfg.sizes.token_high, vocab)
    log("PyTorch peer: loading the model")
    peer = TorchPeer(model_dir)
    theirs = results["torch_peer"] = {"name": "PyTorch compiled (tools/torch_peer.py)", "torch": torch.__version__,
                                      "device": str(peer.device), "dtype": str(peer.dtype).removeprefix("torch.")}
    if peer.device.type == "cuda":
        theirs["gpu"] = torch.cuda.get_device_name()

    def latency():
        prompt = random_prompt(np.random.default_rng([cfg.seed, 1]), s.latency_prompt, high)
        r = theirs["latency"] = peer.decode_throughput([prompt], s.latency_new, s.runs)
        if "roofline_tok_s" in results["tinyvllm"]:
            r["roofline_fraction"] = r["decode_tok_s"] / results["tinyvllm"]["roofline_tok_s"]
        return f"{r['decode_tok_s']:.1f} decode tok/s ({describe(r)})"

    def static(batch):
        prompts = [p for p, _ in static_requests(cfg, batch, high)]
        r = theirs.setdefault("static", {})[str(batch)] = peer.decode_throughput(prompts, s.static_new, s.runs)
        return f"{r['output_tok_s']:.0f} output tok/s ({describe(r)})"

    def step():
        """Step times from the static and latency runs (a batch not run there runs now, once): contexts of
        static_prompt to static_prompt + static_new tokens, where tinyvllm's step workload holds step_context."""
        runs = dict(theirs.get("static", {}))
        if "latency" in theirs and (s.latency_prompt, s.latency_new) == (s.static_prompt, s.static_new):
            runs.setdefault("1", theirs["latency"])
        for batch in s.step_batches:
            if str(batch) not in runs:
                prompts = [p for p, _ in static_requests(cfg, batch, high)]
                runs[str(batch)] = peer.decode_throughput(prompts, s.static_new, 1)
        r = theirs["step"] = step_summary({b: runs[str(b)]["step_s"] for b in s.step_batches}, s.static_prompt)
        return r["summary"]

    def prefill():
        r = theirs["prefill"] = peer.prefill_ttft(
            random_prompt(np.random.default_rng([cfg.seed, 2]), s.prefill_prompt, high), s.runs)
        return f"TTFT {r['ttft_ms']:.2f} ms ({r['mode']}; eager {r['eager_ttft_ms']:.2f} ms)"

    jobs = [("latency", latency)] if "latency" in cfg.workloads else []
    if "static" in cfg.workloads:
        jobs += [(f"static batch {b}", lambda b=b: static(b)) for b in sorted(cfg.static_batches)]
    if "step" in cfg.workloads:
        jobs.append(("step times", step))
    if "prefill" in cfg.workloads:
        jobs.append(("prefill", prefill))
    try:
        for name, job in jobs:
            record(results, f"PyTorch peer {name}", job)
            theirs["failed_modes"] = peer.failed
            emit(results)
    finally:
        peer.close()
    return f"done; {peer_memory_line(torch)}"


def peer_memory_line(torch) -> str:
    if not torch.cuda.is_available():
        return "host memory released"
    free, total = torch.cuda.mem_get_info()
    return f"GPU memory free after the PyTorch peer: {free / 2**30:.1f} of {total / 2**30:.1f} GiB"


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
        emit(results)
    run_tinyvllm(cfg, model_dir, config.vocab_size, results, emit)
    # one user of the GPU at a time: tinyvllm's engines, then these (each frees its memory), then the peers
    single = {"step": lambda: run_step(cfg, model_dir, results),
              "stalls": lambda: run_stalls(cfg, model_dir, config.vocab_size, results, emit),
              "startup": lambda: run_startup(cfg, model_dir, results),
              "kernels": lambda: run_kernels(cfg, config, results, emit),
              "kvcache": lambda: run_kvcache(cfg, model_dir, config, results, emit)}
    for workload, job in single.items():
        if workload in cfg.workloads:
            record(results, f"tinyvllm {workload}", job)
            emit(results)
    results["device"] = device_name(results["tinyvllm"].get("backend"))
    reason = peer_skipped(cfg, "torch", TORCH_PEER_WORKLOADS, "PyTorch peer")
    if reason:
        results["torch_peer"] = {"skipped": reason}
    else:
        record(results, "PyTorch peer", lambda: run_torch_peer(cfg, model_dir, config.vocab_size, results, emit))
    reason = peer_skipped(cfg, "hf", PEER_WORKLOADS, "HF transformers peer")
    if reason:
        results["peer"] = {"skipped": reason}
    else:
        record(results, "HF transformers", lambda: run_peer(cfg, model_dir, config.vocab_size, results, emit))
    results["wall_s"] = time.perf_counter() - started
    results["goals"] = goal_rows(results)
    emit(results)
    return results


def peer_skipped(cfg: BenchConfig, peer: str, workloads: tuple[str, ...], name: str) -> str | None:
    """Why a peer does not run in this configuration (before trying to import it), or None."""
    if not cfg.peer:
        return f"{name} not measured: --no-peer"
    if peer not in cfg.peers:
        return f"{name} not measured: --peers {','.join(cfg.peers) or 'none'}"
    if not set(cfg.workloads) & set(workloads) and not (peer == "hf" and cfg.sweep):
        return f"{name} not measured: none of {', '.join(workloads)} was asked for"
    return None


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


def goal_rows(results: dict) -> list[dict]:
    """Issue 29's goal table: each row's goal, tinyvllm's measured value (None: not measured), met or not, and
    the peers' figures beside it (text, "-" where a peer has none)."""
    s, ours = results["config"]["sizes"], results["tinyvllm"]
    torch_, hf = results.get("torch_peer", {}), results.get("peer", {})
    rows = []

    def row(workload, goal, target, higher, value, text, torch_text=None, hf_text=None):
        met = None if value is None else (value >= target if higher else value <= target)
        rows.append({"workload": workload, "goal": goal, "target": target, "higher_is_better": higher,
                     "value": value, "measured": text if value is not None else "not measured", "met": met,
                     "torch": torch_text or "-", "hf": hf_text or "-"})

    def rate(value, suffix=""):
        return None if value is None else _rate(value) + suffix

    for batch, target in ((64, 40_000), (256, 70_000)):
        row(f"static batch {batch}, prompt {s['static_prompt']} -> {s['static_new']}",
            f">= {target:,} output tok/s", target, True, _get(ours, "static", str(batch), "output_tok_s"),
            rate(_get(ours, "static", str(batch), "output_tok_s")),
            rate(_get(torch_, "static", str(batch), "output_tok_s")))
    hf_tp = hf.get("throughput")
    row(f"throughput: {s['num_requests']} requests, prompts and outputs U[{s['prompt_lens'][0]}, "
        f"{s['prompt_lens'][1]}] / U[{s['output_lens'][0]}, {s['output_lens'][1]}], continuous",
        ">= 35,000 output tok/s", 35_000, True, _get(ours, "throughput", "continuous", "output_tok_s"),
        rate(_get(ours, "throughput", "continuous", "output_tok_s")), None,
        hf_tp and f"{_rate(hf_tp['output_tok_s'])} (generate_batch, {hf_tp['subsample_short']})")
    pre, torch_pre = ours.get("prefill"), torch_.get("prefill")
    row(f"prefill {s['prefill_prompt']:,} tokens (TTFT)", "<= 5 ms", 5.0, False, pre and pre["ttft_ms"],
        pre and f"{pre['ttft_ms']:.2f} ms",
        torch_pre and f"{torch_pre['ttft_ms']:.2f} ms ({torch_pre['mode']}; eager {torch_pre['eager_ttft_ms']:.2f})",
        _get(hf, "prefill", "ttft_ms") and f"{hf['prefill']['ttft_ms']:.2f} ms (eager)")
    lat = _get(ours, "latency", "decode_tok_s")
    row(f"latency: batch 1, prompt {s['latency_prompt']} -> {s['latency_new']}", ">= 1,300 tok/s", 1_300, True, lat,
        lat and f"{_rate(lat)} ({ours['latency']['roofline_fraction']:.0%} of roofline)",
        rate(_get(torch_, "latency", "decode_tok_s")),
        rate(_get(hf, "latency", "static", "decode_tok_s"), " (static cache + compile)"))
    for batch, target in ((16, 1.2), (64, 1.5)):
        mine, theirs = _get(ours, "step", "batches", str(batch)), _get(torch_, "step", "batches", str(batch))
        row(f"decode step at batch {batch} vs batch 1", f"<= {target}x", target, False, mine and mine["ratio"],
            mine and f"{mine['ratio']:.2f}x ({mine['step_s'] * 1e3:.2f} ms)",
            theirs and f"{theirs['ratio']:.2f}x ({theirs['step_s'] * 1e3:.2f} ms)")
    runs = _get(ours, "startup", "runs") or []
    # the goal's second process: the pair's second run, or the one run on a copy of the cache (--startup-from-cache)
    second = runs[-1] if len(runs) > 1 or (runs and _get(ours, "startup", "from_cache")) else None
    row("`tinyvllm generate`, second process on the machine: process start to first token", "<= 10 s", 10.0, False,
        second and second["first_byte_s"],
        second and f"{second['first_byte_s']:.1f} s " + (f"(first, cold cache: {runs[0]['first_byte_s']:.1f} s)"
                                                          if len(runs) > 1 else "(on a copy of this run's cache)"))
    st = ours.get("stalls", {})
    stalls = st["compiles_after_ready"] + st["captures_after_ready"] if "compiles_after_ready" in st else None
    row("compiles or graph captures after the engine reports ready, over a varied workload", "0", 0, False, stalls,
        stalls is not None and f"{st['compiles_after_ready']} compiles, {st['captures_after_ready']} captures "
        f"(longest step {st['worst_step_s'] * 1e3:,.0f} ms)")
    return rows


def goals_markdown(results: dict) -> list[str]:
    """The goal table: one line per row of goal_rows."""
    torch_name = _peer_name(results.get("torch_peer", {}), "PyTorch compiled (ours)")
    hf = results.get("peer", {})
    hf_name = f"HF transformers {hf['version']}" if "version" in hf else "HF transformers"
    lines = ["", f"| goal workload | goal | tinyvllm | met | {torch_name} | {hf_name} |",
             "| --- | ---: | ---: | :---: | ---: | ---: |"]
    for r in goal_rows(results):
        met = {True: "yes", False: "**no**", None: "-"}[r["met"]]
        lines.append(f"| {r['workload']} | {r['goal']} | {r['measured']} | {met} | {r['torch']} | {r['hf']} |")
    return lines


def _peer_name(theirs: dict, default: str) -> str:
    return f"{default} (torch {theirs['torch']}, {theirs['dtype']}, {theirs['device']})" if "torch" in theirs \
        else default


def markdown(results: dict) -> str:
    """A section ready for BENCHMARKS.md: context lines, the goal table, the main table, the details."""
    cfg, ours, theirs = results["config"], results["tinyvllm"], results.get("peer", {})
    torch_ = results.get("torch_peer", {})
    s, v, model = cfg["sizes"], results["versions"], results["model"]
    what = f"random {model['preset']} model (seed {model['seed']})" if model["made"] else f"model {model['dir']}"
    lines = [
        f"{what}, bf16, greedy, ignore_eos; tinyvllm {ours.get('backend', '?')} backend "
        f"(matmul precision {ours.get('matmul_precision', cfg['matmul_precision'])}) on "
        f"{results.get('device', '?')}; {results['date'][:10]}; tinyvllm {v['tinyvllm']} "
        f"(commit {v['git_commit']}), numba {v['numba']}, numba-cuda {v['numba-cuda']}, numpy {v['numpy']}.",
        f"Command: `{results['command']}`",
    ]
    if set(cfg["workloads"]) & set(GOAL_WORKLOADS):
        lines += goals_markdown(results)
    rows = []  # workload, metric, tinyvllm, PyTorch peer, HF peer, speedup vs PyTorch, speedup vs HF

    def speedup(mine, peer, lower_is_better=False):
        if not mine or not peer:
            return ""
        return f"{(peer / mine if lower_is_better else mine / peer):.2f}x"

    lat, peer_lat, torch_lat = ours.get("latency"), theirs.get("latency", {}), torch_.get("latency")
    if lat or peer_lat or torch_lat:
        mine = lat and lat["decode_tok_s"]
        cell = f"{_rate(mine)} ({lat['roofline_fraction']:.0%} of roofline)" if lat else "-"
        mine_t = torch_lat and torch_lat["decode_tok_s"]
        for i, peer in enumerate([peer_lat[m] for m in ("static", "eager") if m in peer_lat] or [None]):
            rows.append([f"latency: batch 1, prompt {s['latency_prompt']}, {s['latency_new']} new", "decode tok/s",
                         cell, _rate(mine_t) if mine_t and i == 0 else ("-" if i == 0 else ""),
                         f"{_rate(peer['decode_tok_s'])} ({peer['mode']})" if peer else "-",
                         speedup(mine, mine_t) if i == 0 else "", speedup(mine, peer and peer["decode_tok_s"])])
    tp, peer_tp = ours.get("throughput", {}), theirs.get("throughput")
    if tp or peer_tp:
        for i, scheduler in enumerate(cfg["schedulers"]):
            mine = tp[scheduler]["output_tok_s"] if scheduler in tp else None
            peer = peer_tp["output_tok_s"] if peer_tp and i == 0 else None  # continuous batching: the first row
            rows.append([f"throughput: {s['num_requests']} requests, prompts {s['prompt_lens'][0]}-"
                         f"{s['prompt_lens'][1]}, outputs {s['output_lens'][0]}-{s['output_lens'][1]}",
                         f"output tok/s, {scheduler}", _rate(mine) + _shortfall(tp[scheduler]) if mine else "-", "-",
                         f"{_rate(peer)} (generate_batch, {peer_tp['subsample_short']}{_shortfall(peer_tp)})"
                         if peer else "", "", speedup(mine, peer)])
    for batch in map(str, sorted(cfg["static_batches"]) if "static" in cfg["workloads"] else []):
        mine, peer = _get(ours, "static", batch, "output_tok_s"), _get(torch_, "static", batch, "output_tok_s")
        rows.append([f"static batch {batch}, prompt {s['static_prompt']}, {s['static_new']} new",
                     "output tok/s (prefill included)", _rate(mine) if mine else "-", _rate(peer) if peer else "-",
                     "-", speedup(mine, peer), ""])
    pre, peer_pre, torch_pre = ours.get("prefill"), theirs.get("prefill"), torch_.get("prefill")
    if pre or peer_pre or torch_pre:
        mine, peer = pre and pre["ttft_ms"], peer_pre and peer_pre["ttft_ms"]
        mine_t = torch_pre and torch_pre["ttft_ms"]
        rows.append([f"prefill: {s['prefill_prompt']}-token prompt", "time to first token (ms)",
                     f"{mine:.2f}" if mine else "-",
                     f"{mine_t:.2f} ({torch_pre['mode']}; eager {torch_pre['eager_ttft_ms']:.2f})" if mine_t else "-",
                     f"{peer:.2f} ({peer_pre['mode']})" if peer else "-",
                     speedup(mine, mine_t, lower_is_better=True), speedup(mine, peer, lower_is_better=True)])
    if rows:
        peer_name = (f"HF transformers {theirs['version']} ({theirs['device']}, torch {v['torch']})"
                     if "version" in theirs else "HF transformers")
        lines += ["", f"| workload | metric | tinyvllm | {_peer_name(torch_, 'PyTorch compiled (ours)')} | "
                  f"{peer_name} | tinyvllm vs PyTorch | tinyvllm vs HF |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for above, row in zip([None] + rows, rows):  # a workload, metric or value repeated from above is blank
            lines.append("| " + " | ".join("" if above and j < 3 and c == above[j] else c
                                           for j, c in enumerate(row)) + " |")
    if lat:
        lines += ["", f"Roofline: {_bytes(model['weight_bytes_per_token'])} of weights per token at "
                  f"{ours['bandwidth_gbs']:,.0f} GB/s ({ours['bandwidth_source']}) = "
                  f"{ours['roofline_tok_s']:,.0f} tok/s at batch 1."]
    notes = [p["skipped"] for p in (torch_, theirs) if "skipped" in p] + theirs.get("notes", [])
    runs = [("latency", torch_.get("latency"))]
    runs += [(f"static batch {b}", r) for b, r in torch_.get("static", {}).items()]
    notes += [f"PyTorch peer {name}: decode step {r['mode']}"
              + (f", {r['eager_agreement']}" if r["eager_agreement"] else "") for name, r in runs if r]
    if notes:
        lines += [""] + [f"{note}." for note in notes]
    lines += details_markdown(results)
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
    lines += kvcache_markdown(results)
    lines += [f"\nFAILED: {e['job']}: {e['error']}" for e in results["errors"]]
    return "\n".join(lines) + "\n"


def details_markdown(results: dict) -> list[str]:
    """Step, startup and stalls in detail (or why each was skipped)."""
    ours, lines = results["tinyvllm"], []
    step = ours.get("step", {})
    if "skipped" in step:
        lines += ["", f"{step['skipped']}."]
    elif step:
        lines += ["", f"Decode step (plain CUDA graph replay, prompts of {step['context']} tokens): "
                  f"{step['summary']}."]
    startup = ours.get("startup")
    if startup:
        runs = "; ".join(f"{r['run']}: first token after {r['first_byte_s']:.1f} s, exit after {r['exit_s']:.1f} s"
                         for r in startup["runs"])
        cache = ("a copy of this run's kernel cache" if startup.get("from_cache")
                 else "a fresh kernel cache for the pair")
        lines += ["", f"Startup (`{startup['command']}`, {cache}): {runs}."]
    stalls = ours.get("stalls")
    if stalls and stalls["phases"]:
        lines += ["", f"Stalls: the engine ({stalls['backend']}) was ready {stalls['ready_s']:.1f} s after "
                  f"LLM() was called, with {stalls['prepared_at_ready']} kernel signatures prepared and "
                  f"{stalls['captures_at_ready']} graphs captured; then:", "",
                  "| phase | requests | steps | compiles | captures | longest step (ms) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {p['phase']} | {p['requests']} | {p['steps']} | {p['compiles']} | {p['captures']} | "
                  f"{p['worst_step_s'] * 1e3:,.1f} |" for p in stalls["phases"]]
    return lines


def kernels_markdown(results: dict) -> list[str]:
    """The kernels workload's table (its lines, each after a blank one), or the reason it was skipped."""
    kernels = results["tinyvllm"].get("kernels")
    if not kernels:
        return []
    if "skipped" in kernels:
        return ["", f"{kernels['skipped']}."]
    lines = ["", f"Single kernels as the engine launches them, on {kernels['device']}, matmul precision "
             f"{kernels['matmul_precision']}; each checked against reference/ before it was timed. "
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
                   help=f"{', '.join(WORKLOADS)}, goals (all but kernels) or all (none: only the --sweep)")
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
    p.add_argument("--matmul-precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="tinyvllm's matmul inputs: auto (default: the engine's own, bf16 on the GPU), fp32 (exact) "
                        "or rounded to bf16 (as vLLM and HF do)")
    p.add_argument("--kv-cache-dtype", choices=KV_FORMATS, default="bf16",
                   help="the KV cache's format of every tinyvllm engine but kvcache's (default bf16)")
    p.add_argument("--kv-formats", type=lambda text: [x for x in text.split(",") if x], default=list(KV_FORMATS),
                   metavar="F1,F2,...", help="kvcache: the formats compared (default bf16,fp8,fp32)")
    p.add_argument("--kv-throughput", type=lambda text: [x for x in text.split(",") if x], default=["bf16", "fp8"],
                   metavar="F1,F2,...", help="kvcache: the formats whose throughput is measured (default bf16,fp8)")
    p.add_argument("--bandwidth-gbs", type=float,
                   help="the copy bandwidth of the roofline (default: a device-to-device copy measured at the "
                        f"start; without a GPU, {H200_COPY_GBS:,.0f}: the H200's)")
    p.add_argument("--no-peer", action="store_true", help="skip every peer")
    p.add_argument("--peers", type=lambda text: [x for x in text.split(",") if x and x != "none"],
                   default=list(PEERS), metavar="torch,hf",
                   help="which peers run: torch (tools/torch_peer.py), hf (transformers), or none (default both)")
    p.add_argument("--static-batches", type=lambda text: [int(b) for b in text.split(",")], default=[16, 64, 256],
                   metavar="B1,B2,...", help="batch sizes of the static workload (default 16,64,256)")
    p.add_argument("--startup-from-cache", action="store_true",
                   help="startup: skip the cold-cache process; time one process on a copy of the kernel cache "
                        "this run's engines filled (saves the cold compile: about 140 s for the 1B model on an H100)")
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
    named = set(a.workloads) | (set(ALL_WORKLOADS) if "all" in a.workloads else set()) | \
        (set(GOAL_WORKLOADS) if "goals" in a.workloads else set())
    workloads = [w for w in WORKLOADS if w in named]
    unknown = [w for w in a.workloads if w not in (*WORKLOADS, "goals", "all")]
    if unknown:
        p.error(f"unknown workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)}, goals, all")
    if not a.workloads and not a.sweep:
        p.error(f"name a workload ({', '.join(WORKLOADS)}, goals, all) or give --sweep")
    if set(a.kv_formats + a.kv_throughput) - set(KV_FORMATS):
        p.error(f"--kv-formats and --kv-throughput take {', '.join(KV_FORMATS)}")
    if set(a.peers) - set(PEERS):
        p.error(f"unknown peer {sorted(set(a.peers) - set(PEERS))[0]!r} in --peers: choose from torch, hf, none")
    if (any(b < 1 for b in a.sweep + a.static_batches) or a.peer_requests < 1 or a.max_num_seqs < 1
            or (a.bandwidth_gbs is not None and not a.bandwidth_gbs > 0)):
        p.error("--sweep and --static-batches batch sizes, --peer-requests, --max-num-seqs and --bandwidth-gbs "
                "must be positive")
    return BenchConfig(workloads=workloads, sizes=QUICK if a.quick else Sizes(), model=a.model, preset=a.preset,
                       model_dir=a.model_dir, backend=a.backend,
                       schedulers=list(SCHEDULERS) if a.scheduler == "both" else [a.scheduler],
                       max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                       gpu_memory_utilization=a.gpu_memory_utilization, bandwidth_gbs=a.bandwidth_gbs,
                       matmul_precision=a.matmul_precision, kv_cache_dtype=a.kv_cache_dtype,
                       kv_formats=a.kv_formats, kv_throughput=a.kv_throughput, peer=not a.no_peer, peers=a.peers, peer_requests=a.peer_requests, sweep=a.sweep,
                       static_batches=a.static_batches, startup_from_cache=a.startup_from_cache, seed=a.seed,
                       command=shlex.join(["python3", "tools/bench.py", *argv])), a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, args = parse_args(argv)

    def emit(results):
        results["goals"] = goal_rows(results)
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
