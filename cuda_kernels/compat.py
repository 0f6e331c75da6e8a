"""Fixes to the libraries underneath, in one place; every kernel module imports this first.

1. numba-cuda 0.30.4 refers to `numpy.row_stack`, which NumPy 2.5 removed; without it no kernel compiles
   ("module 'numpy' has no attribute 'row_stack'"). `row_stack` was an alias of `vstack`, so restore it.
   This must run before numba.cuda is imported.
2. In the CUDA simulator, a race in static shared-array creation (see below).
3. In the CUDA simulator, the cost of calling a device function that does not use `cuda` (see below).
4. In the CUDA simulator, the cost of running a block: a new thread per simulated thread, and a manager
   that polls them (see below).
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
    import functools
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

    # NOTE: the simulator (numba-cuda 0.30) runs each block of a launch by starting a new Python thread per
    # simulated thread (each start waits until the new thread has run) and then polls all of them in a loop,
    # holding the GIL against the threads it waits for, until every one that has not returned waits at the
    # barrier. The engine tests spend most of their time in such blocks: the LM head's GEMM of the tiny model
    # (17 blocks of 64 threads) took about 2.3 s (1.6 s of CPU) and takes about 0.6 s here, and the simulator
    # engine tests take about 40% of their time (with Python's own switch interval: tests/conftest.py).
    # This replacement runs a block on persistent worker threads (one pool for the process, handed to each
    # block in turn) and counts the arrivals at the barrier under a condition. The semantics are the
    # simulator's: every simulated thread is its own Python thread, with its threadIdx, blockIdx and
    # laneid; a barrier opens when every thread of the block that has not returned waits at it; an exception
    # in one thread aborts the others (each raises at its next barrier) and is raised by the launch, in the
    # simulator's words ("tid=[...] ctaid=[...]: ..."). The pool holds as many threads as the largest block.
    import os

    from numba.cuda.simulator import kernel as _sim_kernel
    from numba.cuda.simulator.kernelapi import Dim3 as _Dim3

    class _Block:
        """One block's run: its kernel call, the threads that have not returned, those waiting at the barrier,
        the barrier's generation (counted up each time it opens) and the first exception."""

        def __init__(self, target, threads: int):
            self.target, self.live, self.waiting, self.generation, self.error = target, threads, 0, 0, None
            self.cond = threading.Condition(threading.Lock())

        def arrive(self) -> None:
            """A thread's __syncthreads(): wait until the barrier opens (RuntimeError if the block aborts)."""
            with self.cond:
                self.waiting += 1
                if self.waiting == self.live:
                    self._open()
                else:
                    generation = self.generation
                    while self.generation == generation and self.error is None:
                        self.cond.wait()
                if self.error is not None:
                    raise RuntimeError("abort flag set on syncthreads clear")

        def leave(self, exception) -> None:
            """A thread returned (with the simulator's (exception, traceback) or None)."""
            with self.cond:
                self.live -= 1
                if exception is not None and self.error is None:
                    self.error = exception
                    self.cond.notify_all()
                elif self.waiting == self.live:   # the rest wait at the barrier (or none is left)
                    self._open()

        def _open(self) -> None:
            self.waiting = 0
            self.generation += 1
            self.cond.notify_all()

        def join(self):
            """Wait until every thread has returned or one has raised; the exception, if one did."""
            with self.cond:
                while self.live and self.error is None:
                    self.cond.wait()
                return self.error

    class _Worker(_sim_kernel.BlockThread):
        """A persistent thread that plays one simulated thread of each block it is given."""

        def __init__(self):
            threading.Thread.__init__(self, name="cudasim-worker", daemon=True)
            self.ready = threading.Event()
            self.block = None
            self.retired = False

        def play(self, manager, block: _Block, block_idx, thread_idx, thread_id: int) -> None:
            self._manager, self.block, self.blockIdx, self.threadIdx = manager, block, block_idx, thread_idx
            self.thread_id, self.exception, self.abort, self.debug = thread_id, None, False, manager._debug
            self.ready.set()

        def run(self):
            while True:
                self.ready.wait()
                self.ready.clear()
                if self.retired:
                    return
                block = self.block
                self._target, self._args, self._kwargs = block.target, (), {}
                _sim_kernel.BlockThread.run(self)   # the simulator's: the kernel, an exception kept in its words
                block.leave(self.exception)
                if self.retired:
                    return

        def syncthreads(self):
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            try:
                self.block.arrive()
            except RuntimeError:
                self.abort = True
                raise

    _workers: list = []
    _workers_lock = threading.Lock()
    os.register_at_fork(after_in_child=_workers.clear)   # a forked child has none of these threads

    @functools.lru_cache(maxsize=None)
    def _thread_indices(block_dim: tuple) -> tuple:
        """(threadIdx, linear thread id) of every thread of a block, in the simulator's order."""
        dim = _Dim3(*block_dim)
        return tuple((_Dim3(*p), p[0] + dim.x * (p[1] + dim.y * p[2])) for p in np.ndindex(*block_dim))

    def _run_block(self, grid_point, *args):
        """BlockManager.run: one block of the launch, on the pool's first threads."""
        indices = _thread_indices(tuple(self._block_dim))
        with _workers_lock:
            while len(_workers) < len(indices):
                _workers.append(_Worker())
                _workers[-1].start()
            workers = _workers[:len(indices)]
        f = self._f

        def target():
            if self._debug:
                np.seterr(divide="raise")
            f(*args)

        block, block_idx = _Block(target, len(indices)), _Dim3(*grid_point)
        for worker, (thread_idx, thread_id) in zip(workers, indices):
            worker.play(self, block, block_idx, thread_idx, thread_id)
        try:
            error = block.join()
        except BaseException:   # interrupted (Ctrl-C): the block's threads may still run, so retire them
            _retire(workers)
            raise
        if error is not None:
            # as the simulator does, raise at once; the block's other threads finish aborting on their own
            _retire(workers)
            raise error[0].with_traceback(error[1])

    def _retire(workers) -> None:
        """Take a block's threads out of the pool (each ends when it returns); the next block gets new ones."""
        with _workers_lock:
            for worker in workers:
                worker.retired = True
                worker.ready.set()   # one already idle ends now, one still running when it returns
                if worker in _workers:
                    _workers.remove(worker)

    if not getattr(_sim_kernel.BlockManager.run, "pooled", False):
        _run_block.pooled = True
        _sim_kernel.BlockManager.run = _run_block
