"""Where the time of one prefill goes, launcher by launcher, on the CUDA engine.

    python3 tools/profile_prefill.py [--model DIR | --preset llama-3.2-1b] [--prompt-tokens 1024]
                                     [--matmul-precision fp32 bf16] [--runs 3] [--reps 10]

For each matmul precision: an engine (prefix caching off, so a repeated prompt is prefilled again) takes one
random prompt with max_tokens=1. First the plain time to first token, best of five after a warm-up run,
measured by tools/bench.py's own tv_prefill, and the Python time of issuing the step's launches (the
runner's forward call, timed without a synchronize). Then two breakdowns per engine-level launcher the
runner calls (the fused QKV + RoPE + KV write, attention, the MLP, the other matmuls, the norms,
...), summed over the layers:

- graph: each launcher's kernels captured into a CUDA graph and replayed (the mean of --reps replays,
  timed with events): GPU time without launch cost. The whole step is also captured as one graph, which
  is the prefill's GPU time with Python out of the way.
- synced: each launcher wrapped in a device synchronize on both sides.

NOTE: the synchronizes take away the overlap of Python's launches with the GPU's work, so a synced share
includes the launch cost (tens of us per kernel, GPU.md) and the synced sum exceeds the plain TTFT. The
replays run on a warm L2 and repeat in-place updates (the residual add, the KV write), which changes
values, not times.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from cuda_kernels import compat  # noqa: E402,F401  (the numpy shim before numba.cuda)
from cuda_kernels.compat import SIMULATOR  # noqa: E402
from numba import cuda  # noqa: E402

from cuda_kernels import attention_policy, embedding, matmul, matmul_policy, rmsnorm, sampling_policy  # noqa: E402
from tinyvllm import LLM  # noqa: E402
from tinyvllm.cuda_graph import CUDAGraph  # noqa: E402
from tools.bench import greedy, tv_prefill  # noqa: E402

# (module, function, label): what cuda_runner's step calls; a launcher that calls another is timed once
LAUNCHERS = [(matmul, "matmul_rope_kv_write", "QKV + RoPE + KV write"), (matmul, "mlp", "MLP (gate/up + SiLU, down)"),
             (matmul, "matmul", "matmul (O, LM head)"), (attention_policy, "prefill_attention", "attention"),
             (rmsnorm, "fused_add_rmsnorm", "add + RMSNorm"),
             (rmsnorm, "rmsnorm", "RMSNorm"), (embedding, "embedding", "embedding"),
             (embedding, "gather_rows", "gather"), (sampling_policy, "greedy", "argmax")]


class Wrapped:
    """Every launcher in LAUNCHERS replaced by around(function, label, args, kwargs) for the outermost calls,
    while the `with` block runs."""

    def __init__(self, around):
        self.around, self.depth = around, 0

    def _wrap(self, function, label):
        def run(*args, **kwargs):
            if self.depth:
                return function(*args, **kwargs)
            self.depth += 1
            try:
                return self.around(function, label, args, kwargs)
            finally:
                self.depth -= 1
        return run

    def __enter__(self):
        self.originals = [(module, name, getattr(module, name)) for module, name, _ in LAUNCHERS]
        for (module, name, label), (_, _, function) in zip(LAUNCHERS, self.originals):
            setattr(module, name, self._wrap(function, label))
        return self

    def __exit__(self, *exc):
        for module, name, function in self.originals:
            setattr(module, name, function)


def replay_ms(record, stream, reps: int) -> float:
    """GPU ms of the launches record(stream) makes, captured as a CUDA graph: the mean of reps replays."""
    graph = CUDAGraph(record, stream)
    graph.replay()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    for _ in range(reps):
        graph.replay()
    end.record(stream)
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / reps


def issue_ms(llm, prompt, runs: int) -> float:
    """Python ms of the runner's forward call (the step's launches, issued without waiting), best of runs."""
    runner, times = llm.engine.runner, []
    forward = runner._forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        forward(*args, **kwargs)
        times.append((time.perf_counter() - start) * 1e3)

    runner._forward = timed
    try:
        for _ in range(runs):
            llm.generate([prompt], [greedy(1)], use_tqdm=False)
    finally:
        del runner._forward
    return min(times)


def graph_breakdown(llm, prompt, reps: int) -> tuple[float, dict[str, tuple[float, int]]]:
    """(GPU ms of the whole step as one graph, {label: (GPU ms per prefill, calls per prefill)})."""
    runner = llm.engine.runner
    seconds, calls, steps = defaultdict(float), defaultdict(int), []

    def around(function, label, args, kwargs):
        seconds[label] += replay_ms(lambda _stream: function(*args, **kwargs), runner.stream, reps)
        calls[label] += 1

    forward = runner._forward

    def keep(*args, **kwargs):
        steps.append((args, kwargs))
        forward(*args, **kwargs)

    runner._forward = keep
    try:
        with Wrapped(around):
            llm.generate([prompt], [greedy(1)], use_tqdm=False)
    finally:
        del runner._forward
    (v, shape, max_q_len, greedy_step, stream), _ = steps[0]
    whole = replay_ms(lambda s: forward(v, shape, max_q_len, greedy_step, s, chained=False), stream, reps)
    return whole, {label: (s, calls[label]) for label, s in seconds.items()}


def synced_breakdown(llm, prompt, runs: int) -> tuple[float, dict[str, tuple[float, int]]]:
    """(ms per prefill with every launcher synchronized, {label: (ms per prefill, calls per prefill)})."""
    seconds, calls = defaultdict(float), defaultdict(int)

    def around(function, label, args, kwargs):
        cuda.synchronize()
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            cuda.synchronize()
            seconds[label] += time.perf_counter() - start
            calls[label] += 1

    with Wrapped(around):
        start = time.perf_counter()
        for _ in range(runs):
            llm.generate([prompt], [greedy(1)], use_tqdm=False)
        total = (time.perf_counter() - start) / runs * 1e3
    return total, {label: (s / runs * 1e3, calls[label] // runs) for label, s in seconds.items()}


def switch_ab(llm, prompt, module, flag: str, names: tuple[str, str], rounds: int = 2) -> None:
    """The TTFT with a policy switch (module.flag) off and on (names[0], names[1]; best of 5, `rounds` times
    in turn, in the same engine), and whether the two give the same 8 greedy tokens."""
    tokens, before = {}, getattr(module, flag)
    try:
        for rnd in range(rounds):
            for on in (False, True):
                setattr(module, flag, on)
                ttft = tv_prefill(llm, prompt, runs=5)
                out = llm.generate([prompt], [greedy(8)], use_tqdm=False)[0]
                tokens.setdefault(on, out.outputs[0].token_ids)
                print(f"round {rnd} {names[on]}: TTFT best {ttft['ttft_ms']:.2f} ms of "
                      f"{[round(t, 2) for t in ttft['runs_ttft_ms']]}", flush=True)
    finally:
        setattr(module, flag, before)
    print(f"{names[0]} and {names[1]}: the 8 greedy tokens equal: {tokens[False] == tokens[True]}", flush=True)


def print_table(title: str, parts: dict[str, tuple[float, int]]) -> None:
    print(f"| {title} | ms per prefill | calls |\n| --- | ---: | ---: |")
    for label, (ms, n) in sorted(parts.items(), key=lambda kv: -kv[1][0]):
        print(f"| {label} | {ms:.2f} | {n} |")
    print(f"| sum | {sum(ms for ms, _ in parts.values()):.2f} | |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a model directory (default: a random model of --preset)")
    p.add_argument("--preset", default="llama-3.2-1b", help="random model preset (default llama-3.2-1b)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--matmul-precision", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    p.add_argument("--runs", type=int, default=3, help="synchronized prefills averaged (default 3)")
    p.add_argument("--reps", type=int, default=10, help="replays of each captured graph timed (default 10)")
    p.add_argument("--attention-ab", action="store_true",
                   help="also time the TTFT with prefill attention on attention_tc and on the pipelined kernel, "
                        "alternating in the same engine (attention_policy.PREFILL_PIPELINED), two rounds")
    p.add_argument("--wgmma-ab", action="store_true",
                   help="also time the TTFT with the prefill GEMMs on gemm_pipelined and on gemm_wgmma (bf16 "
                        "inputs), alternating in the same engine (matmul_policy.WGMMA_IN_ENGINE), two rounds")
    p.add_argument("--tall-ab", action="store_true",
                   help="also time the TTFT with gemm_wgmma's 256-row tile in its policy and without (bf16 "
                        "inputs), alternating in the same engine (matmul_policy.WGMMA_TALL_IN_ENGINE), two rounds")
    p.add_argument("--tma-ab", action="store_true",
                   help="also time the TTFT with the prefill GEMMs on gemm_wgmma and on gemm_tma (bf16 inputs), "
                        "alternating in the same engine (matmul_policy.TMA_IN_ENGINE), two rounds")
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
        ttft = tv_prefill(llm, prompt, runs=5)   # after its own untimed prefill, which compiles
        print(f"{precision}: TTFT best {ttft['ttft_ms']:.2f} ms of {[round(t, 2) for t in ttft['runs_ttft_ms']]}")
        print(f"{precision}: Python issues the step's launches in {issue_ms(llm, prompt, 3):.2f} ms")
        if SIMULATOR:
            print(f"{precision}: graph replays skipped (the simulator cannot capture)")
        else:
            whole, parts = graph_breakdown(llm, prompt, args.reps)
            print(f"{precision}: {whole:.2f} ms of GPU time for the step replayed as one CUDA graph")
            print_table(f"launcher ({precision}), graph replay", parts)
        if args.attention_ab:
            switch_ab(llm, prompt, attention_policy, "PREFILL_PIPELINED", ("attention_tc", "pipelined"))
        if args.wgmma_ab and precision == "bf16":
            switch_ab(llm, prompt, matmul_policy, "WGMMA_IN_ENGINE", ("gemm_pipelined", "gemm_wgmma"))
        if args.tall_ab and precision == "bf16":
            switch_ab(llm, prompt, matmul_policy, "WGMMA_TALL_IN_ENGINE", ("128-row tiles", "256-row tile"))
        if args.tma_ab and precision == "bf16":
            switch_ab(llm, prompt, matmul_policy, "TMA_IN_ENGINE", ("gemm_wgmma", "gemm_tma"))
        total, parts = synced_breakdown(llm, prompt, args.runs)
        print(f"{precision}: {total:.2f} ms per prefill with every launcher synchronized")
        print_table(f"launcher ({precision}), synchronized", parts)
        del llm
        gc.collect()   # then numba's deferred frees, so that the next engine finds the memory free
        if not SIMULATOR:
            cuda.current_context().deallocations.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
