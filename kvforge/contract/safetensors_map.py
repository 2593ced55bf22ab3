"""Safetensors tensors memory-mapped rather than read: a 49k x 576 float32 embedding table costs RSS only for the
rows a run looks up. The header is read and checked by tensor_header.read_tensor_header."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.contract.tensor_header import read_tensor_header

_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U8": np.uint8}


def map_tensor(path: Path, name: str) -> np.ndarray:
    """Read-only memory map of one tensor (header entries already checked against the file size)."""
    tensors, _ = read_tensor_header(path, str(path))
    info = tensors.get(name)
    if info is None:
        raise KvforgeError(f"{path} has no tensor {name!r}", str(path))
    dtype = _DTYPES.get(info.dtype)
    if dtype is None:
        raise KvforgeError(f"{path}: tensor {name!r} has dtype {info.dtype}, which kvforge does not map", str(path))
    return np.memmap(path, dtype=dtype, mode="r", offset=info.offset, shape=info.shape)
