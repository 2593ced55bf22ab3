"""llm_test's outputs: a table for people, a JSON report, and JUnit XML for CI systems."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvforge import __version__
from kvforge.contract.files import atomic_write_text
from kvforge.tools.testcases.checks import FAILED, PASSED, SKIPPED
from kvforge.tools.testcases.execute import FileResult, summary_counts


def print_table(out: Console, results: list[FileResult], notes: list[str]) -> None:
    """One row per file, then one line per failed or skipped check (with its reason), then the totals."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for title in ("file", "status", "requests", "passed", "failed", "skipped", "TTFT ms", "reused tok", "run s"):
        table.add_column(title, justify="left" if title in ("file", "status") else "right", no_wrap=True)
    for r in results:
        ttft = "-" if r.ttft_ms is None else f"{r.ttft_ms:.1f}"
        reused = "-" if r.reused_tokens is None else str(r.reused_tokens)
        table.add_row(escape(r.case.name), r.status.upper(), str(len(r.case.requests.requests)),
                      str(r.count(PASSED)), str(r.count(FAILED)), str(r.count(SKIPPED)), ttft, reused,
                      f"{r.timing_s.get('run', 0.0):.2f}")
    out.print(table)
    for r in results:
        if r.error:
            out.print(f"ERROR {escape(r.error)}", soft_wrap=True)
        for check in r.checks:
            if check.status in (FAILED, SKIPPED):
                label = "FAIL" if check.status == FAILED else "SKIP"
                out.print(f"{label}  {escape(r.case.name)} {escape(check.name)}: {escape(check.reason)}",
                          soft_wrap=True)
    for note in notes:
        out.print(f"note: {escape(note)}", soft_wrap=True)
    totals = summary_counts(results)
    out.print(f"{totals['files']} files: {totals['passed']} checks passed, {totals['failed']} failed, "
              f"{totals['skipped']} skipped, {totals['errors']} files could not run")


def json_report(results: list[FileResult], run: dict[str, Any]) -> dict[str, Any]:
    """Everything the table shows and more: every check with its reason, timings, and the profile counters."""
    files = []
    for r in results:
        files.append({
            "file": str(r.case.path), "status": r.status, "error": r.error or None, "context_reuse": r.reuse,
            "requests": len(r.case.requests.requests),
            "checks": [{"name": c.name, "status": c.status, "reason": c.reason} for c in r.checks],
            "ttft_ms_mean": r.ttft_ms, "reused_tokens": r.reused_tokens,
            "timing_s": {k: round(v, 4) for k, v in r.timing_s.items()},
            "profile": {k: r.profile[k] for k in ("prefill", "context_cache", "scheduler") if k in r.profile},
        })
    return {"kvforge": __version__, **run, "summary": summary_counts(results), "files": files}


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def junit_xml(results: list[FileResult], properties: dict[str, str]) -> ET.ElementTree:
    """One <testsuite> per file, one <testcase> per check; a file that could not run is one <error> case."""
    totals = summary_counts(results)
    root = ET.Element("testsuites", name="llm_test", tests=str(sum(len(r.checks) or 1 for r in results)),
                      failures=str(totals["failed"]), errors=str(totals["errors"]), skipped=str(totals["skipped"]),
                      time=_seconds(sum(sum(r.timing_s.values()) for r in results)))
    for r in results:
        suite = ET.SubElement(root, "testsuite", name=r.case.name, tests=str(len(r.checks) or 1),
                              failures=str(r.count(FAILED)), errors=str(int(bool(r.error))),
                              skipped=str(r.count(SKIPPED)), time=_seconds(sum(r.timing_s.values())))
        props = ET.SubElement(suite, "properties")
        for name, value in properties.items():
            ET.SubElement(props, "property", name=name, value=value)
        classname = f"llm_test.{Path(r.case.name).stem}"
        if r.error:
            case = ET.SubElement(suite, "testcase", classname=classname, name="run", time="0")
            ET.SubElement(case, "error", message=r.error, type="KvforgeError").text = r.error
        for check in r.checks:
            case = ET.SubElement(suite, "testcase", classname=classname, name=check.name, time="0")
            if check.status == FAILED:
                ET.SubElement(case, "failure", message=check.reason, type="CheckFailed").text = check.reason
            elif check.status == SKIPPED:
                ET.SubElement(case, "skipped", message=check.reason)
    tree = ET.ElementTree(root)
    ET.indent(tree)
    return tree


def _seconds(value: float) -> str:
    return f"{value:.3f}"
