"""Bad input through the real console scripts: one `error:` line naming the problem, exit 2, no traceback.

Plus one happy-path llm_inference run (response and profile keys) and `--help` of each CLI.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from support.cli_checks import ANSI, assert_one_line_error

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

HI = {"role": "user", "content": "hi"}


def _requests(*requests: dict, **top: object) -> str:
    return json.dumps({**top, "requests": list(requests) or [{"messages": [HI]}]})


# ------------------------------------------------------------------------------------------ llm_inference

REQUEST_FILE_CASES = [
    pytest.param('{"requests": [', ("inputFile", "malformed JSON", "line 1"), id="malformed-json"),
    pytest.param(json.dumps([{"messages": [HI]}]), ("inputFile", "top level", "JSON object", "array"),
                 id="top-level-list"),
    pytest.param(json.dumps({"batch_size": 1}), ("requests", "required"), id="missing-requests"),
    pytest.param(json.dumps({"requests": []}), ("requests", "non-empty", "empty array"), id="empty-requests"),
    pytest.param(_requests({"messages": "hi"}), ("requests[0].messages", "array", "string"),
                 id="messages-wrong-type"),
    pytest.param(_requests({"messages": [HI], "temperature": "hot"}), ("requests[0].temperature", "number"),
                 id="temperature-string"),
    pytest.param(_requests(top_p=1.5), ("top_p", "(0, 1]", "1.5"), id="top-p-above-1"),
    pytest.param(_requests({"messages": [HI], "top_k": -1}), ("requests[0].top_k", "-1"), id="top-k-negative"),
    pytest.param(_requests(num_logprobs=99), ("num_logprobs", "0..50", "99"), id="num-logprobs-99"),
    pytest.param(_requests({"messages": [HI], "max_generate_length": 0}),
                 ("requests[0].max_generate_length", ">= 1", "0"), id="max-generate-length-0"),
    pytest.param(_requests(context_cache_lookup_policy="sometimes"),
                 ("context_cache_lookup_policy", "use_cache", "sometimes"), id="unknown-lookup-policy"),
    # Valid files the tiny engine (maxBatchSize 4, maxInputLen 64) cannot run.
    pytest.param(_requests(batch_size=8), ("batch_size", "8", "maxBatchSize 4"), id="batch-size-over-engine"),
    pytest.param(_requests({"messages": [{"role": "user", "content": "x" * 100}]}, {"messages": [HI]}),
                 ("requests[0].messages", "maxInputLen 64", "--maxInputLen"), id="prompt-over-max-input-len"),
]


@pytest.mark.parametrize("content, needles", REQUEST_FILE_CASES)
def test_bad_request_file(run_cli, tiny_engine_dir: Path, tmp_path: Path, content: str,
                          needles: tuple[str, ...]) -> None:
    input_file = tmp_path / "in.json"
    input_file.write_text(content, encoding="utf-8")
    output_file = tmp_path / "out.json"
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file,
                    "--outputFile", output_file])
    assert_one_line_error(proc, *needles)
    assert not output_file.exists()


@pytest.fixture
def valid_input(tmp_path: Path) -> Path:
    path = tmp_path / "valid.json"
    path.write_text(_requests(max_generate_length=2, temperature=0), encoding="utf-8")
    return path


def test_missing_input_file(run_cli, tiny_engine_dir: Path, tmp_path: Path) -> None:
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", tmp_path / "nope.json",
                    "--outputFile", tmp_path / "out.json"])
    assert_one_line_error(proc, "inputFile", "not found", "nope.json")


def test_output_file_in_missing_directory(run_cli, tiny_engine_dir: Path, valid_input: Path,
                                          tmp_path: Path) -> None:
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", valid_input,
                    "--outputFile", tmp_path / "no_such_dir" / "out.json"])
    assert_one_line_error(proc, "--outputFile", "no_such_dir", "does not exist")


def test_engine_dir_missing_weights(run_cli, tiny_engine_dir: Path, valid_input: Path, tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, engine)
    (engine / "model.onnx.data").unlink()
    proc = run_cli(["llm_inference", "--engineDir", engine, "--inputFile", valid_input,
                    "--outputFile", tmp_path / "out.json"])
    assert_one_line_error(proc, "--engineDir", "model.onnx.data")


def test_onnx_dir_passed_as_engine_dir(run_cli, tiny_onnx_dir: Path, valid_input: Path, tmp_path: Path) -> None:
    proc = run_cli(["llm_inference", "--engineDir", tiny_onnx_dir, "--inputFile", valid_input,
                    "--outputFile", tmp_path / "out.json"])
    assert_one_line_error(proc, "--engineDir", "builder_config", "llm_build")


# ------------------------------------------------------------------------------------------ llm_build

def test_build_refuses_foreign_onnx_dir(run_cli, tmp_path: Path) -> None:
    foreign = tmp_path / "optimum_export"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                     "num_hidden_layers": 2, "vocab_size": 259}))
    (foreign / "model.onnx").write_bytes(b"\x08\x07")
    engine = tmp_path / "engine"
    proc = run_cli(["llm_build", "--onnxDir", foreign, "--engineDir", engine])
    assert_one_line_error(proc, "config.json", "not a kvforge export", "llm_export")
    assert not engine.exists()


BUILD_FLAG_CASES = [
    pytest.param(["--tokensPerPage", "100"], ("--tokensPerPage", "power of two", "100"), id="page-not-pow2"),
    pytest.param(["--maxInputLen", "64", "--maxKVCacheCapacity", "256", "--maxBatchSize", "4",
                  "--tokensPerPage", "16", "--maxKVPoolPages", "15"],
                 ("--maxKVPoolPages", "15", "at least 16"), id="pool-below-one-sequence"),
    pytest.param(["--maxBatchSize", "0"], ("--maxBatchSize", "got 0"), id="batch-0"),
    pytest.param(["--backend", "cuda"], ("--backend", "'cuda'"), id="unknown-backend"),
    pytest.param(["--maxLoraRank", "4"], ("--maxLoraRank", "no lora_A/lora_B inputs"), id="lora-rank-without-lora"),
    pytest.param(["--maxInputLen", "512", "--maxKVCacheCapacity", "256"],
                 ("--maxInputLen", "512", "maxKVCacheCapacity=256"), id="input-len-over-capacity"),
]


@pytest.mark.parametrize("flags, needles", BUILD_FLAG_CASES)
def test_build_bad_flags(run_cli, tiny_onnx_dir: Path, tmp_path: Path, flags: list[str],
                         needles: tuple[str, ...]) -> None:
    engine = tmp_path / "engine"
    proc = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", engine, *flags])
    assert_one_line_error(proc, *needles)
    assert not engine.exists(), "geometry errors must be raised before anything is written"


def test_build_missing_onnx_dir(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["llm_build", "--onnxDir", tmp_path / "nowhere", "--engineDir", tmp_path / "engine"])
    assert_one_line_error(proc, "--onnxDir", "not a directory")


def test_build_accepts_a_pool_smaller_than_a_full_batch(run_cli, tiny_onnx_dir: Path, tmp_path: Path) -> None:
    # One sequence at full capacity (256 / 16 = 16 pages) is enough: rows wait or are preempted when it is full.
    engine = tmp_path / "engine"
    proc = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", engine, "--backend", "onnxruntime",
                    "--maxInputLen", "64", "--maxKVCacheCapacity", "256", "--maxBatchSize", "4",
                    "--tokensPerPage", "16", "--maxKVPoolPages", "16"])
    assert proc.returncode == 0, proc.stderr
    assert "rows will wait or be preempted when the pool is full" in " ".join(proc.stderr.split())
    assert json.loads((engine / "config.json").read_text())["builder_config"]["max_kv_pool_pages"] == 16


def test_build_prints_the_snapshot_slot_and_a_budget_for_reuse_records(run_cli, tiny_onnx_dir: Path,
                                                                       tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    proc = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", engine, "--backend", "onnxruntime",
                    "--maxInputLen", "64", "--maxKVCacheCapacity", "256", "--tokensPerPage", "16",
                    "--reuseRecords", "10"])
    assert proc.returncode == 0, proc.stderr
    slot = json.loads((engine / "config.json").read_text())["builder_config"]["partial_kv_snapshot_bytes_per_slot"]
    text = " ".join(proc.stderr.split())
    assert f"partial-KV snapshot slot: {slot:,} bytes" in text
    assert f"for 10 retained contexts: --contextCachePartialKVSnapshotPoolBytes {10 * slot}" in text
    bad = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", engine, "--reuseRecords", "-1"])
    assert_one_line_error(bad, "--reuseRecords", "-1")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_build_tensorrt_backend_not_installed(run_cli, tiny_onnx_dir: Path, tmp_path: Path) -> None:
    proc = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", tmp_path / "engine",
                    "--backend", "tensorrt"])
    # `kvforge[tensorrt]` survives: error text is printed literally, not as rich markup.
    assert_one_line_error(proc, "--backend", "TensorRT", "not installed", "kvforge[tensorrt]")


# ------------------------------------------------------------------------------------------ llm_export

def test_export_nonexistent_source(run_cli, tmp_path: Path) -> None:
    missing = tmp_path / "no_such_model.gguf"
    out = tmp_path / "onnx"
    proc = run_cli(["llm_export", missing, "--outputDir", out])
    assert_one_line_error(proc, "SOURCE", str(missing))
    assert not out.exists()


def test_export_unknown_synthetic(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["llm_export", "--synthetic", "unknown-name", "--outputDir", tmp_path / "onnx"])
    assert_one_line_error(proc, "--synthetic", "unknown-name", "tiny-llama")


def test_export_garbage_gguf(run_cli, tmp_path: Path) -> None:
    garbage = tmp_path / "model.gguf"
    garbage.write_bytes(b"this is not a gguf file\n" * 8)
    out = tmp_path / "onnx"
    proc = run_cli(["llm_export", garbage, "--outputDir", out])
    assert_one_line_error(proc, "SOURCE", "GGUF", "model.gguf")
    assert not out.exists()


# ------------------------------------------------------------------------------------------ happy paths

RESPONSE_KEYS = {"output_text", "request_idx", "batch_idx", "finish_reason", "usage", "timing"}
FINISH_REASONS = {"end-of-sequence", "max-length", "stop-words"}


def test_inference_writes_responses_and_profile(run_cli, tiny_engine_dir: Path, tmp_path: Path) -> None:
    input_file = tmp_path / "in.json"
    input_file.write_text(_requests({"messages": [HI]}, {"messages": [{"role": "user", "content": "hello"}]},
                                    batch_size=1, temperature=0, max_generate_length=4), encoding="utf-8")
    output_file, profile_file = tmp_path / "out.json", tmp_path / "profile.json"
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file,
                    "--outputFile", output_file, "--profileOutputFile", profile_file])
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr

    responses = json.loads(output_file.read_text(encoding="utf-8"))["responses"]
    assert [r["request_idx"] for r in responses] == [0, 1]
    assert [r["batch_idx"] for r in responses] == [0, 1]  # batch_size 1: one batch per request
    for r in responses:
        assert set(r) >= RESPONSE_KEYS, set(r)
        assert isinstance(r["output_text"], str)
        assert r["finish_reason"] in FINISH_REASONS
        assert r["usage"]["prompt_tokens"] > 0
        assert 1 <= r["usage"]["completion_tokens"] <= 4
        assert {"ttft_ms", "prefill_ms", "decode_ms"} <= set(r["timing"])
        assert all(r["timing"][k] >= 0 for k in ("ttft_ms", "prefill_ms", "decode_ms"))
    # byte-level tokenizer: "hello" is 3 tokens longer than "hi" under the same chat template
    assert responses[1]["usage"]["prompt_tokens"] - responses[0]["usage"]["prompt_tokens"] == 3

    profile = json.loads(profile_file.read_text(encoding="utf-8"))
    assert {"prefill", "generation", "stages", "peak_cpu_memory_bytes"} <= set(profile)
    stages = {s["stage_id"]: s for s in profile["stages"]}
    assert {"llm_prefill", "llm_generation"} <= set(stages)
    for stage in stages.values():
        assert "gpu_time_stats" in stage and stage["gpu_time_stats"]["count"] == stage["total_runs"]
    assert stages["llm_prefill"]["total_runs"] >= 2  # one prefill call per batch
    assert profile["peak_cpu_memory_bytes"] > 0


@pytest.mark.parametrize("script", ["llm_export", "llm_build", "llm_inference"])
def test_help_shows_examples(run_cli, script: str) -> None:
    proc = run_cli([script, "--help"])
    assert proc.returncode == 0, proc.stderr
    out = ANSI.sub("", proc.stdout)
    assert "Examples" in out
    examples = out.split("Examples", 1)[1]
    assert f"{script} " in examples and "--" in examples


# ------------------------------------------------------------------------------------------ flag parsing

@pytest.mark.parametrize("args, needles", [
    pytest.param(["llm_build", "--onnxDir", "x"], ("--engineDir", "llm_build --help"), id="missing-required-flag"),
    pytest.param(["llm_build", "--onnxDir", "x", "--engineDir", "y", "--maxInputLen", "abc"],
                 ("--maxInputLen", "integer"), id="flag-not-an-int"),
    pytest.param(["llm_inference", "--bogus"], ("--bogus",), id="unknown-flag"),
])
def test_flag_parsing_errors_are_one_line(run_cli, args: list[str], needles: tuple[str, ...]) -> None:
    assert_one_line_error(run_cli(args), *needles)


# ------------------------------------------------------------------------------------------ context reuse

REUSE_CASES = [
    pytest.param(_requests(context_cache_commit_policy="everything"), [],
                 ("context_cache_commit_policy", "prefill_state_only"), id="unknown-commit-policy"),
    pytest.param(_requests({"messages": [HI], "cache_salt": 7}), ["--enableContextReuse"],
                 ("requests[0].cache_salt", "string"), id="non-string-salt"),
    pytest.param(_requests({"messages": [HI], "save_system_prompt_kv_cache": True}), ["--enableContextReuse"],
                 ("requests[0].save_system_prompt_kv_cache", "--enableContextReuse"), id="legacy-cache-with-reuse"),
    pytest.param(_requests(), ["--enableContextReuse", "--contextCacheMaxRecords", "-1"],
                 ("--contextCacheMaxRecords", "-1"), id="negative-record-limit"),
    # Engine settings are checked by the engine under domain names; llm_inference shows its flags.
    pytest.param(_requests(), ["--scheduling", "eager"], ("--scheduling", "continuous", "eager"),
                 id="unknown-scheduling"),
    pytest.param(_requests(), ["--maxNumTokens", "-5"], ("--maxNumTokens", "-5"), id="negative-token-budget"),
    pytest.param(_requests(), ["--prefillChunkSize", "-1"], ("--prefillChunkSize", "-1"), id="negative-chunk"),
    pytest.param(_requests(), ["--numThreads", "-1"], ("--numThreads", "-1"), id="negative-threads"),
    pytest.param(_requests(), ["--batchSize", "0"], ("--batchSize", "0"), id="batch-size-override-0"),
    pytest.param(_requests(), ["--numLogprobs", "51"], ("--numLogprobs", "51"), id="num-logprobs-override-51"),
    # Partial-KV snapshots: a budget needs reuse on and room for one slot (a K+V page per layer).
    pytest.param(_requests(), ["--contextCachePartialKVSnapshotPoolBytes", "1048576"],
                 ("--contextCachePartialKVSnapshotPoolBytes", "--enableContextReuse"), id="snapshot-budget-no-reuse"),
    pytest.param(_requests(), ["--enableContextReuse", "--contextCachePartialKVSnapshotPoolBytes", "100"],
                 ("--contextCachePartialKVSnapshotPoolBytes", "100 bytes", "no partial-KV snapshot slot"),
                 id="snapshot-budget-below-one-slot"),
    pytest.param(_requests(), ["--enableContextReuse", "--contextCachePartialKVSnapshotPoolBytes", "-1"],
                 ("--contextCachePartialKVSnapshotPoolBytes", "-1"), id="snapshot-budget-negative"),
    # The shared tier: a second level of reuse, on a store some backend takes, checked before anything loads.
    pytest.param(_requests(), ["--sharedCache", "redis://127.0.0.1:1/0"], ("--sharedCache", "--enableContextReuse"),
                 id="shared-cache-no-reuse"),
    pytest.param(_requests(), ["--enableContextReuse", "--sharedCache", "memcached://127.0.0.1:11211"],
                 ("--sharedCache", "unknown scheme", "redis://"), id="shared-cache-unknown-scheme"),
    pytest.param(_requests(), ["--enableContextReuse", "--sharedCache", "redis://127.0.0.1:1/0",
                               "--sharedCacheTimeoutMs", "0"], ("--sharedCacheTimeoutMs", "> 0"),
                 id="shared-cache-zero-timeout"),
]


@pytest.mark.parametrize("content, flags, needles", REUSE_CASES)
def test_bad_reuse_input(run_cli, tiny_engine_dir: Path, tmp_path: Path, content: str, flags: list[str],
                         needles: tuple[str, ...]) -> None:
    input_file = tmp_path / "in.json"
    input_file.write_text(content, encoding="utf-8")
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file,
                    "--outputFile", tmp_path / "out.json", *flags])
    assert_one_line_error(proc, *needles)


def test_reuse_profile_has_context_cache_counters(run_cli, tiny_engine_dir: Path, tmp_path: Path) -> None:
    long = {"role": "user", "content": "a shared context of a few pages"}
    input_file = tmp_path / "in.json"
    input_file.write_text(_requests({"messages": [long]}, {"messages": [long]}, temperature=0.0,
                                    max_generate_length=2), encoding="utf-8")
    profile = tmp_path / "profile.json"
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file,
                    "--outputFile", tmp_path / "out.json", "--profileOutputFile", profile, "--enableContextReuse",
                    "--warmup", "1"])
    assert proc.returncode == 0, proc.stderr
    cache = json.loads(profile.read_text())["context_cache"]
    for key in ("admitted_sequences", "hit_sequences", "media_aware_sequences", "lookup_bypass_sequences",
                "forced_cold_sequences", "matched_tokens", "reused_tokens", "planning_nanoseconds"):
        assert isinstance(cache[key], int), key
    assert set(cache["plans"]) == {"standard", "no_reusable_prefix", "full_input_rewind"}
    assert set(cache["publications"]) == {"attempts", "committed", "existing", "successful_endpoints"}
    assert set(cache["resource_pools"]) == set(cache["reclaimed_resources"]) == {
        "base_kv_pages", "draft_kv_pages", "recurrent_snapshots", "partial_kv_snapshots", "document_kv_pages",
        "sliding_window_pages", "adapter_corrections"}
    assert cache["admitted_sequences"] == 3 and cache["lookup_bypass_sequences"] == 1  # the warmup bypassed
    assert cache["hit_sequences"] == 1 and cache["reused_tokens"] > 0
    responses = json.loads((tmp_path / "out.json").read_text())["responses"]
    assert responses[0]["output_text"] == responses[1]["output_text"]
    assert responses[1]["usage"]["cached_tokens"] == cache["reused_tokens"]


def test_adapter_on_an_engine_without_lora(run_cli, tiny_engine_dir: Path, tmp_path: Path) -> None:
    input_file = tmp_path / "in.json"
    input_file.write_text(_requests({"messages": [HI], "lora_name": "x"},
                                    available_lora_weights={"x": str(tmp_path / "x.safetensors")}), encoding="utf-8")
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file,
                    "--outputFile", tmp_path / "out.json"])
    assert_one_line_error(proc, 'available_lora_weights["x"]', "--maxLoraRank")


def test_export_lora_missing_adapter_config(run_cli, tiny_onnx_dir: Path, tmp_path: Path) -> None:
    proc = run_cli(["llm_export", "lora", "--adapterDir", tmp_path, "--onnxDir", tiny_onnx_dir,
                    "--output", tmp_path / "a.safetensors"])
    assert_one_line_error(proc, "--adapterDir", "adapter_config.json")


def test_continuous_scheduling_matches_static_through_the_cli(run_cli, tiny_engine_dir: Path, tmp_path: Path) -> None:
    questions = ["What is in the report?", "Who wrote it?", "When?", "Why?", "Summarize it."]
    doc = "A tides and cranes report: "  # with the question under maxInputLen 64
    input_file = tmp_path / "in.json"
    input_file.write_text(json.dumps({"batch_size": 2, "temperature": 0.0, "max_generate_length": 6,
                                      "num_logprobs": 1, "apply_chat_template": False,
                                      "requests": [{"messages": [{"role": "user", "content": doc + q}]}
                                                   for q in questions]}), encoding="utf-8")
    outputs = {}
    for scheduling in ("static", "continuous"):
        out, profile = tmp_path / f"{scheduling}.json", tmp_path / f"{scheduling}.profile.json"
        proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file, "--outputFile",
                        out, "--profileOutputFile", profile, "--scheduling", scheduling, "--enableContextReuse"])
        assert proc.returncode == 0, proc.stderr
        outputs[scheduling] = [(r["output_text"], r["finish_reason"], [s[0]["token_id"] for s in r["logprobs"]],
                                r["batch_idx"]) for r in json.loads(out.read_text())["responses"]]
        scheduler = json.loads(profile.read_text())["scheduler"]
        assert scheduler["max_running"] == (2 if scheduling == "static" else 4)  # tiny engine: maxBatchSize 4
    assert outputs["static"] == outputs["continuous"]
    assert [o[3] for o in outputs["continuous"]] == [0, 0, 1, 1, 2]
