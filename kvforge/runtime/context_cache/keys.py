"""Page keys: a BLAKE2b-128 hash chain over full pages, with every identity field tagged and length-prefixed."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 16
CHAIN_ROOT = b"kvforge-chain-v1".ljust(KEY_BYTES, b"\0")[:KEY_BYTES]

# One tag byte per field; each field is tag + u64 length + bytes, so no two field sequences can
# produce the same byte stream (domain separation): a LoRA named like a salt cannot collide with it.
TAG_PARENT, TAG_TOKENS, TAG_MEDIA, TAG_ADAPTER, TAG_SALT = b"P", b"T", b"M", b"A", b"S"
# The engine fingerprint's fields, tagged the same way (their own letters: a root never hashes like a page).
TAG_WEIGHTS, TAG_KV_DTYPE, TAG_PAGE_SIZE, TAG_LAYOUT, TAG_CHAIN_VERSION = b"W", b"D", b"N", b"L", b"V"
# A document's key hashes its engine root under this tag where a page hashes its parent under TAG_PARENT: the two
# byte streams differ from their first byte, so no document key is ever a page key (issue 37).
TAG_DOCUMENT = b"C"


@dataclass(frozen=True, slots=True)
class EngineFingerprint:
    """What makes two engines' K/V for the same tokens different bytes: it roots the key chain, so a page saved by
    one engine (in a tier shared between processes) can never be found by an engine with other weights or layout."""

    weights_digest: str
    kv_cache_dtype: str
    tokens_per_page: int
    layer_layout: str  # e.g. which layers are attention and which recurrent, and their KV head shapes
    chain_version: int = 1  # bumped when the key derivation itself changes


def chain_root(fingerprint: EngineFingerprint | None) -> bytes:
    """The parent key of every chain: CHAIN_ROOT without a fingerprint (one process, keys as before), else a
    BLAKE2b of the fingerprint's tagged, length-prefixed fields."""
    if fingerprint is None:
        return CHAIN_ROOT
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    digest.update(_field(TAG_WEIGHTS, fingerprint.weights_digest.encode("utf-8")))
    digest.update(_field(TAG_KV_DTYPE, fingerprint.kv_cache_dtype.encode("utf-8")))
    digest.update(_field(TAG_PAGE_SIZE, struct.pack("<Q", fingerprint.tokens_per_page)))
    digest.update(_field(TAG_LAYOUT, fingerprint.layer_layout.encode("utf-8")))
    digest.update(_field(TAG_CHAIN_VERSION, struct.pack("<Q", fingerprint.chain_version)))
    return digest.digest()


@dataclass(frozen=True, slots=True)
class MediaKey:
    """One media item's placeholder span [start, start + length) and its content digest (pixels + shape + dtype)."""

    start: int
    length: int
    digest: bytes


@dataclass(frozen=True, slots=True)
class KeyExtras:
    """Request-wide identity mixed into every page key of a sequence, plus its media spans (in prompt order).

    The adapter digest marks only the pages from `adapter_start` on: an activated LoRA leaves every position before
    its invocation with the base model's K/V, so pages wholly before it are keyed as base pages (found by base
    requests and by any activated adapter over the same tokens). Salt and engine identity stay in every key."""

    adapter_digest: bytes = b""  # digest of the adapter's weights; empty = base model
    cache_salt: str | None = None  # tenant isolation; None and "" are distinct from any salt
    media: tuple[MediaKey, ...] = ()
    adapter_start: int = 0  # first adapted position: 0 for an ordinary adapter (every page carries its digest)
    # A corrected adapter (lora_corrections): keyed as base pages (adapter_start past every page) so its lookup finds
    # the base model's; the adapter_corrections type copies and corrects them, and such a lease never publishes.
    corrected: bool = False

    def encoded(self, end: int | None = None) -> bytes:
        """The identity of a page ending at position `end` (exclusive; None: a page past the activation)."""
        salt = b"\x00" if self.cache_salt is None else b"\x01" + self.cache_salt.encode("utf-8")
        adapted = end is None or end > self.adapter_start
        return _field(TAG_ADAPTER, self.adapter_digest if adapted else b"") + _field(TAG_SALT, salt)


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def page_key(parent: bytes, token_ids: np.ndarray, extras_encoded: bytes, media_encoded: bytes = b"") -> bytes:
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    digest.update(_field(TAG_PARENT, parent))
    digest.update(_field(TAG_TOKENS, np.ascontiguousarray(token_ids, dtype="<i4").tobytes()))
    digest.update(_field(TAG_MEDIA, media_encoded))
    digest.update(extras_encoded)
    return digest.digest()


def page_keys(token_ids: Sequence[int] | np.ndarray, tokens_per_page: int, extras: KeyExtras,
              parent: bytes = CHAIN_ROOT, first_page: int = 0) -> list[bytes]:
    """Keys of the full pages of `token_ids` from page `first_page` on, chained from `parent`.

    A partial tail page gets no key: it is never shared. Media identity (media_encoded) is empty for
    text; the media work fills it per page from the placeholder positions it covers.
    """
    ids = np.asarray(token_ids, dtype=np.int32)
    keys = []
    for page in range(first_page, len(ids) // tokens_per_page):
        begin = page * tokens_per_page
        media = media_in_page(extras.media, begin, begin + tokens_per_page)
        parent = page_key(parent, ids[begin:begin + tokens_per_page], extras.encoded(begin + tokens_per_page), media)
        keys.append(parent)
    return keys


def document_key(token_ids: Sequence[int] | np.ndarray, extras: KeyExtras, root: bytes = CHAIN_ROOT,
                 start: int = 0) -> bytes:
    """The key of a document's K/V: its tokens hashed with no parent, so the same document has one key wherever it
    sits in a prompt. `root` is the engine's chain root (`chain_root(fingerprint)`), so another engine never finds
    it; `extras` adds the adapter digest and the cache salt (which carries the tenant: llm_serve derives each
    tenant's salt), so neither two adapters nor two tenants share a document. Media identity is taken for prompt
    positions [start, start + len(token_ids)) relative to `start`, so it too does not depend on the position."""
    ids = np.asarray(token_ids, dtype=np.int32)
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    digest.update(_field(TAG_DOCUMENT, root))
    digest.update(_field(TAG_TOKENS, np.ascontiguousarray(ids, dtype="<i4").tobytes()))
    digest.update(_field(TAG_MEDIA, media_in_page(extras.media, start, start + len(ids))))
    digest.update(extras.encoded())
    return digest.digest()


def tail_page_key(parent: bytes, token_ids: Sequence[int] | np.ndarray, begin: int, extras: KeyExtras) -> bytes:
    """The key of a partial tail page (positions [begin, len(token_ids))), chained like a full page and carrying
    the media identity of the placeholders it covers, so a partial-KV snapshot never serves another image."""
    ids = np.asarray(token_ids, dtype=np.int32)
    return page_key(parent, ids[begin:], extras.encoded(len(ids)), media_in_page(extras.media, begin, len(ids)))


def media_in_page(media: tuple[MediaKey, ...], begin: int, end: int) -> bytes:
    """The media identity of positions [begin, end): for each span overlapping them, where the overlap starts in
    the page, where in the span, how long, and the item's digest. Placeholder ids are the same for every image,
    so this is what tells two images (or two orders of them) apart; text-only pages encode nothing."""
    out = b""
    for item in media:
        lo, hi = max(begin, item.start), min(end, item.start + item.length)
        if lo < hi:
            out += struct.pack("<QQQ", lo - begin, lo - item.start, hi - lo) + _field(TAG_MEDIA, item.digest)
    return out
