"""The cache types a coordinator can build, in lookup order: adding a type is one module and one `register` call.

Each registration names the type's pool and part (`name`), the keyword options of `ContextCacheManager` the type
reads (its budget, its switches), a factory that builds the type for one deployment or returns None when the
deployment has no use for it (the coordinator then lists its pool empty in the profile), and what the type exports:
its counters' block (`counters`: the profile's block and the /metrics series read from it) and what a record saves
of it in a shared tier (`tier_value`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvforge.contract.profile_schema import (
    ADAPTER_CORRECTIONS,
    BASE_KV_PAGES,
    DOCUMENT_KV_PAGES,
    DRAFT_KV_PAGES,
    PARTIAL_KV_SNAPSHOTS,
    RECURRENT_SNAPSHOTS,
    SLIDING_WINDOW_PAGES,
)
from kvforge.runtime.context_cache.metrics import CounterBlock, Sample
from kvforge.runtime.context_cache.protocol import CacheSetup, CacheType
from kvforge.runtime.context_cache.records import Record
from kvforge.runtime.context_cache.support import CacheSupport
from kvforge.runtime.context_cache.types.adapter_corrections import (
    CORRECTION_COUNTERS,
    CORRECTION_OPTIONS,
    CORRECTION_SUPPORT,
    build_adapter_corrections,
)
from kvforge.runtime.context_cache.types.attention_pages import ATTENTION_SUPPORT, build_attention_pages
from kvforge.runtime.context_cache.types.document_chunks import (
    DOCUMENT_COUNTERS,
    DOCUMENT_OPTIONS,
    DOCUMENT_SUPPORT,
    build_document_chunks,
)
from kvforge.runtime.context_cache.types.draft_paths import (
    DRAFT_COUNTERS,
    DRAFT_OPTIONS,
    DRAFT_SUPPORT,
    build_draft_paths,
)
from kvforge.runtime.context_cache.types.partial_tails import (
    PARTIAL_OPTIONS,
    PARTIAL_SUPPORT,
    TierValue,
    build_partial_tails,
    tail_tier_value,
)
from kvforge.runtime.context_cache.types.recurrent_checkpoints import (
    RECURRENT_OPTIONS,
    RECURRENT_SUPPORT,
    build_recurrent_checkpoints,
    checkpoint_tier_value,
)
from kvforge.runtime.context_cache.types.sliding_window import (
    SLIDING_WINDOW_COUNTERS,
    SLIDING_WINDOW_OPTIONS,
    SLIDING_WINDOW_SUPPORT,
    build_sliding_window,
)

TypeFactory = Callable[[CacheSetup, str], CacheType | None]
TierExport = Callable[[Record], TierValue | None]  # what a record saves of one type in a shared tier (None: nothing)


@dataclass(frozen=True, slots=True)
class Registration:
    name: str  # the pool's and the part's name
    factory: TypeFactory
    options: tuple[str, ...] = ()  # the manager's keyword options this type reads
    counters: CounterBlock | None = None  # its counters' profile block and /metrics series (None: it counts nothing)
    tier_value: TierExport | None = None  # what a record saves of it in a shared tier's endpoint value
    support: CacheSupport | None = None  # its row of the support matrix (the engine's refusals, the docs' table)


_REGISTERED: list[Registration] = []


def register(name: str, factory: TypeFactory, options: tuple[str, ...] = (), *,
             counters: CounterBlock | None = None, tier_value: TierExport | None = None,
             support: CacheSupport | None = None) -> Registration:
    """Add a type after those registered so far (it is asked last in lookups). Returns the registration."""
    if any(entry.name == name for entry in _REGISTERED):
        raise ValueError(f"a cache type named {name!r} is registered already")
    entry = Registration(name, factory, options, counters, tier_value, support)
    _REGISTERED.append(entry)
    return entry


def unregister(entry: Registration) -> None:
    _REGISTERED.remove(entry)


def registered() -> tuple[Registration, ...]:
    """The registered types, in lookup order."""
    return tuple(_REGISTERED)


def cache_samples(cache: Mapping[str, Any]) -> Iterator[Sample]:
    """The /metrics series every registered type exports from a context_cache profile block, in registration
    order (llm_serve's collector: it reaches this through kvforge.runtime.engine)."""
    for entry in _REGISTERED:
        if entry.counters is not None:
            yield from entry.counters.samples(cache)


def support_rows() -> tuple[CacheSupport, ...]:
    """The registered types' support rows, in registration order (the engine's refusals, the docs' matrix)."""
    return tuple(entry.support for entry in _REGISTERED if entry.support is not None)


def tier_values(record: Record) -> list[TierValue]:
    """What a committed record saves in a shared tier's endpoint value, type by type in registration order (the
    tier reads each one's slot from the storage it names)."""
    return [value for entry in _REGISTERED if entry.tier_value is not None
            and (value := entry.tier_value(record)) is not None]


# Lookup order: each type narrows or extends the hit of the ones before it. The checkpoints decide a hybrid's hit before
# the tails add the checkpoint's tail page; the types a speculative admission adds come next, and documents (whose hits
# lie after the prefix every other type agreed on) last.
register(BASE_KV_PAGES, build_attention_pages, support=ATTENTION_SUPPORT)
register(RECURRENT_SNAPSHOTS, build_recurrent_checkpoints, RECURRENT_OPTIONS, tier_value=checkpoint_tier_value,
         support=RECURRENT_SUPPORT)
register(PARTIAL_KV_SNAPSHOTS, build_partial_tails, PARTIAL_OPTIONS, tier_value=tail_tier_value,
         support=PARTIAL_SUPPORT)
register(DRAFT_KV_PAGES, build_draft_paths, DRAFT_OPTIONS, counters=DRAFT_COUNTERS, support=DRAFT_SUPPORT)
register(DOCUMENT_KV_PAGES, build_document_chunks, DOCUMENT_OPTIONS, counters=DOCUMENT_COUNTERS,
         support=DOCUMENT_SUPPORT)
register(SLIDING_WINDOW_PAGES, build_sliding_window, SLIDING_WINDOW_OPTIONS, counters=SLIDING_WINDOW_COUNTERS,
         support=SLIDING_WINDOW_SUPPORT)
# Last: a corrected adapter's plan replaces whatever the others agreed with copies of the base pages it has factors for.
register(ADAPTER_CORRECTIONS, build_adapter_corrections, CORRECTION_OPTIONS, counters=CORRECTION_COUNTERS,
         support=CORRECTION_SUPPORT)
