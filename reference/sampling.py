"""Sampling the next token from logits: greedy, temperature, top-k, top-p and min-p.

Per row (one sequence), with probabilities p = softmax(logits / temperature):

- temperature == 0: greedy, the index of the largest logit (the lowest index among ties).
- top_k > 0: keep tokens whose p is at least the k-th largest p.
- top_p < 1: sort p in decreasing order and find the first rank r whose cumulative sum reaches top_p; keep
  tokens whose p is at least p_(r).
- min_p > 0: keep tokens whose p is at least min_p * max(p).
- Then draw: with the kept tokens in vocabulary order and their cumulative sum C, the token is the first one
  with C > u * C_total, for the uniform number u in [0, 1) supplied by the caller.

Every filter is a threshold on p, with ties at the threshold kept, so the kept set does not depend on how a
sort orders equal values: a GPU kernel can find the same thresholds by search instead of sorting. The
uniform numbers come from the caller (a per-request seeded generator) so the kernel and this reference
draw the same token.
"""

from __future__ import annotations

import numpy as np


def argmax(logits: np.ndarray) -> np.ndarray:
    """logits (S, V) float32 -> (S,) int32: greedy tokens."""
    return np.argmax(logits, axis=-1).astype(np.int32)


def sampling_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """One row's filtered, unnormalised probabilities (V,) float32 for temperature > 0."""
    z = np.asarray(logits, np.float32) / np.float32(temperature)
    p = np.exp(z - z.max())
    p /= p.sum()
    threshold = np.float32(0)
    if 0 < top_k < p.size:
        threshold = max(threshold, np.partition(p, p.size - top_k)[p.size - top_k])
    if top_p < 1:
        ordered = np.sort(p)[::-1]
        rank = min(int(np.searchsorted(np.cumsum(ordered), np.float32(top_p))), p.size - 1)
        threshold = max(threshold, ordered[rank])
    if min_p > 0:
        threshold = max(threshold, np.float32(min_p) * p.max())
    return np.where(p >= threshold, p, np.float32(0))


def sample(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
           min_p: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """logits (S, V) float32; per-row parameters (S,) and uniform numbers (S,) in [0, 1) -> (S,) int32."""
    tokens = argmax(logits)
    for s in range(logits.shape[0]):
        if temperature[s] == 0:
            continue
        kept = sampling_probs(logits[s], temperature[s], int(top_k[s]), float(top_p[s]), float(min_p[s]))
        cumulative = np.cumsum(kept)
        choice = int(np.searchsorted(cumulative, np.float32(uniform[s]) * cumulative[-1], side="right"))
        # u * total can round up to the total itself; the last kept token is then the draw.
        tokens[s] = min(choice, int(np.flatnonzero(kept)[-1]))
    return tokens
