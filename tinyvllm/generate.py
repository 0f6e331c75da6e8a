"""Generating one request on the CPU reference backend: prefill the prompt, then decode token by token.

The KV cache is the same paged cache the GPU engine uses; a single request simply owns blocks 0, 1, 2, ...
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from reference.llama import ReferenceLlama, single_sequence_batch
from reference.sampling import sample
from tinyvllm.config import ModelConfig
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.text_stream import TextStream
from tinyvllm.weights import load_weights

BLOCK_SIZE = 16


class PromptTooLongError(ValueError):
    """The prompt does not fit in the model's context."""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None      # "stop" (eos, stop token or stop string) or "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """New tokens after the first, per second of decoding (the first comes from the prefill)."""
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


class CPUGenerator:
    """A model loaded for the NumPy reference backend."""

    def __init__(self, model_dir, tokenizer):
        self.config = ModelConfig.from_dir(model_dir)
        self.model = ReferenceLlama(self.config, load_weights(model_dir, self.config))
        self.tokenizer = tokenizer

    def stream(self, prompt_ids: list[int], params: SamplingParams, stats: GenerationStats) -> Iterator[str]:
        """Yields text pieces as they are decoded; fills `stats` as it goes."""
        c = self.config
        if not prompt_ids:
            raise PromptTooLongError("the prompt is empty: nothing to generate from")
        if len(prompt_ids) >= c.max_position_embeddings:
            raise PromptTooLongError(f"the prompt has {len(prompt_ids)} tokens; the model's context "
                                     f"(max_position_embeddings) is {c.max_position_embeddings}")
        max_new = min(params.max_tokens, c.max_position_embeddings - len(prompt_ids))
        total = len(prompt_ids) + max_new
        kv = self.model.new_kv_cache(-(-total // BLOCK_SIZE), BLOCK_SIZE)
        block_table = np.arange(kv.num_blocks, dtype=np.int32)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(c.eos_token_ids))
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        rng = np.random.default_rng(params.seed)
        text = TextStream(self.tokenizer, prompt_ids, params.stop)
        stats.prompt_tokens = len(prompt_ids)

        new_ids, start, begin = list(prompt_ids), 0, time.perf_counter()
        while True:
            logits = self.model.forward(single_sequence_batch(new_ids, start, block_table, BLOCK_SIZE), kv)
            token = int(sample(logits, np.array([params.temperature]), np.array([params.top_k]),
                               np.array([params.top_p]), np.array([params.min_p]), rng.random(1))[0])
            now = time.perf_counter()
            if not stats.token_ids:
                stats.prefill_seconds = now - begin
            else:
                stats.decode_seconds += now - begin
            begin = now
            start += len(new_ids)
            new_ids = [token]
            stats.token_ids.append(token)
            finished_by_token = token in stop_ids and len(stats.token_ids) > params.min_tokens
            if not finished_by_token:
                piece = text.push(token)
                if piece:
                    yield piece
            if finished_by_token or text.stopped:
                stats.finish_reason = "stop"
            elif len(stats.token_ids) >= max_new:
                stats.finish_reason = "length"
            else:
                continue
            tail = text.finish()
            if tail:
                yield tail
            stats.text = text.text
            return
