"""The NumPy reference backend on the CPU next to Hugging Face transformers, in one run.

    python tools/bench_cpu.py [decode] [prefill] [--model DIR | --preset smollm2-135m] [options]
    python tools/bench_cpu.py                                   # decode on the embedded default model
    python tools/bench_cpu.py prefill --preset smollm2-135m     # a 4,363-token prefill, no download

Both engines compute in float32 from the same bf16 weights (transformers loads them with dtype=float32,
as tinyvllm's reference widens them) and run greedily. Workloads:

- decode: the chat prompt below, --new-tokens new tokens (eos ignored, so both make as many). Prefill time
  and decode tokens/s for each, their ratio, and how many greedy tokens agree.
- prefill: one prompt of --prompt-tokens token ids (seeded random ids below 256, valid in every
  vocabulary; 4,363 is the prompt of issue 27), timed to its first token: tinyvllm through LLM.generate with
  max_tokens=1 (arrival to first token), transformers as one forward with the last token's logits only
  (logits_to_keep=1, as its generate does), each best of --repeats after a warm-up, the two taking turns.
  Also the process's CPU time of each run (all threads: near the wall time times the threads when the
  machine is quiet; on a busy machine, what the run cost while the wall time also counts waiting) and
  the first greedy token of each.

The model is the embedded default (SmolLM2-135M-Instruct), --model DIR, or with --preset a random model of
that preset's shapes made in a temporary directory (smollm2-135m has the default model's shapes, so its
times are the default model's). transformers and torch are optional: without them only tinyvllm is
measured. tinyvllm's long prefills run on one thread per core the process may use, each with one BLAS
thread (reference/parallel.py); otherwise NumPy's BLAS takes its thread count from the environment
(OPENBLAS_NUM_THREADS, ...). torch takes it from torch.set_num_threads; both default to every core, so
`taskset -c 0 python tools/bench_cpu.py ...` compares the two on one core. The report names the machine
and the thread counts.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

try:
    import tinyvllm  # noqa: F401
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference.parallel import WORKERS
from tinyvllm import LLM, SamplingParams
from tinyvllm.default_model import default_model_dir
from tinyvllm.random_model import PRESETS, make_random_model
from tinyvllm.tokenizer import Tokenizer

PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
WORKLOADS = ("decode", "prefill")


def long_prompt(num_tokens: int) -> list[int]:
    """Seeded random ids below 256: the same prompt for both engines, in any vocabulary."""
    return np.random.default_rng(0).integers(0, 256, num_tokens).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def bench_tinyvllm_decode(llm: LLM, new_tokens: int) -> dict:
    llm.generate([PROMPT], greedy(4), use_tqdm=False)
    out = llm.generate([PROMPT], greedy(new_tokens), use_tqdm=False)[0]
    m, n = out.metrics, len(out.outputs[0].token_ids)
    return {"prompt_tokens": len(out.prompt_token_ids), "new_tokens": n, "tokens": out.outputs[0].token_ids,
            "prefill_s": m["first_token_time"] - m["arrival_time"],
            "decode_tok_s": (n - 1) / (m["last_token_time"] - m["first_token_time"])}


def prefill_tinyvllm(llm: LLM, prompt: list[int]) -> tuple[float, float, int]:
    """(seconds from arrival to the first token, the process's CPU seconds meanwhile, that token)."""
    cpu = time.process_time()
    out = llm.generate([prompt], greedy(1), use_tqdm=False)[0]
    return (out.metrics["first_token_time"] - out.metrics["arrival_time"], time.process_time() - cpu,
            out.outputs[0].token_ids[0])


def load_transformers(model_dir: Path):
    """(torch, the model in float32), or None when they are not importable."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    return torch, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def bench_transformers_decode(torch, model, new_tokens: int, prompt_ids: list[int]) -> dict:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        model(ids)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        total = time.perf_counter() - start
    n = out.shape[1] - len(prompt_ids)
    # generate() includes one prefill; take it out to compare decode rates
    return {"new_tokens": n, "tokens": out[0, len(prompt_ids):].tolist(), "prefill_s": prefill,
            "decode_tok_s": (n - 1) / max(total - prefill, 1e-9)}


def prefill_transformers(torch, model, prompt: list[int]) -> tuple[float, float, int]:
    """(seconds of one forward over the prompt, the process's CPU seconds meanwhile, the greedy next token)."""
    with torch.inference_mode():
        start, cpu = time.perf_counter(), time.process_time()
        logits = model(torch.tensor([prompt]), logits_to_keep=1).logits
        return time.perf_counter() - start, time.process_time() - cpu, int(logits[0, -1].argmax())


def report_decode(model_dir: Path, llm: LLM, peer, new_tokens: int) -> None:
    ours = bench_tinyvllm_decode(llm, new_tokens)
    theirs = peer and bench_transformers_decode(*peer, new_tokens, Tokenizer.from_dir(model_dir).encode_chat(PROMPT))
    print(f"\ndecode: prompt {ours['prompt_tokens']} tokens, {new_tokens} new tokens, greedy")
    print("| engine | prefill (ms) | decode tokens/s |")
    print("| --- | ---: | ---: |")
    print(f"| tinyvllm CPU reference (NumPy) | {ours['prefill_s'] * 1e3:.0f} | {ours['decode_tok_s']:.1f} |")
    if theirs is None:
        print("transformers/torch not importable: peer not measured")
        return
    print(f"| HF transformers, float32 | {theirs['prefill_s'] * 1e3:.0f} | {theirs['decode_tok_s']:.1f} |")
    print(f"ratio tinyvllm / transformers decode: {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x")
    same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
    print(f"greedy tokens identical for {same} of {min(len(ours['tokens']), len(theirs['tokens']))} positions")


def report_prefill(llm: LLM, peer, prompt_tokens: int, repeats: int) -> None:
    prompt = long_prompt(prompt_tokens)
    engines = {"tinyvllm CPU reference (NumPy)": lambda p: prefill_tinyvllm(llm, p)}
    if peer:
        engines["HF transformers, float32"] = lambda p: prefill_transformers(*peer, p)
    for run in engines.values():
        run(prompt[:64])                                     # warm-up
    runs = {name: [] for name in engines}
    for _ in range(repeats):  # the engines take turns, so a change in the machine's load hits both
        for name, run in engines.items():
            runs[name].append(run(prompt))
    print(f"\nprefill: one {prompt_tokens}-token prompt, time to the first token, best of {repeats} (runs alternate)")
    print("| engine | prefill (s) | runs (s) | CPU time of the runs (s) | first token |")
    print("| --- | ---: | --- | --- | ---: |")
    for name, results in runs.items():
        times, cpus = [r[0] for r in results], [r[1] for r in results]
        print(f"| {name} | {min(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} | "
              f"{', '.join(f'{t:.2f}' for t in cpus)} | {results[-1][2]} |")
    if not peer:
        print("transformers/torch not importable: peer not measured")
        return
    best = [min(r[0] for r in results) for results in runs.values()]
    print(f"ratio transformers / tinyvllm prefill time: {best[1] / best[0]:.2f}x")


def machine(peer) -> str:
    blas = next((f"{k}={os.environ[k]}" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
                 if k in os.environ), "BLAS threads: default")
    torch_part = f", torch {peer[0].__version__} with {peer[0].get_num_threads()} threads" if peer else ""
    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"NumPy {np.__version__} ({blas}; reference threads: {WORKERS}){torch_part}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", choices=WORKLOADS, default=["decode"], metavar="WORKLOAD",
                        help=f"any of {', '.join(WORKLOADS)} (default decode)")
    parser.add_argument("--model", type=Path, help="model directory (default: the embedded default model)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a random model of these shapes instead")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode: new tokens (default 64)")
    parser.add_argument("--prompt-tokens", type=int, default=4363, help="prefill: prompt length (default 4363)")
    parser.add_argument("--repeats", type=int, default=2, help="prefill: timed runs per engine (default 2)")
    parser.add_argument("--no-peer", action="store_true", help="skip HF transformers")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = (make_random_model(Path(tmp), args.preset) if args.preset
                     else args.model or default_model_dir())
        # no prefix caching: a warm-up request must not hand a measured one a cached prompt
        llm = LLM(model_dir, backend="cpu", enable_prefix_caching=False)
        peer = None if args.no_peer else load_transformers(model_dir)
        print(f"model {args.preset + ' (random weights)' if args.preset else model_dir.name}; {machine(peer)}")
        if "decode" in args.workloads:
            report_decode(model_dir, llm, peer, args.new_tokens)
        if "prefill" in args.workloads:
            report_prefill(llm, peer, args.prompt_tokens, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
