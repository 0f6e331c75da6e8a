"""Chapter 13 (serving economics): the benchmark's own results as tokens/s, time per token and dollars per
million output tokens, by batch size (tools/serving_cost.py, on the committed H100 run at its assumed price).

Nothing is measured here: every row is read from tools/bench_results/2026-12-07-h100-c/goals.json, which
tools/bench.py wrote on the GPU. Each row's check recomputes what the JSON states from what it counted
(tokens over seconds, sequences over the step time) and the cost from the price, so a results file whose
numbers disagree with each other fails.
"""

from __future__ import annotations

import json

from tools.course_ladders.common import HostStep
from tools.serving_cost import DEFAULT_RESULTS, DEFAULT_USD_PER_HOUR, ServingPoint, serving_points

# (version, idea, workload, batch) of the ladder: from one sequence to the largest batch the run measured
RUNGS = [
    ("13a batch 1", "one sequence: every weight read for one token", "latency", 1),
    ("13b decode step, batch 16", "16 tokens per read of the weights", "decode step", 16),
    ("13c decode step, batch 64", "64 tokens per read; the step grows 2.37x over batch 1", "decode step", 64),
    ("13d static batch 64", "with the prompts' prefill and the batch's ragged end", "static", 64),
    ("13e static batch 256", "the largest batch measured", "static", 256),
    ("13f continuous, 256 requests", "mixed lengths: prefills and long contexts in the steps", "throughput", 256),
]


def cost_steps(real: bool) -> list[HostStep]:
    results = json.loads(DEFAULT_RESULTS.read_text())

    def row(workload: str, batch: int):
        def run():
            points = [p for p in serving_points(results)   # raises if the JSON contradicts itself
                      if p.engine == "tinyvllm" and p.workload == workload and p.batch == batch]
            assert len(points) == 1, f"{DEFAULT_RESULTS.name} has {len(points)} {workload} rows at batch {batch}"
            point: ServingPoint = points[0]
            _recheck(results["tinyvllm"], point)
            cost = point.usd_per_million(DEFAULT_USD_PER_HOUR)
            assert abs(cost * point.tokens_per_s * 3600 / 1e6 - DEFAULT_USD_PER_HOUR) < 1e-9, "cost formula"
            wait = "-" if point.seconds_per_token is None else f"{point.seconds_per_token * 1e3:.2f}"
            return {"output tok/s": f"{point.tokens_per_s:,.0f}", "ms per token of a sequence": wait,
                    f"$ per 1M output tokens at ${DEFAULT_USD_PER_HOUR:.2f}/h": f"{cost:.3f}"}
        return run

    return [HostStep(version, idea, row(workload, batch)) for version, idea, workload, batch in RUNGS]


def _recheck(r: dict, point: ServingPoint) -> None:
    """The point's tokens/s from the counts behind it."""
    if point.workload == "decode step":
        step = r["step"]["batches"][str(point.batch)]
        assert abs(point.tokens_per_s * step["step_s"] - point.batch) < 1e-9
        assert abs(step["step_s"] / r["step"]["batches"]["1"]["step_s"] - step["ratio"]) < 1e-9, "step ratio"
    elif point.workload == "static":
        run = r["static"][str(point.batch)]
        assert run["output_tokens"] == point.batch * 256, "256 new tokens per sequence"
        assert abs(run["output_tokens"] / run["elapsed_s"] - point.tokens_per_s) < 1e-6 * point.tokens_per_s
    elif point.workload == "latency":
        runs = r["latency"]["runs_decode_tok_s"]
        assert point.tokens_per_s == max(runs), "the best of the runs is reported"
