"""Sampling the next token from logits: greedy, temperature, top-k, top-p and min-p; before them the
penalties and logit bias (`apply_penalties`); and the log-probabilities reported to the user (`top_logprobs`).

Per row (one sequence), with probabilities p = softmax(logits / temperature):

- temperature == 0: greedy, the index of the largest logit (the lowest index among ties).
- top_k > 0: keep tokens whose p is at least the k-th largest p.
- top_p < 1: sort p in decreasing order and find the first rank r whose cumulative sum reaches top_p; keep
  tokens whose p is at least p_(r).
- min_p > 0: keep tokens whose p is at least min_p * max(p).
- Then draw: with the kept tokens in vocabulary order and their cumulative sum C, the token is the first one
  with C > u * C_total, for the uniform number u in [0, 1) supplied by the caller. Where nothing is kept (NaN
  or infinite z: a temperature so small, or a penalty so extreme, that l / T overflows) the greedy token, as
  the GPU kernel gives.

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
        with np.errstate(invalid="ignore", over="ignore"):
            kept = sampling_probs(logits[s], temperature[s], int(top_k[s]), float(top_p[s]), float(min_p[s]))
        nonzero = np.flatnonzero(kept > 0)
        if not nonzero.size:
            continue  # nothing kept (NaN or infinite z: a tiny temperature, an extreme penalty): greedy, as the kernel
        cumulative = np.cumsum(kept)
        choice = int(np.searchsorted(cumulative, np.float32(uniform[s]) * cumulative[-1], side="right"))
        # u * total can round up to the total itself; the last kept token is then the draw.
        tokens[s] = min(choice, int(nonzero[-1]))
    return tokens


# --- penalties and logit bias (cuda_kernels/penalties.py) ---------------------------------------------------
#
# Per sampled row s, the host packs one entry per token that the row's processing touches (the tokens of its
# prompt when repetition_penalty != 1, of its output when any penalty is on, of its logit_bias, and its EOS /
# stop ids while min_tokens masks them): entries[e] = (token, output count, in prompt (0/1), bias as float32
# bits), row s owning entries[entry_offsets[s]:entry_offsets[s+1]], distinct tokens within a row. Each entry's
# logit l becomes, in float32 and in this order (vLLM's):
#
#     l = l + bias;   if in_prompt or count > 0:  l = l / r if l > 0 else l * r;   l = l - f * count;
#     if count > 0:  l = l - p                          (r, p, f: the row's repetition, presence, frequency)
#
# pending[s] = 1 says that the row's newest output token is not counted in its entries (the host had not
# read it back yet: the engine's async scheduling); it is the row's last input token,
# token_ids[logits_indices[s]], and counts once more: its entry's count + 1, or an entry (token, 1, 0, 0).
# Logits without an entry are left exactly as they are.

def penalized_logit(logit, bias, count, in_prompt, repetition, presence, frequency):
    """One entry's processed logit, float32 in the kernel's order of operations."""
    f32 = np.float32
    x = f32(f32(logit) + f32(bias))
    if in_prompt or count > 0:
        x = f32(x / f32(repetition)) if x > 0 else f32(x * f32(repetition))
    x = f32(x - f32(f32(frequency) * f32(count)))
    if count > 0:
        x = f32(x - f32(presence))
    return x


def apply_penalties(logits: np.ndarray, token_ids: np.ndarray, logits_indices: np.ndarray, pending: np.ndarray,
                    repetition_penalty: np.ndarray, presence_penalty: np.ndarray, frequency_penalty: np.ndarray,
                    entry_offsets: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """logits (S, V) float32 -> a new (S, V) float32 array with each row's entries applied (see above).

    token_ids (T,) int32: the step's input ids; logits_indices (S,) int32: the row of each sampled row's last
    token; pending (S,) int32; the three penalties (S,) float32; entry_offsets (S + 1,) int32; entries (E, 4)
    int32 (column 3 holds the bias's float32 bits).
    """
    out = np.array(logits, np.float32, copy=True)
    entries = np.asarray(entries, np.int32).reshape(-1, 4)
    bias = entries[:, 3].copy().view(np.float32)
    for s in range(out.shape[0]):
        rows = range(int(entry_offsets[s]), int(entry_offsets[s + 1]))
        extra = int(token_ids[logits_indices[s]]) if pending[s] else -1
        params = (repetition_penalty[s], presence_penalty[s], frequency_penalty[s])
        for e in rows:
            token, count, in_prompt = (int(v) for v in entries[e, :3])
            if token == extra:
                count, extra = count + 1, -1
            out[s, token] = penalized_logit(logits[s, token], bias[e], count, in_prompt, *params)
        if extra >= 0:
            out[s, extra] = penalized_logit(logits[s, extra], 0.0, 1, 0, *params)
    return out


# --- log-probabilities (cuda_kernels/logprobs.py) -----------------------------------------------------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The float64 log-softmax of each row of float32 logits (the math the kernel's values must agree with)."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def top_logprobs(logits: np.ndarray, targets: np.ndarray, num_logprobs: np.ndarray,
                 max_logprobs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row s with num_logprobs[s] = N >= 0 (rows with -1 are skipped):

        ids[s, 0] = targets[s], values[s, 0] = its log-probability, ranks[s] = #{j : l_j >= l_target}
        ids[s, 1 + k], values[s, 1 + k] for k < N: the k-th most likely token (larger logit first, then the
        lower id: numpy's stable order) and its log-probability

    logits (S, V) float32; targets, num_logprobs (S,) int32. Returns ids (S, max_logprobs + 1) int32, values
    (S, max_logprobs + 1) float32 (the float64 log-softmax rounded once), ranks (S,) int32; entries not
    produced are -1 (ids, ranks) and NaN (values). The rank is vLLM's (the count of tokens at least as
    likely), counted on the logits, where no rounding can tie two distinct values.
    """
    rows = logits.shape[0]
    ids = np.full((rows, max_logprobs + 1), -1, np.int32)
    values = np.full((rows, max_logprobs + 1), np.nan, np.float32)
    ranks = np.full(rows, -1, np.int32)
    for s in range(rows):
        n = int(num_logprobs[s])
        if n < 0:
            continue
        row = np.asarray(logits[s], np.float32)
        lp = log_softmax(row).astype(np.float32)
        target = int(targets[s])
        ids[s, 0], values[s, 0] = target, lp[target]
        ranks[s] = int(np.count_nonzero(row >= row[target]))
        order = np.argsort(-row, kind="stable")[:n]
        ids[s, 1:1 + len(order)] = order
        values[s, 1:1 + len(order)] = lp[order]
    return ids, values, ranks
