"""Shared pieces of the kernel tests: which profile runs, shape strategies, device copies, tolerances.

Under the simulator profile (CI) shapes stay tiny, because every simulated thread is a Python thread; under
the GPU profile the same tests run with Llama-3.2-1B shapes. Kernels receive device arrays, as in the engine.
"""

import os
from functools import lru_cache

import numpy as np
from hypothesis import strategies as st

from cuda_kernels import compat  # noqa: F401  (the numpy shim must precede numba.cuda)
from numba import cuda  # noqa: E402

from reference.bf16 import f32_to_bf16  # noqa: E402
from reference.tolerance import F32_EPS, dot_tolerance  # noqa: E402,F401  (the tests' bounds)
from tinyvllm.config import RopeScaling  # noqa: E402

# Llama 3's rope_scaling (Llama 3.1 / 3.2 configs): the tables the kernels' tests rotate with
LLAMA3 = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

SIM = os.environ.get("TINYVLLM_TEST_PROFILE", "sim") == "sim"
EXAMPLES = os.environ.get("TINYVLLM_TEST_EXAMPLES")


def pick(sim_value, gpu_value):
    """The simulator's value or the GPU's, by profile."""
    return sim_value if SIM else gpu_value


def examples(sim_value: int, gpu_value: int) -> int:
    """A test's hypothesis max_examples: the profile's value, or TINYVLLM_TEST_EXAMPLES when that is set.
    NOTE: a test's own @settings(max_examples=...) replaces the profile's count (tests/conftest.py), so the
    variable has to be honoured here as well, or it would not shorten a GPU pass at all."""
    return int(EXAMPLES) if EXAMPLES else pick(sim_value, gpu_value)


def sizes(sim_max: int, gpu_choices: list[int], gpu_max: int | None = None):
    """A size strategy: 1..sim_max in the simulator; on the GPU the real sizes, plus odd ones up to gpu_max."""
    if SIM:
        return st.integers(1, sim_max)
    odd = [st.integers(1, gpu_max)] if gpu_max else []
    return st.one_of(st.sampled_from(gpu_choices), *odd)


def to_device(array):
    return cuda.to_device(np.ascontiguousarray(array))


def device_empty(shape, dtype):
    return cuda.device_array(shape, dtype=dtype)


def assert_close(actual, expected, atol, rtol):
    """|actual - expected| <= atol + rtol * |expected| elementwise (the project's tolerance form)."""
    actual = actual.copy_to_host() if hasattr(actual, "copy_to_host") else np.asarray(actual)
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol)


# fp32 accumulation of n products: the rounding error of a sum grows like sqrt(n) * eps for random data;
# tolerances are derived from that instead of being tuned until tests pass.


@lru_cache(maxsize=6)
def random_bf16(shape: tuple[int, ...], seed: int = 0, scale: float = 1.0):
    """(host bf16 array, its device copy) of N(0, scale^2) values, cached: real weight shapes (a 128256 x
    2048 table is 262M values) cost seconds to draw, too much to redo for every hypothesis example."""
    values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    values *= np.float32(scale)
    host = f32_to_bf16(values)
    return host, cuda.to_device(host)
