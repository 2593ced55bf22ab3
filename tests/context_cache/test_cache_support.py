"""The cache types' support rows (kvforge/runtime/context_cache/support.py): the refusals come from them, and the
docs show them as one generated matrix."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.context_cache.registry import Registration, register, support_rows, unregister
from kvforge.runtime.context_cache.support import (
    NOT_ON_WINDOW_GROUP,
    PLAIN_DECODING,
    CacheSupport,
    ReuseOff,
    Tier,
    check_support,
    refusal,
    support_table_markdown,
)
from kvforge.runtime.context_cache.types.adapter_corrections import CORRECTION_SUPPORT, check_deployment
from kvforge.runtime.context_cache.types.document_chunks import DOCUMENT_SUPPORT
from kvforge.runtime.types import Deployment

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "context-reuse.md"


def config(**changes: object) -> SimpleNamespace:
    values = {"spec_decode": "off", "enable_context_reuse": True, "shared_cache": "", "document_reuse": False,
              "lora_corrections": (), "context_cache_partial_kv_snapshot_pool_bytes": 0}
    return SimpleNamespace(**{**values, **changes})


def build(window: int = 0) -> SimpleNamespace:
    return SimpleNamespace(window_pool_pages=window)


def refused(cfg: SimpleNamespace, deployment: Deployment = Deployment.VANILLA, window: int = 0) -> InvalidConfig:
    with pytest.raises(InvalidConfig) as caught:
        check_support(support_rows(), cfg, build(window), deployment)
    assert "\n" not in str(caught.value)
    return caught.value


def test_docs_show_the_matrix_as_generated() -> None:
    found = re.search(r"<!-- cache-support:begin -->\n(.*?)\n<!-- cache-support:end -->", DOC.read_text("utf-8"), re.S)
    assert found is not None, "docs/context-reuse.md lost its cache-support block"
    assert found.group(1) == support_table_markdown(support_rows()), (
        "the matrix in docs/context-reuse.md differs from the registered rows: paste "
        "support_table_markdown(support_rows()) between the markers")


def test_refusals_come_from_the_rows_with_their_messages() -> None:
    hybrid = refused(config(document_reuse=True), Deployment.HYBRID)
    assert hybrid.field == "document_reuse" and "attention-only engine; this one is hybrid" in hybrid.message
    draft = refused(config(document_reuse=True, spec_decode="eagle3"))
    assert draft.field == "document_reuse" and "--specDecode eagle3: its draft model" in draft.message
    no_reuse = refused(config(lora_corrections=("a",), enable_context_reuse=False))
    assert no_reuse.field == "lora_corrections" and "enable_context_reuse" in no_reuse.message
    assert refused(config(lora_corrections=("a",), spec_decode="ngram")).message == CORRECTION_SUPPORT.refusals["spec"]
    partial = "context_cache_partial_kv_snapshot_pool_bytes"
    for cfg, field in ((config(spec_decode="ngram"), "spec_decode"), (config(shared_cache="redis://x"), "shared_cache"),
                       (config(**{partial: 1}), partial)):
        window = refused(cfg, window=8)
        assert (window.field, window.message) == (field, NOT_ON_WINDOW_GROUP)
    # Documents run beside a sliding-window group (issue 53); with ngram the group's own row still refuses.
    check_support(support_rows(), config(document_reuse=True), build(window=8), Deployment.VANILLA)
    assert refused(config(document_reuse=True, spec_decode="ngram"), window=8).field == "spec_decode"
    # What the rows allow passes: ngram with documents, anything without a type that refuses it.
    check_support(support_rows(), config(document_reuse=True, spec_decode="ngram"), build(), Deployment.VANILLA)
    check_support(support_rows(), config(spec_decode="eagle3", shared_cache="redis://x"), build(), Deployment.HYBRID)
    with pytest.raises(InvalidConfig, match="recurrent and hybrid engines cannot correct adapters"):
        check_deployment(Deployment.PURE_RECURRENT)
    assert DOCUMENT_SUPPORT.reuse_off is ReuseOff.IMPLIES


def test_a_registered_row_refuses_and_shows_up_in_the_matrix() -> None:
    row = CacheSupport("markers", "marker_switch", (Deployment.VANILLA,), PLAIN_DECODING, window_group=True,
                       tier=Tier.SAVED, reuse_off=ReuseOff.RUNS, refusals={"deployment": "no markers on {deployment}",
                                                                          "spec": "no markers with {method}"})
    entry = register("marker_rows", lambda setup, name: None, support=row)
    try:
        assert "| markers | `marker_switch` |" in support_table_markdown(support_rows())
        assert refused(config(marker_switch=True), Deployment.HYBRID).message == "no markers on hybrid"
        assert refused(config(marker_switch=True, spec_decode="ngram")).field == "marker_switch"
        check_support(support_rows(), config(marker_switch=False, spec_decode="ngram"), build(), Deployment.VANILLA)
    finally:
        unregister(entry)
    assert refusal(row, deployment=Deployment.VANILLA, spec_decode="off", reuse=False, window_group=True,
                   shared_cache=True) is None
    assert isinstance(entry, Registration)
