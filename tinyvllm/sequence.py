"""One request's state as it moves through the engine: waiting, running, finished.

A sequence is its prompt plus the tokens generated so far. `num_computed_tokens` counts the tokens whose K
and V are in the cache: the scheduler feeds the model the tokens after that point, a chunk of the prompt at
a time or one token per decode step, and a preempted sequence simply starts again from zero (its prompt and
its outputs so far are recomputed; what the prefix cache still holds is reused).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from tinyvllm.sampling_params import SamplingParams

_seq_ids = itertools.count()


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
