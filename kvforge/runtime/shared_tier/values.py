"""What a shared-tier value holds: a self-describing header, the tokens it covers, the arrays, and a checksum.

A store is shared and outlives any one process, so nothing read from it is trusted by position alone. Every value
names the engine (its chain root), the key it was written under and the tokens it covers, and ends with a BLAKE2b
of all of it. A reader rejects a value whose checksum, root, key, tokens, dtypes or shapes differ from what it
expects; that is a miss, never a wrong answer. Layout (little-endian):

    b"KVFT" | u16 version | u8 kind | u8 0 | chain root (16) | key (16) | u32 num_tokens | u32 num_arrays
    | per array: u8 len + dtype name, u8 ndim, u32 x ndim | int32 tokens | array bytes ... | BLAKE2b-128 of all before

Without a tier secret the checksum catches corruption and truncation but does not authenticate (anyone who can write
the store can write a valid value); with one (secret.py) it is a keyed BLAKE2b-256, a MAC: see docs/shared-tier.md.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

MAGIC = b"KVFT"
VERSION = 1
CHECKSUM_BYTES = 16
MAC_BYTES = 32  # the keyed digest of a tier with a secret
_HEAD = struct.Struct("<4sHBB16s16sII")


class ValueKind(IntEnum):
    PAGE = 1  # one KV page of every attention layer: arrays [2, Hkv, T, D] per layer
    CHECKPOINT = 2  # a recurrent checkpoint: every recurrent state array, then the tail page's K/V (if any)
    LENGTH = 3  # a directory entry: one checkpoint length hanging off an anchor (no arrays)


class ValueRejected(Exception):
    """A value that must not be used. `reason` is the counter it goes to: corrupt (checksum, truncation, format) or
    foreign (another engine's root, another key, other tokens or shapes)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Decoded:
    kind: ValueKind
    tokens: np.ndarray  # int32
    arrays: list[np.ndarray]  # views into the value's bytes (read-only)


def _digest(mac_key: bytes | None) -> hashlib.blake2b:
    if mac_key is None:
        return hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    return hashlib.blake2b(digest_size=MAC_BYTES, key=mac_key)


def encoded_size(num_tokens: int, like: Sequence[np.ndarray], mac_key: bytes | None = None) -> int:
    """The exact length of a value covering `num_tokens` tokens with arrays like `like`: what a read may accept."""
    layout = sum(1 + len(a.dtype.str) + 1 + 4 * a.ndim for a in like)
    tail = CHECKSUM_BYTES if mac_key is None else MAC_BYTES
    return _HEAD.size + layout + 4 * num_tokens + sum(int(a.nbytes) for a in like) + tail


def encode(kind: ValueKind, root: bytes, key: bytes, tokens: Sequence[int] | np.ndarray,
           arrays: Sequence[np.ndarray], mac_key: bytes | None = None) -> bytes:
    """One value. The arrays are written as they are laid out in memory (C order). `mac_key`: the tier secret's
    MAC key, which replaces the checksum by a keyed digest."""
    token_bytes = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    parts = [_HEAD.pack(MAGIC, VERSION, int(kind), 0, root, key, len(token_bytes) // 4, len(arrays))]
    for array in arrays:
        name = array.dtype.str.encode("ascii") if array.dtype.names is None else b""
        if not name or len(name) > 255:
            raise ValueError(f"cannot encode dtype {array.dtype}")
        parts.append(struct.pack("<B", len(name)) + name + struct.pack(f"<B{array.ndim}I", array.ndim, *array.shape))
    parts.append(token_bytes)
    parts.extend(np.ascontiguousarray(array).data.cast("B") for array in arrays)
    digest = _digest(mac_key)
    for part in parts:
        digest.update(part)
    parts.append(digest.digest())
    return b"".join(parts)


def decode(value: bytes, *, root: bytes, key: bytes, kind: ValueKind,
           like: Sequence[np.ndarray] | None = None, tokens: np.ndarray | None = None,
           mac_key: bytes | None = None) -> Decoded:
    """The value's tokens and arrays, after every check: its checksum first (so a corrupt value is never parsed
    further), then that it is the `kind` written by this engine (`root`) under `key`, that its arrays have the
    dtypes and shapes of `like` (the local storage they will be copied into), and its tokens equal `tokens`."""
    view = memoryview(value)
    size = CHECKSUM_BYTES if mac_key is None else MAC_BYTES
    if len(view) < _HEAD.size + size:
        raise ValueRejected("corrupt", f"{len(view)} bytes is shorter than a header")
    body, checksum = view[:-size], view[-size:]
    digest = _digest(mac_key)
    digest.update(body)
    # compare_digest: a forger learns nothing from how long the comparison took
    if not hmac.compare_digest(digest.digest(), bytes(checksum)):
        raise ValueRejected("corrupt", "checksum mismatch" if mac_key is None else "MAC mismatch (forged, or "
                            "written with another tier secret)")
    magic, version, got_kind, _, got_root, got_key, num_tokens, num_arrays = _HEAD.unpack_from(body)
    if magic != MAGIC or version != VERSION:
        raise ValueRejected("corrupt", f"not a kvforge value of version {VERSION}")
    if got_root != root:
        raise ValueRejected("foreign", "written by another engine (its chain root differs)")
    if got_key != key or got_kind != kind:
        raise ValueRejected("foreign", "written under another key or as another kind")
    at = _HEAD.size
    layouts = []
    try:
        for _ in range(num_arrays):
            (name_len,) = struct.unpack_from("<B", body, at)
            dtype = np.dtype(bytes(body[at + 1:at + 1 + name_len]).decode("ascii"))
            at += 1 + name_len
            (ndim,) = struct.unpack_from("<B", body, at)
            shape = struct.unpack_from(f"<{ndim}I", body, at + 1)
            at += 1 + 4 * ndim
            layouts.append((dtype, shape))
        got_tokens = np.frombuffer(body, dtype="<i4", count=num_tokens, offset=at)
        at += 4 * num_tokens
        arrays = []
        for dtype, shape in layouts:
            count = int(np.prod(shape, dtype=np.int64))
            arrays.append(np.frombuffer(body, dtype=dtype, count=count, offset=at).reshape(shape))
            at += count * dtype.itemsize
    except (struct.error, ValueError, TypeError) as exc:
        raise ValueRejected("corrupt", f"malformed layout ({exc})") from None
    if at != len(body):
        raise ValueRejected("corrupt", "trailing bytes after the arrays")
    if like is not None and [(a.dtype, a.shape) for a in arrays] != [(a.dtype, a.shape) for a in like]:
        raise ValueRejected("foreign", "arrays of other dtypes or shapes than this engine's")
    if tokens is not None and not np.array_equal(got_tokens, tokens):
        raise ValueRejected("foreign", "covers other tokens than the request's")
    return Decoded(ValueKind(got_kind), got_tokens, arrays)
