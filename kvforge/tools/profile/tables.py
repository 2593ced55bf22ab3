"""llm_profile show: a profile as rich tables, one per section, laid out from the numbers metrics.py reads."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rich.markup import escape
from rich.table import Table

from kvforge.contract import profile_schema as schema
from kvforge.tools.profile.metrics import (
    SHARED_TIER,
    SPECULATIVE_SECTIONS,
    flat_numbers,
    fmt,
    fmt_pct,
    get,
    hit_rate,
    memory_mib,
    number,
    per_adapter,
    planning_us_per_admitted,
    pool_rows,
    ratio,
    reuse_ratio,
    section,
    shared_tier,
    speculative_blocks,
    stage_rows,
    stage_stat,
    stages_by_id,
    tier_hit_rate,
    tier_ms_per_hit,
    total,
)

_MEMORY_LABELS = {schema.PEAK_CPU_MEMORY: "peak CPU memory", schema.KV_POOL: "KV pool",
                  schema.PEAK_GPU_MEMORY: "peak GPU memory", schema.PEAK_UNIFIED_MEMORY: "peak unified memory"}
# Top-level keys the summary lays out itself; any other section is listed by _other_tables.
_LAID_OUT = frozenset({schema.PREFILL, schema.GENERATION, schema.STAGES, schema.CONTEXT_CACHE, schema.PER_ADAPTER,
                       *SPECULATIVE_SECTIONS}) | schema.MEMORY_KEYS

# context_cache keys the "Context cache" table lays out itself; anything else numeric is listed under "other".
_CACHE_GROUPS = ((schema.PLANS, schema.PLAN_KINDS), (schema.PUBLICATIONS, schema.PUBLICATION_KEYS),
                 (schema.RECORDS, schema.RECORD_KEYS), (schema.HYBRID, schema.HYBRID_KEYS),
                 (schema.SPECULATIVE, schema.SPECULATIVE_KEYS))
_CACHE_LAID_OUT = frozenset({*schema.SEQUENCE_COUNTERS, *schema.TOKEN_COUNTERS, *(group for group, _ in _CACHE_GROUPS),
                             schema.PLANNING_NANOSECONDS, schema.RESOURCE_POOLS, schema.RECLAIMED_RESOURCES,
                             schema.PER_ADAPTER, SHARED_TIER})

# The speculative block's keys (TensorRT Edge-LLM's names; kvforge adds the last three): label and detail.
_SPECULATIVE_ROWS = (
    ("total_iterations", "verify steps", "rows that verified drafts"),
    ("total_draft_tokens", "draft tokens", "proposed and verified"),
    ("total_accepted_tokens", "accepted tokens", "drafts the base kept"),
    ("total_generated_tokens", "committed tokens", "kept drafts + one token per verify step"),
    ("acceptance_length", "tokens per verify step", "committed / verify steps"),
    ("media_cold_requests", "media requests run cold", "image or audio requests: no reuse with speculation"),
    ("reuse_bypassed_requests", "reuse-bypassed requests", "reuse the deployment could not serve"),
    ("prefill_state_only_requests", "prefill-state-only requests", "no decode-end publication (hybrid MTP)"),
)
_SPECULATIVE_STAGES = (schema.SPEC_DRAFT_PROPOSAL_STAGE, schema.BLOCK_DIFFUSION_DENOISE_STAGE,
                       schema.SPEC_BASE_VERIFICATION_STAGE, schema.SPEC_DRAFT_ACCEPT_STAGE)
# The shared tier's counters (kvforge/runtime/shared_tier's TierCounters): label and detail; others are listed as they
# come.
_TIER_ROWS = (
    ("lookups", "lookups", "admissions that asked the store"),
    ("hits", "hits", "lookups that loaded something"),
    ("loaded_tokens", "loaded tokens", ""),
    ("load_ms", "load ms", "lookup to last copy, summed"),
    ("writes", "writes", "values written"),
    ("write_bytes", "written bytes", ""),
    ("skipped_lookups", "skipped lookups", "back-off after a fault, or a request the tier bypasses"),
    ("dropped_writes", "dropped writes", "back-off, or the write queue was full"),
    ("errors", "errors", "store calls that failed"),
    ("timeouts", "timeouts", "loads abandoned at the deadline"),
    ("corrupt", "corrupt values", "rejected: checksum, another engine's root, other tokens or shapes"),
)


# Context-cache blocks of features an engine may not have, and the pools that say it has them: a block is shown when
# it counted something or one of its pools has capacity (the feature is on), so a plain engine's summary is not a
# wall of zeros for documents, sliding windows, adapter corrections, speculation and snapshots it never used.
_OPTIONAL_BLOCKS = {
    schema.HYBRID: (schema.RECURRENT_SNAPSHOTS, schema.PARTIAL_KV_SNAPSHOTS),
    schema.SPECULATIVE: (schema.DRAFT_KV_PAGES,),
    schema.DOCUMENTS: (schema.DOCUMENT_KV_PAGES,),
    schema.SLIDING_WINDOW: (schema.SLIDING_WINDOW_PAGES,),
    schema.ADAPTER_CORRECTIONS: (schema.ADAPTER_CORRECTIONS,),
}


def _pool_in_use(row: Mapping[str, Any]) -> bool:
    """A pool the engine has (capacity > 0) or that reclaimed something; None counts as unknown, so shown."""
    return any(row[key] is None or row[key] != 0 for key in ("capacity", "free", "reclaimed"))


def applies(data: Mapping[str, Any], block: str) -> bool:
    """Whether context_cache's `block` belongs in the summary: not one of _OPTIONAL_BLOCKS, or it counted something
    (any non-zero number), or a pool of its feature has capacity."""
    if block not in _OPTIONAL_BLOCKS:
        return True
    if any(value != 0 for _, value in flat_numbers(section(data, schema.CONTEXT_CACHE).get(block), "")):
        return True
    return any((get(row, "capacity") or 0) > 0 for row in pool_rows(data) if row["name"] in _OPTIONAL_BLOCKS[block])


def _kv_table(title: str) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("detail", style="dim")
    return table


def _add_rows(table: Table, rows: Sequence[tuple[str, str, str]]) -> None:
    for metric, value, detail in rows:
        table.add_row(metric, value, detail)


def _prefill_table(data: Mapping[str, Any]) -> Table | None:
    prefill = section(data, schema.PREFILL)
    stage = stages_by_id(data).get(schema.PREFILL_STAGE)
    if not prefill and stage is None:
        return None
    table = _kv_table("Prefill")
    reused, computed = get(prefill, "reused_tokens"), get(prefill, "computed_tokens")
    if prefill:
        _add_rows(table, [
            ("runs", fmt(get(prefill, "total_runs")), "engine steps with prefill rows"),
            ("prompt tokens", fmt(total(reused, computed)), "reused + computed"),
            ("reused tokens", fmt(reused), "served from the context cache"),
            ("computed tokens", fmt(computed), "run through the engine"),
            ("reuse ratio", fmt_pct(reuse_ratio(data)), "reused / (reused + computed)"),
            ("tokens/s", fmt(get(prefill, "tokens_per_second"), 1), "reused + computed over llm_prefill time"),
            ("tokens per run", fmt(get(prefill, "average_tokens_per_run"), 1), ""),
            ("ms per run", fmt(get(prefill, "average_time_per_run_ms"), 3), ""),
            ("ms per token", fmt(get(prefill, "average_time_per_token_ms"), 4), ""),
        ])
    if stage is not None:
        for key, label in (("mean_ms", "mean"), ("median_ms", "median"), ("p95_ms", "p95"), ("p99_ms", "p99")):
            table.add_row(f"TTFT-ish {label} ms", fmt(stage_stat(stage, key), 3),
                          f"{schema.PREFILL_STAGE} call {label}")
    return table


def _generation_table(data: Mapping[str, Any]) -> Table | None:
    generation = section(data, schema.GENERATION)
    stage = stages_by_id(data).get(schema.GENERATION_STAGE)
    if not generation and stage is None:
        return None
    table = _kv_table("Generation")
    if generation:
        _add_rows(table, [
            ("runs", fmt(get(generation, "total_runs")), "engine steps of decode rows only"),
            ("generated tokens", fmt(get(generation, "generated_tokens")), ""),
            ("tokens per run", fmt(get(generation, "average_tokens_per_run"), 1), ""),
            ("tokens/s", fmt(get(generation, "tokens_per_second"), 1), "generated tokens over llm_generation time"),
            ("ms per token", fmt(get(generation, "average_time_per_token_ms"), 3), ""),
        ])
    if stage is not None:
        for key, label in (("mean_ms", "mean"), ("p95_ms", "p95"), ("p99_ms", "p99")):
            table.add_row(f"decode step {label} ms", fmt(stage_stat(stage, key), 3),
                          f"{schema.GENERATION_STAGE} call {label}")
    return table


def _stages_table(data: Mapping[str, Any]) -> Table | None:
    rows = stage_rows(data)
    if not rows:
        return None
    table = Table(title="Stages (ms; wall time of the engine calls on the CPU backend)", title_justify="left",
                  title_style="bold")
    table.add_column("stage_id")
    for column in ("runs", "total ms", "mean", "median", "p95", "p99", "share"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(escape(row["stage_id"]), fmt(row["runs"]), fmt(row["total_ms"], 3),
                      *(fmt(row[key], 3) for key in ("mean_ms", "median_ms", "p95_ms", "p99_ms")),
                      fmt_pct(row["share"]))
    return table


def _memory_table(data: Mapping[str, Any]) -> Table | None:
    rows = [(_MEMORY_LABELS[figure], memory_mib(data, figure), figure) for figure in schema.MEMORY_FIGURES]
    rows = [row for row in rows if row[1] is not None]
    if not rows:
        return None
    table = _kv_table("Memory")
    for label, mib, figure in rows:
        num_bytes = get(data, schema.bytes_key(figure))
        table.add_row(f"{label} MiB", fmt(float(mib), 1), f"{fmt(num_bytes)} bytes" if num_bytes is not None else "")
    return table


def _counter_label(key: str) -> str:
    """`media_aware_sequences` → "media-aware sequences": the counter's subject hyphenated, then its unit."""
    subject, _, unit = key.rpartition("_")
    return f"{subject.replace('_', '-')} {unit}"


def _context_cache_table(data: Mapping[str, Any]) -> Table | None:
    cache = data.get(schema.CONTEXT_CACHE)
    if not isinstance(cache, Mapping):
        return None
    table = _kv_table("Context cache (cumulative over the process, warmup included)")
    admitted, bypass = get(cache, schema.ADMITTED_SEQUENCES), get(cache, schema.LOOKUP_BYPASS_SEQUENCES)
    for key in schema.SEQUENCE_COUNTERS:
        if key in cache:
            table.add_row(_counter_label(key), fmt(get(cache, key)), "")
    if schema.ADMITTED_SEQUENCES in cache and schema.HIT_SEQUENCES in cache:
        table.add_row("hit rate", fmt_pct(hit_rate(data)), "hit / admitted sequences")
    if bypass and admitted is not None and admitted > bypass:
        looked_up = ratio(get(cache, schema.HIT_SEQUENCES), admitted - bypass)
        table.add_row("hit rate of looked-up", fmt_pct(looked_up), "hit / (admitted − bypass)")
    table.add_section()
    for key in schema.TOKEN_COUNTERS:
        if key in cache:
            table.add_row(_counter_label(key), fmt(get(cache, key)), "")
    for group, keys in _CACHE_GROUPS:
        block = cache.get(group)
        if not isinstance(block, Mapping) or not applies(data, group):
            continue
        table.add_section()
        for key in (*keys, *(extra for extra in block if extra not in keys)):
            if key in block:
                table.add_row(escape(f"{group}.{key}"), fmt(get(block, key)), "")
    if schema.PLANNING_NANOSECONDS in cache:
        table.add_section()
        planning_ns = get(cache, schema.PLANNING_NANOSECONDS)
        table.add_row("planning total ms", fmt(None if planning_ns is None else planning_ns / 1e6, 3), "")
        table.add_row("planning µs per admitted", fmt(planning_us_per_admitted(data), 2),
                      "planning_nanoseconds / admitted_sequences")
    # Every other block is a cache type's counters (documents, sliding_window, adapter_corrections, a new type's):
    # one section each, in the profile's order, so a type's block shows up without an edit here; only the blocks
    # that apply to this profile (`applies`).
    scalars = [(key, value) for top, item in cache.items() if top not in _CACHE_LAID_OUT and applies(data, str(top))
               and not isinstance(item, Mapping) for key, value in flat_numbers(item, str(top))]
    blocks = [list(flat_numbers(item, str(top))) for top, item in cache.items() if top not in _CACHE_LAID_OUT
              and applies(data, str(top)) and isinstance(item, Mapping)]
    for rows in (scalars, *blocks):
        if rows:
            table.add_section()
        for key, value in rows:
            table.add_row(escape(key), fmt(value, 3), "")
    return table if table.row_count else None


def _pools_table(data: Mapping[str, Any]) -> Table | None:
    rows = [row for row in pool_rows(data) if _pool_in_use(row)]  # a pool of capacity 0: the engine has none
    if not rows:
        return None
    table = Table(title="Context-cache resource pools", title_justify="left", title_style="bold")
    table.add_column("pool")
    for column in ("free", "capacity", "in use", "use", "reclaimed"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(escape(row["name"]), fmt(row["free"]), fmt(row["capacity"]), fmt(row["used"]),
                      fmt_pct(row["used_fraction"]), fmt(row["reclaimed"]))
    return table


def _adapter_table(data: Mapping[str, Any]) -> Table | None:
    adapters = per_adapter(data)
    if not adapters:
        return None
    table = Table(title="Per adapter", title_justify="left", title_style="bold")
    table.add_column("adapter")
    base_pages = any(isinstance(e, Mapping) and schema.ADAPTER_BASE_PAGES in e for e in adapters.values())
    for column in ("requests", "reused tokens", "reused per request") + (("base pages reused",) if base_pages else ()):
        table.add_column(column, justify="right")
    for name, entry in adapters.items():
        requests, reused = get(entry, "requests"), get(entry, "reused_tokens")
        cells = [fmt(requests), fmt(reused), fmt(ratio(reused, requests), 1)]
        table.add_row(escape(str(name)), *cells, *([fmt(get(entry, schema.ADAPTER_BASE_PAGES))] if base_pages else []))
    return table


def _speculative_tables(data: Mapping[str, Any]) -> Iterator[Table]:
    """One table per speculative block (kvforge's spec_decode_generation, or Edge-LLM's per-strategy block), with
    the speculative stages' mean times under it."""
    stages = stages_by_id(data)
    for name, block in speculative_blocks(data):
        table = _kv_table(escape(f"Speculative decoding ({name})"))
        if name != schema.SPEC_DECODE_GENERATION or "total_runs" in block:
            table.add_row("runs", fmt(get(block, "total_runs")), "decode runs")
        table.add_row("acceptance rate", fmt_pct(get(block, "average_acceptance_rate")), "accepted / draft tokens")
        known = {"total_runs", "average_acceptance_rate"}
        for key, label, detail in _SPECULATIVE_ROWS:
            known.add(key)
            if key in block:
                table.add_row(label, fmt(get(block, key), 2), detail)
        extras = [(key, value) for top, item in block.items() if top not in known
                  for key, value in flat_numbers(item, str(top))]
        for key, value in extras:
            table.add_row(escape(key), fmt(value, 3), "")
        timed = [stage_id for stage_id in _SPECULATIVE_STAGES if stage_id in stages]
        if timed:
            table.add_section()
        for stage_id in timed:
            table.add_row(f"{stage_id} mean ms", fmt(stage_stat(stages[stage_id], "mean_ms"), 3),
                          f"{fmt(stage_stat(stages[stage_id], 'count'))} calls")
        yield table


def _tier_table(data: Mapping[str, Any]) -> Table | None:
    """The shared tier's block (context_cache.shared_tier): its counters and the two rates they make."""
    tier = shared_tier(data)
    if not tier:
        return None
    table = _kv_table("Shared tier (--sharedCache; cumulative over the process)")
    for key, label, detail in _TIER_ROWS:
        if key in tier:
            table.add_row(label, fmt(get(tier, key), 3 if key == "load_ms" else 2), detail)
    table.add_section()
    table.add_row("hit rate", fmt_pct(tier_hit_rate(data)), "hits / lookups")
    table.add_row("load ms per hit", fmt(tier_ms_per_hit(data), 3), "load ms / hits")
    laid_out = {key for key, _, _ in _TIER_ROWS}
    extras = [(key, value) for top, item in tier.items() if top not in laid_out
              for key, value in flat_numbers(item, str(top))]
    if extras:
        table.add_section()
        for key, value in extras:
            table.add_row(escape(key), fmt(value, 3), "")
    return table


def _other_tables(data: Mapping[str, Any]) -> Iterator[Table]:
    """Sections this tool has no layout for (multimodal, talker, unknown keys): listed."""
    loose: list[tuple[str, float | int]] = []
    for key, value in data.items():
        if key in _LAID_OUT:
            continue
        if isinstance(value, Mapping):
            rows = list(flat_numbers(value, ""))
            if rows:
                table = _kv_table(escape(key))
                for metric, found in rows:
                    table.add_row(escape(metric), fmt(found, 3), "")
                yield table
        elif (found := number(value)) is not None:
            loose.append((key, found))
    if loose:
        table = _kv_table("Other")
        for metric, found in loose:
            table.add_row(escape(metric), fmt(found, 3), "")
        yield table


def summary_tables(data: Mapping[str, Any]) -> list[Table]:
    """The `llm_profile show` tables, in order; sections the profile lacks are left out."""
    tables = [_prefill_table(data), _generation_table(data), *_speculative_tables(data), _stages_table(data),
              _memory_table(data), _context_cache_table(data), _tier_table(data), _pools_table(data),
              _adapter_table(data), *_other_tables(data)]
    return [table for table in tables if table is not None]
