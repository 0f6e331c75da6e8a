"""One request's state as it moves through the engine: waiting, running, finished.

A sequence is its prompt plus the tokens generated so far. `num_computed_tokens` counts the tokens whose K
and V are in the cache: the scheduler feeds the model the tokens after that point, a chunk of the prompt at
a time or one token per decode step, and a preempted sequence simply starts again from zero (its prompt and
its outputs so far are recomputed; what the prefix cache still holds is reused).

A request with n > 1 is n sequences (`index` 0..n-1). Completion 0 computes the prompt; the others wait in
its `forks` until the step that draws its first token, where each draws its own first token from the same
logits and takes a share of its KV blocks (tinyvllm/block_manager.py copies the partly filled last block on
a sequence's first write there).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from tinyvllm.sampling_params import SamplingParams

_seq_ids = itertools.count()

# An output token that was sampled on the device but not read back yet (the engine's async scheduling).
PENDING = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                                   # sampling seed (params.seed, or drawn by the engine)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None            # "stop", "length" or "abort"
    num_cached_prompt_tokens: int = 0           # prompt tokens served by the prefix cache at admission
    num_hashed_blocks: int = 0                  # leading blocks of block_table registered in the prefix cache
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    index: int = 0                              # which of the request's n completions
    masked_ids: tuple[int, ...] = ()            # masked out of the draws until min_tokens (EOS, stop ids)
    stop_ids: frozenset[int] = frozenset()      # the ids that end it (the engine's: stop_token_ids, EOS)
    forks: list["Sequence"] = field(default_factory=list)  # completions forked at this one's first token
    output_counts: dict[int, int] = field(default_factory=dict)  # output token -> count (penalties)
    prompt_unique: object = None                # the prompt's distinct ids, cached by tinyvllm/batch.py
    logprobs: list | None = None                # per output token {id: Logprob}, when params.logprobs is set
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None         # [None, {id: Logprob}, ...], when params.prompt_logprobs is set
    prompt_logprobs_next: int = 0               # the next position whose logits give a prompt logprob
    forked: bool = False                        # shares blocks with other completions (block_manager.fork)

    def __post_init__(self):
        p = self.params
        # whether the step packing has more to do for it than the plain sampling parameters
        self.features = bool(p.uses_penalties or p.logit_bias or (p.min_tokens and self.masked_ids)
                             or p.logprobs is not None or p.prompt_logprobs is not None)
        self.counts_outputs = p.uses_penalties  # output_counts are kept only when a penalty reads them
        if p.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if p.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p: stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
