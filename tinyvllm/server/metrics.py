"""The server's metrics in Prometheus' text format, under vLLM's names with a `tinyvllm:` prefix.

Counters and histograms are updated by the engine thread as requests finish; gauges (running, waiting, KV
cache usage) are read from the engine when /metrics is scraped. A few dozen lines of text formatting need
no client library.
"""

from __future__ import annotations

import bisect
import threading

# Seconds; vLLM's buckets for the same histograms, trimmed.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)

FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)   # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip(self.buckets + (float("inf"),), self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {total}"]


class Metrics:
    """What the engine thread records; `render` reads it under the same lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.rejected = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def request_added(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens

    def tokens_generated(self, n: int) -> None:
        with self._lock:
            self.generation_tokens += n

    def request_finished(self, reason: str, arrival: float, first_token: float | None, last_token: float | None,
                         num_output_tokens: int, now: float) -> None:
        """A request that ended; its times are time.perf_counter() values (abort: only `reason` counts)."""
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if reason == "abort":
                return
            self.e2e.observe(now - arrival)
            if first_token is not None:
                self.ttft.observe(first_token - arrival)
            if num_output_tokens > 1 and last_token is not None and first_token is not None:
                self.tpot.observe((last_token - first_token) / (num_output_tokens - 1))

    def request_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def render(self, running: int, waiting: int, kv_usage: float) -> str:
        """The Prometheus text exposition (version 0.0.4)."""
        p = "tinyvllm:"
        with self._lock:
            blocks = [
                ("num_requests_running", "gauge", "Requests in the running batch.", [f"{p}num_requests_running {running}"]),
                ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
                 [f"{p}num_requests_waiting {waiting}"]),
                ("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = full).",
                 [f"{p}kv_cache_usage_perc {kv_usage!r}"]),
                ("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
                 [f"{p}prompt_tokens_total {self.prompt_tokens}"]),
                ("generation_tokens_total", "counter", "Generated tokens.",
                 [f"{p}generation_tokens_total {self.generation_tokens}"]),
                ("request_success_total", "counter", "Finished requests, by why they finished.",
                 [f'{p}request_success_total{{finished_reason="{r}"}} {n}' for r, n in self.finished.items()]),
                ("request_rejected_total", "counter", "Requests refused with 503 because the queue was full.",
                 [f"{p}request_rejected_total {self.rejected}"]),
                ("time_to_first_token_seconds", "histogram", "Time from arrival to the first token.",
                 self.ttft.lines(f"{p}time_to_first_token_seconds")),
                ("time_per_output_token_seconds", "histogram", "Mean time between a request's output tokens.",
                 self.tpot.lines(f"{p}time_per_output_token_seconds")),
                ("e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.",
                 self.e2e.lines(f"{p}e2e_request_latency_seconds")),
            ]
        text = []
        for name, kind, help_text, lines in blocks:
            text += [f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} {kind}", *lines]
        return "\n".join(text) + "\n"
