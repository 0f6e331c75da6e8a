"""Where the time of one prefill goes, launcher by launcher, on the CUDA engine.

    python3 tools/profile_prefill.py [--model DIR | --preset llama-3.2-1b] [--prompt-tokens 1024]
                                     [--matmul-precision fp32 bf16] [--runs 3]

For each matmul precision: an engine (prefix caching off, so a repeated prompt is prefilled again) takes one
random prompt with max_tokens=1. First the plain time to first token, best of five after two warm-up runs,
measured by tools/bench.py's own tv_prefill. Then the same prefill with each engine-level launcher the
runner calls (the fused QKV + RoPE + KV write, attention, gate/up + SiLU, the other matmuls, the norms,
...) wrapped in a device synchronize on both sides, summed per launcher over the layers.

NOTE: the synchronizes take away the overlap of Python's launches with the GPU's work, so each launcher's
share includes its launch cost (tens of us per kernel, GPU.md) and the sum exceeds the plain TTFT. Read
it for where the time goes, not as kernel times; tools/kernel_benchmarks has those.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from cuda_kernels import compat  # noqa: E402,F401  (the numpy shim before numba.cuda)
from numba import cuda  # noqa: E402

from cuda_kernels import attention, embedding, matmul, rmsnorm, sampling  # noqa: E402
from tinyvllm import LLM  # noqa: E402
from tools.bench import greedy, tv_prefill  # noqa: E402

# (module, function, label): what cuda_runner's step calls; a launcher that calls another is timed once
LAUNCHERS = [(matmul, "matmul_rope_kv_write", "QKV + RoPE + KV write"), (matmul, "gated_matmul", "gate/up + SiLU*mul"),
             (matmul, "matmul", "matmul (O, down, LM head)"), (attention, "prefill_attention_tc", "attention"),
             (attention, "prefill_attention", "attention"), (rmsnorm, "fused_add_rmsnorm", "add + RMSNorm"),
             (rmsnorm, "rmsnorm", "RMSNorm"), (embedding, "embedding", "embedding"),
             (embedding, "gather_rows", "gather"), (sampling, "argmax", "argmax")]


def synced_breakdown(llm, prompt, runs: int) -> tuple[float, dict[str, tuple[float, int]]]:
    """(ms per prefill with every launcher synchronized, {label: (ms per prefill, calls per prefill)})."""
    seconds, calls, depth = defaultdict(float), defaultdict(int), [0]
    runner = llm.engine.runner
    attention_name = runner.prefill_attention.__name__   # chosen when the runner was built

    def timed(function, label):
        def run(*args, **kwargs):
            if depth[0]:
                return function(*args, **kwargs)
            depth[0] += 1
            cuda.synchronize()
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                cuda.synchronize()
                seconds[label] += time.perf_counter() - start
                calls[label] += 1
                depth[0] -= 1
        return run

    originals = [(module, name, getattr(module, name)) for module, name, _ in LAUNCHERS]
    for (module, name, label), (_, _, function) in zip(LAUNCHERS, originals):
        setattr(module, name, timed(function, label))
    runner.prefill_attention = getattr(attention, attention_name)
    try:
        start = time.perf_counter()
        for _ in range(runs):
            llm.generate([prompt], [greedy(1)], use_tqdm=False)
        total = (time.perf_counter() - start) / runs * 1e3
    finally:
        for module, name, function in originals:
            setattr(module, name, function)
        runner.prefill_attention = getattr(attention, attention_name)
    return total, {label: (s / runs * 1e3, calls[label] // runs) for label, s in seconds.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a model directory (default: a random model of --preset)")
    p.add_argument("--preset", default="llama-3.2-1b", help="random model preset (default llama-3.2-1b)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--matmul-precision", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    p.add_argument("--runs", type=int, default=3, help="synchronized prefills averaged (default 3)")
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from tinyvllm.random_model import make_random_model

        model = make_random_model(tempfile.mkdtemp(), args.preset, seed=0)
    for precision in args.matmul_precision:
        llm = LLM(model, backend="cuda", max_num_seqs=8, matmul_precision=precision,
                  gpu_memory_utilization=0.3, enable_prefix_caching=False)
        vocab = min(llm.engine.config.vocab_size, 10000)
        prompt = np.random.default_rng(0).integers(0, vocab, args.prompt_tokens).tolist()
        tv_prefill(llm, prompt, runs=2)   # compile, warm up
        ttft = tv_prefill(llm, prompt, runs=5)
        print(f"{precision}: TTFT best {ttft['ttft_ms']:.2f} ms of {[round(t, 2) for t in ttft['runs_ttft_ms']]}")
        total, parts = synced_breakdown(llm, prompt, args.runs)
        print(f"{precision}: {total:.2f} ms per prefill with every launcher synchronized")
        print("| launcher | ms per prefill | calls |\n| --- | ---: | ---: |")
        for label, (ms, n) in sorted(parts.items(), key=lambda kv: -kv[1][0]):
            print(f"| {label} | {ms:.2f} | {n} |")
        print(f"| sum | {sum(ms for ms, _ in parts.values()):.2f} | |", flush=True)
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
