"""Fixes to the libraries underneath, in one place; every kernel module imports this first.

1. numba-cuda 0.30.4 refers to `numpy.row_stack`, which NumPy 2.5 removed; without it no kernel compiles
   ("module 'numpy' has no attribute 'row_stack'"). `row_stack` was an alias of `vstack`, so restore it.
   This must run before numba.cuda is imported.
2. In the CUDA simulator, a race in static shared-array creation (see below).
3. In the CUDA simulator, the cost of calling a device function that does not use `cuda` (see below).
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

    # NOTE: every call of a simulated device function swaps the `cuda` name in its module's globals for the
    # launch's fake module and back (two locks, and a scan of the module's globals whenever no other thread
    # holds the swap). A pure arithmetic helper such as bf16_to_f32, called once per element, spent most of
    # an engine test's time there (the simulator engine tests took 3-5 minutes each). A device function whose
    # code never names the cuda module needs no swap, so it is called directly; the others keep the swap.
    import types as _pytypes

    from numba import cuda as _cuda
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    def _names_cuda(fn) -> bool:
        """Whether fn's code (nested code objects included) reads a global bound to the cuda module."""
        glob, codes = fn.__globals__, [fn.__code__]
        while codes:
            code = codes.pop()
            if any(glob.get(n) is _cuda or type(glob.get(n)).__name__ == "FakeCUDAModule" for n in code.co_names):
                return True
            codes += [c for c in code.co_consts if isinstance(c, _pytypes.CodeType)]
        return False

    if not getattr(FakeCUDAKernel.__call__, "direct", False):
        _swapping_call = FakeCUDAKernel.__call__

        def _direct_call(self, *args):
            if self._device:
                direct = self.__dict__.get("_direct")
                if direct is None:
                    direct = self.__dict__["_direct"] = not _names_cuda(self.fn)
                if direct:
                    return self.fn(*args)
            return _swapping_call(self, *args)

        _direct_call.direct = True
        FakeCUDAKernel.__call__ = _direct_call
