"""Row gathers: the token embedding lookup, and picking the rows whose logits are wanted.

    embedding:   out[t, :] = float32(table[token_ids[t], :])   for a bf16 table (V, H)
    gather_rows: out[i, :] = x[indices[i], :]                   (e.g. the last token of each sequence)
    chain_tokens: token_ids[t] = sampled[src[t]] where src[t] >= 0  (the previous step's samples as inputs)
"""

import numpy as np

from reference.bf16 import bf16_to_f32


def embedding(token_ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """token_ids (T,) int; table (V, H) uint16 bf16 -> (T, H) float32."""
    return bf16_to_f32(table[np.asarray(token_ids)])


def gather_rows(x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """x (T, H) float32, indices (S,) int -> (S, H) float32."""
    return np.asarray(x, np.float32)[np.asarray(indices)]


def chain_tokens(token_ids: np.ndarray, sampled: np.ndarray, src: np.ndarray) -> np.ndarray:
    """The ids with entry t replaced by sampled[src[t]] where src[t] >= 0 (a new array)."""
    src = np.asarray(src)
    out = np.array(token_ids, copy=True)
    out[src >= 0] = np.asarray(sampled)[src[src >= 0]]
    return out
