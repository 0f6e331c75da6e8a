"""Sampling parameters of one request, validated when they are made (the names follow vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy; top_k 0 or -1 and top_p 1 and min_p 0 switch those filters off; seed makes
    sampling reproducible per request; generation stops at max_tokens, at an eos token (unless ignore_eos),
    at any of stop_token_ids, or when the text ends with one of `stop` (which is then cut off), but never
    before min_tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        def fail(name, problem):
            raise SamplingParamsError(f"SamplingParams.{name} {problem}, got {getattr(self, name)!r}")

        def number(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                fail(name, "must be a number")
            return value

        def integer(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                fail(name, "must be an integer")
            return value

        if not 0 <= number("temperature") < float("inf"):
            fail("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < number("top_p") <= 1:
            fail("top_p", "must be in (0, 1]")
        if not 0 <= number("min_p") <= 1:
            fail("min_p", "must be in [0, 1]")
        if integer("top_k") < -1:
            fail("top_k", "must be -1 or 0 (off) or a positive integer")
        if self.seed is not None and integer("seed") < 0:
            fail("seed", "must be a non-negative integer or None")
        if integer("max_tokens") < 1:
            fail("max_tokens", "must be at least 1")
        if not 0 <= integer("min_tokens") <= self.max_tokens:
            fail("min_tokens", f"must be in [0, max_tokens={self.max_tokens}]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of non-negative token ids")
