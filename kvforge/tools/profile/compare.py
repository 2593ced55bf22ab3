"""llm_profile compare: two profiles' numbers side by side, B−A and B/A, with a verdict where a change is large."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.markup import escape
from rich.table import Table

from kvforge.contract import profile_schema as schema
from kvforge.tools.profile.metrics import MISSING, metrics

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
