"""The exported Gemma 4 graph (lowered for ONNX Runtime) against transformers' Gemma4ForCausalLM on tiny random
configs the runtime can hold (one head size, no per-layer embeddings, no KV sharing): plain-weight norms, the value
norm, no query scale, layer scalars, proportional RoPE on the global layer, sliding layers (window 32) past their
window. The rest of Gemma 4 is refused in one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.ort_support import cpu_kernel_on
from support.paged_rows import CAPACITY, PATHS, Row, lowered_session

from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.families.gemma4 import build_gemma4_graph, config_from_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
WINDOW, VOCAB = 32, 96


def hf_config(**overrides: object) -> object:
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, global_head_dim=32, hidden_size_per_layer_input=0,
                  max_position_embeddings=CAPACITY, sliding_window=WINDOW,
                  layer_types=["sliding_attention"] * 5 + ["full_attention"], final_logit_softcapping=30.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
    fields.update(overrides)
    return transformers.Gemma4TextConfig(**fields)


def randomised(hf: object, seed: int = 0) -> object:
    """Norms and layer scalars off their init values (ones), embeddings of norm ~1, so each one matters."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
        for name, buffer in hf.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand(1))
    return hf.eval()


def exported(hf: object) -> tuple[ModelConfig, object]:
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    config = config_from_hf(hf.config.to_dict(), kv_cache_dtype="fp32")
    config.validate()
    return config, build_gemma4_graph(config, weights)


@pytest.fixture(scope="module")
def models() -> tuple[object, ModelConfig, object]:
    hf = randomised(transformers.Gemma4ForCausalLM(hf_config()))
    config, model = exported(hf)
    assert config.sliding_window_layers == [0, 1, 2, 3, 4] and config.rope_proportion == 0.25
    assert not config.uniform_rope  # document reuse's key rotation by the table would be wrong here
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    return hf, config, model


def reference_logits(hf: object, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


def prompt(length: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, VOCAB, length)]


@pytest.mark.parametrize("path", PATHS)
def test_chunked_prefill_and_decode_past_the_window_match_transformers(models: tuple, path: str) -> None:
    hf, config, model = models
    row, ids = Row(config, lowered_session(model, path), hf.model.embed_tokens.weight.detach().numpy()), prompt(90)
    row.step(ids[:23])
    row.step(ids[23:61])
    np.testing.assert_allclose(row.step(ids[61:]), reference_logits(hf, ids), atol=2e-4, rtol=0)
    for token in (5, 17, 60):
        ids = ids + [token]
        np.testing.assert_allclose(row.step([token]), reference_logits(hf, ids), atol=2e-4, rtol=0)


def test_greedy_tokens_over_a_1500_token_prompt_equal_transformers(models: tuple) -> None:
    hf, config, model = models
    ids = prompt(1500, seed=2)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    expected = out[0, len(ids):].tolist()
    row = Row(config, lowered_session(model, "kernel" if cpu_kernel_on() else "gqa"),
              hf.model.embed_tokens.weight.detach().numpy())
    assert row.greedy(ids, len(expected), banned=hf.config.eos_token_id) == expected


def test_plain_global_rope_matches_transformers() -> None:
    """A default (not proportional) global RoPE: the table's own rotation, no pre-rotation on that layer type."""
    hf = randomised(transformers.Gemma4ForCausalLM(hf_config(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})), seed=4)
    config, model = exported(hf)
    assert config.rope_proportion == 0.0 and config.rope_theta == 500_000.0
    row, ids = Row(config, lowered_session(model, "gqa"), hf.model.embed_tokens.weight.detach().numpy()), prompt(70)
    np.testing.assert_allclose(row.step(ids), reference_logits(hf, ids), atol=2e-4, rtol=0)


SHARED_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


@pytest.fixture(scope="module")
def shared() -> tuple[object, ModelConfig, object]:
    """The last two layers share K/V: layer 4 (sliding) reads layer 3's pool, layer 5 (global) layer 2's; their
    MLPs are double-wide, as transformers makes the KV-shared layers' with use_double_wide_mlp."""
    hf = randomised(transformers.Gemma4ForCausalLM(hf_config(  # the byte-level tokenizer's 259 tokens fit
        vocab_size=320, layer_types=SHARED_TYPES, num_kv_shared_layers=2, use_double_wide_mlp=True)), seed=5)
    config, model = exported(hf)
    assert config.kv_source_layers == [0, 1, 2, 3, 3, 2] and config.attention_layer_ids == [0, 1, 2, 3]
    assert hf.model.layers[5].mlp.up_proj.weight.shape[0] == 2 * hf.config.intermediate_size
    return hf, config, model


@pytest.mark.parametrize("path", PATHS)
def test_kv_shared_layers_read_their_sources_pool(shared: tuple, path: str) -> None:
    hf, config, model = shared
    names = {i.name for i in model.graph.input}
    assert {"past_key_values_3", "past_key_values_2"} <= names and "past_key_values_4" not in names
    row, ids = Row(config, lowered_session(model, path), hf.model.embed_tokens.weight.detach().numpy()), prompt(80)
    row.step(ids[:45])
    np.testing.assert_allclose(row.step(ids[45:]), reference_logits(hf, ids), atol=2e-4, rtol=0)
    ids = ids + [9]
    np.testing.assert_allclose(row.step([9]), reference_logits(hf, ids), atol=2e-4, rtol=0)


def test_kv_shared_checkpoint_runs_in_the_engine_with_reuse(tmp_path: Path, shared: tuple) -> None:
    """The engine allocates pools for the four owning layers only; a second turn hits the first's pages and both
    greedy answers equal transformers'."""
    from support.engine_driver import make_engine

    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.runtime.sequence import EngineRequest
    from kvforge.runtime.types import SamplingParams
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer
    from kvforge.tools.export.writer import write_onnx_dir

    hf = shared[0]
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    byte_level_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    write_onnx_dir(load_hf_dir(tmp_path / "hf", kv_cache_dtype="fp32"), tmp_path / "onnx")
    build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(max_input_len=256, max_kv_cache_capacity=512,
                                                                      tokens_per_page=16))
    eos = hf.config.eos_token_id
    first = prompt(120, seed=9)
    with torch.no_grad():
        expected_first = hf.generate(torch.tensor([first]), max_new_tokens=5, min_new_tokens=5,
                                     do_sample=False)[0, len(first):].tolist()
        second = first + expected_first + prompt(30, seed=10)
        expected_second = hf.generate(torch.tensor([second]), max_new_tokens=5, min_new_tokens=5,
                                      do_sample=False)[0, len(second):].tolist()
    engine = make_engine(tmp_path / "engine", reuse=True, prefill_chunk_size=64)
    assert len(engine.backend.kv_store.layers) == 4
    greedy = SamplingParams(max_generate_length=5, temperature=0.0, logit_bias={eos: -100.0})
    answers, cached = [], []
    for ids in (first, second):
        engine.add_request(EngineRequest(ids, greedy))
        done = []
        while not done:
            done = [o for o in engine.step() if o.finished]
        answers.append(done[0].token_ids)
        cached.append(done[0].cached_tokens)
    assert answers == [expected_first, expected_second] and cached[1] > 0


def test_hf_checkpoint_dir_exports_and_matches_transformers(tmp_path: Path, models: tuple) -> None:
    from kvforge.contract.files import read_json
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer
    from kvforge.tools.export.writer import write_onnx_dir

    hf = models[0]
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    byte_level_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    loaded = load_hf_dir(tmp_path / "hf", kv_cache_dtype="fp32")
    assert loaded.config.model == "gemma4"
    write_onnx_dir(loaded, tmp_path / "onnx")
    config = ModelConfig.from_dict(read_json(tmp_path / "onnx" / "config.json", "onnx_dir"))
    import onnx

    row = Row(config, lowered_session(onnx.load(tmp_path / "onnx" / "model.onnx"), "gqa"),
              loaded.weights["model.embed_tokens.weight"])
    ids = prompt(70, seed=4)
    row.step(ids[:40])
    np.testing.assert_allclose(row.step(ids[40:]), reference_logits(hf, ids), atol=2e-4, rtol=0)


@pytest.mark.parametrize(("change", "needle"), [
    (dict(hidden_size_per_layer_input=16), "hidden_size_per_layer_input"),
    (dict(per_layer_config={"5": {"head_dim": 64}}), "global_head_dim"),
    (dict(num_kv_shared_layers=6), "num_kv_shared_layers"),
    (dict(attention_k_eq_v=True), "attention_k_eq_v"),
    (dict(enable_moe_block=True), "enable_moe_block"),
    (dict(layer_types=["sliding_attention"] * 5 + ["chunked_attention"]), "layer_types"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "rope_parameters"),
])
def test_what_the_runtime_cannot_hold_yet_is_refused_in_one_line(run_cli, tmp_path: Path, models: tuple,
                                                                 change: dict, needle: str) -> None:
    from support.cli_checks import assert_one_line_error

    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer

    models[0].save_pretrained(tmp_path / "hf", safe_serialization=True)
    byte_level_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf, **change}))
    export = run_cli(["llm_export", tmp_path / "hf", "--outputDir", tmp_path / "onnx"])
    assert_one_line_error(export, needle)


def test_synthetic_engine_answers_equal_transformers_with_reuse(tmp_path: Path) -> None:
    """llm_export's tiny-gemma4 built by llm_build and run by the engine loop: a 300-token prompt, then a second turn
    extending it (a reuse hit); both greedy answers equal transformers'."""
    from support.engine_driver import make_engine

    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.runtime.sequence import EngineRequest
    from kvforge.runtime.types import SamplingParams
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    loaded = synthetic_model("tiny-gemma4", kv_cache_dtype="fp32")
    c = loaded.config
    hf = transformers.Gemma4ForCausalLM(hf_config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings, eos_token_id=c.eos_token_ids[0],
        rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": c.rope_proportion,
                                            "rope_theta": c.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}})).eval()
    keys = hf.load_state_dict({k: torch.tensor(v) for k, v in loaded.weights.items()}, strict=False)
    assert keys.missing_keys == ["lm_head.weight"] and not keys.unexpected_keys  # tied to the embedding
    write_onnx_dir(loaded, tmp_path / "onnx")
    build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(max_input_len=512, max_kv_cache_capacity=1024,
                                                                      tokens_per_page=16))
    eos = c.eos_token_ids[0]
    first = [int(t) for t in np.random.default_rng(6).integers(3, c.vocab_size, 300)]
    with torch.no_grad():
        expected_first = hf.generate(torch.tensor([first]), max_new_tokens=6, min_new_tokens=6,
                                     do_sample=False)[0, 300:].tolist()
        second = first + expected_first + [int(t) for t in np.random.default_rng(7).integers(3, 200, 40)]
        expected_second = hf.generate(torch.tensor([second]), max_new_tokens=6, min_new_tokens=6,
                                      do_sample=False)[0, len(second):].tolist()
    engine = make_engine(tmp_path / "engine", reuse=True, prefill_chunk_size=64)
    greedy = SamplingParams(max_generate_length=6, temperature=0.0, logit_bias={eos: -100.0})
    answers, cached = [], []
    for ids in (first, second):
        engine.add_request(EngineRequest(ids, greedy))
        done = []
        while not done:
            done = [o for o in engine.step() if o.finished]
        answers.append(done[0].token_ids)
        cached.append(done[0].cached_tokens)
    assert answers == [expected_first, expected_second] and cached[1] > 0


def test_multimodal_checkpoint_dir_exports_its_text_model(tmp_path: Path) -> None:
    """A `gemma4` dir (Gemma4ForConditionalGeneration): the text model under model.language_model.*, its logits."""
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer

    full = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=hf_config().to_dict(), vision_config=None, audio_config=None))
    full = randomised(full, seed=6)
    full.save_pretrained(tmp_path / "hf", safe_serialization=True)
    byte_level_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    loaded = load_hf_dir(tmp_path / "hf", kv_cache_dtype="fp32")
    assert loaded.config.model == "gemma4" and all(n.startswith(("model.", "lm_head")) for n in loaded.weights)
    row = Row(loaded.config, lowered_session(build_gemma4_graph(loaded.config, loaded.weights), "gqa"),
              loaded.weights["model.embed_tokens.weight"])
    ids = prompt(60, seed=11)
    with torch.no_grad():
        expected = full(input_ids=torch.tensor([ids])).logits[0, -1].numpy()
    np.testing.assert_allclose(row.step(ids), expected, atol=2e-4, rtol=0)
