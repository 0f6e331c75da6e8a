"""Reading and writing safetensors files, bf16 included.

The format: 8 bytes little-endian header length N, N bytes of JSON
``{name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the raw little-endian tensor bytes. The `safetensors` library validates the header (offsets inside
the file, no overlaps); its NumPy backend cannot return BF16 (NumPy has no such type), so the bytes are
mapped here with `np.memmap` and bf16 is returned as its uint16 bit patterns, zero-copy.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Mapping

import numpy as np
from safetensors import safe_open

# safetensors dtype name -> the NumPy dtype its bytes are viewed as (BF16 as raw bit patterns)
NUMPY_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64}
_NAMES_BY_NUMPY = {np.dtype(np.uint16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32",
                   np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}


class SafetensorsError(ValueError):
    """A safetensors file is unreadable, truncated or holds something we cannot use."""


class SafetensorsFile:
    """One validated safetensors file: names, dtypes, shapes and zero-copy arrays."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with safe_open(str(self.path), framework="numpy") as handle:
                names = list(handle.keys())
        except Exception as exc:  # the library raises its own error type, or OSError for I/O
            raise SafetensorsError(f"{self.path}: not a valid safetensors file ({exc})") from None
        with open(self.path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        self.metadata = header.pop("__metadata__", None) or {}
        self.header = {name: header[name] for name in names}
        self._data_start = 8 + header_len
        data_len = self.path.stat().st_size - self._data_start
        end = max((entry["data_offsets"][1] for entry in self.header.values()), default=0)
        if end > data_len:
            raise SafetensorsError(f"{self.path}: truncated: tensors need {end} data bytes, file has {data_len}")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start, shape=(data_len,)) \
            if data_len else np.zeros(0, np.uint8)

    def keys(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only NumPy array (BF16 as uint16 bit patterns)."""
        entry = self.header[name]
        dtype = NUMPY_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise SafetensorsError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, "
                                   f"expected one of {sorted(NUMPY_DTYPES)}")
        begin, end = entry["data_offsets"]
        return self._map[begin:end].view(dtype).reshape(entry["shape"])


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` to `path`; uint16 arrays are written as BF16 bit patterns."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    arrays = {}
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype not in _NAMES_BY_NUMPY:
            raise SafetensorsError(f"tensor {name!r}: cannot write dtype {array.dtype}")
        header[name] = {"dtype": _NAMES_BY_NUMPY[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays[name] = array
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for array in arrays.values():
            fh.write(array.data)
    partial.replace(path)
