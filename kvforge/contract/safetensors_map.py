"""Safetensors tensors memory-mapped rather than read: a 49k x 576 float32 embedding table costs RSS only for the
rows a run looks up (the file format is an 8-byte header length, a JSON header, then raw little-endian data)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from kvforge.contract.errors import KvforgeError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "I64": np.int64, "I32": np.int32, "U8": np.uint8}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """(tensor entries by name, byte offset of the data section); KvforgeError naming the file if malformed."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise KvforgeError(f"{path} is not a readable safetensors file ({exc})", str(path)) from None
    header.pop("__metadata__", None)
    return header, 8 + length


def map_tensor(path: Path, name: str) -> np.ndarray:
    """Read-only memory map of one tensor; its shape, dtype and byte range are checked against the file size."""
    header, data_start = read_header(path)
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise KvforgeError(f"{path} has no tensor {name!r}", str(path))
    dtype = _DTYPES.get(entry.get("dtype"))
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if dtype is None or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        raise KvforgeError(f"{path}: tensor {name!r} has an unsupported dtype or a malformed entry", str(path))
    begin, end = (int(v) for v in offsets)
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if end - begin != expected or data_start + end > path.stat().st_size:
        raise KvforgeError(f"{path}: tensor {name!r} does not fit the file (truncated?)", str(path))
    return np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin, shape=tuple(shape))
