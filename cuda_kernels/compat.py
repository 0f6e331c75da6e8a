"""Fixes to the libraries underneath, in one place; every kernel module imports this first.

1. numba-cuda 0.30.4 refers to `numpy.row_stack`, which NumPy 2.5 removed; without it no kernel compiles
   ("module 'numpy' has no attribute 'row_stack'"). `row_stack` was an alias of `vstack`, so restore it.
   This must run before numba.cuda is imported.
2. In the CUDA simulator, a race in static shared-array creation (see below).
"""

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config as _numba_config  # noqa: E402  (after the fix above, on purpose)

#: True when kernels run in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1): Python threads, no GPU.
SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)

if SIMULATOR:
    # NOTE: the simulator (numba-cuda 0.30) creates a static shared array on its first use in a launch, keyed
    # by the calling line, with an unlocked dict get-then-set: two threads of a launch's first block can race,
    # hold different arrays and silently compute garbage (seen under CPU load). This replacement takes the
    # same key under a lock, from the caller's frame (no traceback extraction, which is also much faster).
    import sys
    import threading

    from numba.core import types as _types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support as _numpy_support

    if not getattr(FakeCUDAShared.array, "locked", False):
        _dynamic_shared, _shared_lock = FakeCUDAShared.array, threading.Lock()

        def _locked_shared_array(self, shape, dtype, alignment=None):
            if shape == 0 or alignment is not None:   # dynamic shared memory (not keyed), or the error
                return _dynamic_shared(self, shape, dtype, alignment)
            if isinstance(dtype, _types.Type):
                dtype = _numpy_support.as_dtype(dtype)
            caller = sys._getframe(1)
            key = (caller.f_code.co_filename, caller.f_lineno)
            with _shared_lock:
                array = self._allocations.get(key)
                if array is None:
                    array = self._allocations[key] = np.empty(shape, dtype)
            return array

        _locked_shared_array.locked = True
        FakeCUDAShared.array = _locked_shared_array
