"""Launching a compiled kernel with one driver call: Numba's `kernel[grid, block, stream](*args)` without the
per-call generality.

What a Numba launch does on every call: it makes a launch-configuration object (and checks the grid for
an occupancy warning); types every argument to find the compiled overload (a device array made by a slice
or a reshape is a new object, typed afresh); wraps every array in a cuda.core StridedMemoryView and
flattens it into the kernel's parameters; builds a cuda.core LaunchConfig; and packs the parameters. On
the H200 that is about 30 us of Python for a five-array kernel, and the launchers' own slices and reshapes
cost as much again: a 1,024-token prefill (about 220 launches) spent 18 ms issuing its launches against
15 ms of GPU work (tools/profile_prefill.py), so the GPU waited on Python.

`launch(kernel, grid, block, stream, *args)` does the same launch, with the per-call work cut to what
changes from call to call:

- The compiled overload, its driver handle and a packer for its parameters are found once per kernel and
  argument signature (dtype, dimensions and layout of each array, the type of each scalar) and cached. The
  machine code itself comes from the on-disk kernel cache when an earlier process compiled it
  (cuda_kernels/kernel_cache.py); else Numba compiles it and the cache keeps it.
- The parameters are the ABI Numba compiles a kernel to. An array of ndim dimensions is 5 + 2 ndim
  parameters, (meminfo, parent, nitems, itemsize, data, shape[0], ..., strides[0], ...), each 8 bytes
  (meminfo and parent are host-side bookkeeping a kernel never reads: 0); a scalar is one parameter of its
  own type. One `struct.pack_into` writes them into a buffer of 8-byte slots, and the driver gets the
  (fixed) addresses of the slots. The driver copies the values when it enqueues the launch, so the buffer
  is free again when the call returns, and a launch captured into a CUDA graph keeps its own copy.
- One `cuLaunchKernelEx` through cuda.bindings, with the programmatic-stream-serialization attribute when
  `dependent` is set: the kernel may then start while the one before it finishes, and must follow
  cuda_kernels/pdl.py's rules (grid_wait before reading what an earlier kernel writes).
- Dynamic shared memory above the 48 KB every kernel may use is opted into once per overload and size.
- `view(array, shape, dtype)` stands for array.view(dtype).reshape(shape) of a C-contiguous array (a
  GEMM's operands as 1-D buffers, a bf16 cache read as 64-bit words) and is packed straight from the
  array's pointer, without the new device-array objects (tens of us each) that a view and a reshape make.

In the simulator `launch` is Numba's own launch, `view` the view and reshape, and `dependent` has no
effect.
Kernels compile (or load) on their first launch, as with Numba's syntax. One process, one device: the cache
does not tell contexts apart. `prepared()` counts the kernel signatures set up so far in the process (in
the simulator: first seen), so that a caller can check that none is added after a warm-up.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import weakref
from functools import lru_cache

import numpy as np

from cuda_kernels import compat  # noqa: F401  (the numpy shim precedes numba.cuda)
from cuda_kernels.compat import SIMULATOR
from numba import cuda

STATIC_SHARED_LIMIT = 48 * 1024   # dynamic shared memory a kernel gets without opting in
OPT_IN_SHARED_LIMIT = 227 * 1024  # what one block may opt in to on the H200 (launch(..., shared=) does it)
SLOT = 8                          # bytes per parameter slot: every parameter here is at most 8 bytes
PDL_MIN_CC = (9, 0)


def _dim3(value) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


@lru_cache(maxsize=None)
def pdl_enabled() -> bool:
    """Whether dependent launches get the PDL attribute: a device of compute capability 9.0 or later (the
    attribute and griddepcontrol exist from sm_90 on) and TINYVLLM_PDL not "0" (for A/B measurements)."""
    if SIMULATOR or os.environ.get("TINYVLLM_PDL", "1") == "0":
        return False
    return tuple(cuda.get_current_device().compute_capability) >= PDL_MIN_CC


def _view_shape(array, shape, dtype) -> tuple[np.dtype, tuple[int, ...]]:
    """(dtype, shape) of view(array, shape, dtype): by default the array's dtype, and its shape with the
    last dimension rescaled to the new item size."""
    dtype = np.dtype(dtype or array.dtype)
    if shape is None:
        dims = tuple(array.shape)   # NOTE: a tuple first: the simulator's shape takes no negative index
        nbytes = dims[-1] * array.dtype.itemsize
        if nbytes % dtype.itemsize:
            raise ValueError(f"view: rows of {nbytes} bytes do not hold whole {dtype} items")
        shape = (*dims[:-1], nbytes // dtype.itemsize)
    shape = tuple(int(n) for n in shape)
    if int(np.prod(shape)) * dtype.itemsize != array.size * array.dtype.itemsize:
        raise ValueError(f"view: {tuple(array.shape)} {array.dtype} cannot be seen as {shape} {dtype}")
    return dtype, shape


# (kernel, signature) pairs launched so far: what prepared() counts; and how many of them were compiled
_prepared: set = set()
_compiled = [0]


def prepared() -> int:
    """How many kernel signatures this process has compiled or loaded (simulator: launched) so far."""
    return len(_prepared)


def compiled() -> int:
    """How many of them Numba compiled (the others came from the on-disk kernel cache; GPU only)."""
    return _compiled[0]


_preparing = [False]


@contextlib.contextmanager
def preparing():
    """Inside, `launch` only compiles (or loads) the kernel for its arguments and returns: nothing runs. A
    warm-up walks a step's launches this way to have every kernel ready before the first request."""
    _preparing[0] = True
    try:
        yield
    finally:
        _preparing[0] = False


if SIMULATOR:
    def view(array, shape=None, dtype=None):
        """array (C-contiguous) seen as `shape` of `dtype`: Numba's view and reshape in the simulator."""
        if not array.is_c_contiguous():
            raise ValueError(f"view: the array must be C-contiguous, got strides {array.strides}")
        dtype, shape = _view_shape(array, shape, dtype)
        return array.view(dtype).reshape(shape)

    def _submit(kernel, grid, block, stream, args, shared, dependent):
        """Numba's own launch: the simulator has no driver to call, and no PDL."""
        _prepared.add((kernel, tuple((a.dtype, len(a.shape)) if hasattr(a, "shape") else type(a) for a in args)))
        if not _preparing[0]:
            kernel[grid, block, stream, shared](*args)

else:
    from cuda.bindings import driver as _drv
    from cuda.core import ObjectCode
    from numba.core import types

    from cuda_kernels import kernel_cache
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.np import numpy_support

    from cuda_kernels.driver import ok, stream_handle

    class view:   # noqa: N801  (named like the function it is in the simulator)
        """A C-contiguous device array passed to a kernel as a C-contiguous array of `shape` and `dtype` over
        the same bytes (by default: its own shape and dtype, the last dimension rescaled to the dtype)."""

        __slots__ = ("array", "dtype", "shape", "strides", "size", "key")

        def __init__(self, array, shape=None, dtype=None):
            if not array.is_c_contiguous():
                raise ValueError(f"view: the array must be C-contiguous, got strides {array.strides}")
            self.array = array
            self.dtype, self.shape = _view_shape(array, shape, dtype)
            strides, step = [], self.dtype.itemsize
            for n in reversed(self.shape):
                strides.append(step)
                step *= n
            self.strides = tuple(reversed(strides))
            self.size = step // self.dtype.itemsize
            self.key = (view, self.dtype, len(self.shape))

        def values(self) -> tuple:
            """Its parameters: the array's pointer, with the view's size, item size, shape and strides."""
            pointer = _array_params(self.array)[1][4]
            return (0, 0, self.size, self.dtype.itemsize, pointer, *self.shape, *self.strides)

    def _array_key(a) -> tuple:
        """What of Numba's type of a device array picks the overload: dtype, ndim and layout."""
        if 0 in a.strides and a.size:
            layout = "A"    # broadcast: Numba types it "A" (its strides are not the contiguous ones)
        else:
            layout = "C" if a.is_c_contiguous() else "F" if a.is_f_contiguous() else "A"
        return a.dtype, a.ndim, layout

    # scalar parameters: struct code, padded to a slot
    _SCALAR_FORMATS = {types.float32: "f4x", types.float64: "d", types.boolean: "?7x"}
    _INTEGER_CODES = {8: "b", 16: "h", 32: "i", 64: "q"}

    def _scalar_format(ty) -> str:
        if ty in _SCALAR_FORMATS:
            return _SCALAR_FORMATS[ty]
        if isinstance(ty, types.Integer):
            code = _INTEGER_CODES[ty.bitwidth]
            return (code if ty.signed else code.upper()) + "x" * (SLOT - ty.bitwidth // 8)
        raise TypeError(f"launch: no packing for a kernel argument of type {ty}")

    def _array_params(a) -> tuple:
        """(the overload key, the parameter values) of a device array, computed once per array object.

        NOTE: kept on the array (a Numba device array never changes its pointer, shape or strides), so that
        the engine's long-lived buffers cost one attribute lookup per launch."""
        try:
            return a._tinyvllm_params
        except AttributeError:
            pass
        pointer = int(a.gpu_data.device_pointer) if a.size else 0
        params = (_array_key(a), (0, 0, a.size, a.dtype.itemsize, pointer, *a.shape, *a.strides))
        a._tinyvllm_params = params
        return params

    def _params(args) -> tuple[tuple, list]:
        """(the overload key of args, their flattened parameter values in the kernel ABI's order)."""
        keys, values = [], []
        for a in args:
            if isinstance(a, DeviceNDArray):
                key, more = _array_params(a)
                keys.append(key)
                values += more
            elif isinstance(a, view):
                keys.append(a.key)
                values += a.values()
            else:
                keys.append(type(a))
                values.append(a)
        return tuple(keys), values

    class _Entry:
        """One kernel and argument signature: its overload's driver handle, its parameter layout and the
        buffer the parameters are packed into."""

        def __init__(self, kernel, args):
            argtypes, fmt = [], ["="]
            for a in args:
                if isinstance(a, DeviceNDArray):
                    dtype, ndim, layout = _array_key(a)
                    argtypes.append(types.Array(numpy_support.from_dtype(dtype), ndim, layout))
                    fmt.append("q" * (5 + 2 * ndim))
                elif isinstance(a, view):
                    argtypes.append(types.Array(numpy_support.from_dtype(a.dtype), len(a.shape), "C"))
                    fmt.append("q" * (5 + 2 * len(a.shape)))
                else:
                    argtypes.append(kernel.typeof_pyval(a))
                    fmt.append(_scalar_format(argtypes[-1]))
            self.name = kernel.py_func.__name__
            self.kernel_handle, self._code = _machine_code(kernel, tuple(argtypes))
            self.handle = _drv.CUfunction(int(self.kernel_handle))
            self.format = struct.Struct("".join(fmt))
            slots = self.format.size // SLOT
            self.buffer = np.zeros(slots, np.uint64)
            # the void** the driver reads: the address of every slot
            self.pointers = self.buffer.ctypes.data + SLOT * np.arange(slots, dtype=np.uint64)
            self.params = int(self.pointers.ctypes.data)
            self.shared = STATIC_SHARED_LIMIT
            self.lock = threading.Lock()

        def allow_shared(self, nbytes: int) -> None:
            """Opt in to nbytes of dynamic shared memory (refused above 48 KB until then: docs/performance.md)."""
            if nbytes <= self.shared:
                return
            attribute = _drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            if isinstance(self.kernel_handle, _drv.CUkernel):
                device = _drv.CUdevice(cuda.get_current_device().id)
                result = _drv.cuKernelSetAttribute(attribute, nbytes, self.kernel_handle, device)
            else:
                result = _drv.cuFuncSetAttribute(self.kernel_handle, attribute, nbytes)
            err = result[0] if isinstance(result, tuple) else result
            if int(err) != 0:
                raise RuntimeError(f"launch: could not allow {nbytes} bytes of dynamic shared memory for "
                                   f"{self.name}: {err}")
            self.shared = nbytes

    def _machine_code(kernel, argtypes):
        """(driver handle, the object that keeps the code loaded) of kernel for argtypes: from the on-disk cache
        (kernel_cache.py) when it holds it, else compiled by Numba and stored there."""
        cache_key = kernel_cache.key(kernel, argtypes, tuple(cuda.get_current_device().compute_capability))
        hit = kernel_cache.load(cache_key)
        if hit is not None:
            name, cubin = hit
            try:
                code = ObjectCode.from_cubin(cubin)
                loaded = code.get_kernel(name)
                return loaded.handle, (code, loaded)
            except Exception:   # a damaged or foreign entry: compile, and overwrite it below
                pass
        compiled = kernel.compile(argtypes)
        _compiled[0] += 1
        library = compiled._codelibrary
        handle = library.get_cufunc().handle
        # NOTE: a kernel linked with code that needs set-up at load time is not cached (none here has)
        if not library._setup_functions:
            kernel_cache.store(cache_key, library._entry_name, library.get_cubin())
        return handle, compiled

    _entries: dict = {}
    _streams: dict = {}   # id(stream) -> (a weak reference to the stream, its CUstream)
    _local = threading.local()

    def _configs():
        """This thread's two reusable launch configurations: plain, and with the PDL attribute."""
        pair = getattr(_local, "configs", None)
        if pair is None:
            plain, dependent = _drv.CUlaunchConfig(), _drv.CUlaunchConfig()
            attribute = _drv.CUlaunchAttribute()
            attribute.id = _drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attribute.value.programmaticStreamSerializationAllowed = 1
            dependent.attrs = [attribute]
            dependent.numAttrs = 1
            pair = _local.configs = (plain, dependent)
        return pair

    def _stream(stream):
        if not stream:
            return _drv.CUstream(0)
        known = _streams.get(id(stream))
        if known is None or known[0]() is not stream:   # new, or a dead stream's id reused
            known = _streams[id(stream)] = (weakref.ref(stream), stream_handle(stream))
        return known[1]

    def _submit(kernel, grid, block, stream, args, shared, dependent):
        """The driver launch behind `launch` (see the module docstring)."""
        keys, values = _params(args)
        key = (kernel, keys)
        entry = _entries.get(key)
        if entry is None:
            entry = _entries[key] = _Entry(kernel, args)
            _prepared.add(key)
        if shared > entry.shared:
            entry.allow_shared(shared)
        if _preparing[0]:
            return
        config = _configs()[1 if dependent and pdl_enabled() else 0]
        config.gridDimX, config.gridDimY, config.gridDimZ = _dim3(grid)
        config.blockDimX, config.blockDimY, config.blockDimZ = _dim3(block)
        config.sharedMemBytes = shared
        config.hStream = _stream(stream)
        with entry.lock:
            entry.format.pack_into(entry.buffer, 0, *values)
            ok(_drv.cuLaunchKernelEx(config, entry.handle, entry.params, 0))


# What `launch` calls: submit(kernel, grid, block, stream, args, shared, dependent). Tools that watch or
# filter launches (tools/profile_step.py, tools/offline_compile.py) replace it, and call the one they
# replaced to launch.
submit = _submit


def launch(kernel, grid, block, stream, *args, shared: int = 0, dependent: bool = False):
    """kernel[grid, block, stream, shared](*args), as one cuLaunchKernelEx on a GPU (see the module
    docstring). kernel: a @cuda.jit dispatcher; args: Numba device arrays, view(...)s and scalars;
    shared: bytes of dynamic shared memory; dependent: with programmatic stream serialization, for a kernel
    that follows cuda_kernels/pdl.py's rules."""
    submit(kernel, grid, block, stream, args, shared, dependent)


# ---------------------------------------------------------------------------------------------------------
# kernels: what a kernel sees of its arguments (the test of the packing)


@cuda.jit
def _echo_kernel(matrix, words, f32, f64, i32, u64, flag, out):
    """out[0:10] <- matrix's shape and last element, words' length and last element, the five scalars."""
    if cuda.grid(1) == 0:
        rows, cols = matrix.shape
        out[0], out[1], out[2] = rows, cols, matrix[rows - 1, cols - 1]
        out[3], out[4] = words.shape[0], words[words.shape[0] - 1]
        out[5], out[6], out[7], out[8] = f32, f64, i32, u64
        out[9] = 1.0 if flag else 0.0


# ---------------------------------------------------------------------------------------------------------
# launchers


def echo(matrix, words, f32, f64, i32, u64, flag, out, stream=0):
    """Launch _echo_kernel through `launch`. matrix: a 2-D float32 device array (any strides); words: a
    device array or a view(...) of one, 1-D; out: (10,) float64."""
    launch(_echo_kernel, 1, 32, stream, matrix, words, f32, f64, i32, u64, flag, out)
