"""Compiled kernels kept on disk between processes, so that a new process loads machine code instead of
compiling every kernel again (Numba types each kernel, LLVM and NVVM build PTX, ptxas assembles it: about a
second a kernel, 30-40 s for the engine's kernels).

An entry is the cubin of one kernel for one argument signature, and the name of its entry point in it. Its
key is a SHA-256 over everything that decides the machine code:
- the source of every file of this package that the kernel's module, or the module of any function its
  closure holds, imports, directly or through other files of the package (the imports read from each
  file's syntax tree, those inside functions included): a device function, a constant or a helper changed
  in one of them invalidates the entry, while an edit to a kernel file that the kernel never imports does
  not (a kernel defined outside the package: every file), and the versions of numba-cuda and the driver;
- the kernel's own code and its compile options, and the values its closure holds: the compile-time
  constants a kernel factory was called with, and, for a device function the kernel closes over, the same
  recursively (see `_stable`);
- the Numba types of the arguments, and the compute capability.
A kernel whose closure holds anything else (whose value cannot be written down stably) is not cached: it
compiles as before. Entries are written atomically (a temporary file, then a rename), so processes may share
the directory; a damaged entry is ignored and rewritten.

Where: $TINYVLLM_KERNEL_CACHE if set ("0" turns the cache off), else `kernels/` in tinyvllm's cache
directory ($TINYVLLM_CACHE_DIR, else $XDG_CACHE_HOME/tinyvllm or ~/.cache/tinyvllm).
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import struct
import tempfile
import types
from functools import lru_cache
from pathlib import Path

import numpy as np

PACKAGE = Path(__file__).resolve().parent
_MAGIC = b"TVKC1"


def directory() -> Path | None:
    """The cache directory, or None when the cache is off."""
    setting = os.environ.get("TINYVLLM_KERNEL_CACHE")
    if setting == "0":
        return None
    if setting:
        return Path(setting)
    # NOTE: the same root as tinyvllm's downloads (tinyvllm.pypi_assets.cache_dir, whose rule this repeats:
    # this package does not import the engine, and tests/kernels/test_kernel_cache.py holds the two together)
    root = os.environ.get("TINYVLLM_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tinyvllm" / "kernels"


@lru_cache(maxsize=None)
def _versions() -> bytes:
    """The compiler and driver versions: a change to either invalidates every entry."""
    import numba_cuda
    from cuda.bindings import driver

    err, version = driver.cuDriverGetVersion()
    return f"numba-cuda {numba_cuda.__version__} driver {int(version)}".encode()


@lru_cache(maxsize=None)
def _imports(module: str) -> frozenset:
    """The package modules (names of files in this folder, no suffix) that `module`'s file imports anywhere
    in it: `from cuda_kernels import a, b`, `from cuda_kernels.a import f`, `import cuda_kernels.a`."""
    path = PACKAGE / f"{module}.py"
    if not path.is_file():
        return frozenset()
    found = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            head, _, rest = name.partition(".")
            sub = rest.split(".")[0]
            if head == PACKAGE.name and sub and (PACKAGE / f"{sub}.py").is_file():
                found.add(sub)
    return frozenset(found)


@lru_cache(maxsize=None)
def _sources(modules: frozenset) -> bytes:
    """A digest of the sources of `modules` (package module names) and of every package file they import,
    transitively."""
    todo, closure = list(modules), set()
    while todo:
        module = todo.pop()
        if module not in closure:
            closure.add(module)
            todo.extend(_imports(module))
    digest = hashlib.sha256()
    for module in sorted(closure):
        digest.update(module.encode() + b"\0" + (PACKAGE / f"{module}.py").read_bytes() + b"\0")
    return digest.digest()


def _stable(value, seen: frozenset = frozenset()) -> str | None:
    """A text that stands for `value` as compiled code sees it, or None if there is no stable one (an object
    whose repr is its address, say)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.integer, np.floating, np.dtype)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list)):   # tuples and NamedTuples (tile configurations), option lists
        parts = [_stable(v, seen) for v in value]
        return None if None in parts else f"{type(value).__name__}({','.join(parts)})"
    py_func = getattr(value, "py_func", None)   # a Numba dispatcher: a kernel or a device function
    if isinstance(py_func, types.FunctionType):
        return _function(py_func, getattr(value, "targetoptions", {}), seen)
    if isinstance(value, types.FunctionType):
        return _function(value, {}, seen)
    if isinstance(value, types.ModuleType):
        return f"module:{value.__name__}"
    name = getattr(value, "__qualname__", None) or getattr(getattr(value, "_defn", None), "__qualname__", None)
    module = getattr(value, "__module__", "")
    if name and module.startswith("cuda_kernels"):   # an intrinsic or other helper defined in this package
        return f"{module}.{name}"
    return None


def _function(fn: types.FunctionType, options: dict, seen: frozenset) -> str | None:
    if id(fn) in seen:   # a recursive reference: the name is enough
        return f"{fn.__module__}.{fn.__qualname__}"
    seen = seen | {id(fn)}
    cells = []
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:   # an empty cell
            contents = None
        text = _stable(contents, seen)
        if text is None:
            return None
        cells.append(text)
    opts = []
    for name, value in sorted(options.items()):
        text = _stable(value, seen)
        if text is None:
            return None
        opts.append(f"{name}={text}")
    code = hashlib.sha256(_code_bytes(fn.__code__)).hexdigest()
    return f"{fn.__module__}.{fn.__qualname__}[{code}]({';'.join(cells)}){{{';'.join(opts)}}}"


def _code_bytes(code: types.CodeType) -> bytes:
    """A code object's bytecode with its constants (nested code objects included) and the names it reads."""
    parts = [code.co_code, repr(code.co_names).encode()]
    for const in code.co_consts:
        parts.append(_code_bytes(const) if isinstance(const, types.CodeType) else repr(const).encode())
    return b"\0".join(parts)


def key(kernel, argtypes, cc: tuple[int, int]) -> str | None:
    """The cache key of `kernel` (a Numba dispatcher) compiled for `argtypes` on compute capability cc, or
    None when it cannot be cached."""
    text = _stable(kernel)
    if text is None:
        return None
    if getattr(kernel.py_func, "__module__", "").startswith(f"{PACKAGE.name}."):
        # the modules of the kernel and of every function its closure holds, as _function names them
        modules = set(re.findall(rf"\b{PACKAGE.name}\.(\w+)", text))
    else:   # a kernel defined elsewhere (a test's) may reach any package file through its own globals
        modules = {path.stem for path in PACKAGE.glob("*.py")}
    digest = hashlib.sha256(_versions() + _sources(frozenset(modules)))
    digest.update(f"{text}|{[str(t) for t in argtypes]}|sm_{cc[0]}{cc[1]}".encode())
    return digest.hexdigest()


def load(cache_key: str) -> tuple[str, bytes] | None:
    """(entry point name, cubin) of an entry, or None."""
    root = directory()
    if root is None or cache_key is None:
        return None
    try:
        data = (root / f"{cache_key}.cubin").read_bytes()
    except OSError:
        return None
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 4:
        return None
    (name_len,) = struct.unpack_from("<I", data, len(_MAGIC))
    start = len(_MAGIC) + 4
    name = data[start:start + name_len].decode(errors="replace")
    cubin = data[start + name_len:]
    return (name, cubin) if cubin else None


def store(cache_key: str, name: str, cubin) -> None:
    """Write an entry (atomically). cubin: bytes, or an object holding them in `.code` (cuda.core's
    ObjectCode, what Numba's code library returns). Anything else, or an unwritable directory, leaves the
    entry unwritten, silently: the cache only ever saves time."""
    root = directory()
    code = getattr(cubin, "code", cubin)
    if root is None or cache_key is None or not isinstance(code, (bytes, bytearray, memoryview)):
        return
    cubin = bytes(code)
    try:
        root.mkdir(parents=True, exist_ok=True)
        encoded = name.encode()
        with tempfile.NamedTemporaryFile(dir=root, delete=False, suffix=".tmp") as tmp:
            tmp.write(_MAGIC + struct.pack("<I", len(encoded)) + encoded + bytes(cubin))
        os.replace(tmp.name, root / f"{cache_key}.cubin")
    except OSError:
        pass
