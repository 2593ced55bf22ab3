"""Profiler statistics, section presence rules and the profile JSON file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.profile import Profiler, StageTimer, write_profile
from kvforge.tools.profile.summary import format_summary

STAGE_KEYS = {"stage_id", "total_runs", "total_gpu_time_ms", "average_time_per_run_ms", "gpu_time_stats"}
STATS_KEYS = {"count", "min_ms", "max_ms", "mean_ms", "median_ms", "p95_ms", "p99_ms", "stddev_ms"}
PREFILL_KEYS = {"total_runs", "reused_tokens", "computed_tokens", "average_tokens_per_run",
                "average_time_per_run_ms", "tokens_per_second", "average_time_per_token_ms"}
GENERATION_KEYS = {"total_runs", "generated_tokens", "average_tokens_per_run", "tokens_per_second",
                   "average_time_per_token_ms"}


def _walk_numbers(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _walk_numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _walk_numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def test_stats_on_known_samples() -> None:
    samples = [1.0, 2.0, 3.0, 4.0]
    timer = StageTimer("llm_prefill", list(samples))
    stats = timer.stats()
    assert set(stats) == STATS_KEYS
    assert stats["count"] == 4 and isinstance(stats["count"], int)
    assert stats["min_ms"] == 1.0 and stats["max_ms"] == 4.0
    assert stats["mean_ms"] == 2.5
    assert stats["median_ms"] == 2.5
    assert stats["p95_ms"] == pytest.approx(round(float(np.percentile(samples, 95)), 4))
    assert stats["p95_ms"] == pytest.approx(3.85)
    assert stats["p99_ms"] == pytest.approx(3.97)
    assert stats["stddev_ms"] == pytest.approx(round(math.sqrt(1.25), 4))  # population, not sample
    stage = timer.to_dict()
    assert set(stage) == STAGE_KEYS
    assert stage["total_runs"] == 4
    assert stage["total_gpu_time_ms"] == 10.0
    assert stage["average_time_per_run_ms"] == 2.5


def test_floats_rounded_to_four_decimals() -> None:
    stats = StageTimer("s", [1.0, 2.0, 2.0]).stats()
    assert stats["mean_ms"] == 1.6667
    assert stats["stddev_ms"] == 0.4714


def test_stage_context_manager_times_body() -> None:
    profiler = Profiler()
    with profiler.stage("llm_prefill"):
        sum(range(1000))
    with profiler.stage("llm_prefill"):
        pass
    timer = profiler.stages["llm_prefill"]
    assert len(timer.samples_ms) == 2
    assert all(ms >= 0.0 for ms in timer.samples_ms)


def test_stage_that_raises_is_not_recorded() -> None:
    profiler = Profiler()
    with pytest.raises(RuntimeError), profiler.stage("llm_prefill"):
        raise RuntimeError("engine failed")
    assert "llm_prefill" not in profiler.stages


def test_disabled_profiler_records_nothing() -> None:
    profiler = Profiler(enabled=False)
    with profiler.stage("llm_prefill"):
        pass
    profiler.record("llm_generation", 5.0)
    profiler.add_prefill(3, 4)
    profiler.add_generation(10)
    profiler.note_peak_memory(kv_pool_bytes=1024)
    assert profiler.to_dict() == {}

    # Re-enabled after warmup: only what follows counts.
    profiler.enabled = True
    profiler.add_prefill(1, 2)
    assert profiler.to_dict()["prefill"]["total_runs"] == 1


def test_empty_profiler_has_no_sections() -> None:
    data = Profiler().to_dict()
    assert data == {}
    assert format_summary(data)


def test_prefill_and_generation_sections() -> None:
    profiler = Profiler()
    profiler.record("llm_prefill", 40.0)
    profiler.record("llm_prefill", 60.0)
    profiler.add_prefill(reused_tokens=30, computed_tokens=20)
    profiler.add_prefill(reused_tokens=0, computed_tokens=50)
    profiler.record("llm_generation", 200.0)
    profiler.add_generation(40)

    data = profiler.to_dict()
    prefill = data["prefill"]
    assert set(prefill) == PREFILL_KEYS
    assert prefill["total_runs"] == 2
    assert prefill["reused_tokens"] == 30 and isinstance(prefill["reused_tokens"], int)
    assert prefill["computed_tokens"] == 70
    assert prefill["average_tokens_per_run"] == 50.0
    assert prefill["average_time_per_run_ms"] == 50.0
    assert prefill["tokens_per_second"] == 1000.0  # 100 tokens over 100 ms
    assert prefill["average_time_per_token_ms"] == 1.0

    generation = data["generation"]
    assert set(generation) == GENERATION_KEYS
    assert generation["total_runs"] == 1
    assert generation["generated_tokens"] == 40
    assert generation["average_tokens_per_run"] == 40.0
    assert generation["tokens_per_second"] == 200.0
    assert generation["average_time_per_token_ms"] == 5.0
    assert "context_cache" not in data


def test_keys_present_only_with_data() -> None:
    profiler = Profiler()
    profiler.add_prefill(0, 8)
    data = profiler.to_dict()
    assert "prefill" in data
    assert "generation" not in data
    assert "stages" not in data
    assert "peak_cpu_memory_bytes" not in data
    assert "kv_pool_bytes" not in data
    # No llm_prefill time recorded: rates are 0, never inf/NaN.
    assert data["prefill"]["tokens_per_second"] == 0.0
    assert data["prefill"]["average_time_per_token_ms"] == 0.0


def test_context_cache_passed_verbatim() -> None:
    cache = {"admitted_sequences": 3, "hit_sequences": 1, "plans": {"standard": 2}}
    data = Profiler().to_dict(context_cache=cache)
    assert data["context_cache"] == cache
    assert "context_cache" not in Profiler().to_dict(context_cache=None)


def test_stages_in_first_seen_order() -> None:
    profiler = Profiler()
    for stage_id in ("llm_prefill", "llm_generation", "llm_prefill", "vision_encoder"):
        profiler.record(stage_id, 1.0)
    stages = profiler.to_dict()["stages"]
    assert [stage["stage_id"] for stage in stages] == ["llm_prefill", "llm_generation", "vision_encoder"]
    assert stages[0]["total_runs"] == 2


def test_memory_keys() -> None:
    profiler = Profiler()
    profiler.note_peak_memory()
    data = profiler.to_dict()
    assert isinstance(data["peak_cpu_memory_bytes"], int)
    assert data["peak_cpu_memory_bytes"] > 1024 * 1024  # a Python process is well over 1 MiB
    assert data["peak_cpu_memory_mb"] == round(data["peak_cpu_memory_bytes"] / 2**20, 4)
    assert "kv_pool_bytes" not in data

    profiler.note_peak_memory(kv_pool_bytes=64 * 2**20)
    data = profiler.to_dict()
    assert data["kv_pool_bytes"] == 64 * 2**20
    assert data["kv_pool_mb"] == 64.0


def test_json_round_trip_has_no_nan(tmp_path: Path) -> None:
    profiler = Profiler()
    profiler.record("llm_prefill", 0.0)  # zero time must not divide into inf
    profiler.add_prefill(0, 0)  # zero tokens must not divide into NaN
    profiler.record("llm_generation", 0.0)
    profiler.add_generation(0)
    profiler.note_peak_memory(kv_pool_bytes=0)
    data = profiler.to_dict(context_cache={"matched_tokens": 0})

    path = tmp_path / "profile.json"
    write_profile(path, data)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert text.startswith('{\n  "prefill"')  # 2-space indent
    loaded = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-finite {name}"))
    assert loaded == data
    assert all(math.isfinite(number) for number in _walk_numbers(loaded))


def test_write_profile_missing_directory_names_field(tmp_path: Path) -> None:
    with pytest.raises(KvforgeError) as info:
        write_profile(tmp_path / "missing" / "profile.json", {})
    assert info.value.field == "profile_output_file"  # llm_inference maps it to --profileOutputFile
    assert "profile_output_file" in str(info.value)


def test_summary_mentions_stages_and_counts() -> None:
    profiler = Profiler()
    profiler.record("llm_prefill", 10.0)
    profiler.add_prefill(reused_tokens=12, computed_tokens=4)
    profiler.record("llm_generation", 20.0)
    profiler.add_generation(8)
    profiler.note_peak_memory(kv_pool_bytes=2**20)
    summary = format_summary(profiler.to_dict())
    assert "llm_prefill" in summary and "llm_generation" in summary
    assert "12 reused" in summary and "4 computed" in summary
    assert "tok/s" in summary
    assert "peak memory" in summary and "KV pool" in summary


def test_summary_reads_profiles_it_did_not_write() -> None:
    """The --dumpProfile text is read by llm_profile's metrics: missing or odd keys print "—", never raise."""
    summary = format_summary({"prefill": {"total_runs": 2, "reused_tokens": "x"}, "generation": [],
                              "stages": [{"stage_id": "vision_encoder"}, 7],
                              "eagle_generation": {"average_acceptance_rate": 0.5},
                              "peak_cpu_memory_bytes": 3 * 2**20})
    assert "prefill:    2 runs, — tokens" in summary
    assert "acceptance 50.0 %" in summary
    assert "vision_encoder" in summary and "3.0 MiB CPU" in summary
