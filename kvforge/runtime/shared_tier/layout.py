"""Where the tier's values live in a store and how each type's values are written: key prefixes, one codec per
value type, and the directory of checkpoint lengths.

Under the in-process cache's own content-addressed keys (so adapter, salt and media identity carry over), rooted in
the engine fingerprint (so another engine never finds them):

    b"p" + page key           one full KV page of every attention layer (attention-only and hybrid engines)
    b"c" + terminal key       an endpoint after exactly L tokens: every recurrent state array (checkpoint engines),
                              then the K/V of its partial tail page when L is not page-aligned
    b"n" + anchor + slot i    directory entries (i < DIRECTORY_SLOTS): the lengths of endpoints whose last full
                              page is `anchor` (the chain root below one page), so a lookup learns which lengths to
                              ask for without hashing every position
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvforge.runtime.shared_tier.secret import TierSecret
from kvforge.runtime.shared_tier.values import Decoded, ValueKind, ValueRejected, decode, encode, encoded_size

PAGE_PREFIX, CHECKPOINT_PREFIX, DIRECTORY_PREFIX = b"p", b"c", b"n"
DIRECTORY_SLOTS = 8  # checkpoint lengths listed per anchor page; more are still stored, only not found


@dataclass(frozen=True, slots=True)
class Codec:
    """One value type's store keys and bytes: every value of the type is written and read through it, so the size
    a read accepts, the MAC and the encryption are decided in one place."""

    kind: ValueKind
    prefix: bytes
    root: bytes
    secret: TierSecret | None

    def store_key(self, key: bytes) -> bytes:
        return self.prefix + key

    def encode(self, key: bytes, tokens: Sequence[int] | np.ndarray, arrays: Sequence[np.ndarray]) -> bytes:
        mac_key = self.secret.mac_key if self.secret is not None else None
        value = encode(self.kind, self.root, key, tokens, arrays, mac_key)
        return self.secret.seal(self.store_key(key), value) if self.secret is not None else value

    def max_bytes(self, num_tokens: int, like: Sequence[np.ndarray]) -> int:
        """The exact size of a value of `num_tokens` tokens over arrays like `like`: a read asks for no more."""
        mac_key = self.secret.mac_key if self.secret is not None else None
        overhead = self.secret.overhead if self.secret is not None else 0
        return encoded_size(num_tokens, like, mac_key) + overhead

    def decode(self, value: bytes, key: bytes, *, like: Sequence[np.ndarray] = (),
               tokens: np.ndarray | None = None, num_tokens: int | None = None) -> Decoded:
        """The value after every check (values.decode), refusing first anything longer than the type allows: a value
        larger than expected is corrupt, and is never parsed."""
        limit = self.max_bytes(int(tokens.size) if tokens is not None else (num_tokens or 0), like)
        if len(value) > limit:
            raise ValueRejected("corrupt", f"{len(value)} bytes, more than the {limit} a value of this type holds")
        if self.secret is None:
            return decode(value, root=self.root, key=key, kind=self.kind, like=like or None, tokens=tokens)
        first: ValueRejected | None = None
        for secret in self.secret.readers:  # the writing secret first, then those a rotation also reads with
            try:
                opened = secret.open(self.store_key(key), value)
                return decode(opened, root=self.root, key=key, kind=self.kind, like=like or None, tokens=tokens,
                              mac_key=secret.mac_key)
            except ValueRejected as exc:
                first = first or exc
        assert first is not None
        raise first


class Layout:
    """The codecs of one engine's tier (pages, endpoints, directory entries) and the directory's slots."""

    def __init__(self, root: bytes, secret: TierSecret | None) -> None:
        self.root = root
        self.page = Codec(ValueKind.PAGE, PAGE_PREFIX, root, secret)
        self.checkpoint = Codec(ValueKind.CHECKPOINT, CHECKPOINT_PREFIX, root, secret)
        self.length = Codec(ValueKind.LENGTH, DIRECTORY_PREFIX, root, secret)

    def directory_slots(self, anchor: bytes) -> list[bytes]:
        """The store keys of the directory entries of `anchor`."""
        return [DIRECTORY_PREFIX + anchor + bytes([i]) for i in range(DIRECTORY_SLOTS)]

    def directory_entry(self, anchor: bytes, length: int) -> bytes:
        return self.length.encode(anchor, [length], [])

    def listed_length(self, anchor: bytes, value: bytes) -> int:
        """The length a directory entry of `anchor` lists; ValueRejected if the entry is damaged or foreign. An
        entry's header names its anchor (the slot number needs no check)."""
        entry = self.length.decode(value, anchor, num_tokens=1)
        if entry.tokens.size != 1:
            raise ValueRejected("corrupt", "a directory entry lists one length")
        return int(entry.tokens[0])
