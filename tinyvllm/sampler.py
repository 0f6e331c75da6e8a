"""The sampling step of the CPU backend, in NumPy (reference/sampling.py), and the logprobs a runner returns.

Order per step, as on the GPU (tinyvllm/cuda_runner.py): the raw logits of the sampled rows -> penalties, logit
bias and min_tokens masks (only rows with entries change) -> temperature / top-k / top-p / min-p and the draw;
then the logprobs of the chosen tokens from the raw logits (vLLM's default), and those of the prompt rows
(prompt_logprobs), whose logits the model computed after the sampled rows' (`with_prompt_rows`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from reference.llama import ForwardBatch
from reference.sampling import apply_penalties, sample, top_logprobs
from tinyvllm.batch import SamplingBatch
from tinyvllm.sampling_params import MAX_LOGPROBS

#: columns of a logprobs row: the chosen token, then up to MAX_LOGPROBS most likely
LOGPROB_WIDTH = MAX_LOGPROBS + 1


@dataclass
class StepLogprobs:
    """What a runner returns for a step's logprobs: per sampled row and per prompt-logprob row, a triple of
    ids (R, LOGPROB_WIDTH) int32, values (R, LOGPROB_WIDTH) float32, ranks (R,) int32; column 0 is the
    chosen token (or the prompt token the row predicts), then the most likely ones (cuda_kernels/logprobs.py).
    None where the step has no such rows."""

    sampled: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    prompt: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def with_prompt_rows(batch: ForwardBatch, sampling: SamplingBatch) -> ForwardBatch:
    """The batch with the prompt-logprob rows appended to the rows whose logits are computed."""
    if not sampling.num_prompt_rows:
        return batch
    return dataclasses.replace(batch, logits_indices=np.concatenate([batch.logits_indices, sampling.prompt_rows]))


def sample_step(logits: np.ndarray, batch: ForwardBatch,
                sampling: SamplingBatch) -> tuple[np.ndarray, StepLogprobs | None]:
    """(tokens (n,) int32, the step's logprobs or None) from the logits of with_prompt_rows(batch, sampling)."""
    n = len(batch.logits_indices)
    raw = logits[:n]
    processed = raw
    if sampling.processes_logits:
        processed = apply_penalties(raw, batch.token_ids, batch.logits_indices, sampling.pending,
                                    sampling.repetition_penalty, sampling.presence_penalty,
                                    sampling.frequency_penalty, sampling.entry_offsets, sampling.entries)
    tokens = sample(processed, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                    sampling.uniform).astype(np.int32)
    if not (sampling.wants_logprobs or sampling.num_prompt_rows):
        return tokens, None
    result = StepLogprobs()
    if sampling.wants_logprobs:
        result.sampled = top_logprobs(raw, tokens, sampling.num_logprobs, MAX_LOGPROBS)
    if sampling.num_prompt_rows:
        result.prompt = top_logprobs(logits[n:], sampling.prompt_targets, sampling.prompt_num_logprobs,
                                     MAX_LOGPROBS)
    return tokens, result
