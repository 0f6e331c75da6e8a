"""Compatibility fixes that must run before numba.cuda is imported; every kernel module imports this first.

numba-cuda 0.30.4 refers to `numpy.row_stack`, which NumPy 2.5 removed; without it no kernel compiles
("module 'numpy' has no attribute 'row_stack'"). `row_stack` was an alias of `vstack`, so restore it.
"""

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config as _numba_config  # noqa: E402  (after the fix above, on purpose)

#: True when kernels run in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1): Python threads, no GPU.
SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)
