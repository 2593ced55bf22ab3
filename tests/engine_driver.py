"""Test helpers that drive the product's own loop (`run_request_file` over `Engine.step`), with audits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.runtime.context_cache.manager import ContextCacheManager
from kvforge.runtime.engine import Engine, EngineConfig
from kvforge.runtime.file_runner import Scheduling, prepare_requests, run_request_file
from kvforge.runtime.request_file import parse_request_file
from kvforge.runtime.runner import EngineRunner


def make_engine(engine_dir: Path, runner: EngineRunner | None = None, *, reuse: bool = False,
                **config: Any) -> Engine:
    """Engines may share a runner one after another (a fresh cache treats every page as free and pages are
    written before they are read), never interleaved: a warm cache needs its pages left alone."""
    return Engine(engine_dir, EngineConfig(num_threads=config.pop("num_threads", 2), enable_context_reuse=reuse,
                                           **config), runner=runner)


def shrink_pool(engine: Engine, num_pages: int, max_records: int) -> None:
    """Run on the first `num_pages` pages only, to force waiting, eviction and preemption in tests."""
    engine.cache = ContextCacheManager(num_pages, engine.cache.tokens_per_page, enabled=engine.cache.enabled,
                                       max_records=max_records)
    engine.scheduler.cache = engine.cache


def run_file(engine: Engine, data: dict, scheduling: Scheduling = Scheduling.STATIC,
             base_dir: Path | None = None) -> list[dict]:
    """Run a request file (as a dict) to completion; then audit the cache and check every page came back."""
    request_file = parse_request_file(data)
    responses = run_request_file(engine, request_file, prepare_requests(engine, request_file, base_dir), scheduling)
    assert_idle(engine)
    return responses


def assert_idle(engine: Engine) -> None:
    cache = engine.cache
    cache.check_invariants()
    assert not cache.leases and not engine.has_unfinished()
    cached_pages = {p for r in cache.records.least_recent_first() for p in r.page_ids}
    assert cache.pages.num_free == cache.pages.capacity - len(cached_pages)  # nothing leaked


def top1_ids(response: dict) -> list[int]:
    return [step[0]["token_id"] for step in response["logprobs"]]
