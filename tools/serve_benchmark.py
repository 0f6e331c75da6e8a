"""Issue 28's serving benchmark in one run: tinyvllm's server against the offline LLM.generate on the same
requests, and against `transformers serve` (Hugging Face's OpenAI-compatible server) on the same card.

    python tools/serve_benchmark.py tinyvllm --model DIR --out OUT [--backend cuda] [--runs inf:256,4:120]
    python tools/serve_benchmark.py transformers --model DIR --out OUT [--runs inf:64] [--device cuda:0]
    python tools/serve_benchmark.py table --out OUT      # OUT/serve_bench.md from OUT/tinyvllm.json, transformers.json

A run is RATE:N: N requests of tools/bench.py's throughput workload (seed --seed, prompt ids drawn from
[0, min(10000, vocabulary)), prompt and output lengths uniform in --prompt-lens and --output-lens, every request
generating exactly its output length), sent by tools/bench_serve.py (a process of its own) as Poisson arrivals
at RATE per second, or all at once for inf, with no cap on the requests in flight: inf is the saturation run.

tinyvllm: engines built as `tinyvllm serve --model DIR --backend B` builds its (max_num_seqs 256,
max_num_batched_tokens 8192, gpu_memory_utilization 0.9, bf16 matmul inputs on the GPU) but for prefix caching,
off: the runs send the same prompts again, and a prompt cached by an earlier run would make a later one cheaper
(random prompts share no prefix within a run). First, in a process of its own (which then gives the GPU back),
LLM.generate on each saturation run's N requests (the offline output tokens/s); then `tinyvllm serve`'s app
(uvicorn in a thread of this process) over an engine in a process of its own, as `tinyvllm serve` runs it
(--engine thread: in a thread of this process), for the runs.

transformers: `transformers serve DIR --continuous-batching` in a subprocess (its paged continuous batching; the
default runs one `generate` per request in turn), offline (HF_HUB_OFFLINE), on --device; bench_serve's
--server transformers dialect (text prompts, EOS off through generation_config).

Each server gets 8 short untimed requests before its first run, and the offline engine 8 before its first
LLM.generate (tinyvllm's engine has compiled its kernels and captured its graphs when it is built; transformers
serve sets up its continuous batching on its first request). transformers serve is skipped, with the reason
written down, where transformers or its serving extras are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: tools.bench, tinyvllm from the checkout
    sys.path.insert(0, str(REPO))

SATURATION = float("inf")
WARMUP = 8   # short requests (16 new tokens), untimed, before the first timed run of each server and offline


def log(message: str) -> None:
    print(f"[serve_benchmark {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_runs(text: str) -> list[tuple[float, int]]:
    """'inf:256,4:120' -> [(inf, 256), (4.0, 120)]."""
    runs = []
    for item in text.split(","):
        rate, _, n = item.partition(":")
        runs.append((float(rate), int(n)))
        if not (runs[-1][0] > 0 and runs[-1][1] > 0):
            raise argparse.ArgumentTypeError(f"run {item!r}: RATE and N must be positive")
    return runs


def token_high(model_dir: Path) -> int:
    """tools/bench.py's bound on random prompt ids."""
    config = json.loads((model_dir / "config.json").read_text())
    return min(10000, int(config["vocab_size"]))


def workload(args, n: int) -> list[tuple[list[int], int]]:
    """The N requests bench_serve sends for the same options (the same function, seed and bounds)."""
    from tools.bench import random_requests

    return random_requests(np.random.default_rng(args.seed), n, tuple(args.prompt_lens), tuple(args.output_lens),
                           token_high(args.model))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(args, url: str, rate: float, n: int, name: str, extra: list[str] = ()) -> dict:
    """One tools/bench_serve.py run in a process of its own; its JSON summary (or the error)."""
    path = args.out / f"{name}.json"
    cmd = [sys.executable, str(REPO / "tools" / "bench_serve.py"), "--url", url, "--dataset", "throughput",
           "--num-prompts", str(n), "--request-rate", str(rate), "--max-concurrency", str(n),
           "--prompt-lens", *map(str, args.prompt_lens), "--output-lens", *map(str, args.output_lens),
           "--token-high", str(token_high(args.model)), "--seed", str(args.seed), "--json", str(path), *extra]
    log(f"{name}: {n} requests, rate {rate}/s")
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.run_timeout} s", "rate": rate, "n": n}
    print(done.stdout, end="", file=sys.stderr)
    if not path.exists():
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}", "rate": rate, "n": n}
    summary = json.loads(path.read_text())
    summary["wall_s"] = time.perf_counter() - start
    if done.returncode:
        summary["error"] = f"exit {done.returncode}: {done.stderr[-500:]}"
    return summary


def save(args, name: str, results: dict) -> None:
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2, default=str))


def device_name() -> str:
    """GPU 0's name, asked of the driver without a context (one in this process would take GPU memory from the
    server's engine, which sizes its KV cache by what is free)."""
    try:
        from cuda_kernels import compat
        from cuda_kernels.driver import driver, ok
        from numba import cuda

        if compat.SIMULATOR or not cuda.is_available():   # (initialises the driver; makes no context)
            return "no GPU"
        drv = driver()
        name = ok(drv.cuDeviceGetName(256, ok(drv.cuDeviceGet(0))))
        return name.split(b"\0")[0].decode()
    except Exception as exc:  # a report line, not a failure
        return f"unknown ({type(exc).__name__})"


def uvicorn_stack() -> str:
    """What uvicorn serves with here: its event loop and HTTP parser ("auto" picks uvloop and httptools when
    installed; they cost the event loop less per streamed chunk, see setup.cfg's serve extra)."""
    import importlib.util as u

    loop = "uvloop" if u.find_spec("uvloop") else "asyncio"
    return f"{loop} + {'httptools' if u.find_spec('httptools') else 'h11'}"


# -- tinyvllm ---------------------------------------------------------------------------------------------------

def engine_recipe(args) -> tuple[object, dict]:
    """The served engine's factory and options (tinyvllm/server/engine_core.EngineProcess's): `tinyvllm serve`'s
    engine with prefix caching off, or for --backend sim the GPU's step times over the real host work."""
    if args.backend == "sim":
        from tools.sim_runner import sim_engine

        return sim_engine, {"base_ms": args.sim_step_ms[0], "per_token_ms": args.sim_step_ms[1]}
    from tinyvllm.server.engine_core import build_engine

    return build_engine, {"backend": args.backend, "enable_prefix_caching": False}


def offline_runs(args, factory, options: dict) -> dict:
    """LLM.generate on each saturation run's requests, over an engine built as the server's (run in a process of
    its own, which gives the GPU back before the server's engine takes it)."""
    from tinyvllm import LLM, SamplingParams
    from tools.bench_serve import make_prompts

    start = time.perf_counter()
    llm = LLM.from_engine(factory(args.model, **options))
    runner = llm.engine.runner
    facts = {"engine_ready_s": time.perf_counter() - start, "backend": runner.name,
             "matmul_precision": getattr(runner, "matmul_precision", None), "offline": []}
    # untimed, as each server gets before its first run (bench_serve --warmup): a few short requests
    llm.generate(make_prompts(WARMUP, 64, args.seed + 1), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    for n in sorted({n for rate, n in args.runs if rate == SATURATION}, reverse=True):
        requests = workload(args, n)
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in requests]
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == sum(o for _, o in requests), "ignore_eos requests generate exactly their length"
        facts["offline"].append({"num_prompts": n, "duration_s": seconds, "output_tokens": tokens,
                                 "prompt_tokens": sum(len(p) for p, _ in requests),
                                 "request_throughput": n / seconds, "output_throughput": tokens / seconds})
    return facts


def run_tinyvllm(args) -> int:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tinyvllm.server.app import build_app
    from tinyvllm.server.engine_core import EngineProcess
    from tinyvllm.server.launch import serving_in_thread

    results = {"command": " ".join(sys.argv), "device": device_name(), "model": str(args.model),
               "backend": args.backend, "engine": "as `tinyvllm serve` builds it, prefix caching off",
               "server_engine": args.engine, "offline": [], "runs": [], "errors": [], "uvicorn": uvicorn_stack()}
    factory, options = engine_recipe(args)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        facts = pool.submit(offline_runs, args, factory, options).result()
    results.update(facts)
    log(f"engine ({facts['backend']}) ready in {facts['engine_ready_s']:.1f} s")
    for o in facts["offline"]:
        log(f"offline LLM.generate, {o['num_prompts']} requests: {o['output_throughput']:,.0f} output tok/s")
    save(args, "tinyvllm", results)
    # the server: its engine in a process of its own, as `tinyvllm serve` runs it, or (--engine thread) in a
    # thread of this one
    engine = EngineProcess(args.model, options, factory) if args.engine == "process" else factory(args.model, **options)
    with serving_in_thread(build_app(engine, "tinyvllm"), "serve-benchmark-uvicorn") as url:
        for i, (rate, n) in enumerate(args.runs):
            cpu = time.process_time()
            warm = ["--warmup", str(WARMUP)] if i == 0 else []
            summary = client(args, url, rate, n, f"tinyvllm_{n}_at_{rate:g}", warm)
            # this process: uvicorn's event loop and the front end (and with --engine thread, the engine's thread)
            summary["server_cpu_s"] = time.process_time() - cpu
            results["runs"].append(summary)
            if "error" in summary:
                results["errors"].append(summary["error"])
            save(args, "tinyvllm", results)
    save(args, "tinyvllm", results)
    return 1 if results["errors"] else 0


# -- transformers serve -----------------------------------------------------------------------------------------

def transformers_missing(python: str) -> str | None:
    """Why `transformers serve` cannot run under `python`, or None."""
    probe = ("import importlib.util as u, sys; "
             "missing = [m for m in ('transformers', 'torch', 'fastapi', 'uvicorn', 'pydantic', 'openai') "
             "if u.find_spec(m) is None]; print(' '.join(missing))")
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if done.returncode:
        return done.stderr.strip()[-300:]
    missing = done.stdout.strip()
    return f"not importable: {missing}" if missing else None


def run_transformers(args) -> int:
    results = {"command": " ".join(sys.argv), "model": str(args.model), "device": args.device, "runs": [],
               "errors": []}
    reason = transformers_missing(args.python)
    if reason is not None:
        results["skipped"] = f"transformers serve cannot run: {reason}"
        log(results["skipped"])
        save(args, "transformers", results)
        return 0
    port = free_port()
    cmd = [args.python, "-c", "from transformers.cli.transformers import app; app()", "serve", str(args.model),
           "--continuous-batching", "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
           "--log-level", "warning", *args.hf_args]
    results["server_command"] = cmd
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    import httpx

    url = f"http://127.0.0.1:{port}"
    with open(args.out / "transformers_serve.log", "w") as server_log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT, env=env, cwd=str(args.out))
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"transformers serve exited with {proc.returncode} (see transformers_serve.log)")
                if time.perf_counter() - start > args.start_timeout:
                    raise RuntimeError(f"transformers serve not healthy after {args.start_timeout} s")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            results["ready_s"] = time.perf_counter() - start
            log(f"transformers serve ready in {results['ready_s']:.1f} s")
            extra = ["--server", "transformers", "--tokenizer", str(args.model), "--model", str(args.model)]
            for i, (rate, n) in enumerate(args.runs):
                warm = ["--warmup", str(WARMUP)] if i == 0 else []
                summary = client(args, url, rate, n, f"transformers_{n}_at_{rate:g}", extra + warm)
                results["runs"].append(summary)
                if "error" in summary:
                    results["errors"].append(summary["error"])
                save(args, "transformers", results)
        except RuntimeError as exc:
            results["errors"].append(str(exc))
            log(str(exc))
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    save(args, "transformers", results)
    return 1 if results["errors"] else 0


# -- the table ----------------------------------------------------------------------------------------------------

def _ms(p: dict | None) -> str:
    if not p or p.get("p50") is None:
        return "-"
    return f"{p['p50']:,.1f} / {p['p90']:,.1f} / {p['p99']:,.1f}"


def _share(r: dict) -> str:
    """The client's CPU time per second of the run: near 100%, the client was the bottleneck."""
    return f"{r['client_cpu_s'] / r['duration_s']:.0%}" if r.get("client_cpu_s") is not None else "-"


def _arrivals(rate) -> str:
    return "all at once" if float(rate) == SATURATION else f"Poisson {float(rate):g}/s"


def table(out: Path) -> str:
    """The markdown table of the runs in OUT (and the goals of issue 28, where their runs exist)."""
    tiny = json.loads((out / "tinyvllm.json").read_text()) if (out / "tinyvllm.json").exists() else None
    hf = json.loads((out / "transformers.json").read_text()) if (out / "transformers.json").exists() else None
    lines = ["| server | requests | arrivals | completed | req/s | output tok/s | TTFT ms p50 / p90 / p99 "
             "| TPOT ms p50 / p90 / p99 | ITL ms p50 / p90 / p99 | client CPU |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    goals = []
    for name, res in (("tinyvllm serve", tiny), ("transformers serve", hf)):
        if res is None:
            continue
        if name == "tinyvllm serve":
            for o in res.get("offline", []):
                lines.append(f"| tinyvllm LLM.generate (offline) | {o['num_prompts']} | all at once | "
                             f"{o['num_prompts']} | {o['request_throughput']:.2f} | {o['output_throughput']:,.0f} "
                             "| - | - | - | |")
        if res.get("skipped"):
            lines.append(f"| {name} | - | - | - | - | - | {res['skipped']} | | | |")
        for r in res.get("runs", []):
            if "completed" not in r:
                lines.append(f"| {name} | {r.get('n')} | {_arrivals(r.get('rate'))} | failed: {r.get('error')} "
                             "| | | | | | |")
                continue
            lines.append(f"| {name} | {r['num_prompts']} | {_arrivals(r['request_rate'])} | {r['completed']} | "
                         f"{r['request_throughput']:.2f} | {r['output_throughput']:,.0f} | {_ms(r['ttft_ms'])} | "
                         f"{_ms(r['tpot_ms'])} | {_ms(r['itl_ms'])} | {_share(r)} |")
            if name != "tinyvllm serve" or r["failed"]:
                continue
            if float(r["request_rate"]) == SATURATION:
                offline = [o for o in res.get("offline", []) if o["num_prompts"] == r["num_prompts"]]
                if offline:
                    ratio = r["output_throughput"] / offline[0]["output_throughput"]
                    goals.append(f"- {r['num_prompts']} requests at once: the server's {r['output_throughput']:,.0f} "
                                 f"output tok/s are {ratio:.1%} of LLM.generate's "
                                 f"{offline[0]['output_throughput']:,.0f} (goal >= 90%: "
                                 f"{'met' if ratio >= 0.9 else 'not met'})")
            elif float(r["request_rate"]) == 4:
                p99 = r["ttft_ms"]["p99"]
                goals.append(f"- at 4 requests/s ({r['num_prompts']} requests): p99 TTFT {p99:,.1f} ms "
                             f"(goal < 150 ms: {'met' if p99 < 150 else 'not met'})")
    header = []
    if tiny:
        header.append(f"Device: {tiny.get('device')}; tinyvllm backend {tiny.get('backend')}, matmul inputs "
                      f"{tiny.get('matmul_precision')}, engine ready in {tiny.get('engine_ready_s', 0):.0f} s, "
                      f"uvicorn on {tiny.get('uvicorn', 'asyncio + h11')}.")
    if hf and hf.get("ready_s") is not None:
        header.append(f"transformers serve --continuous-batching on {hf.get('device')}: healthy after "
                      f"{hf['ready_s']:.0f} s.")
    notes = ["", "TTFT: request sent to its first chunk with choices (its text may be empty); TPOT: (latency - TTFT) "
             "/ (output tokens - 1) per request; ITL: gaps between streamed chunks. Client CPU: the load generator's "
             "CPU seconds per second of the run (near 100%, it was the bottleneck)."]
    return "\n".join(header + [""] + lines + notes + [""] + goals) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="what", required=True)
    for what in ("tinyvllm", "transformers", "table"):
        s = sub.add_parser(what)
        s.add_argument("--out", type=Path, required=True, help="the directory for the JSON and markdown results")
        if what == "table":
            continue
        s.add_argument("--model", type=Path, required=True, help="a model directory in Hugging Face layout")
        s.add_argument("--runs", type=parse_runs, default=parse_runs("inf:256,4:120" if what == "tinyvllm" else
                                                                       "inf:64"),
                       help="RATE:N,...: N requests at RATE per second (inf: all at once)")
        s.add_argument("--prompt-lens", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
        s.add_argument("--output-lens", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--run-timeout", type=float, default=300, help="seconds a client run may take (default 300)")
        if what == "tinyvllm":
            s.add_argument("--backend", choices=("auto", "cpu", "cuda", "sim"), default="auto",
                           help="sim: no model, a GPU's step times (tools/sim_runner.py), to see the server's cost")
            from tools.sim_runner import BASE_MS, PER_TOKEN_MS

            s.add_argument("--engine", choices=("process", "thread"), default="process",
                           help="where the server's engine steps: a process of its own (as `tinyvllm serve`) or a "
                                "thread of the server's (tinyvllm/server/engine_core.py)")
            s.add_argument("--sim-step-ms", type=float, nargs=2, default=[BASE_MS, PER_TOKEN_MS],
                           metavar=("BASE", "PER_TOKEN"), help="--backend sim: a step takes BASE + PER_TOKEN * its "
                           f"new tokens ms (default {BASE_MS:g} {PER_TOKEN_MS:g})")
        else:
            s.add_argument("--device", default="cuda:0", help="transformers serve --device (default cuda:0)")
            s.add_argument("--python", default=sys.executable, help="the Python that runs transformers serve")
            s.add_argument("--start-timeout", type=float, default=300)
            s.add_argument("--hf-args", nargs=argparse.REMAINDER, default=[],
                           help="more options for transformers serve (last)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # `timeout` stops a phase with SIGTERM: unwind, so that `finally` stops the server started here
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.what == "tinyvllm":
        return run_tinyvllm(args)
    if args.what == "transformers":
        return run_transformers(args)
    text = table(args.out)
    (args.out / "serve_bench.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
