"""Serving economics from a benchmark's own results: tokens/s, time per token and dollars per million output
tokens, by batch size, at a given hourly price of the GPU.

    python tools/serving_cost.py                                  # the committed H100 run, $2.50 an hour
    python tools/serving_cost.py bench.json --usd-per-hour 3.99   # your run (tools/bench.py --json), your price
    python tools/serving_cost.py --plot docs/course/13-serving-cost.png   # also the plot (needs matplotlib)

A GPU rented by the hour costs the same whether it serves one sequence or 256, so the cost of a token is the
price of a second over the tokens made in that second:

    $ per million output tokens = usd_per_hour / 3600 / (output tokens per second) * 1e6

and the time a user waits between two tokens of one sequence is the step time (all sequences of a batch get
a token per step). Both come from the results JSON of `tools/bench.py` (goals or any run with the latency,
step, static or throughput workloads), for tinyvllm and for the PyTorch peer where it ran:

- "decode step, batch B" (workload step): B sequences at context 256, one token each per step of step_s
  seconds: B / step_s tokens/s, step_s per token. Decode only: what a long generation approaches.
- "latency, batch 1" (workload latency): one 128-token prompt, 256 new tokens: decode tokens/s.
- "static batch B" (workload static): B prompts of 128 tokens, 256 new tokens each, one batch start to end,
  prefill included: output tokens / elapsed s, and elapsed s / 256 per token of a sequence.
- "throughput" (workload throughput, continuous batching): 256 requests of mixed lengths: output tokens /
  elapsed s. Its sequences start and end at different times: no single time per token.

The default price, $2.50 an hour for one H100, is an assumption, neither a quote nor a measurement: pass
what you pay (the cost scales with it linearly). The electricity, the host and idle hours are not counted; at a lower utilisation the cost per token rises in
proportion. Without matplotlib the table is printed and the plot is skipped (said on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO / "tools" / "bench_results" / "2026-12-07-h100-c" / "goals.json"
DEFAULT_USD_PER_HOUR = 2.50   # an assumption, not a quote (see the module docstring)


def cost_per_million_tokens(usd_per_hour: float, tokens_per_s: float) -> float:
    """Dollars per million tokens made at tokens_per_s on a machine rented at usd_per_hour."""
    return usd_per_hour / 3600.0 / tokens_per_s * 1e6


@dataclass(frozen=True)
class ServingPoint:
    engine: str                       # "tinyvllm" or the peer's name
    workload: str                     # "decode step", "latency", "static", "throughput"
    detail: str                       # the workload's sizes, as the bench ran them
    batch: int                        # sequences served together (throughput: the number of requests)
    tokens_per_s: float               # output tokens per second
    seconds_per_token: float | None   # the wait between two tokens of one sequence (None: not one number)
    source: str                       # where in the JSON it comes from

    def usd_per_million(self, usd_per_hour: float) -> float:
        return cost_per_million_tokens(usd_per_hour, self.tokens_per_s)


def serving_points(results: dict) -> list[ServingPoint]:
    """Every point the results hold, tinyvllm's first, then the PyTorch peer's, each by workload and batch.
    Checks the bench's own arithmetic as it goes (tokens / elapsed = tokens/s): ValueError if it disagrees."""
    points = _engine_points("tinyvllm", results.get("tinyvllm", {}), "tinyvllm")
    peer = results.get("torch_peer")
    if isinstance(peer, dict) and "skipped" not in peer:
        points += _engine_points("PyTorch compiled (peer)", peer, "torch_peer")
    if not points:
        raise ValueError("no latency, step, static or throughput results in this JSON")
    return points


def _engine_points(engine: str, r: dict, key: str) -> list[ServingPoint]:
    points = []
    steps = r.get("step", {})
    for batch, step in sorted(((int(b), s) for b, s in steps.get("batches", {}).items())):
        points.append(ServingPoint(engine, "decode step", f"context {steps.get('context', '?')}", batch,
                                   batch / step["step_s"], step["step_s"], f"{key}.step.batches.{batch}.step_s"))
    latency = r.get("latency")
    if latency and "decode_tok_s" in latency:
        detail = f"prompt {latency.get('prompt_tokens', '?')}, {latency.get('new_tokens', '?')} new"
        points.append(ServingPoint(engine, "latency", detail, 1, latency["decode_tok_s"],
                                   1 / latency["decode_tok_s"], f"{key}.latency.decode_tok_s"))
    for batch, run in sorted(((int(b), s) for b, s in r.get("static", {}).items())):
        if "output_tok_s" not in run:
            continue
        if "output_tokens" in run:
            _same(run["output_tokens"] / run["elapsed_s"], run["output_tok_s"], f"{key}.static.{batch}")
        new = run.get("new_tokens") or run["output_tokens"] // run["requests"]   # per sequence
        prompt = run.get("prompt_tokens", 0) // run.get("requests", 1) if "requests" in run else run.get(
            "prompt_tokens", "?")
        points.append(ServingPoint(engine, "static", f"prompt {prompt}, {new} new, prefill included", batch,
                                   run["output_tok_s"], run["elapsed_s"] / new, f"{key}.static.{batch}.output_tok_s"))
    continuous = r.get("throughput", {}).get("continuous")
    if continuous and "output_tok_s" in continuous:
        _same(continuous["output_tokens"] / continuous["elapsed_s"], continuous["output_tok_s"],
              f"{key}.throughput.continuous")
        points.append(ServingPoint(engine, "throughput", "mixed lengths, continuous batching",
                                   continuous["requests"], continuous["output_tok_s"], None,
                                   f"{key}.throughput.continuous.output_tok_s"))
    return points


def _same(derived: float, stated: float, where: str) -> None:
    if abs(derived - stated) > 1e-6 * abs(stated):
        raise ValueError(f"{where}: output_tokens / elapsed_s = {derived:.3f}, but output_tok_s = {stated:.3f}")


def table(points: list[ServingPoint], usd_per_hour: float) -> str:
    """The points as a markdown table, at usd_per_hour."""
    lines = [f"| engine | workload | batch | output tok/s | ms per token of a sequence | $ per 1M output tokens "
             f"at ${usd_per_hour:.2f}/h |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for p in points:
        wait = "-" if p.seconds_per_token is None else f"{p.seconds_per_token * 1e3:.2f}"
        lines.append(f"| {p.engine} | {p.workload} ({p.detail}) | {p.batch} | {p.tokens_per_s:,.0f} | {wait} | "
                     f"{p.usd_per_million(usd_per_hour):.3f} |")
    return "\n".join(lines)


def header(results: dict) -> str:
    versions = results.get("versions", {})
    return (f"{results.get('device', 'unknown device')}, {results.get('date', 'undated')}, "
            f"commit {versions.get('git_commit', '?')}; command: `{results.get('command', '?')}`")


def plot(points: list[ServingPoint], usd_per_hour: float, path: Path, title: str) -> str | None:
    """Two panels against the batch size: dollars per million output tokens, and milliseconds per token of a
    sequence. Returns why not when matplotlib is missing, else None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, (cost_ax, wait_ax) = plt.subplots(1, 2, figsize=(11, 5.6))
    styles = {"decode step": "o-", "static": "s--", "latency": "^", "throughput": "D"}
    for engine in dict.fromkeys(p.engine for p in points):
        color = "tab:blue" if engine == "tinyvllm" else "tab:orange"
        for workload, style in styles.items():
            mine = [p for p in points if p.engine == engine and p.workload == workload]
            if not mine:
                continue
            label = f"{engine}: {workload} ({mine[0].detail})"
            cost_ax.plot([p.batch for p in mine], [p.usd_per_million(usd_per_hour) for p in mine], style,
                         color=color, label=label)
            timed = [p for p in mine if p.seconds_per_token is not None]
            if timed:
                wait_ax.plot([p.batch for p in timed], [p.seconds_per_token * 1e3 for p in timed], style,
                             color=color, label=label)
    batches = sorted({p.batch for p in points})
    for ax in (cost_ax, wait_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size (sequences per step; throughput: requests)")
        ax.grid(True, which="both", alpha=0.3)
    cost_ax.set_yscale("log")
    cost_ax.set_ylabel(f"\\$ per 1M output tokens at \\${usd_per_hour:.2f}/h")   # \$: not mathtext
    wait_ax.set_ylabel("ms per token of one sequence")
    wait_ax.set_ylim(bottom=0)
    handles, labels = cost_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=DEFAULT_RESULTS,
                        help=f"a tools/bench.py --json file (default: {DEFAULT_RESULTS.relative_to(REPO)})")
    parser.add_argument("--usd-per-hour", type=float, default=DEFAULT_USD_PER_HOUR,
                        help=f"what the GPU costs an hour (default {DEFAULT_USD_PER_HOUR:.2f}: an assumption)")
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG; needs matplotlib)")
    args = parser.parse_args(argv)
    if args.usd_per_hour <= 0:
        parser.error("--usd-per-hour must be positive")
    results = json.loads(args.results.read_text())
    points = serving_points(results)
    print(f"{header(results)}\n\n{table(points, args.usd_per_hour)}")
    if args.plot:
        why_not = plot(points, args.usd_per_hour, args.plot,
                       f"{results.get('device', '')}, {results.get('date', '')[:10]}: Llama-3.2-1B shapes, bf16, "
                       f"random weights ({args.results.name})")
        print(why_not or f"\nplot: {args.plot}", file=sys.stderr if why_not else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
