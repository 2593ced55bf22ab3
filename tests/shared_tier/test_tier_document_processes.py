"""Documents across two processes on a real Redis (issue 53, item 6): process B, its cache empty, serves other
questions over A's documents in another order and finds them through the tier, and `full` repair stays exact."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from conftest import DEMO_BUILD

from experiments.reuse import document_tier


def test_a_second_process_finds_the_first_ones_documents_through_redis(
        engine_dir_for: Callable[..., Path], tmp_path: Path) -> None:
    args = argparse.Namespace(engineDir=engine_dir_for(DEMO_BUILD), policy="none", threads=1, requests=5, reports=4,
                              shown=2, filler=1, maxTokens=4, seed=0, url=None, checkFull=True)
    summary = document_tier.measure(args, tmp_path)  # starts redis-server (skips, saying why, without it)
    tier, local = summary["tier"], summary["local"]
    # B's questions and order are not A's: nothing of B's prompts but the documents can come from A.
    assert tier["tier_hits"] > 0 and tier["tier_loaded_tokens"] > 0 and tier["tier_faults"] == 0
    # The documents B meets first were computed by A, so B caches more than it does alone (which caches only the
    # documents it already produced itself).
    assert tier["cached_share_of_prompt"] > local["cached_share_of_prompt"] > 0
    assert tier["documents"]["document_hits"] > 0
    # `full` recomputes every document token in place: the pages from the tier change no answer.
    full = summary["tier-full"]
    assert full["tier_hits"] > 0
    assert full["same_tokens_as_cold"] == args.requests
