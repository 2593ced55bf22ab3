"""The cheap LM head: quantized blocks rank the vocabulary, their top-k are rescored against the float head."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.numpy_llama import dense_logits

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import TIED_HEAD_INPUT
from kvforge.runtime.context_cache.manager import Admission
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.quantize import EMBEDDING, LM_HEAD, set_accuracy_level
from kvforge.tools.export.quantize_model import quantize_linears
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

# Float32 prefill: these compare logits with a float reference to 1e-5 (bf16 prefill rounds to ~3e-3).
BUILD = BuildOptions(max_input_len=64, max_kv_cache_capacity=128, max_batch_size=2, tokens_per_page=16,
                     cpu_prefill_matmul="fp32")
CANDIDATES = 8


def _export(tmp_path: Path, model: str, lm_head: str, candidates: int = CANDIDATES, kv: str = "fp32"):
    loaded = synthetic_model(model, kv_cache_dtype=kv)
    quantize_linears(loaded, "int4", 32, lm_head=lm_head, lm_head_candidates=candidates)
    write_onnx_dir(loaded, tmp_path / f"onnx-{lm_head}")
    build_engine(tmp_path / f"onnx-{lm_head}", tmp_path / f"engine-{lm_head}", BUILD)
    return loaded, tmp_path / f"engine-{lm_head}"


def _logits(engine: Engine, ids: list[int]) -> np.ndarray:
    """The raw logits row of one prefill call over `ids` (the engine's runner, as experiments/quality/quality.py
    drives it)."""
    lease = engine.cache.try_acquire(Admission(ids))
    assert lease is not None
    try:
        embeds = engine.executor.embedding[ids][None]
        return engine.backend.forward(StepInputs(embeds, np.array([len(ids)], np.int32), np.zeros(1, np.int32),
                                                [lease.page_ids])).logits[0]
    finally:
        engine.cache.release(lease)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])  # an untied head, and one tied to the embedding
def test_rescored_candidates_equal_the_float_head(model: str, tmp_path: Path) -> None:
    """The k best tokens of the approximate head get exactly the float head's logits; every other token keeps
    the approximate one. Accuracy level 0 everywhere makes the approximate head reproducible in numpy."""
    loaded, engine_dir = _export(tmp_path, model, "int4")
    config = loaded.config
    assert (config.lm_head, config.lm_head_candidates) == ("int4", CANDIDATES)
    float_head = loaded.weights[EMBEDDING if config.tie_word_embeddings else LM_HEAD]
    layers = {name: blocks.dequantize().T for name, blocks in loaded.quantized.items() if name != LM_HEAD}
    exact = dense_logits(config, {**loaded.weights, **layers, LM_HEAD: float_head}, ids := list(range(4, 30)))[-1]
    approx = dense_logits(config, {**loaded.weights, **layers,
                                   LM_HEAD: loaded.quantized[LM_HEAD].dequantize().T}, ids)[-1]
    order = np.argsort(-approx)
    assert approx[order[CANDIDATES - 1]] - approx[order[CANDIDATES]] > 1e-3  # the candidate set is unambiguous
    candidates, others = order[:CANDIDATES], order[CANDIDATES:]

    graph = onnx.load(engine_dir / "model.onnx", load_external_data=False).graph
    assert (TIED_HEAD_INPUT in [i.name for i in graph.input]) == config.tie_word_embeddings  # no second copy
    set_accuracy_level(engine_dir, 0)
    got = _logits(Engine(engine_dir, EngineConfig(num_threads=2)), ids)
    np.testing.assert_allclose(got[candidates], exact[candidates], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[others], approx[others], rtol=1e-5, atol=1e-4)
    assert np.abs(exact[candidates] - approx[candidates]).max() > 1e-3  # the rescoring changed something


def test_a_rescored_head_greedy_decodes_like_the_float_head(tmp_path: Path) -> None:
    """Same int4 layers, float head vs int4 head (accuracy level 4, as exported) + rescoring: equal greedy tokens
    and top-1 ids for a batch of two prompts."""
    engines = {head: _export(tmp_path, "tiny-llama", head, kv="fp16")[1] for head in ("float", "int4")}
    prompts = [list(range(3, 21)), [7, 9, 11, 40, 41, 5, 6]]
    results = {}
    for head, engine_dir in engines.items():
        engine = Engine(engine_dir, EngineConfig(num_threads=2))
        for prompt in prompts:
            engine.add_request(EngineRequest(prompt, SamplingParams(temperature=0.0, max_generate_length=12,
                                                                    num_logprobs=1)))
        outputs = []
        while engine.has_unfinished():
            outputs += [o for o in engine.step() if o.finished]
        results[head] = sorted((o.request_id, o.token_ids) for o in outputs)
    assert results["float"] == results["int4"]


def test_config_records_the_head_and_the_flag_refuses_bad_values(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["llm_export", "--synthetic", "tiny-llama", "--outputDir", tmp_path / "ok",
                    "--quantization", "int4", "--lmHead", "int8", "--lmHeadCandidates", "4"])
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert (config["lm_head"], config["lm_head_candidates"]) == ("int8", 4)
    for flags, needle in ((["--quantization", "int4", "--lmHead", "int3"], "int3"),
                          (["--quantization", "none", "--lmHead", "int4"], "--quantization int4"),
                          (["--quantization", "int4", "--lmHeadCandidates", "-1"], "--lmHeadCandidates"),
                          (["--quantization", "none", "--prefillInt8Rows", "64"], "--prefillInt8Rows")):
        proc = run_cli(["llm_export", "--synthetic", "tiny-llama", "--outputDir", tmp_path / "bad", *flags])
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not (tmp_path / "bad" / "config.json").exists()
