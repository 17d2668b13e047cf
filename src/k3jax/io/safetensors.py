"""A strict safetensors reader (header checked against the file; bf16 via ml_dtypes; memory-mapped)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or of the wrong shape; the message names it."""


_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


class SafetensorsFile:
    """Index of one ``.safetensors`` file: ``keys()``, ``shape(k)``, ``dtype(k)``, ``get(k)`` → numpy array."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated ({size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{self.path}: header claims {n} bytes but the file has {size - 8} after it")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: header is not valid JSON ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        data_len = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for key, e in header.items():
            try:
                dt = _DTYPES[e["dtype"]]
                shape = tuple(int(s) for s in e["shape"])
                start, end = (int(o) for o in e["data_offsets"])
            except KeyError as err:
                raise CheckpointError(f"{self.path}: tensor {key!r}: unsupported or missing header field {err}") \
                    from None
            want = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if end - start != want or start < 0:
                raise CheckpointError(f"{self.path}: tensor {key!r}: header says {end - start} bytes for "
                                      f"{e['dtype']}{list(shape)} (needs {want})")
            if end > data_len:
                raise CheckpointError(f"{self.path}: tensor {key!r} ends at byte {end} of the data section but the "
                                      f"file holds only {data_len} (truncated?)")
            self._entries[key] = (dt, shape, start, end)
        self._mmap: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def dtype(self, key: str) -> np.dtype:
        return self._entries[key][0]

    def get(self, key: str) -> np.ndarray:
        """The tensor as a numpy array (a copy, so the file can be closed)."""
        dt, shape, start, end = self._entries[key]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mmap[self._data_start + start: self._data_start + end]
        return np.frombuffer(raw.tobytes(), dtype=dt).reshape(shape)

    def close(self) -> None:
        self._mmap = None


_NAMES = {v: k for k, v in _DTYPES.items()}


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (C-order numpy arrays, bf16 via ml_dtypes) as one safetensors file; returns its size.

    Keys are written in sorted order with 8-byte aligned data, like the reference writer. Written to a temporary
    name and renamed, so a crash never leaves a truncated file under the final name.
    """
    path = Path(path)
    header: dict[str, object] = {}
    offset = 0
    order = sorted(tensors)
    for k in order:
        a = tensors[k]
        if a.dtype not in _NAMES:
            raise CheckpointError(f"{path}: tensor {k!r}: dtype {a.dtype} cannot be stored in safetensors")
        n = a.nbytes
        header[k] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for k in order:
            f.write(np.ascontiguousarray(tensors[k]).tobytes())
    tmp.replace(path)
    return 8 + len(raw) + offset
