"""Load a running OpenAI-compatible server and measure it as vLLM's serving benchmark does.

    tinyvllm serve --model DIR &                       # or any OpenAI-compatible server
    python tools/bench_serve.py --num-prompts 200 --max-concurrency 32
    python tools/bench_serve.py --num-prompts 200 --request-rate 4 --json out.json
    python tools/bench_serve.py --dataset throughput --num-prompts 256 --token-high 10000

Requests are streamed (server-sent events) completions, each generating exactly its number of tokens
(ignore_eos, as vLLM's random dataset does), so every run asks the same work. Two datasets:
- words (the default): prompts of --input-words random words, --output-len tokens each;
- throughput: tools/bench.py's throughput workload (seed --seed): prompt ids drawn from [0, --token-high)
  (use min(10000, the vocabulary size), as bench.py does), prompt and output lengths uniform in --prompt-lens
  and --output-lens, so that the server's output tokens/s compare with `tools/bench.py throughput`'s offline
  LLM.generate on the same requests.
They arrive all at once (the default) or as a Poisson process at --request-rate per second; at most
--max-concurrency are in flight, so `--max-concurrency N` alone is N clients sending back to back.

Reported: request throughput, output tokens/s, and p50 / p90 / p99 of
- TTFT, time to first token: from sending the request to its first chunk with choices, as vLLM's benchmark
  counts it (its text may be empty: a token that decodes to no text, such as a special token, still comes as
  a chunk from vLLM's server and tinyvllm's);
- TPOT, time per output token: (latency - TTFT) / (output tokens - 1), per request;
- ITL, inter-token latency: the gaps between successive chunks with choices (a chunk may carry more than one
  token when the client falls behind the server, so this is per chunk);
- E2E, the whole request.
Token counts are the server's own (stream_options.include_usage). The streams are read with a few lines of
HTTP/1.1 over asyncio (http_stream); httpx (in tinyvllm's test extra) asks for the model's name.

--server transformers speaks to `transformers serve` (Hugging Face's OpenAI-compatible server), which refuses
vLLM's fields with a 422 and takes text prompts only: prompts given as token ids (the throughput dataset) are
decoded to text with --tokenizer's tokenizer.json (so the server's own tokenization may count a few tokens
differently: its usage is what is reported), EOS is switched off through its `generation_config` field
(eos_token_id -1) instead of ignore_eos, and it always sends usage in its last chunk. --warmup N sends N short
requests first, untimed (a server that compiles or allocates on its first requests pays for it there).
tools/serve_benchmark.py runs this client against tinyvllm and transformers on the GPU, beside the offline
LLM.generate on the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: tools.bench, for its throughput workload
    sys.path.insert(0, str(REPO))

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "number group problem fact model token cache block batch kernel memory queue server stream").split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def text_prompts(requests: list[tuple[str | list[int], int]], tokenizer_dir: str | None) -> list[tuple[str, int]]:
    """The requests with token-id prompts decoded to text (for a server that takes text only)."""
    if all(isinstance(prompt, str) for prompt, _ in requests):
        return requests
    if tokenizer_dir is None:
        raise SystemExit("token-id prompts for a text-only server: give --tokenizer (a model directory)")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return [(p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False), n) for p, n in requests]


def request_body(model: str, prompt: str | list[int], output_len: int, server: str) -> dict:
    """A streamed greedy completion of exactly output_len tokens, in the server's dialect."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True}
    if server == "transformers":
        # no ignore_eos or stream_options (refused); its generation_config replaces the model's (EOS -1: never)
        body["generation_config"] = json.dumps({"eos_token_id": -1, "do_sample": False, "max_new_tokens": output_len})
    else:
        body.update(ignore_eos=True, stream_options={"include_usage": True})
    return body


def make_requests(args) -> list[tuple[str | list[int], int]]:
    """(prompt, output length) pairs of the chosen dataset."""
    if args.dataset == "words":
        return [(p, args.output_len) for p in make_prompts(args.num_prompts, args.input_words, args.seed)]
    from tools.bench import random_requests  # the offline benchmark's own workload

    return random_requests(np.random.default_rng(args.seed), args.num_prompts, tuple(args.prompt_lens),
                           tuple(args.output_lens), args.token_high)


async def http_stream(url: str, body: dict, headers: dict[str, str]) -> AsyncIterator[tuple[float, bytes]]:
    """POST `body` as JSON on a connection of its own and yield the response's body as it arrives, as
    (arrival time, bytes); raises HTTPStatus for a status other than 200.

    NOTE: a few lines of HTTP/1.1 over asyncio streams instead of httpx: with hundreds of streams in flight,
    httpx's connection pool and per-read layers cost this client ~50 us of CPU per chunk (py-spy: a third of it
    in the pool's bookkeeping), so at saturation (~20k chunks/s) the client, not the server, was the limit.
    A connection per request, as httpx's pool gave every one of the requests sent at once."""
    target = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(target.hostname, target.port or 80, limit=1 << 20)
    try:
        payload = json.dumps(body).encode()
        head = [f"POST {target.path} HTTP/1.1", f"Host: {target.netloc}", "Content-Type: application/json",
                f"Content-Length: {len(payload)}", "Accept: text/event-stream", "Connection: close",
                *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        status = int((await reader.readline()).split()[1])
        fields = {}
        while (line := await reader.readline()).strip():
            name, _, value = line.decode("latin-1").partition(":")
            fields[name.strip().lower()] = value.strip()
        chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        if status != 200:
            raise HTTPStatus(status, await reader.read())  # (chunked: its framing shows, in an error message)
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    return
                data = (await reader.readexactly(size + 2))[:-2]
            else:
                data = await reader.read(1 << 16)
                if not data:
                    return
            yield time.perf_counter(), data
    finally:
        writer.close()


class HTTPStatus(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:200]!r}")


async def one_request(url: str, body: dict, headers: dict[str, str]) -> Result:
    start = time.perf_counter()
    chunks: list[float] = []
    usage = None
    pending = b""
    try:
        async for arrived, data in http_stream(url, body, headers):
            # server-sent events: "data: ..." lines, an empty line after each; those of one read share its time
            *events, pending = (pending + data).replace(b"\r\n", b"\n").split(b"\n\n")
            for line in (line for e in events for line in e.split(b"\n")):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # OpenAI's {"message": ...}, or a bare string (transformers serve)
                    error = event["error"]
                    return Result(False, error=str(error.get("message", error) if isinstance(error, dict) else error))
                if event.get("usage"):
                    usage = event["usage"]
                # as vLLM's benchmark: any chunk with choices is a token's, text or not (a random model's tokens
                # may decode to none); the usage chunk's choices are []. (A chat stream's opening chunk, the role
                # only, would count too: this client sends completions only, which have none.)
                if event.get("choices"):
                    chunks.append(arrived)
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, HTTPStatus) as exc:
        return Result(False, error=str(exc) if isinstance(exc, HTTPStatus) else f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if not chunks or usage is None:
        return Result(False, error="no choices or no usage in the stream")
    return Result(True, ttft=chunks[0] - start, latency=end - start, prompt_tokens=usage["prompt_tokens"],
                  output_tokens=usage["completion_tokens"], itl=list(np.diff(chunks)))


async def run(args) -> dict:
    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None)) as http:
        model = args.model or (await http.get(f"{base}/v1/models")).json()["data"][0]["id"]
        requests = make_requests(args)
        if args.server == "transformers":
            requests = text_prompts(requests, args.tokenizer)
        bodies = [request_body(model, prompt, output_len, args.server) for prompt, output_len in requests]
        gate = asyncio.Semaphore(args.max_concurrency)
        arrivals = np.random.default_rng(args.seed)

        async def gated(body):
            async with gate:
                return await one_request(f"{base}/v1/completions", body, headers)

        warmup_s = 0.0
        if args.warmup:  # short requests, untimed, all at once; prompts of their own (none cached for the run)
            warm = [request_body(model, prompt, 16, args.server)
                    for prompt in make_prompts(args.warmup, args.input_words, args.seed + 1)]
            start = time.perf_counter()
            failed = [r.error for r in await asyncio.gather(*(gated(b) for b in warm)) if not r.ok]
            warmup_s = time.perf_counter() - start
            if failed:
                raise SystemExit(f"warm-up requests failed: {failed[0]}")

        start, cpu = time.perf_counter(), time.process_time()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(gated(body)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(arrivals.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        # NOTE: near 1 per second of the run, this client (one Python thread) was the bottleneck, not the server
        client_cpu_s = time.process_time() - cpu
    return {**summarize(results, duration, model, args), "warmup_s": warmup_s, "client_cpu_s": client_cpu_s}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[Result], duration: float, model: str, args) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "model": model, "server": args.server, "num_prompts": len(results), "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency, "warmup": args.warmup,
        "dataset": args.dataset,
        "dataset_options": ({"input_words": args.input_words, "output_len": args.output_len}
                            if args.dataset == "words" else
                            {"prompt_lens": args.prompt_lens, "output_lens": args.output_lens,
                             "token_high": args.token_high, "seed": args.seed}),
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_ms": percentiles([gap for r in ok for gap in r.itl]),
        "e2e_ms": percentiles([r.latency for r in ok]),
    }


def report(s: dict) -> str:
    lines = [f"model {s['model']}: {s['completed']}/{s['num_prompts']} requests completed in {s['duration_s']:.2f} s "
             f"(rate {s['request_rate']}/s, max concurrency {s['max_concurrency']})",
             f"prompt tokens {s['prompt_tokens']}, output tokens {s['output_tokens']}",
             f"request throughput {s['request_throughput']:.2f} req/s, output {s['output_throughput']:.1f} tok/s",
             f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        p = s[f"{name}_ms"]
        cells = "".join(f"{p[k]:>10.2f}" if p[k] is not None else f"{'-':>10}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name.upper():<6}{cells}")
    if s.get("client_cpu_s") is not None:
        lines.append(f"client CPU {s['client_cpu_s']:.2f} s in {s['duration_s']:.2f} s "
                     "(near 1:1 would mean the client, not the server, was the bottleneck)")
    if s["failed"]:
        lines.append(f"{s['failed']} failed, e.g.: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    p.add_argument("--dataset", choices=("words", "throughput"), default="words",
                   help="words (default): random words; throughput: tools/bench.py's throughput requests")
    p.add_argument("--input-words", type=int, default=64, help="words: random words per prompt (default 64)")
    p.add_argument("--output-len", type=int, default=64, help="words: tokens generated per request (default 64)")
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"),
                   help="throughput: prompt lengths in tokens (default 100 1024, as tools/bench.py)")
    p.add_argument("--output-lens", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"),
                   help="throughput: output lengths in tokens (default 100 1024, as tools/bench.py)")
    p.add_argument("--token-high", type=int, default=10000,
                   help="throughput: prompt ids are drawn from [0, N) (default 10000)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=64, help="most requests in flight (default 64)")
    p.add_argument("--server", choices=("tinyvllm", "transformers"), default="tinyvllm",
                   help="the server's dialect: tinyvllm (default; also vLLM's) or transformers (`transformers serve`)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="--server transformers: a model directory whose tokenizer.json decodes token-id prompts")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="send N short requests first, untimed (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_concurrency < 1 or args.output_len < 1 or args.request_rate <= 0:
        p.error("--num-prompts, --max-concurrency, --output-len and --request-rate must be positive")
    if args.warmup < 0:
        p.error("--warmup must be 0 or more")
    summary = asyncio.run(run(args))
    print(report(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
