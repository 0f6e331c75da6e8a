"""Sampling parameters of one request, validated when they are made (the names and meanings follow vLLM's).

The logits of a row go through, in this order (vLLM's), before temperature, top-k, top-p and min-p:

    l_i += logit_bias[i]                                     (and -inf for EOS / stop_token_ids before min_tokens)
    l_i  = l_i / r if l_i > 0 else l_i * r                   for i in the prompt or output (r: repetition_penalty)
    l_i -= frequency_penalty * c_i + presence_penalty * [c_i > 0]          c_i = count of i in the output

Greedy rows (temperature 0) take the argmax of the processed logits. logprobs / prompt_logprobs report the
model's own log-softmax, before any of this (vLLM's default "raw" logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the most logprobs (and prompt_logprobs) a request may ask for: vLLM's default max_logprobs
MAX_LOGPROBS = 20
#: OpenAI's ranges for the presence and frequency penalties and for logit_bias values
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
#: repetition_penalty divides or multiplies float32 logits, so it must be a positive normal float32: the smallest
#: and the largest (a tinier value rounds to 0 in float32 and divides by zero, a larger one to infinity)
REPETITION_PENALTY_RANGE = (1.1754943508222875e-38, 3.4028234663852886e38)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy; top_k 0 or -1 and top_p 1 and min_p 0 switch those filters off; seed makes
    sampling reproducible per request (with n > 1, completion i uses seed + i, as vLLM); generation stops at
    max_tokens, at an eos token (unless ignore_eos), at any of stop_token_ids, or when the text ends with one
    of `stop` (which is then cut off). Until min_tokens tokens are out, eos (unless ignore_eos) and
    stop_token_ids are masked out of the distribution and stop strings are not looked for.

    n: completions of the prompt (they share its KV blocks). repetition_penalty (> 0, 1 = off) over prompt
    and output tokens; presence_penalty and frequency_penalty in [-2, 2] over output tokens; logit_bias:
    token id -> value in [-100, 100] added to its logit (ids are checked against the model's vocabulary when
    the request is added). logprobs / prompt_logprobs: None, or how many of the most likely tokens to report
    besides the chosen one (0 to MAX_LOGPROBS).
    """

    n: int = 1
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
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

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

        if integer("n") < 1:
            fail("n", "must be at least 1")
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
        low, high = REPETITION_PENALTY_RANGE
        if not low <= number("repetition_penalty") <= high:
            fail("repetition_penalty", f"must be > 0 and a normal float32, in [{low:.3g}, {high:.3g}] (1 means no "
                                       "penalty)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not PENALTY_RANGE[0] <= number(name) <= PENALTY_RANGE[1]:
                fail(name, f"must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}]")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= integer(name) <= MAX_LOGPROBS:
                fail(name, f"must be None or in [0, {MAX_LOGPROBS}] (the most this engine reports)")
        if self.logit_bias is not None:
            self.logit_bias = self._checked_logit_bias(fail)

    def _checked_logit_bias(self, fail) -> dict[int, float]:
        """logit_bias with int keys (JSON gives OpenAI's keys as strings of digits) and float values."""
        if not isinstance(self.logit_bias, dict):
            fail("logit_bias", "must be a dict of token id -> bias")
        checked = {}
        for key, value in self.logit_bias.items():
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                fail("logit_bias", f"has key {key!r}, which is not a token id (a non-negative integer)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]):
                fail("logit_bias", f"has value {value!r} for token {token}, outside [{LOGIT_BIAS_RANGE[0]:g}, "
                                   f"{LOGIT_BIAS_RANGE[1]:g}]")
            checked[token] = float(value)
        return checked

    @property
    def uses_penalties(self) -> bool:
        """Whether the output (or prompt) token counts change the logits."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
