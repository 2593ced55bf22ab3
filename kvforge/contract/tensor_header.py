"""A safetensors file's header read on its own, so names, dtypes and shapes are checked before any tensor is.

A hostile header can claim tensors of any size; reading it first (bounded) and checking it against what
the model expects means no tensor data is read, or allocated, until the file is known to fit.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import loads_json

MAX_HEADER_BYTES = 16 * 2**20  # a header lists names, dtypes and offsets: a few KiB per thousand tensors
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0  # where the tensor's data starts in the file (bytes), for memory maps


def read_tensor_header(path: Path, where: str, shown: str | None = None) -> tuple[dict[str, TensorInfo],
                                                                                  dict[str, str]]:
    """(tensor name → dtype and shape, metadata) of a safetensors file, every entry checked against the
    file's size; errors are one KvforgeError on `where` and name the file as `shown` (default: its path)."""
    from kvforge.contract.validation import one_line

    shown = one_line(str(path) if shown is None else shown)
    try:
        with open(path, "rb") as handle:
            size = path.stat().st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise KvforgeError(f"cannot read {shown}: not a safetensors file (too short)", where)
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise KvforgeError(f"cannot read {shown}: not a safetensors file (header of {header_len} bytes)", where)
            raw = handle.read(header_len)
    except OSError as exc:
        raise KvforgeError(f"cannot read {shown}: {one_line(exc.strerror or str(exc))}", where) from None
    header = loads_json(raw, where, f"the header of {shown}")
    if not isinstance(header, dict):
        raise KvforgeError(f"{shown}: the safetensors header is not a JSON object", where)
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise KvforgeError(f"{shown}: __metadata__ must map names to strings", where)
    data_bytes = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        shown_name = one_line(name)[:80]
        if not isinstance(entry, dict):
            raise KvforgeError(f"{shown}: tensor {shown_name} has a malformed header entry", where)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise KvforgeError(f"{shown}: tensor {shown_name} has an unknown dtype", where)
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(type(d) is int and 0 <= d < 2**40 for d in shape)):
            raise KvforgeError(f"{shown}: tensor {shown_name} has a malformed shape", where)
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_bytes
                or offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]):
            raise KvforgeError(f"{shown}: tensor {shown_name} claims data outside the file (truncated or forged)",
                               where)
        tensors[name] = TensorInfo(dtype, tuple(shape), 8 + header_len + offsets[0])
    return tensors, metadata
