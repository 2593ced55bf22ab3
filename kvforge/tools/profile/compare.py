"""llm_profile compare: two profiles' numbers side by side, B−A and B/A, with a verdict where a change is large."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.markup import escape
from rich.table import Table

from kvforge.contract import profile_schema as schema
from kvforge.tools.profile.metrics import (
    MISSING,
    PER_REQUEST,
    PER_REQUEST_TIMES,
    get,
    metrics,
    per_request,
    per_request_spread_ms,
    section,
    stage_spread_ms,
    stage_stat,
    stage_total_ms,
    stages_by_id,
)

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
    # "better" / "worse" / "changed" for notable rows, "noise" for a notable timing change within twice its
    # standard error, "per call" for a per-call figure of a stage that ran a different number of calls; else ""
    verdict: str
    noise: float | None = None  # twice the standard error of B−A from the runs' own call spread, where known


CC = schema.CONTEXT_CACHE
# A profile without a context_cache section ran without reuse: it reused nothing, so these compare against 0
# rather than land in "only in B" (where reuse, the point of a cold/warm comparison, went unseen).
REUSE_COUNTERS = (f"{CC}.{schema.HIT_SEQUENCES}", f"{CC}.{schema.MATCHED_TOKENS}", f"{CC}.{schema.REUSED_TOKENS}",
                  f"{CC}.hit_rate")
# Figures of one call (or one engine step): when a stage ran a different number of calls in A and B they are not
# comparable (reuse computes fewer tokens, often in fewer calls of another length); the per-request table is.
_PER_CALL = ("mean_ms", "median_ms", "min_ms", "max_ms", "p95_ms", "p99_ms", "stddev_ms", "average_time_per_run_ms",
             "average_tokens_per_run")
_STAGE_OF_SECTION = {schema.PREFILL: schema.PREFILL_STAGE, schema.GENERATION: schema.GENERATION_STAGE}


def with_reuse_zeros(metrics_a: Mapping[str, float | int],
                     metrics_b: Mapping[str, float | int]) -> tuple[dict[str, float | int], dict[str, float | int]]:
    """Both metrics, the side without any context_cache field given 0 for the reuse counters the other has."""
    filled_a, filled_b = dict(metrics_a), dict(metrics_b)
    for mine, other in ((filled_a, filled_b), (filled_b, filled_a)):
        if not any(key.startswith(f"{CC}.") for key in mine):
            mine.update({key: 0 for key in REUSE_COUNTERS if key in other})
    return filled_a, filled_b


def _calls(data: Mapping[str, Any], stage_id: str) -> float | None:
    return stage_stat(stages_by_id(data).get(stage_id), "count")


def _stage_of(key: str) -> str | None:
    """The stage a key's timing comes from: stages.<id>.*, or prefill/generation's own stage."""
    parts = key.split(".")
    if parts[0] == schema.STAGES and len(parts) == 3:
        return parts[1]
    return _STAGE_OF_SECTION.get(parts[0]) if len(parts) == 2 else None


def noise(key: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> float | None:
    """Twice the standard error of B−A for a timing key, from each single run's own call-to-call spread (a
    difference below it is within the noise of one run); None for counts and where the spread is unknown."""
    leaf = key.rsplit(".", 1)[-1]
    if key.startswith(f"{PER_REQUEST}."):
        if leaf not in {name for name, _, _ in PER_REQUEST_TIMES}:
            return None
        spread_a, spread_b = per_request_spread_ms(a, leaf), per_request_spread_ms(b, leaf)
        return None if spread_a is None or spread_b is None else 2 * math.hypot(spread_a, spread_b)
    stage_id = _stage_of(key)
    if stage_id is None:
        return None
    stage_a, stage_b = stages_by_id(a).get(stage_id), stages_by_id(b).get(stage_id)
    n_a, n_b = stage_stat(stage_a, "count"), stage_stat(stage_b, "count")
    sd_a, sd_b = stage_stat(stage_a, "stddev_ms"), stage_stat(stage_b, "stddev_ms")
    if not n_a or not n_b or sd_a is None or sd_b is None:
        return None
    if leaf in ("mean_ms", "average_time_per_run_ms", "median_ms"):  # a mean of n calls: Welch's standard error
        return 2 * math.sqrt(sd_a * sd_a / n_a + sd_b * sd_b / n_b)
    if leaf == "total_gpu_time_ms":
        return 2 * math.hypot(stage_spread_ms(a, (stage_id,)) or 0.0, stage_spread_ms(b, (stage_id,)) or 0.0)
    if leaf in ("tokens_per_second", "average_time_per_token_ms"):  # a rate over the stage's total: its relative error
        totals = stage_total_ms(a, (stage_id,)), stage_total_ms(b, (stage_id,))
        value_a, value_b = get(section(a, key.split(".")[0]), leaf), get(section(b, key.split(".")[0]), leaf)
        if not totals[0] or not totals[1] or value_a is None or value_b is None:
            return None
        relative = math.hypot(math.sqrt(n_a) * sd_a / totals[0], math.sqrt(n_b) * sd_b / totals[1])
        return 2 * relative * (abs(value_a) + abs(value_b)) / 2
    return None


def _row(key: str, value_a: float | int, value_b: float | int, threshold: float, a: Mapping[str, Any],
         b: Mapping[str, Any]) -> CompareRow:
    diff = value_b - value_a
    ratio = (1.0 if value_b == 0 else None) if value_a == 0 else value_b / value_a
    notable = diff != 0 and (ratio is None or abs(ratio - 1.0) >= threshold)
    spread = noise(key, a, b)
    verdict = ""
    stage_id = _stage_of(key)
    if notable:
        sign = direction(key) * (1 if diff > 0 else -1)
        verdict = "better" if sign > 0 else "worse" if sign < 0 else "changed"
        if key.rsplit(".", 1)[-1] in _PER_CALL and stage_id and _calls(a, stage_id) != _calls(b, stage_id):
            verdict = "per call"
        elif spread is not None and abs(diff) <= spread and verdict in ("better", "worse"):
            verdict = "noise"
    return CompareRow(key, value_a, value_b, diff, ratio, notable, verdict, spread)


def compare_rows(a: Mapping[str, Any], b: Mapping[str, Any], threshold: float = 0.10) -> list[CompareRow]:
    """Numeric fields present in both profiles (metrics() keys, A's order) with B−A and B/A; the reuse counters
    of a profile run without reuse count as 0."""
    metrics_a, metrics_b = with_reuse_zeros(metrics(a), metrics(b))
    return [_row(key, value_a, metrics_b[key], threshold, a, b) for key, value_a in metrics_a.items()
            if key in metrics_b]


def per_request_rows(a: Mapping[str, Any], b: Mapping[str, Any], threshold: float = 0.10) -> list[CompareRow]:
    """What one request cost in A and in B (TTFT, decode and engine time, prompt tokens computed and reused) and
    the reuse ratio and hit rate: the figures a cold/warm comparison is about. Empty unless both count requests."""
    per_a, per_b = per_request(a), per_request(b)
    if not per_a or not per_b:
        return []
    metrics_a, metrics_b = with_reuse_zeros(metrics(a), metrics(b))
    per_a.update({key: metrics_a[key] for key in (f"{schema.PREFILL}.reuse_ratio", f"{CC}.hit_rate")
                  if key in metrics_a})
    per_b.update({key: metrics_b[key] for key in (f"{schema.PREFILL}.reuse_ratio", f"{CC}.hit_rate")
                  if key in metrics_b})
    return [_row(key, value_a, per_b[key], threshold, a, b) for key, value_a in per_a.items() if key in per_b]


PER_REQUEST_LABELS = {
    f"{PER_REQUEST}.requests": "requests",
    **{f"{PER_REQUEST}.{key}": label for key, _, label in PER_REQUEST_TIMES},
    f"{PER_REQUEST}.computed_tokens": "computed prompt tokens per request",
    f"{PER_REQUEST}.reused_tokens": "reused prompt tokens per request",
    f"{schema.PREFILL}.reuse_ratio": "reuse ratio (reused / prompt tokens)",
    f"{CC}.hit_rate": "hit rate (hit / admitted sequences)",
}


def only_in(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """metrics() keys found in only one of the profiles: (only in A, only in B)."""
    metrics_a, metrics_b = with_reuse_zeros(metrics(a), metrics(b))
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


_VERDICT_STYLE = {"better": "bold green", "worse": "bold red", "changed": "bold yellow", "noise": "dim",
                  "per call": "dim"}
NOTES = {"better": "▲ better", "worse": "▼ worse", "changed": "● changed", "noise": "≈ noise",
         "per call": "● per call"}


def compare_table(rows: Sequence[CompareRow], label_a: str, label_b: str, changed_only: bool = False,
                  title: str | None = None, labels: Mapping[str, str] | None = None) -> Table:
    """The `llm_profile compare` table; notable rows are coloured and carry a verdict."""
    table = Table(title=escape(title or f"A = {label_a}   B = {label_b}"), title_justify="left", title_style="bold")
    table.add_column("field", no_wrap=True)
    for column in ("A", "B", "B−A", "B/A"):
        table.add_column(column, justify="right")
    table.add_column("note", no_wrap=True)
    for row in rows:
        if changed_only and not row.notable:
            continue
        diff = _fmt_compare(row.diff)
        diff = diff if row.diff <= 0 else f"+{diff}"
        ratio = MISSING if row.ratio is None else f"{row.ratio:.3f}×"  # None: A is 0, B is not
        style = _VERDICT_STYLE.get(row.verdict)
        note = NOTES.get(row.verdict, "")
        label = (labels or {}).get(row.key, row.key)
        table.add_row(escape(label), _fmt_compare(row.a), _fmt_compare(row.b), diff, ratio, note, style=style)
    return table
