"""The numbers of a profile, read once for every view of it: llm_profile's tables, comparisons and plots, and the
plain-text summary llm_inference prints.

Every reader here tolerates missing sections and missing or non-numeric keys (a profile from an older kvforge, from
TensorRT Edge-LLM, or hand-edited): what is absent is None, shown as "—".
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from kvforge.contract import profile_schema as schema

MIB = 1024 * 1024
MISSING = "—"

# The speculative blocks: kvforge writes spec_decode_generation for every method (and a copy under the strategy's
# own name, as TensorRT Edge-LLM names it); Edge-LLM writes only the strategy's.
SPECULATIVE_SECTIONS = (schema.SPEC_DECODE_GENERATION, schema.EAGLE_GENERATION, schema.MTP_GENERATION)
# The shared tier's counters, inside context_cache when the engine ran with --sharedCache.
SHARED_TIER = "shared_tier"


def number(value: Any) -> float | int | None:
    """A finite JSON number, else None (booleans are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def get(mapping: Any, *keys: str) -> float | int | None:
    """A number at a nested key path of a dict, or None when any level is missing or of the wrong type."""
    for key in keys:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(key)
    return number(mapping)


def section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """data[key] when it is an object, else {}."""
    value = data.get(key)
    return value if isinstance(value, Mapping) else {}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def total(*values: float | None) -> float | None:
    """The sum, or None when any term is missing."""
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


def flat_numbers(value: Any, prefix: str) -> Iterator[tuple[str, float | int]]:
    """Every number under `value` with its dotted key path below `prefix`."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from flat_numbers(item, f"{prefix}.{key}" if prefix else str(key))
    elif (found := number(value)) is not None:
        yield prefix, found


# ------------------------------------------------------------------------------------------------ stages

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


def stage_stat(stage: Mapping[str, Any] | None, key: str) -> float | None:
    """A gpu_time_stats value, falling back to the stage's own keys (total_runs, average_time_per_run_ms)."""
    if stage is None:
        return None
    value = get(stage, "gpu_time_stats", key)
    if value is None and key == "mean_ms":
        value = get(stage, "average_time_per_run_ms")
    if value is None and key == "count":
        value = get(stage, "total_runs")
    return value


def stage_rows(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One dict per stage: stage_id, runs, total_ms, mean_ms, median_ms, p95_ms, p99_ms, share (of all stages)."""
    rows = []
    for stage_id, stage in stages_by_id(data).items():
        rows.append({"stage_id": stage_id, "runs": stage_stat(stage, "count"),
                     "total_ms": get(stage, "total_gpu_time_ms"),
                     **{key: stage_stat(stage, key) for key in ("mean_ms", "median_ms", "p95_ms", "p99_ms")}})
    grand_total = sum(row["total_ms"] or 0.0 for row in rows)
    for row in rows:
        row["share"] = ratio(row["total_ms"], grand_total)
    return rows


# ------------------------------------------------------------------------------------------------ ratios

def reuse_ratio(data: Mapping[str, Any]) -> float | None:
    """Prefill reuse ratio = reused / (reused + computed) prompt tokens; None without prefill counters."""
    prefill = section(data, schema.PREFILL)
    reused, computed = get(prefill, "reused_tokens"), get(prefill, "computed_tokens")
    return ratio(reused, total(reused, computed))


def hit_rate(data: Mapping[str, Any]) -> float | None:
    """Context-cache hit rate = hit_sequences / admitted_sequences."""
    cache = section(data, schema.CONTEXT_CACHE)
    return ratio(get(cache, schema.HIT_SEQUENCES), get(cache, schema.ADMITTED_SEQUENCES))


def planning_us_per_admitted(data: Mapping[str, Any]) -> float | None:
    """Reuse-planning time per admitted sequence in µs (planning_nanoseconds / admitted_sequences / 1000)."""
    cache = section(data, schema.CONTEXT_CACHE)
    per_sequence_ns = ratio(get(cache, schema.PLANNING_NANOSECONDS), get(cache, schema.ADMITTED_SEQUENCES))
    return None if per_sequence_ns is None else per_sequence_ns / 1000.0


def shared_tier(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """context_cache.shared_tier ({} without a shared tier)."""
    return section(section(data, schema.CONTEXT_CACHE), SHARED_TIER)


def tier_hit_rate(data: Mapping[str, Any]) -> float | None:
    """Shared-tier hit rate = lookups that loaded something / lookups."""
    tier = shared_tier(data)
    return ratio(get(tier, "hits"), get(tier, "lookups"))


def tier_ms_per_hit(data: Mapping[str, Any]) -> float | None:
    """Shared-tier load time per hit in ms (from the lookup to the last copy)."""
    tier = shared_tier(data)
    return ratio(get(tier, "load_ms"), get(tier, "hits"))


def speculative_blocks(data: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """The speculative sections present, each once: a strategy section that only copies spec_decode_generation
    (kvforge writes both) is left out."""
    blocks: list[tuple[str, Mapping[str, Any]]] = []
    for name in SPECULATIVE_SECTIONS:
        block = data.get(name)
        if isinstance(block, Mapping) and not any(block == other for _, other in blocks):
            blocks.append((name, block))
    return blocks


def per_adapter(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The `per_adapter` block ({name: {requests, reused_tokens}}), top level or inside context_cache."""
    block = data.get(schema.PER_ADAPTER)
    if not isinstance(block, Mapping):
        block = section(data, schema.CONTEXT_CACHE).get(schema.PER_ADAPTER)
    return block if isinstance(block, Mapping) else {}


def memory_mib(data: Mapping[str, Any], figure: str) -> float | None:
    """A memory figure in MiB: its _mb key, else its _bytes key converted."""
    mib = get(data, schema.mb_key(figure))
    if mib is None:
        num_bytes = get(data, schema.bytes_key(figure))
        mib = None if num_bytes is None else num_bytes / MIB
    return mib


def pool_rows(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """resource_pools joined with reclaimed_resources: name, free, capacity, used, used_fraction, reclaimed."""
    cache = section(data, schema.CONTEXT_CACHE)
    pools = section(cache, schema.RESOURCE_POOLS)
    reclaimed = section(cache, schema.RECLAIMED_RESOURCES)
    rows = []
    for name in (*pools, *(name for name in reclaimed if name not in pools)):
        free, capacity = get(pools, name, schema.POOL_FREE), get(pools, name, schema.POOL_CAPACITY)
        used = None if free is None or capacity is None else capacity - free
        rows.append({"name": str(name), "free": free, "capacity": capacity, "used": used,
                     "used_fraction": ratio(used, capacity), "reclaimed": get(reclaimed, name)})
    return rows


# ------------------------------------------------------------------------------------------------ flat view

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
                        flat.update(flat_numbers(item, f"{schema.STAGES}.{stage_id}"))
                    elif (found := number(item)) is not None:
                        flat[f"{schema.STAGES}.{stage_id}.{sub}"] = found
        else:
            flat.update(flat_numbers(value, str(key)))
    return flat


def derived_metrics(data: Mapping[str, Any]) -> dict[str, float]:
    """Ratios the profile does not store but `show` reports: reuse ratio, hit rate, planning µs per sequence, and
    the shared tier's hit rate and ms per hit."""
    tier = f"{schema.CONTEXT_CACHE}.{SHARED_TIER}"
    values = {f"{schema.PREFILL}.reuse_ratio": reuse_ratio(data), f"{schema.CONTEXT_CACHE}.hit_rate": hit_rate(data),
              f"{schema.CONTEXT_CACHE}.planning_us_per_admitted": planning_us_per_admitted(data),
              f"{tier}.hit_rate": tier_hit_rate(data), f"{tier}.load_per_hit_ms": tier_ms_per_hit(data)}
    return {key: value for key, value in values.items() if value is not None}


def metrics(data: Mapping[str, Any]) -> dict[str, float | int]:
    """flatten() plus derived_metrics(), each derived key placed after the last key of its section."""
    flat = flatten(data)
    derived = derived_metrics(data)
    ordered: dict[str, float | int] = {}
    keys = list(flat)
    for index, key in enumerate(keys):
        ordered[key] = flat[key]
        top = key.split(".")[0]
        if index + 1 == len(keys) or keys[index + 1].split(".")[0] != top:
            ordered.update({name: value for name, value in derived.items() if name.split(".")[0] == top})
    ordered.update({name: value for name, value in derived.items() if name not in ordered})
    return ordered


# ------------------------------------------------------------------------------------------------ per request

PER_REQUEST = "per_request"


def request_count(data: Mapping[str, Any]) -> int | None:
    """Requests the profile covers: per_adapter's requests summed (kvforge counts every request there), else the
    context cache's admitted sequences; None when the profile has neither."""
    counts = [get(entry, "requests") for entry in per_adapter(data).values()]
    if counts and all(count is not None for count in counts):
        return int(sum(counts))  # type: ignore[arg-type]
    admitted = get(section(data, schema.CONTEXT_CACHE), schema.ADMITTED_SEQUENCES)
    return None if admitted is None else int(admitted)


def stage_total_ms(data: Mapping[str, Any], stage_ids: tuple[str, ...] | None = None) -> float | None:
    """The summed wall time of the stages named (all of them when None); None when one named is missing."""
    stages = stages_by_id(data)
    chosen = list(stages) if stage_ids is None else list(stage_ids)
    if not chosen or any(stage_id not in stages for stage_id in chosen):
        return None
    return total(*(get(stages[stage_id], "total_gpu_time_ms") for stage_id in chosen))


def stage_spread_ms(data: Mapping[str, Any], stage_ids: tuple[str, ...] | None = None) -> float | None:
    """One standard error of `stage_total_ms` from the calls' own spread: sqrt(Σ count · stddev²). A single run's
    estimate of how much its total would move on a rerun (None without stddev_ms and count)."""
    stages = stages_by_id(data)
    chosen = list(stages) if stage_ids is None else list(stage_ids)
    variance = 0.0
    for stage_id in chosen:
        count, stddev = stage_stat(stages.get(stage_id), "count"), stage_stat(stages.get(stage_id), "stddev_ms")
        if count is None or stddev is None:
            return None
        variance += count * stddev * stddev
    return math.sqrt(variance) if chosen else None


# The per-request figures `compare` leads with: (key, stages timed or None for every stage, label). Prefill time
# per request is what a request waits for its first token on an idle engine (TTFT without queueing); comparing
# it, not the mean time per llm_prefill call, keeps reuse (fewer computed tokens, often fewer but longer calls)
# from reading as slower.
PER_REQUEST_TIMES = (
    ("ttft_ms", (schema.PREFILL_STAGE,), "TTFT ms (prefill time per request)"),
    ("decode_ms", (schema.GENERATION_STAGE,), "decode ms per request"),
    ("engine_ms", None, "engine ms per request (all stages)"),
)


def per_request(data: Mapping[str, Any]) -> dict[str, float]:
    """`per_request.*`: the stage times and prompt tokens of one request on average (empty without a request
    count)."""
    requests = request_count(data)
    if not requests:
        return {}
    prefill = section(data, schema.PREFILL)
    values = {f"{PER_REQUEST}.requests": float(requests)}
    for key, stage_ids, _ in PER_REQUEST_TIMES:
        values[f"{PER_REQUEST}.{key}"] = ratio(stage_total_ms(data, stage_ids), requests)  # type: ignore[assignment]
    for key in ("computed_tokens", "reused_tokens"):
        values[f"{PER_REQUEST}.{key}"] = ratio(get(prefill, key), requests)  # type: ignore[assignment]
    return {key: value for key, value in values.items() if value is not None}


def per_request_spread_ms(data: Mapping[str, Any], key: str) -> float | None:
    """One standard error of the per-request time `key` (a PER_REQUEST_TIMES key)."""
    stage_ids = next(ids for name, ids, _ in PER_REQUEST_TIMES if name == key)
    return ratio(stage_spread_ms(data, stage_ids), request_count(data))
