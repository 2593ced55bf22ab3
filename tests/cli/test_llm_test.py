"""llm_test: config strings resolve as in the seed's harness, every check type fails with a one-line reason, the
shipped test cases pass with their counters asserted, and the console script's exit codes, JSON and JUnit hold."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from conftest import strip_ansi
from support.engine_driver import lora_model_with_adapters

from kvforge.builder.build import BuildOptions
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import KvforgeError
from kvforge.tools.testcases.checks import (
    FAILED,
    PASSED,
    counter_mismatches,
    identity_check,
    reuse_check,
    rouge_check,
    rouge_scorer,
)
from kvforge.tools.testcases.config_string import check_engine, named_test_case, parse_config

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

ROOT = Path(__file__).resolve().parents[2]
TEST_CASES = ROOT / "test_cases"
SEED_BUILD = "mxsl1024-mxbs1-mxil1024-mxkvp64"  # the seed's tests/python-unittests/test_pipeline_context_reuse.py
SEED_INFERENCE = f"{SEED_BUILD}-ctxreuse-ccrsb67108864-ccpkvsb67108864-llm_context_reuse"
TINY_CONFIG = "mxsl4096-mxbs4-mxil3072-mxlr8-tpp16"  # the Makefile's synthetic run; the files' engine_specific[0]


# --- config strings ---------------------------------------------------------------------------------------

def test_seed_strings_resolve_to_the_seed_harness_flags() -> None:
    build, inference = parse_config(SEED_BUILD), parse_config(SEED_INFERENCE)
    assert build.build_args() == ["--maxKVCacheCapacity=1024", "--maxBatchSize=1", "--maxInputLen=1024",
                                  "--maxKVPoolPages=64"]
    assert inference.build_args() == build.build_args()  # the inference string names the same engine
    assert build.inference_args() == [] and not build.context_reuse
    assert inference.inference_args() == ["--enableContextReuse", "--contextCacheRecurrentSnapshotPoolBytes=67108864",
                                          "--contextCachePartialKVSnapshotPoolBytes=67108864"]
    assert named_test_case(inference, TEST_CASES) == TEST_CASES / "llm_context_reuse.json"
    assert named_test_case(build, TEST_CASES) is None
    assert "ignored" in inference.notes()[0] and build.notes() == []


@pytest.mark.parametrize(("token", "setting", "value"), [
    ("mxsl2048", "max_kv_cache_capacity", 2048), ("mxbs2", "max_batch_size", 2), ("mxil512", "max_input_len", 512),
    ("mxkvp0", "max_kv_pool_pages", 0), ("mxlr16", "max_lora_rank", 16), ("tpp64", "tokens_per_page", 64),
])
def test_each_build_token_sets_its_build_option(token: str, setting: str, value: int) -> None:
    assert parse_config(token).build_options() == {setting: value}


def test_run_tokens_become_inference_flags() -> None:
    config = parse_config("bs4-ctxreuse-ccpkvsb8")
    assert config.batch_size == 4 and config.context_reuse and config.build_options() == {}
    assert config.inference_args() == ["--enableContextReuse", "--batchSize=4",
                                       "--contextCachePartialKVSnapshotPoolBytes=8"]


@pytest.mark.parametrize(("text", "says"), [
    ("mxbs1-foo-mxil64", "unknown token 'foo'"),
    ("Qwen3.5-4B-nvfp4-mxbs1", "unknown token 'Qwen3.5'"),  # the seed's <model>-<precision> prefix
    ("mxbs1--mxil64", "unknown token ''"),
    ("mxbs0", "--maxBatchSize must be positive"),
    ("ctxreuse-ccrsb0", "--contextCacheRecurrentSnapshotPoolBytes must be positive"),
    ("mxbs1-mxbs2", "mxbs is given twice"),
    (f"{SEED_BUILD}-ccrsb67108864-llm_context_reuse", "snapshot pool budgets require ctxreuse"),
    ("mxbs1-ccpkvsb67108864", "snapshot pool budgets require ctxreuse"),
])
def test_bad_config_strings_are_refused_in_one_line(text: str, says: str) -> None:
    with pytest.raises(KvforgeError) as info:
        parse_config(text)
    assert info.value.field == "--config" and says in info.value.message and "\n" not in str(info.value)


def test_a_last_token_that_names_no_test_case_is_refused() -> None:
    with pytest.raises(KvforgeError, match="neither a known token .* nor a test case"):
        named_test_case(parse_config("mxbs1-no_such_case"), TEST_CASES)


def test_build_tokens_must_match_a_given_engine(tiny_engine_dir: Path, tiny_build_options: BuildOptions) -> None:
    build = load_engine_dir(tiny_engine_dir).build
    check_engine(parse_config(f"mxbs{tiny_build_options.max_batch_size}-tpp16-mxkvp0-ctxreuse"), build,
                 tiny_engine_dir)
    with pytest.raises(KvforgeError, match="asks for maxBatchSize 1 but the engine .* was built with 4"):
        check_engine(parse_config("mxbs1"), build, tiny_engine_dir)


# --- each check type, alone -------------------------------------------------------------------------------

def _response(text: str, ids: list[int], finish: str = "max-length") -> dict[str, Any]:
    return {"output_text": text, "finish_reason": finish, "logprobs": [[{"token_id": i}] for i in ids]}


def test_rouge_uses_the_seed_thresholds_and_explains_a_miss_in_one_line() -> None:
    score = rouge_scorer()
    ok = rouge_check(0, "The capital of France is Paris.", "Paris is the capital of France.", (0.25, 0.2), score)
    assert ok.status == PASSED
    miss = rouge_check(3, "The capital of France is Paris.", "Berlin.\nDefinitely Berlin.", (0.25, 0.2), score)
    assert miss.status == FAILED and miss.name == "rouge[3]"
    assert miss.reason.startswith("ROUGE-1 0.000 (min 0.25), ROUGE-L 0.000 (min 0.2)") and "\n" not in miss.reason
    assert rouge_check(0, "a b c d", "a b x y", (0.6, 0.2), score).status == FAILED  # ROUGE-1 0.5 < 0.6


def test_identity_compares_text_finish_reason_and_top1_ids() -> None:
    base = _response("NVIDIA", [5, 6])
    assert identity_check([base, {}, _response("NVIDIA", [5, 6])], 0, 2).status == PASSED
    cases = [(_response("Intel", [5, 6]), "output_text differs"),
             (_response("NVIDIA", [5, 6], "end-of-sequence"), "finish_reason differs"),
             (_response("NVIDIA", [5, 7]), "top-1 logprob ids differ at step 1: [6] vs [7]"),
             ({"output_text": "NVIDIA", "finish_reason": "max-length"}, "no logprobs to compare")]
    for other, reason in cases:
        result = identity_check([base, other], 0, 1)
        assert result.status == FAILED and reason in result.reason and "\n" not in result.reason


def test_reuse_needs_positive_reused_tokens() -> None:
    assert reuse_check({"prefill": {"reused_tokens": 128}}).status == PASSED
    zero = reuse_check({"prefill": {"reused_tokens": 0}})
    assert zero.status == FAILED and "prefill.reused_tokens is 0" in zero.reason


def test_counters_compare_only_expected_keys_nested() -> None:
    actual = {"hit_sequences": 2, "plans": {"standard": 2, "no_reusable_prefix": 1}, "extra": 9}
    assert counter_mismatches({"hit_sequences": 2, "plans": {"standard": 2}}, actual, "context_cache") == []
    wrong = counter_mismatches({"hit_sequences": 3, "plans": {"full_input_rewind": 0}}, actual, "context_cache")
    assert wrong == ["context_cache.hit_sequences expected 3, got 2",
                     "context_cache.plans.full_input_rewind missing from the profile"]


# --- the console script on the tiny engine ----------------------------------------------------------------

def _write(directory: Path, name: str, requests: list[str], **top: Any) -> Path:
    data = {"temperature": 0.0, "max_generate_length": 4, "num_logprobs": 1, "apply_chat_template": False, **top,
            "requests": [{"messages": [{"role": "user", "content": p}]} for p in requests]}
    path = directory / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


SHARED = "abcdefghijklmnopqrstuvwxyz0123456789ABCD"  # 40 bytes: two full 16-token pages of the tiny byte-level model


@pytest.fixture(scope="module")
def check_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One file per check type that must fail, and one that passes everything it declares."""
    d = tmp_path_factory.mktemp("cases")
    good = {"_checks": {"context_reuse": True, "identical": [[0, 1]]},
            "expected_context_cache": {"admitted_sequences": 2, "hit_sequences": 1,
                                       "plans": {"standard": 1, "no_reusable_prefix": 1}},
            "expected_prefill": {"reused_tokens": 32}}
    files = {
        "good": _write(d, "good.json", [SHARED, SHARED], **good),
        "counters": _write(d, "counters.json", [SHARED, SHARED], **{**good, "expected_prefill": {"reused_tokens": 33}}),
        "identity": _write(d, "identity.json", [SHARED, "zz" * 20], _checks={"identical": [[0, 1]]}),
        "reuse": _write(d, "reuse.json", [SHARED, "zz" * 20], _checks={"context_reuse": True}),
    }
    reference = json.loads(files["good"].read_text())
    reference["requests"][0]["reference"] = "The capital of France is Paris."
    files["reference"] = d / "reference.json"
    files["reference"].write_text(json.dumps(reference), encoding="utf-8")
    return files


def _report(run_cli, args: list[Any], tmp_path: Path) -> tuple[Any, dict[str, Any], ET.Element]:
    report, junit = tmp_path / "report.json", tmp_path / "junit.xml"
    result = run_cli(["llm_test", *args, "--jsonReport", report, "--junitXml", junit])
    return result, json.loads(report.read_text()), ET.parse(junit).getroot()


def _checks(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, str]]:
    return {(Path(f["file"]).stem, c["name"]): c for f in report["files"] for c in f["checks"]}


def test_each_check_type_fails_with_a_one_line_reason(run_cli, tiny_engine_dir: Path, check_files: dict[str, Path],
                                                      tmp_path: Path) -> None:
    result, report, junit = _report(run_cli, ["--engineDir", tiny_engine_dir, "--rouge", "on",
                                              *check_files.values()], tmp_path)
    assert result.returncode == 1, result.stderr
    checks = _checks(report)
    expected_failures = {
        ("counters", "expected_prefill"): "prefill.reused_tokens expected 33, got 32",
        ("identity", "identical[0,1]"): "differ",
        ("reuse", "reused_tokens>0"): "prefill.reused_tokens is 0",
        ("reference", "rouge[0]"): "ROUGE-1 ",
    }
    failed = {key: c["reason"] for key, c in checks.items() if c["status"] == FAILED}
    assert set(failed) == set(expected_failures)
    for key, phrase in expected_failures.items():
        assert phrase in failed[key] and "\n" not in failed[key]
    assert all(c["status"] == PASSED for (stem, _), c in checks.items() if stem == "good")
    assert checks[("good", "identical[0,1]")]["status"] == PASSED  # reuse leaves the answer unchanged
    table = strip_ansi(result.stdout)
    assert "FAIL  counters.json expected_prefill: prefill.reused_tokens expected 33, got 32" in table
    # JUnit XML: well formed, and its counts agree with the JSON report.
    assert junit.tag == "testsuites" and int(junit.get("failures")) == report["summary"]["failed"] == 4
    cases = junit.findall("testsuite/testcase")
    assert len(cases) == sum(len(f["checks"]) for f in report["files"])
    assert {c.get("name") for c in cases if c.find("failure") is not None} == {n for _, n in expected_failures}
    assert [s.get("name") for s in junit.findall("testsuite")] == [p.name for p in check_files.values()]


def test_rouge_is_skipped_with_its_reason_on_a_synthetic_engine(run_cli, tiny_engine_dir: Path,
                                                                check_files: dict[str, Path], tmp_path: Path) -> None:
    result, report, junit = _report(run_cli, ["--engineDir", tiny_engine_dir, check_files["reference"]], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    rouge = _checks(report)[("reference", "rouge[0]")]
    assert rouge["status"] == "skipped" and "synthetic engine" in rouge["reason"]
    assert "SKIP  reference.json rouge[0]: synthetic engine" in strip_ansi(result.stdout)
    assert junit.find("testsuite/testcase[@name='rouge[0]']/skipped") is not None
    off = run_cli(["llm_test", "--engineDir", tiny_engine_dir, "--rouge", "off", check_files["reference"]])
    assert off.returncode == 0 and "rouge[0]: --rouge off" in strip_ansi(off.stdout)


def test_bad_input_exits_2_with_one_line(run_cli, tiny_engine_dir: Path, check_files: dict[str, Path],
                                         tmp_path: Path) -> None:
    malformed = tmp_path / "malformed.json"
    malformed.write_text("{", encoding="utf-8")
    typo = _write(tmp_path, "typo.json", ["x"], _checks={"identicl": [[0, 1]]})
    out_of_range = _write(tmp_path, "range.json", ["x"], _checks={"identical": [[0, 3]]})
    too_wide = _write(tmp_path, "wide.json", ["x"] * 8, batch_size=8)  # the engine runs 4 rows: cannot run
    engine = ["--engineDir", tiny_engine_dir]
    cases = [
        ([*engine, tmp_path / "missing.json"], "request file not found"),
        ([*engine, malformed], "malformed JSON"),
        ([*engine, typo], "_checks.identicl: unknown check"),
        ([*engine, out_of_range], "_checks.identical[0]: must be an integer in 0..0"),
        ([*engine, "--config", "mxbs4-bogus-tpp16", check_files["good"]], "--config: unknown token 'bogus'"),
        ([*engine, "--config", "ccrsb64", check_files["good"]], "snapshot pool budgets require ctxreuse"),
        ([*engine, "--config", "mxbs1", check_files["good"]], "asks for maxBatchSize 1"),
        ([*engine, "--rougeThresholds", "0.3", check_files["good"]], "--rougeThresholds"),
        ([check_files["good"]], "give either --engineDir DIR or --onnxDir DIR"),
        ([*engine], "no test files"),
        ([*engine, too_wide, check_files["good"]], "1 of 2 files could not run (first: wide.json: batch_size: 8"),
    ]
    for args, says in cases:
        result = run_cli(["llm_test", *args])
        lines = strip_ansi(result.stderr).strip().splitlines()
        assert result.returncode == 2, (args, result.stderr)
        assert lines[-1].startswith("error: ") and says in lines[-1], (args, lines)
        assert "Traceback" not in result.stderr


def test_built_engines_are_cached_by_resolved_flags(run_cli, tiny_onnx_dir: Path, check_files: dict[str, Path],
                                                    tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = ["llm_test", "--onnxDir", tiny_onnx_dir, "--cacheDir", cache, check_files["good"]]
    first = run_cli([*args, "--config", "mxsl256-mxbs2-mxil64-tpp16"])
    second = run_cli([*args, "--config", "mxil64-tpp16-mxsl256-mxbs2"])  # same flags, other order: same engine
    other = run_cli([*args, "--config", "mxsl256-mxbs4-mxil64-tpp16"])
    assert [r.returncode for r in (first, second, other)] == [0, 0, 0], first.stderr + other.stderr
    assert "built in" in first.stderr and "cached" in second.stderr and "built in" in other.stderr
    engines = sorted(p.name for p in cache.iterdir())
    assert len(engines) == 2 and all(p.startswith(tiny_onnx_dir.name) for p in engines)
    assert load_engine_dir(cache / engines[0]).build.tokens_per_page == 16


@pytest.fixture(scope="module")
def tiny_lora_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA-capable tiny-llama ONNX dir with the two adapters test_cases/llm_lora.json names."""
    root = tmp_path_factory.mktemp("tiny_lora")
    lora_model_with_adapters(root, BuildOptions(max_input_len=64, max_kv_cache_capacity=128, max_lora_rank=8),
                             "fp16", (("summarizer", 1, 8), ("classifier", 2, 8)))
    return root


@pytest.mark.parametrize("scheduling", ["static", "continuous"])
def test_shipped_test_cases_pass_with_their_counters(run_cli, tiny_lora_model: Path, tmp_path: Path,
                                                     scheduling: str) -> None:
    """Every file in test_cases/ declares checks, and on the synthetic engine of `make test` they all hold."""
    files = sorted(TEST_CASES.glob("*.json"))
    result, report, _ = _report(run_cli, ["--onnxDir", tiny_lora_model / "onnx", "--config", TINY_CONFIG,
                                          "--cacheDir", tmp_path / "cache", "--loraWeightsDir", tiny_lora_model,
                                          "--scheduling", scheduling, "--numThreads", "2", *files], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    checks = _checks(report)
    for path in files:
        if path.stem.startswith(("vlm_", "audio_")):  # media files need an encoder engine: test_multimodal/test_audio
            assert checks[(path.stem, "media")]["status"] == "skipped", path.name
            continue
        declared = {name for (stem, name), c in checks.items() if stem == path.stem and c["status"] == PASSED}
        assert "engine_specific[0]" in declared, path.name  # the tiny-llama counters, asserted exactly
        assert any(n.startswith("expected_") for n in declared), path.name
    assert checks[("llm_context_reuse", "identical[0,2]")]["status"] == PASSED
    assert all(checks[(case, "reused_tokens>0")]["status"] == PASSED
               for case in ("llm_context_reuse", "llm_lora", "llm_multiturn_reuse"))


# --- SmolLM2 ----------------------------------------------------------------------------------------------

@pytest.mark.model
def test_smollm2_passes_rouge_and_the_seed_reuse_string(run_cli, smollm2_onnx_dir: Path, tmp_path: Path) -> None:
    """A real model meets the seed's ROUGE thresholds; a seed-style string with a trailing test case runs it."""
    result, report, _ = _report(run_cli, [
        "--onnxDir", smollm2_onnx_dir, "--config", "mxsl2048-mxbs2-mxil1024-tpp64-ctxreuse-llm_context_reuse",
        "--testCasesDir", TEST_CASES, "--cacheDir", tmp_path / "cache", "--numThreads", "2",
        TEST_CASES / "llm_basic.json"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    checks = _checks(report)
    assert checks[("llm_basic", "rouge[0]")]["status"] == PASSED
    for name in ("identical[0,2]", "reused_tokens>0", "expected_context_cache", "engine_specific[1]"):
        assert checks[("llm_context_reuse", name)]["status"] == PASSED, name
