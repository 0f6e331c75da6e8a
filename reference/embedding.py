"""Token embedding lookup: ``out[t, :] = float32(table[token_ids[t], :])`` for a bf16 table (V, H)."""

import numpy as np

from reference.bf16 import bf16_to_f32


def embedding(token_ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """token_ids (T,) int; table (V, H) uint16 bf16 -> (T, H) float32."""
    return bf16_to_f32(table[np.asarray(token_ids)])
