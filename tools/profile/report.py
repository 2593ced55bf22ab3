"""Profile JSON → rich tables, flattened metrics, A/B comparison rows and a matplotlib chart.

Every reader here tolerates missing sections and missing or non-numeric keys (a profile from an
older kvforge, from TensorRT Edge-LLM, or hand-edited): what is absent is skipped or shown as "—".
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from kvforge.contract import profile_schema as schema
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import atomic_output, loads_json, read_limited
from kvforge.contract.validation import json_kind, printable

_MIB = 1024 * 1024
MISSING = "—"

_MEMORY_LABELS = {schema.PEAK_CPU_MEMORY: "peak CPU memory", schema.KV_POOL: "KV pool",
                  schema.PEAK_GPU_MEMORY: "peak GPU memory", schema.PEAK_UNIFIED_MEMORY: "peak unified memory"}
# Top-level keys the summary lays out itself; any other section is listed by _other_tables.
_LAID_OUT = frozenset({schema.PREFILL, schema.GENERATION, schema.STAGES, schema.CONTEXT_CACHE,
                       schema.PER_ADAPTER}) | schema.MEMORY_KEYS

# context_cache keys the "Context cache" table lays out itself; anything else numeric is listed under "other".
_CACHE_GROUPS = ((schema.PLANS, schema.PLAN_KINDS), (schema.PUBLICATIONS, schema.PUBLICATION_KEYS),
                 (schema.RECORDS, schema.RECORD_KEYS), (schema.HYBRID, schema.HYBRID_KEYS),
                 (schema.SPECULATIVE, schema.SPECULATIVE_KEYS))
_CACHE_LAID_OUT = frozenset({*schema.SEQUENCE_COUNTERS, *schema.TOKEN_COUNTERS, *(group for group, _ in _CACHE_GROUPS),
                             schema.PLANNING_NANOSECONDS, schema.RESOURCE_POOLS, schema.RECLAIMED_RESOURCES,
                             schema.PER_ADAPTER})


# ------------------------------------------------------------------------------------------------ loading

def load_profile(path: Path) -> dict[str, Any]:
    """Read and sanity-check a profile JSON; every failure is a KvforgeError naming the file."""
    path = Path(path)
    name = str(path)
    if not path.exists():
        raise KvforgeError("no such file", name)
    if path.is_dir():
        raise KvforgeError("is a directory, expected a profile JSON file", name)
    try:
        text = read_limited(path, MAX_PROFILE_BYTES, name).decode("utf-8")
    except UnicodeDecodeError:
        raise KvforgeError("not UTF-8 text, expected a profile JSON file", name) from None
    except OSError as exc:
        raise KvforgeError(f"cannot read: {exc.strerror or exc}", name) from None
    data = sanitize(loads_json(text, name))  # duplicate keys, nesting and huge literals: one line each
    if not isinstance(data, dict):
        raise KvforgeError(f"not a profile: the top level is a JSON {json_kind(data)}, expected an object", name)
    if not schema.TOP_LEVEL_KEYS & data.keys():
        raise KvforgeError("not a profile: none of the sections prefill, generation, stages, context_cache, "
                           "peak_*_memory found (write one with llm_inference --profileOutputFile)", name)
    return data




MAX_PROFILE_BYTES = 64 * 2**20
MAX_DEPTH = 32  # a profile nests 4 deep; anything deeper is dropped, not walked
MAX_STRING = 200


def sanitize(value: Any, depth: int = 0) -> Any:
    """A profile as the tables may print it: strings and keys made terminal-safe (escape sequences shown, not
    obeyed) and shortened, numbers beyond float range or non-finite dropped (None), nesting capped."""
    if depth > MAX_DEPTH:
        return None
    if isinstance(value, dict):
        return {_clean_text(str(k)): sanitize(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [sanitize(v, depth + 1) for v in value]
    if isinstance(value, str):
        return _clean_text(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**63 else None  # formatting or mixing it with floats would overflow
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return None


def _clean_text(text: str) -> str:
    text = printable(text)
    return text if len(text) <= MAX_STRING else text[:MAX_STRING - 3] + "..."


# ------------------------------------------------------------------------------------------- small helpers

def _number(value: Any) -> float | int | None:
    """A finite JSON number, else None (booleans are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def _get(mapping: Any, *keys: str) -> float | int | None:
    """A number at a nested key path of a dict, or None when any level is missing or of the wrong type."""
    for key in keys:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(key)
    return _number(mapping)


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    return value if isinstance(value, Mapping) else {}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _sum(*values: float | None) -> float | None:
    return None if any(value is None for value in values) else sum(values)  # type: ignore[arg-type]


def fmt(value: float | None, decimals: int = 2) -> str:
    """Integers with thousands separators, floats with `decimals` places; None → "—"."""
    if value is None:
        return MISSING
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{decimals}f}"


def fmt_pct(value: float | None) -> str:
    return MISSING if value is None else f"{value * 100:.1f} %"


def stages_by_id(data: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """`stages[]` keyed by stage_id (first occurrence wins); entries that are not objects are skipped."""
    stages = data.get(schema.STAGES)
    result: dict[str, Mapping[str, Any]] = {}
    if isinstance(stages, list):
        for index, stage in enumerate(stages):
            if isinstance(stage, Mapping):
                stage_id = stage.get("stage_id")
                result.setdefault(str(stage_id) if stage_id is not None else f"stage[{index}]", stage)
    return result


def _stage_stat(stage: Mapping[str, Any] | None, key: str) -> float | None:
    """A gpu_time_stats value, falling back to the stage's own keys (total_runs, average_time_per_run_ms)."""
    if stage is None:
        return None
    value = _get(stage, "gpu_time_stats", key)
    if value is None and key == "mean_ms":
        value = _get(stage, "average_time_per_run_ms")
    if value is None and key == "count":
        value = _get(stage, "total_runs")
    return value


def reuse_ratio(data: Mapping[str, Any]) -> float | None:
    """Prefill reuse ratio = reused / (reused + computed) prompt tokens; None without prefill counters."""
    prefill = _section(data, schema.PREFILL)
    reused, computed = _get(prefill, "reused_tokens"), _get(prefill, "computed_tokens")
    return _ratio(reused, _sum(reused, computed))


def hit_rate(data: Mapping[str, Any]) -> float | None:
    """Context-cache hit rate = hit_sequences / admitted_sequences."""
    cache = _section(data, schema.CONTEXT_CACHE)
    return _ratio(_get(cache, schema.HIT_SEQUENCES), _get(cache, schema.ADMITTED_SEQUENCES))


def planning_us_per_admitted(data: Mapping[str, Any]) -> float | None:
    """Reuse-planning time per admitted sequence in µs (planning_nanoseconds / admitted_sequences / 1000)."""
    cache = _section(data, schema.CONTEXT_CACHE)
    per_sequence_ns = _ratio(_get(cache, schema.PLANNING_NANOSECONDS), _get(cache, schema.ADMITTED_SEQUENCES))
    return None if per_sequence_ns is None else per_sequence_ns / 1000.0


def per_adapter(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The `per_adapter` block ({name: {requests, reused_tokens}}), top level or inside context_cache."""
    block = data.get(schema.PER_ADAPTER)
    if not isinstance(block, Mapping):
        block = _section(data, schema.CONTEXT_CACHE).get(schema.PER_ADAPTER)
    return block if isinstance(block, Mapping) else {}


# ------------------------------------------------------------------------------------------------ summary

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
    prefill = _section(data, schema.PREFILL)
    stage = stages_by_id(data).get(schema.PREFILL_STAGE)
    if not prefill and stage is None:
        return None
    table = _kv_table("Prefill")
    reused, computed = _get(prefill, "reused_tokens"), _get(prefill, "computed_tokens")
    if prefill:
        _add_rows(table, [
            ("runs", fmt(_get(prefill, "total_runs")), "engine steps with prefill rows"),
            ("prompt tokens", fmt(_sum(reused, computed)), "reused + computed"),
            ("reused tokens", fmt(reused), "served from the context cache"),
            ("computed tokens", fmt(computed), "run through the engine"),
            ("reuse ratio", fmt_pct(reuse_ratio(data)), "reused / (reused + computed)"),
            ("tokens/s", fmt(_get(prefill, "tokens_per_second"), 1), "reused + computed over llm_prefill time"),
            ("tokens per run", fmt(_get(prefill, "average_tokens_per_run"), 1), ""),
            ("ms per run", fmt(_get(prefill, "average_time_per_run_ms"), 3), ""),
            ("ms per token", fmt(_get(prefill, "average_time_per_token_ms"), 4), ""),
        ])
    if stage is not None:
        for key, label in (("mean_ms", "mean"), ("median_ms", "median"), ("p95_ms", "p95"), ("p99_ms", "p99")):
            table.add_row(f"TTFT-ish {label} ms", fmt(_stage_stat(stage, key), 3),
                          f"{schema.PREFILL_STAGE} call {label}")
    return table


def _generation_table(data: Mapping[str, Any]) -> Table | None:
    generation = _section(data, schema.GENERATION)
    stage = stages_by_id(data).get(schema.GENERATION_STAGE)
    if not generation and stage is None:
        return None
    table = _kv_table("Generation")
    if generation:
        _add_rows(table, [
            ("runs", fmt(_get(generation, "total_runs")), "engine steps of decode rows only"),
            ("generated tokens", fmt(_get(generation, "generated_tokens")), ""),
            ("tokens per run", fmt(_get(generation, "average_tokens_per_run"), 1), ""),
            ("tokens/s", fmt(_get(generation, "tokens_per_second"), 1), "generated tokens over llm_generation time"),
            ("ms per token", fmt(_get(generation, "average_time_per_token_ms"), 3), ""),
        ])
    if stage is not None:
        for key, label in (("mean_ms", "mean"), ("p95_ms", "p95"), ("p99_ms", "p99")):
            table.add_row(f"decode step {label} ms", fmt(_stage_stat(stage, key), 3),
                          f"{schema.GENERATION_STAGE} call {label}")
    return table


def stage_rows(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One dict per stage: stage_id, runs, total_ms, mean_ms, median_ms, p95_ms, p99_ms, share (of all stages)."""
    rows = []
    for stage_id, stage in stages_by_id(data).items():
        rows.append({"stage_id": stage_id, "runs": _stage_stat(stage, "count"),
                     "total_ms": _get(stage, "total_gpu_time_ms"),
                     **{key: _stage_stat(stage, key) for key in ("mean_ms", "median_ms", "p95_ms", "p99_ms")}})
    grand_total = sum(row["total_ms"] or 0.0 for row in rows)
    for row in rows:
        row["share"] = _ratio(row["total_ms"], grand_total)
    return rows


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


def _memory_mib(data: Mapping[str, Any], figure: str) -> float | None:
    mib = _get(data, schema.mb_key(figure))
    if mib is None:
        num_bytes = _get(data, schema.bytes_key(figure))
        mib = None if num_bytes is None else num_bytes / _MIB
    return mib


def _memory_table(data: Mapping[str, Any]) -> Table | None:
    rows = [(_MEMORY_LABELS[figure], _memory_mib(data, figure), figure) for figure in schema.MEMORY_FIGURES]
    rows = [row for row in rows if row[1] is not None]
    if not rows:
        return None
    table = _kv_table("Memory")
    for label, mib, figure in rows:
        num_bytes = _get(data, schema.bytes_key(figure))
        table.add_row(f"{label} MiB", fmt(float(mib), 1), f"{fmt(num_bytes)} bytes" if num_bytes is not None else "")
    return table


def _flat_numbers(value: Any, prefix: str) -> Iterator[tuple[str, float | int]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _flat_numbers(item, f"{prefix}.{key}" if prefix else str(key))
    elif (number := _number(value)) is not None:
        yield prefix, number


def _counter_label(key: str) -> str:
    """`media_aware_sequences` → "media-aware sequences": the counter's subject hyphenated, then its unit."""
    subject, _, unit = key.rpartition("_")
    return f"{subject.replace('_', '-')} {unit}"


def _context_cache_table(data: Mapping[str, Any]) -> Table | None:
    cache = data.get(schema.CONTEXT_CACHE)
    if not isinstance(cache, Mapping):
        return None
    table = _kv_table("Context cache (cumulative over the process, warmup included)")
    admitted, bypass = _get(cache, schema.ADMITTED_SEQUENCES), _get(cache, schema.LOOKUP_BYPASS_SEQUENCES)
    for key in schema.SEQUENCE_COUNTERS:
        if key in cache:
            table.add_row(_counter_label(key), fmt(_get(cache, key)), "")
    if schema.ADMITTED_SEQUENCES in cache and schema.HIT_SEQUENCES in cache:
        table.add_row("hit rate", fmt_pct(hit_rate(data)), "hit / admitted sequences")
    if bypass and admitted is not None and admitted > bypass:
        looked_up = _ratio(_get(cache, schema.HIT_SEQUENCES), admitted - bypass)
        table.add_row("hit rate of looked-up", fmt_pct(looked_up), "hit / (admitted − bypass)")
    table.add_section()
    for key in schema.TOKEN_COUNTERS:
        if key in cache:
            table.add_row(_counter_label(key), fmt(_get(cache, key)), "")
    for group, keys in _CACHE_GROUPS:
        block = cache.get(group)
        if not isinstance(block, Mapping):
            continue
        table.add_section()
        for key in (*keys, *(extra for extra in block if extra not in keys)):
            if key in block:
                table.add_row(escape(f"{group}.{key}"), fmt(_get(block, key)), "")
    if schema.PLANNING_NANOSECONDS in cache:
        table.add_section()
        planning_ns = _get(cache, schema.PLANNING_NANOSECONDS)
        table.add_row("planning total ms", fmt(None if planning_ns is None else planning_ns / 1e6, 3), "")
        table.add_row("planning µs per admitted", fmt(planning_us_per_admitted(data), 2),
                      "planning_nanoseconds / admitted_sequences")
    others = [(key, value) for top, item in cache.items() if top not in _CACHE_LAID_OUT
              for key, value in _flat_numbers(item, str(top))]
    if others:
        table.add_section()
        for key, value in others:
            table.add_row(escape(key), fmt(value, 3), "")
    return table if table.row_count else None


def pool_rows(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """resource_pools joined with reclaimed_resources: name, free, capacity, used, used_fraction, reclaimed."""
    cache = _section(data, schema.CONTEXT_CACHE)
    pools = _section(cache, schema.RESOURCE_POOLS)
    reclaimed = _section(cache, schema.RECLAIMED_RESOURCES)
    rows = []
    for name in (*pools, *(name for name in reclaimed if name not in pools)):
        free, capacity = _get(pools, name, schema.POOL_FREE), _get(pools, name, schema.POOL_CAPACITY)
        used = None if free is None or capacity is None else capacity - free
        rows.append({"name": str(name), "free": free, "capacity": capacity, "used": used,
                     "used_fraction": _ratio(used, capacity), "reclaimed": _get(reclaimed, name)})
    return rows


def _pools_table(data: Mapping[str, Any]) -> Table | None:
    rows = pool_rows(data)
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
    for column in ("requests", "reused tokens", "reused per request"):
        table.add_column(column, justify="right")
    for name, entry in adapters.items():
        requests, reused = _get(entry, "requests"), _get(entry, "reused_tokens")
        table.add_row(escape(str(name)), fmt(requests), fmt(reused), fmt(_ratio(reused, requests), 1))
    return table


def _other_tables(data: Mapping[str, Any]) -> Iterator[Table]:
    """Sections this tool has no layout for (speculative decoding, multimodal, talker, unknown keys): listed."""
    loose: list[tuple[str, float | int]] = []
    for key, value in data.items():
        if key in _LAID_OUT:
            continue
        if isinstance(value, Mapping):
            rows = list(_flat_numbers(value, ""))
            if rows:
                table = _kv_table(escape(key))
                for metric, number in rows:
                    table.add_row(escape(metric), fmt(number, 3), "")
                yield table
        elif (number := _number(value)) is not None:
            loose.append((key, number))
    if loose:
        table = _kv_table("Other")
        for metric, number in loose:
            table.add_row(escape(metric), fmt(number, 3), "")
        yield table


def summary_tables(data: Mapping[str, Any]) -> list[Table]:
    """The `llm_profile show` tables, in order; sections the profile lacks are left out."""
    tables = [_prefill_table(data), _generation_table(data), _stages_table(data), _memory_table(data),
              _context_cache_table(data), _pools_table(data), _adapter_table(data), *_other_tables(data)]
    return [table for table in tables if table is not None]


# ------------------------------------------------------------------------------------------------ compare

def flatten(data: Mapping[str, Any]) -> dict[str, float | int]:
    """Every number in the profile under a dotted key; stages are keyed by id with gpu_time_stats inlined.

    `{"prefill": {"tokens_per_second": 9.0}}` → `prefill.tokens_per_second`;
    `stages[{stage_id: llm_prefill, gpu_time_stats: {mean_ms}}]` → `stages.llm_prefill.mean_ms`.
    """
    flat: dict[str, float | int] = {}
    for key, value in data.items():
        if key == schema.STAGES:
            for stage_id, stage in stages_by_id(data).items():
                for sub, item in stage.items():
                    if sub == "gpu_time_stats" and isinstance(item, Mapping):
                        flat.update(_flat_numbers(item, f"{schema.STAGES}.{stage_id}"))
                    elif (number := _number(item)) is not None:
                        flat[f"{schema.STAGES}.{stage_id}.{sub}"] = number
        else:
            flat.update(_flat_numbers(value, str(key)))
    return flat


def derived_metrics(data: Mapping[str, Any]) -> dict[str, float]:
    """Ratios the profile does not store but `show` reports: reuse ratio, hit rate, planning µs per sequence."""
    values = {f"{schema.PREFILL}.reuse_ratio": reuse_ratio(data), f"{schema.CONTEXT_CACHE}.hit_rate": hit_rate(data),
              f"{schema.CONTEXT_CACHE}.planning_us_per_admitted": planning_us_per_admitted(data)}
    return {key: value for key, value in values.items() if value is not None}


def metrics(data: Mapping[str, Any]) -> dict[str, float | int]:
    """flatten() plus derived_metrics(), each derived key placed after the last key of its section."""
    flat = flatten(data)
    derived = derived_metrics(data)
    ordered: dict[str, float | int] = {}
    keys = list(flat)
    for index, key in enumerate(keys):
        ordered[key] = flat[key]
        section = key.split(".")[0]
        if index + 1 == len(keys) or keys[index + 1].split(".")[0] != section:
            ordered.update({name: value for name, value in derived.items() if name.split(".")[0] == section})
    ordered.update({name: value for name, value in derived.items() if name not in ordered})
    return ordered


_HIGHER_IS_BETTER = ("tokens_per_second", "reuse_ratio", "hit_rate", schema.HIT_SEQUENCES, schema.REUSED_TOKENS,
                     schema.MATCHED_TOKENS, "average_acceptance_rate", schema.PUBLICATIONS_COMMITTED,
                     schema.SUCCESSFUL_ENDPOINTS)
_LOWER_IS_BETTER = ("_ms", "_mb", "_bytes", schema.PLANNING_NANOSECONDS, "planning_us_per_admitted", "computed_tokens",
                    schema.RECORDS_EVICTED, schema.FORCED_COLD_SEQUENCES, schema.SNAPSHOT_PRESSURE_SKIPS,
                    schema.SCHEDULER_PREEMPTIONS)


def direction(key: str) -> int:
    """+1 if a larger value is better, -1 if smaller is better, 0 when neither (counts, capacities)."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf.endswith(_HIGHER_IS_BETTER):
        return 1
    if leaf.endswith(_LOWER_IS_BETTER):
        return -1
    return 0


@dataclass(frozen=True, slots=True)
class CompareRow:
    key: str
    a: float | int
    b: float | int
    diff: float | int
    ratio: float | None  # None when A is 0 and B is not
    notable: bool  # |B/A − 1| ≥ threshold (or a change away from 0)
    verdict: str  # "better" / "worse" / "changed" for notable rows, else ""


def compare_rows(a: Mapping[str, Any], b: Mapping[str, Any], threshold: float = 0.10) -> list[CompareRow]:
    """Numeric fields present in both profiles (metrics() keys, A's order) with B−A and B/A."""
    metrics_a, metrics_b = metrics(a), metrics(b)
    rows = []
    for key, value_a in metrics_a.items():
        if key not in metrics_b:
            continue
        value_b = metrics_b[key]
        diff = value_b - value_a
        ratio = (1.0 if value_b == 0 else None) if value_a == 0 else value_b / value_a
        notable = diff != 0 and (ratio is None or abs(ratio - 1.0) >= threshold)
        verdict = ""
        if notable:
            sign = direction(key) * (1 if diff > 0 else -1)
            verdict = "better" if sign > 0 else "worse" if sign < 0 else "changed"
        rows.append(CompareRow(key, value_a, value_b, diff, ratio, notable, verdict))
    return rows


def only_in(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """metrics() keys found in only one of the profiles: (only in A, only in B)."""
    metrics_a, metrics_b = metrics(a), metrics(b)
    return [key for key in metrics_a if key not in metrics_b], [key for key in metrics_b if key not in metrics_a]


def group_keys(keys: Sequence[str]) -> str:
    """`["context_cache.x", "context_cache.y", "stages.vision_encoder.mean_ms"]` →
    "context_cache (2 fields), stages.vision_encoder (1 field)": sections, or stages by id."""
    counts: dict[str, int] = {}
    for key in keys:
        parts = key.split(".")
        group = ".".join(parts[:2]) if parts[0] == schema.STAGES and len(parts) > 2 else parts[0]
        counts[group] = counts.get(group, 0) + 1
    return ", ".join(f"{group} ({count} field{'s' if count != 1 else ''})" for group, count in counts.items())


def _fmt_compare(value: float | int) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.4f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:,.0f}"


_VERDICT_STYLE = {"better": "bold green", "worse": "bold red", "changed": "bold yellow"}


def compare_table(rows: Sequence[CompareRow], label_a: str, label_b: str, changed_only: bool = False) -> Table:
    """The `llm_profile compare` table; notable rows are coloured and carry a verdict."""
    table = Table(title=escape(f"A = {label_a}   B = {label_b}"), title_justify="left", title_style="bold")
    table.add_column("field", no_wrap=True)
    for column in ("A", "B", "B−A", "B/A"):
        table.add_column(column, justify="right")
    table.add_column("note")
    for row in rows:
        if changed_only and not row.notable:
            continue
        diff = _fmt_compare(row.diff)
        diff = diff if row.diff <= 0 else f"+{diff}"
        ratio = MISSING if row.ratio is None else f"{row.ratio:.3f}×"  # None: A is 0, B is not
        style = _VERDICT_STYLE.get(row.verdict)
        note = {"better": "▲ better", "worse": "▼ worse", "changed": "● changed"}.get(row.verdict, "")
        table.add_row(escape(row.key), _fmt_compare(row.a), _fmt_compare(row.b), diff, ratio, note, style=style)
    return table


# ------------------------------------------------------------------------------------------------ plotting

def _import_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise KvforgeError("matplotlib is not installed; pip install 'kvforge[plot]'", "--plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _has_reuse_tokens(data: Mapping[str, Any]) -> bool:
    return reuse_ratio(data) is not None


def _has_cache_sequences(data: Mapping[str, Any]) -> bool:
    return _get(_section(data, schema.CONTEXT_CACHE), schema.ADMITTED_SEQUENCES) is not None


def _label_bars(ax: Any, bars: Any, values: Sequence[float], fmt_value: str = "{:,.2f}") -> None:
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(fmt_value.format(value), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=8)


def plot_profile(profiles: Sequence[tuple[str, Mapping[str, Any]]], out: Path) -> Path:
    """Draw stage mean times (grouped bars per profile) and, when present, the reuse counters; write `out`.

    `profiles` is [(label, profile)], one for `show`, two (A, B) for `compare`.
    """
    out = Path(out)
    if not out.parent.is_dir():
        raise KvforgeError(f"directory {str(out.parent)!r} does not exist", "--plot")
    stage_ids: list[str] = []
    for _, data in profiles:
        stage_ids.extend(stage_id for stage_id in stages_by_id(data) if stage_id not in stage_ids)
    show_tokens = any(_has_reuse_tokens(data) for _, data in profiles)
    show_cache = any(_has_cache_sequences(data) for _, data in profiles)
    panels = (["stages"] if stage_ids else []) + (["tokens"] if show_tokens else []) + (["cache"] if show_cache else [])
    if not panels:
        raise KvforgeError("nothing to plot: no stages, prefill token counters or context_cache sequences", "--plot")

    plt = _import_pyplot()
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator
    colors = ["#4C72B0", "#DD8452"]
    widths = {"stages": max(4.5, 1.4 * len(stage_ids) * len(profiles)), "tokens": 2.0 + 1.6 * len(profiles),
              "cache": 4.5 + 1.0 * len(profiles)}
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths[p] for p in panels) + 1.0, 4.8),
                             gridspec_kw={"width_ratios": [widths[p] for p in panels]}, squeeze=False)
    title = "llm_profile: " + (profiles[0][0] if len(profiles) == 1 else f"{profiles[0][0]} vs {profiles[1][0]}")
    fig.suptitle(title, fontsize=12, fontweight="bold")
    bar_width = 0.8 / len(profiles)

    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "stages":
            positions = range(len(stage_ids))
            for index, (label, data) in enumerate(profiles):
                stages = stages_by_id(data)
                means = [_stage_stat(stages.get(stage_id), "mean_ms") for stage_id in stage_ids]
                present = [(p, mean) for p, mean in zip(positions, means, strict=True) if mean is not None]
                offsets = [p + (index - (len(profiles) - 1) / 2) * bar_width for p, _ in present]
                values = [mean for _, mean in present]
                bars = ax.bar(offsets, values, bar_width, label=label, color=colors[index % len(colors)])
                _label_bars(ax, bars, values, "{:,.2f}")
            ax.set_xticks(list(positions), stage_ids, rotation=20 if len(stage_ids) > 3 else 0, ha="center")
            ax.set_ylabel("mean time per call (ms)")
            ax.set_title("Stage mean time per call")
            ax.margins(y=0.15)
            if len(profiles) > 1:
                ax.legend(fontsize=8)
        elif panel == "tokens":
            names = [label for label, _ in profiles]
            reused = [_get(_section(data, schema.PREFILL), "reused_tokens") or 0 for _, data in profiles]
            computed = [_get(_section(data, schema.PREFILL), "computed_tokens") or 0 for _, data in profiles]
            ax.bar(names, reused, 0.6, label="reused", color="#55A868")
            ax.bar(names, computed, 0.6, bottom=reused, label="computed", color="#8C8C8C")
            for position, (_, data) in enumerate(profiles):
                total = reused[position] + computed[position]
                ratio = reuse_ratio(data)
                text = f"{fmt_pct(ratio)} reused" if ratio is not None else "no counters"
                ax.annotate(text, (position, total), xytext=(0, 3), textcoords="offset points", ha="center",
                            va="bottom", fontsize=8)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel("prompt tokens")
            ax.set_title("Prefill prompt tokens")
            ax.margins(y=0.3)
            ax.legend(fontsize=8, loc="upper left", ncol=2)
        else:
            keys = [schema.ADMITTED_SEQUENCES, schema.HIT_SEQUENCES, schema.LOOKUP_BYPASS_SEQUENCES,
                    schema.FORCED_COLD_SEQUENCES]
            categories = [key.rpartition("_")[0].replace("_", " ") for key in keys]
            handles = []  # in profile order; an outline-only entry where the section is absent (not zero)
            for index, (label, data) in enumerate(profiles):
                color = colors[index % len(colors)]
                if not _has_cache_sequences(data):
                    handles.append(Patch(facecolor="none", edgecolor=color, label=f"{label} (no context_cache)"))
                    continue
                cache = _section(data, schema.CONTEXT_CACHE)
                values = [_get(cache, key) or 0 for key in keys]
                offsets = [p + (index - (len(profiles) - 1) / 2) * bar_width for p in range(len(categories))]
                rate = hit_rate(data)
                legend = f"{label} (hit rate {fmt_pct(rate)})" if rate is not None else label
                bars = ax.bar(offsets, values, bar_width, label=legend, color=color)
                handles.append(bars)
                _label_bars(ax, bars, values, "{:,.0f}")
            ax.set_xticks(range(len(categories)), categories)
            ax.set_ylabel("sequences")
            ax.set_title("Context cache sequences")
            ax.margins(y=0.3)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(handles=handles, fontsize=8, loc="upper right")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    fig.tight_layout()
    try:
        with atomic_output(out, "wb") as handle:  # a failed plot leaves no partial image
            fig.savefig(handle, dpi=120, format=(out.suffix.lstrip(".").lower() or "png"))
    except (OSError, ValueError) as exc:
        raise KvforgeError(f"cannot write {str(out)!r}: {getattr(exc, 'strerror', None) or exc}", "--plot") from None
    finally:
        plt.close(fig)
    return out
