"""From the engines' traces to figures: medians per role, ratios to the baseline engine, tables, JSON and a plot."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from kvforge.contract.errors import KvforgeError
from kvforge.contract.speculation import SPEC_NGRAM
from kvforge.tools.bench.text import SPEC_KINDS
from kvforge.tools.bench.workloads import DECODE_CONTEXT, DOCUMENT_ROLES, SPEC_ROLES

Trace = dict[str, Any]  # worker.Trace as JSON


@dataclass(frozen=True, slots=True)
class Metric:
    key: str
    name: str
    unit: str
    higher_is_better: bool
    measure: Callable[[dict[str, list[Trace]], dict[str, Any]], float | None]  # (traces by role, result) → value


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _ttft(*roles: str) -> Callable[[dict[str, list[Trace]], dict[str, Any]], float | None]:
    return lambda by_role, _result: _median([t["ttft_ms"] for role in roles for t in by_role.get(role, [])])


def _end_to_end(*roles: str) -> Callable[[dict[str, list[Trace]], dict[str, Any]], float | None]:
    """Request to last token (TTFT plus decode): what a user waits for a whole answer of --maxTokens tokens."""
    return lambda by_role, _result: _median([t["ttft_ms"] + t["decode_ms"] for role in roles
                                             for t in by_role.get(role, [])])


def _cold_prefill(by_role: dict[str, list[Trace]], _result: dict[str, Any]) -> float | None:
    return _median([t["prompt_tokens"] / (t["ttft_ms"] / 1e3) for t in by_role.get("cold", [])])


def _rates(traces: list[Trace]) -> list[float]:
    """Decode tokens/s of each trace: every token after the first over the time from the first to the last."""
    return [(t["tokens"] - 1) / (t["decode_ms"] / 1e3) for t in traces if t["tokens"] > 1 and t["decode_ms"] > 0]


def _decode(by_role: dict[str, list[Trace]], _result: dict[str, Any]) -> float | None:
    """Decode tokens/s of the document requests (every token after the first, at ~--promptTokens of context), or
    of every request when no document workload ran (decode_context's points have a table of their own)."""
    roles = [role for role in DOCUMENT_ROLES if role in by_role] or \
        [r for r in by_role if r != DECODE_CONTEXT and r not in SPEC_ROLES]
    return _median(_rates([t for role in roles for t in by_role[role]]))


def _peak_rss(_by_role: dict[str, list[Trace]], result: dict[str, Any]) -> float | None:
    return result["peak_rss_bytes"] / 2**20


METRICS = [
    Metric("cold_ttft_ms", "cold TTFT", "ms", False, _ttft("cold")),
    Metric("cold_prefill_tok_s", "cold prefill", "tok/s", True, _cold_prefill),
    Metric("warm_ttft_ms", "warm TTFT", "ms", False, _ttft("warm")),
    Metric("warm_next_ttft_ms", "warm TTFT right after", "ms", False, _ttft("warm_next")),
    Metric("warm_e2e_ms", "warm end to end", "ms", False, _end_to_end("warm")),
    Metric("warm_next_e2e_ms", "warm end to end right after", "ms", False, _end_to_end("warm_next")),
    Metric("decode_tok_s", "decode", "tok/s", True, _decode),
    Metric("unrelated_ttft_ms", "unrelated TTFT", "ms", False, _ttft("unrelated")),
    Metric("chat_ttft_ms", "chat TTFT", "ms", False, _ttft("chat")),
    Metric("file_ttft_ms", "file TTFT", "ms", False, _ttft("file")),
    Metric("peak_rss_mb", "peak RSS", "MiB", False, _peak_rss),
]
LEGEND = {
    "cold_ttft_ms": "document + first question, nothing cached: time to the first token",
    "cold_prefill_tok_s": "prompt tokens / cold TTFT",
    "warm_ttft_ms": "a new question on the document after an unrelated prompt (non-consecutive requests)",
    "warm_next_ttft_ms": "a new question on the document right after the previous one (llama.cpp's best case)",
    "warm_e2e_ms": "that warm question from the request to its last token (--maxTokens generated)",
    "warm_next_e2e_ms": "the question right after the previous one, request to last token",
    "decode_tok_s": "(tokens - 1) / (last token - first token) of the document requests (of every request "
                    "but decode_context's and spec_decode's when no document workload ran)",
    "unrelated_ttft_ms": "prompts sharing no prefix with anything before them",
    "chat_ttft_ms": "chat turns 2 and later (the whole history plus one message)",
    "file_ttft_ms": "the requests of --inputFile",
    "peak_rss_mb": "the engine's process at its peak (VmHWM), loading included",
}


def by_role(result: dict[str, Any]) -> dict[str, list[Trace]]:
    grouped: dict[str, list[Trace]] = {}
    for passes in result["workloads"].values():
        for traces in passes:
            for trace in traces:
                grouped.setdefault(trace["role"], []).append(trace)
    return grouped


def engine_metrics(result: dict[str, Any]) -> dict[str, float | None]:
    grouped = by_role(result)
    return {m.key: m.measure(grouped, result) for m in METRICS}


def workload_summary(result: dict[str, Any]) -> dict[str, dict[str, float | int | None]]:
    """Per workload: the median pass (all its requests, TTFT + decode) in seconds and the median TTFT."""
    summary = {}
    for name, passes in result["workloads"].items():
        seconds = [sum(t["ttft_ms"] + t["decode_ms"] for t in traces) / 1e3 for traces in passes]
        cached = [t["cached_tokens"] for t in passes[0]] if passes else []
        summary[name] = {"pass_s": _median(seconds),
                         "ttft_ms": _median([t["ttft_ms"] for traces in passes for t in traces]),
                         "cached_tokens": None if any(c is None for c in cached) else sum(cached)}
    return summary


def ratios(metrics: dict[str, float | None], base: dict[str, float | None] | None) -> dict[str, float | None]:
    """metric / the baseline's metric (None where either is missing)."""
    if base is None:
        return {key: None for key in metrics}
    return {key: value / base[key] if value is not None and base.get(key) else None for key, value in metrics.items()}


def shown_metrics(engines: list[dict[str, Any]]) -> list[Metric]:
    """The metrics some engine has a value for (the selected workloads decide which)."""
    ok = [e for e in engines if e["status"] == "ok"]
    return [m for m in METRICS if any(e["metrics"].get(m.key) is not None for e in ok)]


def _figure(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.1f}"


def figures_table(engines: list[dict[str, Any]], baseline: str | None) -> Table:
    metrics = shown_metrics(engines)
    table = Table(title="llm_bench: medians per engine", title_justify="left")
    table.add_column("engine")
    table.add_column("kind")
    for metric in metrics:
        table.add_column(f"{metric.name} {metric.unit}", justify="right")
    for engine in engines:
        if engine["status"] != "ok":
            continue
        name = engine["name"] + (" (baseline)" if engine["name"] == baseline else "")
        table.add_row(name, engine["kind"], *(_figure(engine["metrics"].get(m.key)) for m in metrics))
    return table


def ratios_table(engines: list[dict[str, Any]], baseline: str) -> Table:
    metrics = shown_metrics(engines)
    table = Table(title=f"ratios to {baseline} (engine / baseline; ↑ higher is better, ↓ lower is better)",
                  title_justify="left")
    table.add_column("engine")
    for metric in metrics:
        table.add_column(f"{metric.name} {'↑' if metric.higher_is_better else '↓'}", justify="right")
    for engine in engines:
        if engine["status"] != "ok":
            continue
        table.add_row(engine["name"], *(f"{r:.3g}×" if (r := engine["ratios"].get(m.key)) is not None else "—"
                                        for m in metrics))
    return table


def workloads_table(engines: list[dict[str, Any]]) -> Table:
    ok = [e for e in engines if e["status"] == "ok"]
    names = list(ok[0]["workloads"]) if ok else []
    table = Table(title="per workload: median seconds per pass (TTFT + decode of every request) / median TTFT ms",
                  title_justify="left")
    table.add_column("engine")
    for name in names:
        table.add_column(name, justify="right")
    for engine in ok:
        cells = []
        for name in names:
            row = engine["workload_summary"][name]
            cached = f", {row['cached_tokens']} cached" if row["cached_tokens"] else ""
            cells.append(f"{_figure(row['pass_s'])} s / {_figure(row['ttft_ms'])} ms{cached}")
        table.add_row(engine["name"], *cells)
    return table


# --- decode_context: decode tok/s per context length --------------------------------------------------------

FLATNESS_UP_TO = 1536  # issue 19: decode after 1,536 tokens of context should be >= 0.8x decode after 64
FLATNESS_TARGET = 0.8


def context_points(workloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decode_context requests of the run (label, prompt_tokens), shortest first; [] when it did not run."""
    for workload in workloads:
        if workload["name"] == DECODE_CONTEXT:
            return sorted(workload["requests"], key=lambda r: r["prompt_tokens"])
    return []


def decode_context(result: dict[str, Any], points: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's median decode tok/s after each context length (keys: the context, as a string), the points it
    skipped with their reasons, and its flatness: decode after the longest point <= FLATNESS_UP_TO over decode
    after the shortest point."""
    traces = [t for passes in result["workloads"].get(DECODE_CONTEXT, []) for t in passes]
    reasons = result.get("skipped_points", {})
    tok_s = {str(p["prompt_tokens"]): _median(_rates([t for t in traces if t["label"] == p["label"]]))
             for p in points}
    skipped = {str(p["prompt_tokens"]): reasons[p["label"]] for p in points if p["label"] in reasons}
    return {"tok_s": tok_s, "skipped": skipped, "flatness": flatness(tok_s)}


def flatness(tok_s: dict[str, float | None]) -> dict[str, Any]:
    contexts = sorted(int(n) for n in tok_s)
    longest = [n for n in contexts if n <= FLATNESS_UP_TO]
    start, end = (contexts[0], longest[-1]) if len(longest) > 1 else (None, None)
    first, last = (tok_s[str(start)], tok_s[str(end)]) if start is not None else (None, None)
    ratio = last / first if first and last is not None else None
    return {"from": start, "to": end, "ratio": ratio, "target": FLATNESS_TARGET,
            "met": None if ratio is None else ratio >= FLATNESS_TARGET}


def context_ratios(mine: dict[str, Any], base: dict[str, Any] | None) -> dict[str, float | None]:
    """Decode tok/s after each context over the baseline's after the same context (None where either is missing)."""
    theirs = base["tok_s"] if base else {}
    return {n: value / theirs[n] if value is not None and theirs.get(n) else None
            for n, value in mine["tok_s"].items()}


CONTEXT_LEGEND = (
    "decode tok/s: (tokens - 1) / (last - first token) after a prompt of N tokens, nothing cached",
    f"flatness: decode after the longest point ≤ {FLATNESS_UP_TO:,} / decode after the shortest "
    f"(target ≥ {FLATNESS_TARGET})",
    "vs: decode tok/s / the baseline's after the same N tokens",
)


def _context_engines(engines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in engines if e["status"] == "ok" and "decode_context" in e]


def decode_context_table(engines: list[dict[str, Any]], points: list[dict[str, Any]]) -> Table:
    contexts = [str(p["prompt_tokens"]) for p in points]
    table = Table(title="decode tok/s after N tokens of context ↑", title_justify="left")
    table.add_column("engine")
    for n in contexts:
        table.add_column(f"{int(n):,}", justify="right")
    table.add_column("flatness", justify="right")
    for engine in _context_engines(engines):
        figures = engine["decode_context"]
        cells = ["skipped" if n in figures["skipped"] else _figure(figures["tok_s"][n]) for n in contexts]
        table.add_row(engine["name"], *cells, _flatness_cell(figures["flatness"]))
    return table


def _flatness_cell(figure: dict[str, Any]) -> str:
    if figure["ratio"] is None:
        return "—"
    verdict = "met" if figure["met"] else "missed"
    return f"{figure['ratio']:.2f}× ({figure['to']:,}/{figure['from']:,}, {verdict})"


def context_ratios_table(engines: list[dict[str, Any]], points: list[dict[str, Any]], baseline: str) -> Table:
    contexts = [str(p["prompt_tokens"]) for p in points]
    table = Table(title=f"decode vs {baseline} per context ↑", title_justify="left")
    table.add_column("engine")
    for n in contexts:
        table.add_column(f"{int(n):,}", justify="right")
    for engine in _context_engines(engines):
        ratios_now = engine["decode_context"]["ratios"]
        table.add_row(engine["name"], *(f"{r:.3g}×" if (r := ratios_now.get(n)) is not None else "—"
                                        for n in contexts))
    return table


# --- spec_decode: speculative engines against the plain ones -------------------------------------------------

# Issue 21's targets for prompt lookup (kvforge speculative engines): on the document workloads, decode >= 1.5x the
# same engine without speculation and >= 2x llama.cpp without it; on unrelated chat, at most 5% slower than plain.
SPEC_TARGETS = {
    "spec_quote": {"vs_kvforge_plain": 1.5, "vs_llama_cpp_plain": 2.0},
    "spec_summary": {"vs_kvforge_plain": 1.5, "vs_llama_cpp_plain": 2.0},
    "spec_chat": {"vs_kvforge_plain": 0.95},
}
SPEC_LEGEND = (
    "decode tok/s: (tokens - 1) / (last - first token), median over the prompts of the kind and the repeats",
    "vs kvforge plain: / the kvforge engine on the same engine dir without spec= (else the first plain kvforge "
    "engine); vs llama.cpp plain: / the first llama.cpp engine without spec=",
    "accept len: tokens committed per verify row (kept drafts + 1); accept rate: drafts kept / drafts verified "
    "(llama.cpp's counted by llm_bench from its draft calls)",
    "same tokens: the greedy tokens equal those of the same engine without spec= on every request",
    "targets (kvforge speculative engines): quotes and summary ≥ 1.5× kvforge plain and ≥ 2× llama.cpp plain; "
    "unrelated chat ≥ 0.95× kvforge plain (speculation costs at most 5%)",
)


def _speculative(engine: dict[str, Any]) -> bool:
    return engine.get("spec", {}).get("spec_decode", "off") != "off"


def _plain_counterpart(engine: dict[str, Any], ok: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The engine of the same kind and the same engine dir / model file without speculation (the same reuse
    setting preferred); None when the run has none."""
    same = [e for e in ok if e["kind"] == engine["kind"] and not _speculative(e)
            and e["spec"].get("path") == engine["spec"].get("path")]
    same.sort(key=lambda e: e["spec"].get("reuse") != engine["spec"].get("reuse"))
    return same[0] if same else None


def _spec_traces(engine: dict[str, Any]) -> dict[str, list[Trace]]:
    passes = engine["workloads"].get("spec_decode", [])
    return {role: [t for p in passes for t in p if t["role"] == role] for role in SPEC_ROLES}


def spec_decode(engines: list[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """Per engine that ran spec_decode, per kind of prompt (SPEC_ROLES): decode tok/s, its ratios to kvforge
    plain and to llama.cpp plain, the acceptance figures (speculative engines), whether its tokens equal its plain
    counterpart's, and the targets (kvforge speculative engines). None when spec_decode did not run."""
    ok = [e for e in engines if e["status"] == "ok" and "spec_decode" in e["workloads"]]
    if not ok:
        return None
    rates = {e["name"]: {role: _median(_rates(traces)) for role, traces in _spec_traces(e).items()} for e in ok}
    first_kvforge = next((e for e in ok if e["kind"] == "kvforge" and not _speculative(e)), None)
    llama_plain = next((e for e in ok if e["kind"] == "llama.cpp" and not _speculative(e)), None)
    figures: dict[str, dict[str, Any]] = {}
    for engine in ok:
        counterpart = _plain_counterpart(engine, ok) if _speculative(engine) else None
        kvforge_plain = counterpart if engine["kind"] == "kvforge" and counterpart else first_kvforge
        traces = _spec_traces(engine)
        kinds = {}
        for role in SPEC_ROLES:
            rate = rates[engine["name"]][role]
            row: dict[str, Any] = {
                "decode_tok_s": rate,
                "vs_kvforge_plain": _ratio(rate, rates[kvforge_plain["name"]][role] if kvforge_plain else None),
                "vs_llama_cpp_plain": _ratio(rate, rates[llama_plain["name"]][role] if llama_plain else None),
                "kvforge_plain": kvforge_plain["name"] if kvforge_plain else None,
                "llama_cpp_plain": llama_plain["name"] if llama_plain else None,
            }
            if _speculative(engine):
                row.update(acceptance(traces[role]))
                row["plain"] = counterpart["name"] if counterpart else None
                row["same_tokens"] = _same_tokens(engine, counterpart, role) if counterpart else None
            if _speculative(engine) and engine["kind"] == "kvforge":
                row["targets"] = {key: {"target": target, "met": None if row[key] is None else row[key] >= target}
                                  for key, target in SPEC_TARGETS[role].items()}
            kinds[role] = row
        figures[engine["name"]] = kinds
    return figures


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def acceptance(traces: list[Trace]) -> dict[str, Any]:
    """Acceptance over the requests' speculation counters, pooled: acceptance length = committed tokens / verify
    rows, acceptance rate = accepted / draft tokens (None where no row verified drafts)."""
    totals = {key: sum((t.get("spec") or {}).get(key, 0) for t in traces)
              for key in ("verify_rows", "draft_tokens", "accepted_tokens", "committed_tokens")}
    return {**totals,
            "acceptance_length": _ratio(totals["committed_tokens"], totals["verify_rows"]),
            "acceptance_rate": _ratio(totals["accepted_tokens"], totals["draft_tokens"])}


def _same_tokens(engine: dict[str, Any], plain: dict[str, Any], role: str) -> bool:
    mine, theirs = _spec_traces(engine)[role], _spec_traces(plain)[role]
    return len(mine) == len(theirs) and all(a["token_ids"] == b["token_ids"] for a, b in zip(mine, theirs,
                                                                                            strict=True))


def _times(value: float | None) -> str:
    return f"{value:.2f}×" if value is not None else "—"


def _targets_cell(row: dict[str, Any]) -> str:
    names = {"vs_kvforge_plain": "kvforge plain", "vs_llama_cpp_plain": "llama.cpp plain"}
    cells = []
    for key, figure in row.get("targets", {}).items():
        verdict = f"no {names[key]}" if figure["met"] is None else "met" if figure["met"] else "missed"
        cells.append(f"≥{figure['target']:g}× {names[key]}: {verdict}")
    return "; ".join(cells) or "—"


def spec_decode_table(engines: list[dict[str, Any]], figures: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="spec_decode: decode tok/s per kind of prompt, speculative engines against plain ones",
                  title_justify="left")
    for column in ("prompts", "engine", "spec", "decode tok/s", "vs kvforge plain", "vs llama.cpp plain",
                   "accept len", "accept rate", "same tokens", "targets"):
        table.add_column(column, justify="left" if column in ("prompts", "engine", "spec", "targets") else "right")
    by_name = {e["name"]: e for e in engines}
    for index, role in enumerate(SPEC_ROLES):
        for name, kinds in figures.items():
            row, spec = kinds[role], by_name[name]["spec"]
            method, settings = spec.get("spec_decode", "off"), by_name[name].get("spec_settings")
            if method != "off" and settings:  # what the engine ran with (its defaults where the spec gave none)
                high, low = settings["ngram_sizes"]
                method += f" k={settings['draft_step']}" + (
                    f", top-{settings['draft_top_k']} tree" if settings.get("draft_top_k", 1) > 1 else "")
                method += f", n={high}..{low}" if method.startswith(SPEC_NGRAM) else ""
            length, rate = row.get("acceptance_length"), row.get("acceptance_rate")
            same = row.get("same_tokens")
            table.add_row(SPEC_KINDS[role], name, method, _figure(row["decode_tok_s"]),
                          _times(row["vs_kvforge_plain"]), _times(row["vs_llama_cpp_plain"]),
                          f"{length:.2f}" if length is not None else "—", f"{rate:.2f}" if rate is not None else "—",
                          "—" if same is None else "yes" if same else "no", _targets_cell(row),
                          end_section=index < len(SPEC_ROLES) - 1 and name == list(figures)[-1])
    return table


def context_plot_path(path: Path) -> Path:
    """The decode_context chart is written next to --plot's: bench.png → bench-decode-context.png."""
    return path.with_name(f"{path.stem}-decode-context{path.suffix}")


def plot_decode_context(engines: list[dict[str, Any]], baseline: str | None, path: Path) -> None:
    """Decode tok/s against context tokens (log x), a line per engine, the baseline dashed; skipped points left out."""
    plt = _pyplot()
    figure, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, engine in enumerate(_context_engines(engines)):
        points = sorted((int(n), v) for n, v in engine["decode_context"]["tok_s"].items() if v is not None)
        if points:
            ax.plot([n for n, _ in points], [v for _, v in points], marker="o", color=f"C{index}",
                    linestyle="--" if engine["name"] == baseline else "-",
                    label=engine["name"] + (" (baseline)" if engine["name"] == baseline else ""))
    ax.set_xscale("log")
    contexts = sorted({int(n) for e in _context_engines(engines) for n in e["decode_context"]["tok_s"]})
    ax.set_xticks(contexts, [f"{n:,}" for n in contexts], fontsize=8)
    ax.minorticks_off()
    ax.set_ylim(bottom=0)  # from zero, so a line's drop reads as the fraction of speed lost
    ax.set_xlabel("context tokens before decoding")
    ax.set_ylabel("decode tok/s (higher is better)")
    ax.set_title("llm_bench decode_context: decode speed vs context", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=8)
    _save(plt, figure, path)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KvforgeError("needs matplotlib: pip install 'kvforge[plot]'", "plot") from None
    return plt


def _save(plt: Any, figure: Any, path: Path) -> None:
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except (OSError, ValueError) as exc:
        raise KvforgeError(f"cannot write {path}: {exc}", "plot") from None
    finally:
        plt.close(figure)


def plot(engines: list[dict[str, Any]], baseline: str | None, path: Path) -> None:
    """One bar chart per metric, an engine per bar, the baseline hatched."""
    plt = _pyplot()
    ok = [e for e in engines if e["status"] == "ok"]
    metrics = shown_metrics(engines)
    columns = min(3, len(metrics)) or 1
    rows = -(-len(metrics) // columns) or 1
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics, strict=False):
        names = [e["name"] for e in ok]
        values = [e["metrics"].get(metric.key) or 0.0 for e in ok]
        bars = ax.bar(range(len(names)), values, color=[f"C{i}" for i in range(len(names))])
        for bar, engine in zip(bars, ok, strict=True):
            if engine["name"] == baseline:
                bar.set_hatch("//")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        better = "higher" if metric.higher_is_better else "lower"
        ax.set_title(f"{metric.name} {metric.unit} ({better} is better)", fontsize=9)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    _save(plt, figure, path)
