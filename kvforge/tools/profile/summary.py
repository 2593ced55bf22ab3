"""The few-line plain-text view of a profile that `llm_inference --dumpProfile` prints, read by metrics.py as
llm_profile's tables are, so the two views cannot disagree."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvforge.contract import profile_schema as schema
from kvforge.tools.profile.metrics import (
    fmt,
    fmt_pct,
    get,
    memory_mib,
    reuse_ratio,
    section,
    speculative_blocks,
    stage_rows,
    total,
)


def format_summary(data: Mapping[str, Any]) -> str:
    """Prefill, generation, speculation, stage times and memory in a few lines; "—" where a number is missing."""
    lines: list[str] = []
    prefill = section(data, schema.PREFILL)
    if prefill:
        reused, computed = get(prefill, "reused_tokens"), get(prefill, "computed_tokens")
        lines.append(f"prefill:    {fmt(get(prefill, 'total_runs'))} runs, {fmt(total(reused, computed))} tokens "
                     f"({fmt(reused)} reused, {fmt(computed)} computed; {fmt_pct(reuse_ratio(data))}), "
                     f"{fmt(get(prefill, 'tokens_per_second'), 1)} tok/s")
    generation = section(data, schema.GENERATION)
    if generation:
        lines.append(f"generation: {fmt(get(generation, 'total_runs'))} runs, "
                     f"{fmt(get(generation, 'generated_tokens'))} tokens, "
                     f"{fmt(get(generation, 'tokens_per_second'), 1)} tok/s, "
                     f"{fmt(get(generation, 'average_time_per_token_ms'))} ms/token")
    for _, block in speculative_blocks(data)[:1]:
        lines.append(f"speculation: acceptance {fmt_pct(get(block, 'average_acceptance_rate'))}, "
                     f"{fmt(get(block, 'acceptance_length'))} tokens per verify step")
    rows = stage_rows(data)
    if rows:
        width = max(len("stage"), *(len(row["stage_id"]) for row in rows))
        lines.append(f"{'stage':<{width}}  {'runs':>6}  {'mean ms':>10}  {'p95 ms':>10}")
        lines += [f"{row['stage_id']:<{width}}  {fmt(row['runs']):>6}  {fmt(row['mean_ms'], 3):>10}  "
                  f"{fmt(row['p95_ms'], 3):>10}" for row in rows]
    cpu = memory_mib(data, schema.PEAK_CPU_MEMORY)
    if cpu is not None:
        pool = memory_mib(data, schema.KV_POOL)
        lines.append(f"peak memory: {cpu:.1f} MiB CPU" + (f", KV pool {pool:.1f} MiB" if pool is not None else ""))
    cpu_block = (data.get("engine") or {}).get("cpu")
    if lines and cpu_block:
        from kvforge.plugins.cpu_kernel import describe_cpu
        lines.append(f"cpu: {describe_cpu(cpu_block)}")
    return "\n".join(lines) if lines else "profile: no data recorded"
