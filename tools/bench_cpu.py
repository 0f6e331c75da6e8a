"""CPU decode speed of the NumPy reference backend next to Hugging Face transformers, in one run.

    python tools/bench_cpu.py [--model DIR] [--new-tokens 64] [--threads N]

Both generate greedily from the same chat prompt with the same bf16 weights (transformers computes in
float32, as tinyvllm's reference does) and ignore eos so they produce the same number of tokens. Reports
prefill time and decode tokens/s for each and their ratio. transformers and torch are optional: without
them only tinyvllm is measured.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

try:
    import tinyvllm  # noqa: F401
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyvllm import LLM, SamplingParams
from tinyvllm.default_model import default_model_dir
from tinyvllm.tokenizer import Tokenizer

PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def bench_tinyvllm(model_dir: Path, new_tokens: int) -> dict:
    # no prefix caching: the warm-up request must not hand the measured one a cached prompt
    llm = LLM(model_dir, backend="cpu", enable_prefix_caching=False)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                       use_tqdm=False)[0]
    m, n = out.metrics, len(out.outputs[0].token_ids)
    return {"prompt_tokens": len(out.prompt_token_ids), "new_tokens": n, "tokens": out.outputs[0].token_ids,
            "prefill_s": m["first_token_time"] - m["arrival_time"],
            "decode_tok_s": (n - 1) / (m["last_token_time"] - m["first_token_time"])}


def bench_transformers(model_dir: Path, new_tokens: int, prompt_ids: list[int]) -> dict | None:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
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
            "decode_tok_s": (n - 1) / max(total - prefill, 1e-9), "versions": f"torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model directory (default: the embedded default model)")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model_dir = args.model or default_model_dir()
    ours = bench_tinyvllm(model_dir, args.new_tokens)
    tokenizer = Tokenizer.from_dir(model_dir)
    theirs = bench_transformers(model_dir, args.new_tokens, tokenizer.encode_chat(PROMPT))
    print(f"model {model_dir.name}, prompt {ours['prompt_tokens']} tokens, {args.new_tokens} new tokens, greedy; "
          f"{platform.processor() or platform.machine()}, {platform.python_version()}")
    print("| engine | prefill (ms) | decode tokens/s |")
    print("| --- | ---: | ---: |")
    print(f"| tinyvllm CPU reference (NumPy) | {ours['prefill_s'] * 1e3:.0f} | {ours['decode_tok_s']:.1f} |")
    if theirs is None:
        print("transformers/torch not importable: peer not measured")
        return 0
    print(f"| HF transformers, float32 ({theirs['versions']}) | {theirs['prefill_s'] * 1e3:.0f} | "
          f"{theirs['decode_tok_s']:.1f} |")
    print(f"ratio tinyvllm / transformers decode: {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x")
    same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
    print(f"greedy tokens identical for {same} of {min(len(ours['tokens']), len(theirs['tokens']))} positions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
