"""llm_profile reads reuse as users do (issue 51 items 11, 12): compare leads with what a request cost (TTFT as
prefill time per request), counts a run without reuse as reusing nothing, says when a timing change is within one
run's noise and when per-call times compare nothing; show prints only the blocks that apply to the engine."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvforge.tools.profile.compare import compare_rows, only_in, per_request_rows
from kvforge.tools.profile.plot import plot_profile
from kvforge.tools.profile.tables import summary_tables


def _stage(stage_id: str, runs: int, mean_ms: float, stddev_ms: float) -> dict[str, Any]:
    return {"stage_id": stage_id, "total_runs": runs, "total_gpu_time_ms": runs * mean_ms,
            "average_time_per_run_ms": mean_ms,
            "gpu_time_stats": {"count": runs, "min_ms": mean_ms / 2, "max_ms": mean_ms * 2, "mean_ms": mean_ms,
                               "median_ms": mean_ms, "p95_ms": mean_ms * 1.5, "p99_ms": mean_ms * 1.8,
                               "stddev_ms": stddev_ms}}


def _profile(prefill_calls: int, prefill_mean_ms: float, reused: int, computed: int, requests: int = 4,
             decode_mean_ms: float = 5.0, stddev_ms: float = 0.5) -> dict[str, Any]:
    """What Profiler.to_dict writes: per_adapter counts every request, with or without reuse."""
    return {
        "prefill": {"total_runs": prefill_calls, "reused_tokens": reused, "computed_tokens": computed,
                    "average_tokens_per_run": (reused + computed) / prefill_calls,
                    "average_time_per_run_ms": prefill_mean_ms,
                    "tokens_per_second": (reused + computed) * 1000 / (prefill_calls * prefill_mean_ms),
                    "average_time_per_token_ms": prefill_calls * prefill_mean_ms / (reused + computed)},
        "generation": {"total_runs": 64, "generated_tokens": 64, "average_tokens_per_run": 1.0,
                       "tokens_per_second": 1000 / decode_mean_ms, "average_time_per_token_ms": decode_mean_ms},
        "per_adapter": {"base": {"requests": requests, "reused_tokens": reused}},
        "stages": [_stage("llm_prefill", prefill_calls, prefill_mean_ms, stddev_ms),
                   _stage("llm_generation", 64, decode_mean_ms, stddev_ms)],
    }


def _cold() -> dict[str, Any]:
    """4 requests of 1,536 prompt tokens, each prefilled in 3 chunks of 512: 12 calls of 10 ms, 30 ms a request."""
    return _profile(prefill_calls=12, prefill_mean_ms=10.0, reused=0, computed=6144)


def _warm() -> dict[str, Any]:
    """The same with reuse: each request computes one 400-token tail in one call of 15 ms (longer than a cold
    chunk's mean, as a call covers more positions), 15 ms a request; a context_cache block."""
    profile = _profile(prefill_calls=4, prefill_mean_ms=15.0, reused=4544, computed=1600)
    pools = {"base_kv_pages": {"free": 40, "capacity": 64}, "draft_kv_pages": {"free": 0, "capacity": 0},
             "recurrent_snapshots": {"free": 0, "capacity": 0}, "partial_kv_snapshots": {"free": 0, "capacity": 0},
             "document_kv_pages": {"free": 0, "capacity": 0}, "sliding_window_pages": {"free": 0, "capacity": 0},
             "adapter_corrections": {"free": 0, "capacity": 0}}
    profile["context_cache"] = {
        "admitted_sequences": 4, "hit_sequences": 3, "media_aware_sequences": 0, "lookup_bypass_sequences": 0,
        "forced_cold_sequences": 0, "matched_tokens": 4544, "reused_tokens": 4544,
        "plans": {"standard": 3, "no_reusable_prefix": 1, "full_input_rewind": 0},
        "hybrid": {"restores": 0, "snapshot_pressure_skips": 0, "capture_synchronizations": 0},
        "speculative": {"full_page_replays": 0, "pair_publications": 0},
        "documents": {"documents_seen": 0, "document_hits": 0, "reused_tokens": 0, "repaired_tokens": 0,
                      "rotated_pages": 0, "documents_produced": 0},
        "adapter_corrections": {"corrected_pages": 0, "stored_pages": 0, "skipped_pages": 0},
        "sliding_window": {"hits": 0, "skips": 0},
        "resource_pools": pools,
        "reclaimed_resources": {name: 0 for name in pools},
    }
    return profile


def _rows(rows: list[Any]) -> dict[str, Any]:
    return {row.key: row for row in rows}


# ------------------------------------------------------------------------------------------------ compare

def test_reuse_reads_faster_per_request_not_slower_per_call() -> None:
    per_request = _rows(per_request_rows(_cold(), _warm()))
    ttft = per_request["per_request.ttft_ms"]
    assert (ttft.a, ttft.b, ttft.verdict) == (30.0, 15.0, "better")  # 12 × 10 / 4 → 4 × 15 / 4
    assert per_request["per_request.computed_tokens"].verdict == "better"
    assert per_request["per_request.reused_tokens"].b == 1136
    assert per_request["prefill.reuse_ratio"].verdict == "better"
    rows = _rows(compare_rows(_cold(), _warm()))
    mean = rows["stages.llm_prefill.mean_ms"]  # 10 → 15 ms per call: "worse" before, though every request is faster
    assert mean.notable and mean.verdict == "per call"
    assert rows["prefill.average_time_per_run_ms"].verdict == "per call"
    assert rows["stages.llm_prefill.total_gpu_time_ms"].verdict == "better"  # 120 → 60 ms: totals stay comparable


def test_reuse_counters_of_a_run_without_reuse_are_zero() -> None:
    rows = _rows(compare_rows(_cold(), _warm()))
    reused = rows["context_cache.reused_tokens"]
    assert (reused.a, reused.b, reused.verdict) == (0, 4544, "better")
    assert rows["context_cache.hit_rate"].a == 0 and rows["context_cache.hit_sequences"].b == 3
    only_a, only_b = only_in(_cold(), _warm())
    assert not only_a and "context_cache.reused_tokens" not in only_b and "context_cache.hit_rate" not in only_b
    assert "context_cache.plans.standard" in only_b  # no reuse is not zero plans: still listed as B's own
    rows = _rows(per_request_rows(_warm(), _cold()))  # either side
    assert rows["context_cache.hit_rate"].b == 0 and rows["context_cache.hit_rate"].verdict == "worse"


def test_changes_within_one_runs_noise_are_said_so() -> None:
    noisy_a, noisy_b = (_profile(8, 10.0, 0, 4096, decode_mean_ms=mean, stddev_ms=3.0) for mean in (5.0, 5.6))
    rows = _rows(compare_rows(noisy_a, noisy_b, threshold=0.05))
    decode = rows["stages.llm_generation.mean_ms"]  # +12 %, but 2 SE = 2·sqrt(2·9/64) ≈ 1.06 ms > 0.6 ms
    assert decode.notable and decode.verdict == "noise" and decode.noise == pytest.approx(1.0607, abs=1e-3)
    assert rows["generation.tokens_per_second"].verdict == "noise"
    assert _rows(per_request_rows(noisy_a, noisy_b, 0.05))["per_request.decode_ms"].verdict == "noise"
    steady_a, steady_b = (_profile(8, 10.0, 0, 4096, decode_mean_ms=mean, stddev_ms=0.1) for mean in (5.0, 5.6))
    assert _rows(compare_rows(steady_a, steady_b, 0.05))["stages.llm_generation.mean_ms"].verdict == "worse"
    assert _rows(per_request_rows(steady_a, steady_b, 0.05))["per_request.decode_ms"].verdict == "worse"


def test_no_request_count_means_no_per_request_rows() -> None:
    a, b = _cold(), _warm()
    del a["per_adapter"]
    assert per_request_rows(a, b) == []


def test_cli_compare_leads_with_per_request(tmp_path: Path, run_cli: Callable[..., subprocess.CompletedProcess[str]]
                                            ) -> None:
    a, b = tmp_path / "cold.json", tmp_path / "warm.json"
    a.write_text(json.dumps(_cold())), b.write_text(json.dumps(_warm()))
    proc = run_cli(["llm_profile", "compare", a, b, "--plot", tmp_path / "ab.png"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.index("Per request") < proc.stdout.index("stages.llm_prefill.mean_ms")
    ttft = next(line for line in proc.stdout.splitlines() if "TTFT ms" in line)
    assert "30" in ttft and "15" in ttft and "better" in ttft
    assert re.search(r"stages\.llm_prefill\.mean_ms .*● per call", proc.stdout)
    assert "● per call: the stage ran a different number of calls" in proc.stdout
    assert "only in B (warm.json)" in proc.stdout and "context_cache.reused_tokens" in proc.stdout
    assert (tmp_path / "ab.png").read_bytes().startswith(b"\x89PNG")


def test_plot_shows_time_per_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage panel draws each stage's total over the requests (with ±2 SE whiskers), not the mean per call."""
    import matplotlib.axes

    drawn: list[tuple[list[float], Any]] = []
    original = matplotlib.axes.Axes.bar

    def bar(self: Any, x: Any, height: Any, *args: Any, **kwargs: Any) -> Any:
        drawn.append((list(height) if isinstance(height, list) else height, kwargs.get("yerr")))
        return original(self, x, height, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    plot_profile([("A", _cold()), ("B", _warm())], tmp_path / "x.png")
    assert drawn[0][0] == [30.0, 80.0] and drawn[1][0] == [15.0, 80.0]  # prefill, decode ms per request
    assert drawn[0][1] is not None and all(error > 0 for error in drawn[0][1])


# ------------------------------------------------------------------------------------------------ show

def _render(profile: dict[str, Any]) -> str:
    console = Console(file=StringIO(), width=200, no_color=True, highlight=False)
    for table in summary_tables(profile):
        console.print(table)
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_show_leaves_out_blocks_that_do_not_apply() -> None:
    text = _render(_warm())
    for absent in ("documents.", "sliding_window.", "adapter_corrections.", "hybrid.", "speculative.",
                   "draft_kv_pages", "recurrent_snapshots", "partial_kv_snapshots", "document_kv_pages",
                   "sliding_window_pages"):
        assert absent not in text, absent
    assert "base_kv_pages" in text and "plans.standard" in text and "reused tokens" in text


def test_show_keeps_a_block_that_counted_or_is_enabled() -> None:
    counted = _warm()
    counted["context_cache"]["documents"]["document_hits"] = 2
    assert "documents.document_hits" in _render(counted) and "sliding_window." not in _render(counted)
    enabled = _warm()  # a hybrid engine with snapshot pools that has restored nothing yet: its zeros say so
    enabled["context_cache"]["resource_pools"]["recurrent_snapshots"] = {"free": 8, "capacity": 8}
    text = _render(enabled)
    assert "hybrid.restores" in text and "recurrent_snapshots" in text and "documents." not in text


# ------------------------------------------------------------------------------------------------ a real engine

def test_real_cold_and_warm_profiles(tiny_engine_dir: Path, tmp_path: Path,
                                     run_cli: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    """llm_inference's own profiles, without and with reuse: the per-request table and the reuse counters."""
    system = "Be kind and brief."  # the byte-level tiny engine takes 64 prompt tokens, the chat template included
    requests = [{"messages": [{"role": "system", "content": system},
                              {"role": "user", "content": f"q{i}"}], "max_generate_length": 4}
                for i in range(3)]
    (tmp_path / "in.json").write_text(json.dumps({"batch_size": 1, "temperature": 0, "requests": requests}))
    for name, extra in (("cold", []), ("warm", ["--enableContextReuse"])):
        proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", tmp_path / "in.json",
                        "--outputFile", tmp_path / f"{name}_out.json", "--profileOutputFile", tmp_path / f"{name}.json",
                        *extra])
        assert proc.returncode == 0, proc.stderr
    cold, warm = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("cold", "warm"))
    rows = _rows(per_request_rows(cold, warm))
    assert rows["per_request.requests"].a == rows["per_request.requests"].b == 3
    assert rows["per_request.computed_tokens"].b < rows["per_request.computed_tokens"].a
    assert rows["per_request.reused_tokens"].verdict == "better"
    assert {"per_request.ttft_ms", "per_request.decode_ms", "per_request.engine_ms"} <= set(rows)
    assert _rows(compare_rows(cold, warm))["context_cache.reused_tokens"].a == 0
    shown = run_cli(["llm_profile", "show", tmp_path / "warm.json"])
    assert shown.returncode == 0 and "documents." not in shown.stdout and "draft_kv_pages" not in shown.stdout
