"""llm_profile: summarize one llm_inference profile JSON or compare two, optionally as a PNG chart."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from kvforge.cli_common import console, run_app, run_guarded
from kvforge.contract.files import check_distinct, check_output_file
from kvforge.contract.validation import printable
from kvforge.tools.profile.compare import (
    PER_REQUEST_LABELS,
    compare_rows,
    compare_table,
    group_keys,
    only_in,
    per_request_rows,
)
from kvforge.tools.profile.load import load_profile
from kvforge.tools.profile.plot import plot_profile
from kvforge.tools.profile.tables import summary_tables

# The tables go to stdout (pipe them to a file); status lines and errors go to stderr via `console`.
# A pipe gets 160 columns rather than rich's 80 so the compare table's dotted keys fit on one line.
out = Console(highlight=False, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)

APP_HELP = """
Read the profile JSON written by [bold]llm_inference --profileOutputFile[/]: a summary of one \
profile, or a comparison of two. [bold]llm_profile PROFILE.json[/] is short for \
[bold]llm_profile show PROFILE.json[/].

[bold]Examples[/]

  llm_profile profile.json
  llm_profile show profile.json --plot profile.png
  llm_profile compare cold.json warm.json --plot cold_vs_warm.png
"""
SHOW_HELP = """
Summarize one profile: prefill (reused vs computed tokens, reuse ratio, tok/s, TTFT-ish latency of \
the llm_prefill calls), generation (tok/s, ms/token), a stage table, peak memory and, when present, \
the context_cache counters, resource pools and per-adapter reuse. Only what applies is shown: missing \
sections, and the blocks of features the engine did not use (documents, sliding window, adapter corrections, \
speculation, snapshots: all zero with no pool capacity), are left out.

[bold]Examples[/]

  llm_profile show profile.json
  llm_profile profile.json --plot profile.png
"""
COMPARE_HELP = """
Compare two profiles. First what one request cost in each (TTFT as prefill time per request, decode and \
engine time, prompt tokens computed and reused, reuse ratio, hit rate), then every numeric field present in \
both (dotted keys such as prefill.tokens_per_second, context_cache.reused_tokens, stages.llm_prefill.mean_ms) \
with A, B, B−A and B/A. A profile run without reuse counts as reusing nothing. Changes of at least \
--threshold percent are marked better / worse (by the field's meaning) or changed; a timing change smaller \
than twice its standard error (from the calls' spread) is marked within noise, and per-call times of a stage \
that ran a different number of calls are marked per call.

[bold]Examples[/]

  llm_profile compare cold.json warm.json
  llm_profile compare cold.json warm.json --changedOnly --threshold 5 --plot cold_vs_warm.png
"""
NOISE_NOTE = ("≈ noise: a change smaller than twice its standard error, estimated from each run's own "
              "call-to-call spread. A and B are single runs: rerun both (or use llm_bench --repeats) before "
              "trusting it.")
PER_CALL_NOTE = ("● per call: the stage ran a different number of calls in A and B, so a time per call compares "
                 "nothing; read the per-request table.")
PLOT_HELP = "Also write a chart (PNG, or any format matplotlib knows from the suffix); needs kvforge\\[plot]."
COMMANDS = ("show", "compare")

app = typer.Typer(add_completion=False, rich_markup_mode="rich", help=APP_HELP)


@app.command(help=SHOW_HELP, short_help="Summarize one profile (the default command).")
def show(
    profile: Path = typer.Argument(..., metavar="PROFILE.json", help="Profile JSON from llm_inference."),
    plot: Path | None = typer.Option(None, "--plot", help=PLOT_HELP),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    """Print the summary tables of one profile."""

    def body() -> None:
        _check_plot(plot, profile)
        data = load_profile(profile)
        out.print(f"[bold]profile:[/] {escape(printable(str(profile)))}")
        for table in summary_tables(data):
            out.print()
            out.print(table)
        if plot is not None:
            plot_profile([(profile.name, data)], plot)
            console.print(f"plot written to {escape(str(plot))}")

    run_guarded(body, debug)


@app.command(help=COMPARE_HELP, short_help="Compare two profiles field by field: A, B, B−A, B/A.")
def compare(
    profile_a: Path = typer.Argument(..., metavar="A.json", help="Baseline profile."),
    profile_b: Path = typer.Argument(..., metavar="B.json", help="Profile compared with the baseline."),
    plot: Path | None = typer.Option(None, "--plot", help=PLOT_HELP),
    threshold: float = typer.Option(10.0, "--threshold", min=0.0,
                                    help="Percent change (|B/A − 1|) from which a field is marked."),
    changed_only: bool = typer.Option(False, "--changedOnly", help="List only the marked fields."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    """Print A vs B for every numeric field the two profiles share."""

    def body() -> None:
        _check_plot(plot, profile_a, profile_b)
        data_a, data_b = load_profile(profile_a), load_profile(profile_b)
        label_a, label_b = printable(profile_a.name), printable(profile_b.name)
        if label_a == label_b:
            label_a, label_b = printable(str(profile_a)), printable(str(profile_b))
        headline = per_request_rows(data_a, data_b, threshold / 100.0)
        if headline:  # what a request cost: the comparison a cold/warm or before/after run is about
            out.print(compare_table(headline, label_a, label_b, title=f"Per request   A = {label_a}   B = {label_b}",
                                    labels=PER_REQUEST_LABELS))
            out.print()
        else:
            out.print("no per-request figures: a profile counts no requests (no per_adapter or context_cache block)")
        rows = compare_rows(data_a, data_b, threshold / 100.0)
        out.print(compare_table(rows, label_a, label_b, changed_only))
        marked = sum(row.notable for row in rows)
        out.print(f"{len(rows)} shared fields, {marked} changed by ≥ {threshold:g} %")
        for name, keys in zip((f"A ({label_a})", f"B ({label_b})"), only_in(data_a, data_b), strict=True):
            if keys:
                out.print(f"only in {name}: {group_keys(keys)}")
        verdicts = {row.verdict for row in (*headline, *rows)}
        if "noise" in verdicts:
            out.print(NOISE_NOTE)
        if "per call" in verdicts:
            out.print(PER_CALL_NOTE)
        if plot is not None:
            plot_profile([(f"A: {label_a}", data_a), (f"B: {label_b}", data_b)], plot)
            console.print(f"plot written to {escape(str(plot))}")

    run_guarded(body, debug)


def _check_plot(plot: Path | None, *profiles: Path) -> None:
    """--plot is written atomically, and never over an input profile."""
    if plot is not None:
        check_output_file(plot, "--plot")
        check_distinct({"--plot": plot}, {f"PROFILE {i + 1}": p for i, p in enumerate(profiles)})


def _default_to_show(argv: list[str]) -> list[str]:
    """`llm_profile PROFILE.json ...` → `llm_profile show PROFILE.json ...` (a click group needs a command name);
    no arguments at all → the overview help."""
    if not argv:
        return ["--help"]
    if argv[0] not in COMMANDS and argv[0] not in ("--help", "--version"):
        return ["show", *argv]
    return argv


def main() -> None:
    sys.argv[1:] = _default_to_show(sys.argv[1:])
    run_app(app)
