"""Hand-written Numba CUDA kernels, one kernel family per module; the only place that defines @cuda.jit kernels.

Every kernel has a twin of the same name and arguments in `reference/`, and tests in tests/kernels/ that
compare the two under hypothesis, in Numba's CUDA simulator (CI) and on a real GPU.
"""

from cuda_kernels import compat  # noqa: F401  (must precede any numba.cuda import)
