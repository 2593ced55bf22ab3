"""llm_profile --plot: stage times, prefill reuse and context-cache sequences of one or two profiles as a chart."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvforge.contract import profile_schema as schema
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import atomic_output
from kvforge.tools.profile.metrics import (
    fmt_pct,
    get,
    hit_rate,
    request_count,
    reuse_ratio,
    section,
    stage_spread_ms,
    stage_total_ms,
    stages_by_id,
)


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
    return get(section(data, schema.CONTEXT_CACHE), schema.ADMITTED_SEQUENCES) is not None


def _label_bars(ax: Any, bars: Any, values: Sequence[float], fmt_value: str = "{:,.2f}") -> None:
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(fmt_value.format(value), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=8)


def plot_profile(profiles: Sequence[tuple[str, Mapping[str, Any]]], out: Path) -> Path:
    """Draw stage times per request (grouped bars per profile) and, when present, the reuse counters; write `out`.

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
            # Time per request, not per call: reuse computes fewer tokens, often in fewer calls of another length,
            # so a mean per call can grow while every request gets faster. Whiskers: twice the standard error
            # from the run's own call spread (what a rerun of a single run may move by).
            positions = range(len(stage_ids))
            requests = [request_count(data) for _, data in profiles]
            per_request = all(requests)
            for index, (label, data) in enumerate(profiles):
                divisor = requests[index] if per_request else 1
                times = [stage_total_ms(data, (stage_id,)) for stage_id in stage_ids]
                spreads = [stage_spread_ms(data, (stage_id,)) for stage_id in stage_ids]
                present = [(p, time / divisor, 2 * (spread or 0.0) / divisor)  # type: ignore[operator]
                           for p, time, spread in zip(positions, times, spreads, strict=True) if time is not None]
                offsets = [p + (index - (len(profiles) - 1) / 2) * bar_width for p, _, _ in present]
                values = [value for _, value, _ in present]
                bars = ax.bar(offsets, values, bar_width, yerr=[error for _, _, error in present], capsize=3,
                              error_kw={"elinewidth": 0.8, "alpha": 0.6}, color=colors[index % len(colors)],
                              label=f"{label} ({requests[index]} requests)" if per_request else label)
                _label_bars(ax, bars, values, "{:,.2f}")
            ax.set_xticks(list(positions), stage_ids, rotation=20 if len(stage_ids) > 3 else 0, ha="center")
            ax.set_ylabel("time per request (ms)" if per_request else "total time (ms)")
            ax.set_title(("Stage time per request" if per_request else "Stage total time (no request count)")
                         + "; whiskers ±2 SE", fontsize=10)
            ax.margins(y=0.15)
            ax.set_ylim(bottom=0)
            if len(profiles) > 1:
                ax.legend(fontsize=8)
        elif panel == "tokens":
            names = [label for label, _ in profiles]
            reused = [get(section(data, schema.PREFILL), "reused_tokens") or 0 for _, data in profiles]
            computed = [get(section(data, schema.PREFILL), "computed_tokens") or 0 for _, data in profiles]
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
                cache = section(data, schema.CONTEXT_CACHE)
                values = [get(cache, key) or 0 for key in keys]
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
