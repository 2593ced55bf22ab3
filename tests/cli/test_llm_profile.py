"""llm_profile: summary figures, flattening and A/B rows, the chart, and the CLI's output and one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from support.inprocess import run_cli_inprocess

from kvforge.contract.errors import KvforgeError
from kvforge.tools.profile.compare import compare_rows, only_in
from kvforge.tools.profile.load import load_profile
from kvforge.tools.profile.metrics import flatten, metrics
from kvforge.tools.profile.plot import plot_profile
from kvforge.tools.profile.tables import summary_tables

LLM_PROFILE = Path(sys.executable).parent / "llm_profile"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
USER_ERROR = 2
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def _stage(stage_id: str, runs: int, mean_ms: float) -> dict[str, Any]:
    return {"stage_id": stage_id, "total_runs": runs, "total_gpu_time_ms": runs * mean_ms,
            "average_time_per_run_ms": mean_ms,
            "gpu_time_stats": {"count": runs, "min_ms": mean_ms * 0.5, "max_ms": mean_ms * 2, "mean_ms": mean_ms,
                               "median_ms": mean_ms * 0.9, "p95_ms": mean_ms * 1.5, "p99_ms": mean_ms * 1.8,
                               "stddev_ms": mean_ms * 0.1}}


def cold_profile() -> dict[str, Any]:
    """What Profiler.to_dict writes without reuse: no context_cache section."""
    return {
        "prefill": {"total_runs": 4, "reused_tokens": 200, "computed_tokens": 600, "average_tokens_per_run": 200.0,
                    "average_time_per_run_ms": 50.0, "tokens_per_second": 4000.0, "average_time_per_token_ms": 0.25},
        "generation": {"total_runs": 4, "generated_tokens": 128, "average_tokens_per_run": 32.0,
                       "tokens_per_second": 100.0, "average_time_per_token_ms": 10.0},
        "stages": [_stage("llm_prefill", 4, 50.0), _stage("llm_generation", 128, 10.0)],
        "peak_cpu_memory_bytes": 512 * 2**20, "peak_cpu_memory_mb": 512.0,
        "kv_pool_bytes": 64 * 2**20, "kv_pool_mb": 64.0,
    }


def warm_profile() -> dict[str, Any]:
    """The same run with reuse: faster prefill and a full context_cache block (TensorRT Edge-LLM keys)."""
    profile = cold_profile()
    profile["prefill"].update(reused_tokens=600, computed_tokens=200, average_time_per_run_ms=20.0,
                              tokens_per_second=10000.0, average_time_per_token_ms=0.1)
    profile["stages"][0] = _stage("llm_prefill", 4, 20.0)
    profile["stages"][1] = _stage("llm_generation", 128, 12.5)
    pools = ("base_kv_pages", "draft_kv_pages", "recurrent_snapshots", "partial_kv_snapshots")
    profile["context_cache"] = {
        "admitted_sequences": 4, "hit_sequences": 3, "media_aware_sequences": 0, "lookup_bypass_sequences": 1,
        "forced_cold_sequences": 0, "matched_tokens": 640, "reused_tokens": 600,
        "plans": {"standard": 3, "no_reusable_prefix": 1, "full_input_rewind": 2},
        "publications": {"attempts": 4, "committed": 3, "existing": 1, "successful_endpoints": 7},
        "hybrid": {"restores": 0, "snapshot_pressure_skips": 0, "capture_synchronizations": 0},
        "speculative": {"full_page_replays": 0, "pair_publications": 0},
        "planning_nanoseconds": 84_000,
        "records": {"current": 5, "evicted": 9},
        "resource_pools": {name: {"free": 40, "capacity": 64} if name == "base_kv_pages" else
                           {"free": 0, "capacity": 0} for name in pools},
        "reclaimed_resources": {name: 12 if name == "base_kv_pages" else 0 for name in pools},
        "per_adapter": {"base": {"requests": 2, "reused_tokens": 400}, "support-lora": {"requests": 2,
                                                                                        "reused_tokens": 200}},
    }
    return profile


def render(profile: dict[str, Any]) -> str:
    console = Console(file=StringIO(), width=200, no_color=True, highlight=False)
    for table in summary_tables(profile):
        console.print(table)
    return console.file.getvalue()  # type: ignore[attr-defined]


def row(text: str, label: str) -> list[str]:
    """The cells of the table row whose first cell is `label`."""
    for line in text.splitlines():
        cells = [cell.strip() for cell in re.split(r"[│┃]", line)[1:-1]]
        if cells and cells[0] == label:
            return cells
    raise AssertionError(f"no row {label!r} in\n{text}")


def write(tmp_path: Path, name: str, profile: Any) -> Path:
    path = tmp_path / name
    path.write_text(profile if isinstance(profile, str) else json.dumps(profile, indent=2), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ summary

def test_summary_without_context_cache() -> None:
    text = render(cold_profile())
    assert row(text, "reuse ratio")[1] == "25.0 %"  # 200 / (200 + 600)
    assert row(text, "prompt tokens")[1] == "800"
    assert row(text, "tokens/s")[1] == "4,000.0"
    assert row(text, "TTFT-ish mean ms")[1] == "50.000"
    assert row(text, "TTFT-ish p95 ms")[1] == "75.000"
    assert row(text, "ms per token")[1] == "0.2500"  # the prefill table's; generation has one too
    assert row(text, "decode step mean ms")[1] == "10.000"
    assert row(text, "llm_generation")[1:] == ["128", "1,280.000", "10.000", "9.000", "15.000", "18.000", "86.5 %"]
    assert row(text, "peak CPU memory MiB")[1] == "512.0"
    assert row(text, "KV pool MiB")[1] == "64.0"
    assert "Context cache" not in text and "Per adapter" not in text


def test_summary_with_full_context_cache() -> None:
    text = render(warm_profile())
    assert row(text, "reuse ratio")[1] == "75.0 %"
    assert row(text, "admitted sequences")[1] == "4"
    assert row(text, "lookup-bypass sequences")[1] == "1"
    assert row(text, "hit rate")[1] == "75.0 %"
    assert row(text, "hit rate of looked-up")[1] == "100.0 %"  # 3 / (4 − 1)
    assert row(text, "matched tokens")[1] == "640"
    assert row(text, "plans.full_input_rewind")[1] == "2"
    assert row(text, "publications.successful_endpoints")[1] == "7"
    assert row(text, "records.evicted")[1] == "9"
    assert row(text, "planning µs per admitted")[1] == "21.00"  # 84,000 ns / 4 sequences
    assert row(text, "base_kv_pages") == ["base_kv_pages", "40", "64", "24", "37.5 %", "12"]
    assert "draft_kv_pages" not in text  # capacity 0: the engine has no such pool (issue 51 item 12)
    assert row(text, "support-lora") == ["support-lora", "2", "200", "100.0"]


def test_per_adapter_at_top_level() -> None:
    profile = cold_profile()
    profile["per_adapter"] = {"a": {"requests": 4, "reused_tokens": 10}}
    assert row(render(profile), "a") == ["a", "4", "10", "2.5"]
    profile["per_adapter"] = {"base": {"requests": 1, "reused_tokens": 0},
                              "act": {"requests": 2, "reused_tokens": 96, "base_pages_reused": 5}}
    assert row(render(profile), "act") == ["act", "2", "96", "48.0", "5"]
    assert row(render(profile), "base") == ["base", "1", "0", "0.0", "—"]  # base requests reuse their own pages


@pytest.mark.parametrize("drop", ["prefill", "generation", "stages", "context_cache", "peak_cpu_memory_bytes",
                                  "peak_cpu_memory_mb", "kv_pool_bytes", "kv_pool_mb"])
def test_any_section_may_be_missing(drop: str) -> None:
    profile = warm_profile()
    del profile[drop]
    render(profile)
    assert metrics(profile)
    compare_rows(profile, warm_profile())


def test_malformed_sections_do_not_crash() -> None:
    profile = {"prefill": [], "generation": {"total_runs": "four"}, "stages": [1, {"stage_id": "vision_encoder"},
               {"gpu_time_stats": None}], "context_cache": {"resource_pools": {"base_kv_pages": 3},
               "per_adapter": {"x": 1}, "plans": "none", "hybrid": {"restores": True}},
               "eagle_generation": {"average_acceptance_rate": 0.6}, "peak_cpu_memory_bytes": 3 * 2**20}
    text = render(profile)
    assert row(text, "runs")[1] == "—"
    assert row(text, "acceptance rate")[1] == "60.0 %"  # Edge-LLM's per-strategy block, laid out
    assert row(text, "peak CPU memory MiB")[1] == "3.0"  # from the _bytes key
    assert compare_rows(profile, profile)


def test_speculative_block_has_a_layout() -> None:
    """kvforge writes spec_decode_generation and a copy under the strategy's name: one table, rows labelled."""
    block = {"total_runs": 6, "total_iterations": 10, "total_draft_tokens": 40, "total_accepted_tokens": 30,
             "total_generated_tokens": 40, "average_acceptance_rate": 0.75, "acceptance_length": 4.0,
             "media_cold_requests": 1, "reuse_bypassed_requests": 0, "prefill_state_only_requests": 2,
             "tree_width": 3}
    profile = {**cold_profile(), "spec_decode_generation": block, "mtp_generation": dict(block)}
    profile["stages"].append(_stage("spec_decode_draft_proposal", 10, 1.5))
    text = render(profile)
    assert text.count("Speculative decoding") == 1 and "spec_decode_generation" in text
    assert row(text, "acceptance rate")[1] == "75.0 %"
    assert row(text, "tokens per verify step")[1] == "4.00"
    assert row(text, "prefill-state-only requests")[1] == "2"
    assert row(text, "tree_width")[1] == "3"  # a key without a layout is still listed
    assert row(text, "spec_decode_draft_proposal mean ms")[1] == "1.500"
    assert "total_draft_tokens" not in text  # laid out, not listed


def test_shared_tier_block_has_a_layout() -> None:
    profile = warm_profile()
    profile["context_cache"]["shared_tier"] = {"lookups": 8, "hits": 6, "loaded_tokens": 384, "load_ms": 12.0,
                                               "writes": 5, "write_bytes": 4096, "errors": 0, "timeouts": 1,
                                               "corrupt": 0, "skipped_lookups": 2, "dropped_writes": 0}
    text = render(profile)
    assert "Shared tier" in text
    assert row(text, "hit rate")[1] == "75.0 %"  # the context cache's: 3 / 4
    tier = text[text.index("Shared tier"):]
    assert row(tier, "hit rate")[1] == "75.0 %"  # the tier's: 6 / 8
    assert row(tier, "load ms per hit")[1] == "2.000"
    assert row(tier, "skipped lookups")[1] == "2"
    assert "shared_tier.lookups" not in text  # no longer in the cache table's loose listing
    derived = metrics(profile)
    assert derived["context_cache.shared_tier.hit_rate"] == 0.75
    assert derived["context_cache.shared_tier.load_per_hit_ms"] == 2.0


# ------------------------------------------------------------------------------------------------ loading

@pytest.mark.parametrize(("content", "needle"), [
    pytest.param(None, "no such file", id="missing"),
    pytest.param('{"prefill": ', "malformed JSON", id="malformed"),
    pytest.param("[1, 2]", "JSON array", id="array"),
    pytest.param('{"requests": []}', "not a profile", id="no-known-section"),
    pytest.param("{}", "not a profile", id="empty-object"),
])
def test_load_profile_errors_name_the_file(tmp_path: Path, content: str | None, needle: str) -> None:
    path = tmp_path / "p.json" if content is None else write(tmp_path, "p.json", content)
    with pytest.raises(KvforgeError) as info:
        load_profile(path)
    assert str(path) in str(info.value) and needle in str(info.value)


def test_load_profile_directory(tmp_path: Path) -> None:
    with pytest.raises(KvforgeError, match="directory"):
        load_profile(tmp_path)


# ------------------------------------------------------------------------------------------------ compare

def test_flatten_keys() -> None:
    flat = flatten(warm_profile())
    assert flat["prefill.tokens_per_second"] == 10000.0
    assert flat["stages.llm_prefill.mean_ms"] == 20.0  # gpu_time_stats inlined
    assert flat["stages.llm_generation.total_runs"] == 128
    assert flat["context_cache.reused_tokens"] == 600
    assert flat["context_cache.plans.standard"] == 3
    assert flat["context_cache.resource_pools.base_kv_pages.capacity"] == 64
    assert flat["context_cache.per_adapter.base.requests"] == 2
    assert flat["kv_pool_mb"] == 64.0
    assert all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in flat.values())
    derived = metrics(warm_profile())
    assert derived["prefill.reuse_ratio"] == 0.75
    assert derived["context_cache.hit_rate"] == 0.75
    assert derived["context_cache.planning_us_per_admitted"] == 21.0
    keys = list(derived)  # derived keys sit at the end of their own section
    assert keys.index("prefill.reuse_ratio") == keys.index("prefill.average_time_per_token_ms") + 1


def test_compare_rows() -> None:
    rows = {r.key: r for r in compare_rows(cold_profile(), warm_profile())}
    tps = rows["prefill.tokens_per_second"]
    assert (tps.a, tps.b, tps.diff, tps.ratio) == (4000.0, 10000.0, 6000.0, 2.5)
    assert tps.notable and tps.verdict == "better"
    assert rows["stages.llm_prefill.mean_ms"].verdict == "better"  # 50 → 20 ms
    assert rows["stages.llm_generation.mean_ms"].verdict == "worse"  # 10 → 12.5 ms
    assert rows["prefill.computed_tokens"].ratio == pytest.approx(1 / 3)
    assert rows["prefill.reuse_ratio"].b == 0.75
    steady = rows["generation.generated_tokens"]
    assert steady.ratio == 1.0 and not steady.notable and steady.verdict == ""
    assert rows["context_cache.reused_tokens"].a == 0  # A ran without reuse: it reused nothing (issue 51 item 11)
    only_a, only_b = only_in(cold_profile(), warm_profile())
    assert not only_a and "context_cache.reused_tokens" not in only_b and "context_cache.plans.standard" in only_b


def test_compare_threshold_and_zero_baseline() -> None:
    a, b = cold_profile(), cold_profile()
    b["generation"]["tokens_per_second"] = 104.0  # +4 %
    b["prefill"]["reused_tokens"], a["prefill"]["reused_tokens"] = 5, 0
    rows = {r.key: r for r in compare_rows(a, b, threshold=0.05)}
    assert not rows["generation.tokens_per_second"].notable
    assert rows["prefill.reused_tokens"].ratio is None and rows["prefill.reused_tokens"].notable
    rows = {r.key: r for r in compare_rows(a, b, threshold=0.01)}
    assert rows["generation.tokens_per_second"].verdict == "better"
    assert rows["peak_cpu_memory_mb"].verdict == ""  # unchanged


# ------------------------------------------------------------------------------------------------ plotting

@pytest.mark.parametrize("count", [1, 2])
def test_plot_writes_png(tmp_path: Path, count: int) -> None:
    profiles = [("A: cold", cold_profile()), ("B: warm", warm_profile())][-count:]
    out = plot_profile(profiles, tmp_path / "chart.png")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_plot_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KvforgeError, match="nothing to plot"):
        plot_profile([("p", {"peak_cpu_memory_mb": 1.0})], tmp_path / "x.png")
    with pytest.raises(KvforgeError, match="does not exist"):
        plot_profile([("p", cold_profile())], tmp_path / "missing" / "x.png")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(KvforgeError, match=re.escape("pip install 'kvforge[plot]'")):
        plot_profile([("p", cold_profile())], tmp_path / "x.png")


# ------------------------------------------------------------------------------------------------ CLI

def run(*args: Any) -> subprocess.CompletedProcess[str]:
    """llm_profile in this process (what it prints is the point, not the process)."""
    return run_cli_inprocess(["llm_profile", *args], env={"COLUMNS": "200"})


def run_process(*args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """llm_profile in a process of its own, for an environment the interpreter reads at start (PYTHONPATH)."""
    base = {k: v for k, v in os.environ.items() if k != "KVFORGE_DEBUG"}
    base.update(NO_COLOR="1", TERM="dumb", COLUMNS="200", PYTHONIOENCODING="utf-8", **(env or {}))
    return subprocess.run([str(LLM_PROFILE), *map(str, args)], capture_output=True, text=True, encoding="utf-8",
                          timeout=120, env=base, check=False)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    stderr = _ANSI.sub("", proc.stderr)
    assert "Traceback" not in stderr, stderr
    assert proc.returncode == USER_ERROR, f"exit {proc.returncode}: {stderr}"
    lines = stderr.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def test_cli_show_and_default_command(tmp_path: Path) -> None:
    path = write(tmp_path, "warm.json", warm_profile())
    shown = run("show", path)
    assert shown.returncode == 0, shown.stderr
    assert row(shown.stdout, "reuse ratio")[1] == "75.0 %"
    assert row(shown.stdout, "hit rate")[1] == "75.0 %"
    assert row(shown.stdout, "planning µs per admitted")[1] == "21.00"
    default = run(path)  # `llm_profile PROFILE.json` is `show`
    assert default.returncode == 0 and default.stdout == shown.stdout


def test_cli_compare(tmp_path: Path) -> None:
    a, b = write(tmp_path, "cold.json", cold_profile()), write(tmp_path, "warm.json", warm_profile())
    proc = run("compare", a, b)
    assert proc.returncode == 0, proc.stderr
    assert row(proc.stdout, "prefill.tokens_per_second") == ["prefill.tokens_per_second", "4,000", "10,000",
                                                             "+6,000", "2.500×", "▲ better"]
    assert row(proc.stdout, "stages.llm_generation.mean_ms")[-2:] == ["1.250×", "▼ worse"]
    assert row(proc.stdout, "generation.generated_tokens")[-1] == ""
    assert "only in B (warm.json): context_cache" in proc.stdout
    changed = run("compare", a, b, "--changedOnly", "--threshold", "30")
    assert "generation.generated_tokens" not in changed.stdout
    assert "stages.llm_generation.mean_ms" not in changed.stdout  # +25 % < 30 %
    assert "prefill.tokens_per_second" in changed.stdout


def test_cli_plot(tmp_path: Path) -> None:
    a, b = write(tmp_path, "cold.json", cold_profile()), write(tmp_path, "warm.json", warm_profile())
    for args, out in ((["show", b], tmp_path / "show.png"), (["compare", a, b], tmp_path / "compare.png")):
        proc = run(*args, "--plot", out)
        assert proc.returncode == 0, proc.stderr
        assert out.read_bytes().startswith(PNG_MAGIC)


def test_cli_help_and_no_arguments() -> None:
    overview = run()
    assert overview.returncode == 0 and "show" in overview.stdout and "compare" in overview.stdout
    for command in ("show", "compare"):
        proc = run(command, "--help")
        assert proc.returncode == 0 and "Examples" in proc.stdout and "--plot" in proc.stdout


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    good = write(tmp_path, "good.json", cold_profile())
    bad = write(tmp_path, "bad.json", '{"prefill": {')
    foreign = write(tmp_path, "requests.json", {"requests": [{"messages": []}]})
    assert_one_line_error(run(tmp_path / "nope.json"), "nope.json", "no such file")
    assert_one_line_error(run("show", bad), "bad.json", "malformed JSON")
    assert_one_line_error(run("show", foreign), "requests.json", "not a profile")
    assert_one_line_error(run("compare", good, bad), "bad.json", "malformed JSON")
    assert_one_line_error(run("compare", good), "B.json")
    assert_one_line_error(run("show", good, "--plot", tmp_path / "no" / "x.png"), "--plot", "does not exist")
    assert_one_line_error(run("show", good, "--bogus"), "--bogus")


def test_cli_plot_without_matplotlib(tmp_path: Path) -> None:
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    good = write(tmp_path, "good.json", cold_profile())
    proc = run_process("show", good, "--plot", tmp_path / "x.png", env={"PYTHONPATH": str(shim.parent)})
    assert_one_line_error(proc, "--plot", "pip install 'kvforge[plot]'")
    assert not (tmp_path / "x.png").exists()
