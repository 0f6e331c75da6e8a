"""The gated MLP activation: ``out = silu(gate) * up`` with ``silu(g) = g / (1 + exp(-g))``.

The input is the output of the fused gate/up projection, (T, 2F): gate in columns [0, F), up in [F, 2F).
"""

import numpy as np


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    """gate_up (T, 2F) float32 -> (T, F) float32."""
    gate_up = np.asarray(gate_up, dtype=np.float32)
    f = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :f], gate_up[..., f:]
    # NOTE: exp(-g) overflows to inf for g < -88; g / inf = -0, which is the right limit of silu.
    # Each step writes into one array: the same roundings as the expression, without its four (T, F)
    # temporaries, which cost a long prompt's MLP as much time as the arithmetic.
    with np.errstate(over="ignore"):
        out = np.negative(gate)
        np.exp(out, out=out)
        out += np.float32(1)
        np.divide(gate, out, out=out)
        out *= up
    return out
