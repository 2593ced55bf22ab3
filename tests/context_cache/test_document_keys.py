"""Document keys (issue 37): one key per document wherever it sits in a prompt, never shared across engines,
tenants, salts or adapters, and never equal to a page key of the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.runtime.context_cache.keys import (
    CHAIN_ROOT,
    EngineFingerprint,
    KeyExtras,
    MediaKey,
    chain_root,
    document_key,
    page_key,
    page_keys,
)
from kvforge.server.tenants import Tenants

DOCUMENT = list(range(100, 148))  # 48 tokens
ENGINE = chain_root(EngineFingerprint("weights-a", "fp16", 16, "attention x2"))


def test_the_same_document_at_other_positions_has_one_key() -> None:
    """Behind another system prompt, in another order: the span's tokens alone decide the key."""
    first = [1, 2, 3, *DOCUMENT, 9]
    second = [7] * 21 + [5, *DOCUMENT]
    a = document_key(first[3:3 + len(DOCUMENT)], KeyExtras(), ENGINE, start=3)
    b = document_key(second[22:22 + len(DOCUMENT)], KeyExtras(), ENGINE, start=22)
    assert a == b == document_key(np.asarray(DOCUMENT), KeyExtras(), ENGINE)
    assert document_key(DOCUMENT[:-1], KeyExtras(), ENGINE) != a  # and the tokens do decide it


def test_media_identity_is_relative_to_the_document() -> None:
    image = MediaKey(start=10, length=4, digest=b"img-1")
    moved = MediaKey(start=110, length=4, digest=b"img-1")
    other = MediaKey(start=10, length=4, digest=b"img-2")
    at_0 = document_key(DOCUMENT, KeyExtras(media=(image,)), ENGINE, start=0)
    assert at_0 == document_key(DOCUMENT, KeyExtras(media=(moved,)), ENGINE, start=100)
    assert at_0 != document_key(DOCUMENT, KeyExtras(media=(other,)), ENGINE, start=0)
    assert at_0 != document_key(DOCUMENT, KeyExtras(), ENGINE)


@pytest.mark.parametrize("extras", [
    KeyExtras(cache_salt=""), KeyExtras(cache_salt="a"), KeyExtras(cache_salt="b"),
    KeyExtras(adapter_digest=b"lora-1"), KeyExtras(adapter_digest=b"lora-2"),
    KeyExtras(adapter_digest=b"lora-1", cache_salt="a"),
])
def test_salts_and_adapters_never_share_a_document(extras: KeyExtras) -> None:
    base = document_key(DOCUMENT, KeyExtras(), ENGINE)
    assert document_key(DOCUMENT, extras, ENGINE) != base


def test_tenants_never_share_a_document() -> None:
    """llm_serve keys every tenant's pages under its own derived salt; documents take the same salt."""
    tenants = Tenants(b"s" * 32, {})
    keys = {document_key(DOCUMENT, KeyExtras(cache_salt=tenants.cache_salt(tenant, salt)), ENGINE)
            for tenant in ("alice", "bob") for salt in (None, "x")}
    assert len(keys) == 4


def test_engines_never_share_a_document() -> None:
    other = chain_root(EngineFingerprint("weights-a", "fp8", 16, "attention x2"))
    assert len({document_key(DOCUMENT, KeyExtras(), root) for root in (ENGINE, other, CHAIN_ROOT)}) == 3


@pytest.mark.parametrize("extras", [KeyExtras(), KeyExtras(adapter_digest=b"lora-1", cache_salt="t")])
def test_a_document_key_is_never_a_page_key_of_the_same_tokens(extras: KeyExtras) -> None:
    key = document_key(DOCUMENT, extras, ENGINE)
    pages = {page_key(parent, np.asarray(DOCUMENT, dtype=np.int32), extras.encoded())
             for parent in (ENGINE, CHAIN_ROOT, key)}  # the whole document as one page, under any parent
    for size in (1, 2, 4, 8, 16, 48):
        for root in (ENGINE, CHAIN_ROOT):
            pages.update(page_keys(DOCUMENT, size, extras, parent=root))
    assert key not in pages
