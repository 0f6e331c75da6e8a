"""The front end's half of a step: a request's token ids, as the engine core sends them, turned into text and
RequestOutputs, with its stop strings looked for.

This is what LLMEngine.step does for a request added with text (TextStream.advance, the same code), done in the
server's process instead of the engine's. One difference: the engine core does not look for stop strings, so a
completion goes on in the engine until it hears that one was found (a command back, `stop_completion`); the
tokens it computed meanwhile are dropped here, and the completion ends where LLMEngine.step would have ended it.
"""

from __future__ import annotations

from tinyvllm.engine import CompletionOutput, RequestOutput, TokenIdsSoFar
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.text_stream import TextStream


class CompletionState:
    """One of a request's n completions: its ids so far, its text stream, how it ended."""

    __slots__ = ("index", "stream", "token_ids", "finish_reason", "logprobs", "cumulative_logprob")

    def __init__(self, index: int, stream: TextStream, wants_logprobs: bool):
        self.index = index
        self.stream = stream
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs: list | None = [] if wants_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None


class RequestState:
    """One request in flight, from the front end: `add` each TokenRow's fields, `output()` when it changed."""

    __slots__ = ("request_id", "prompt_token_ids", "final_only", "min_tokens", "completions", "num_unfinished",
                 "num_cached_tokens", "prompt_logprobs", "new_text", "arrival", "first_token_time",
                 "last_token_time")

    def __init__(self, tokenizer, request_id: str, prompt_ids: list[int], params: SamplingParams, final_only: bool,
                 arrival: float):
        self.request_id = request_id
        self.prompt_token_ids = prompt_ids
        self.final_only = final_only      # the handler wants the last output only (not streamed)
        self.min_tokens = params.min_tokens
        self.completions = [CompletionState(i, TextStream(tokenizer, prompt_ids, params.stop, final_only=final_only),
                                            params.logprobs is not None) for i in range(params.n)]
        self.num_unfinished = params.n
        self.num_cached_tokens = 0
        self.prompt_logprobs = None
        self.new_text = ""                # completion 0's text since the last output
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return not self.num_unfinished

    def add(self, index: int, token: int, reason: str | None, extra: dict | None, now: float) -> bool:
        """A token of completion `index` and the engine's finish reason for it (see LLMEngine.step_tokens). True
        when a stop string ends the completion here: the engine, which does not look for them, is to be told."""
        c = self.completions[index]
        if c.finish_reason is not None:
            return False  # computed before the engine heard of the stop string: not the completion's
        c.token_ids.append(token)
        if extra is not None:
            self._take(c, extra)
        text, reason_now = c.stream.advance(token, reason, check_stop=len(c.token_ids) > self.min_tokens)
        if index == 0:
            self.new_text += text
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        if reason_now is not None:
            c.finish_reason = reason_now
            self.num_unfinished -= 1
        return reason_now is not None and reason is None

    def _take(self, c: CompletionState, extra: dict) -> None:
        if "logprobs" in extra:
            c.logprobs.append(extra["logprobs"])
            c.cumulative_logprob = extra["cumulative_logprob"]
        if "num_cached_tokens" in extra:
            self.num_cached_tokens = extra["num_cached_tokens"]
        if "prompt_logprobs" in extra:
            self.prompt_logprobs = extra["prompt_logprobs"]

    def output(self) -> RequestOutput:
        """The request as LLMEngine.step reports it: cumulative, with the text released since the last output."""
        finished = self.finished
        completions = [CompletionOutput(
            c.index, c.stream.text, list(c.token_ids) if finished else TokenIdsSoFar(c.token_ids, len(c.token_ids)),
            c.finish_reason, None if c.logprobs is None else list(c.logprobs), c.cumulative_logprob)
            for c in self.completions]
        new_text, self.new_text = self.new_text, ""
        return RequestOutput(self.request_id, None, self.prompt_token_ids, completions, finished, new_text,
                             self.num_cached_tokens, {"first_token_time": self.first_token_time,
                                                      "last_token_time": self.last_token_time},
                             self.prompt_logprobs)

    @property
    def num_output_tokens(self) -> int:
        return max(len(c.token_ids) for c in self.completions)
