"""The exported Gemma 3 graph (lowered for ONNX Runtime) against transformers' Gemma3ForCausalLM on tiny random
configs: sliding layers (window 32) past their window, two RoPE bases, the sandwich norms, query_pre_attn_scalar and
logit soft-capping. The test binds the pools itself, chunked prefill then greedy decoding, on each attention path
the ONNX Runtime lowering has (the CPU kernel, GroupQueryAttention, the op-by-op form)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.lazy_import import LazyModule
from support.ort_support import cpu_kernel_on
from support.paged_rows import CAPACITY, PATHS, Row, lowered_session

from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.families.gemma3 import build_gemma3_graph, config_from_hf

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

torch = LazyModule("torch")
transformers = LazyModule("transformers")
WINDOW, VOCAB = 32, 96
LONG_PROMPT = 1500  # the length, well past the window


def hf_config(**overrides: object) -> object:
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=CAPACITY, sliding_window=WINDOW,
                  layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=24,
                  final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    fields.update(overrides)
    return transformers.Gemma3TextConfig(**fields)


def randomised(hf: object, seed: int = 0) -> object:
    """Norm weights off zero (Gemma's norms multiply by 1 + w) and embeddings of norm ~1, so each one matters."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(0.3 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
            elif param.dim() >= 2:  # the projections too: the constructor drew them from torch's global generator,
                # whose state depends on what ran before in the process (under xdist, on which files a worker took)
                param.normal_(0.0, hf.config.initializer_range)
    return hf.eval()


@pytest.fixture(scope="module")
def models() -> tuple[object, ModelConfig, onnx.ModelProto]:
    hf = randomised(transformers.Gemma3ForCausalLM(hf_config()))
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    config = config_from_hf(hf.config.to_dict(), kv_cache_dtype="fp32")
    config.validate()
    assert config.sliding_window_layers == [0, 1, 2, 3, 4] and config.sliding_window == WINDOW
    assert (config.rope_theta, config.rope_local_theta, config.query_pre_attn_scalar) == (1e6, 1e4, 24.0)
    assert not config.uniform_rope  # document reuse's key rotation by the table would be wrong here
    assert config_from_hf(hf_config(rope_parameters={"full_attention": {"rope_theta": 1e4},
                                                     "sliding_attention": {"rope_theta": 1e4}}).to_dict(),
                          kv_cache_dtype="fp32").uniform_rope
    return hf, config, build_gemma3_graph(config, weights)


def reference_logits(hf: object, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


def reference_greedy(hf: object, prompt: list[int], count: int, banned: int | None = None) -> list[int]:
    """transformers' greedy continuation (its own KV cache and sliding-window masks), `banned` never chosen."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=count, do_sample=False, min_new_tokens=count,
                          suppress_tokens=[banned] if banned is not None else None)
    return out[0, len(prompt):].tolist()


def prompt(length: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, VOCAB, length)]


@pytest.mark.parametrize("path", PATHS)
def test_chunked_prefill_and_decode_past_the_window_match_transformers(models: tuple, path: str) -> None:
    """Chunks that end mid-page and mid-window, then decode steps: every logit equals transformers'."""
    hf, config, model = models
    row, ids = Row(config, lowered_session(model, path), hf.model.embed_tokens.weight.detach().numpy()), prompt(90)
    row.step(ids[:23])
    row.step(ids[23:61])
    np.testing.assert_allclose(row.step(ids[61:]), reference_logits(hf, ids), atol=2e-4, rtol=0)
    for token in (5, 17, 60):
        ids = ids + [token]
        np.testing.assert_allclose(row.step([token]), reference_logits(hf, ids), atol=2e-4, rtol=0)


@pytest.mark.parametrize("path", ["kernel", "gqa"])
def test_linear_rope_scaling_of_the_global_layers_matches_transformers(path: str) -> None:
    """Gemma 3 4B/12B/27B scale their global layers' RoPE linearly (factor 8): a rotation before the table's."""
    hf = randomised(transformers.Gemma3ForCausalLM(hf_config(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})), seed=7)
    config = config_from_hf(hf.config.to_dict(), kv_cache_dtype="fp32")
    assert config.rope_linear_factor == 8.0
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    row = Row(config, lowered_session(build_gemma3_graph(config, weights), path),
              hf.model.embed_tokens.weight.detach().numpy())
    ids = prompt(120, seed=8)
    row.step(ids[:77])
    np.testing.assert_allclose(row.step(ids[77:]), reference_logits(hf, ids), atol=2e-4, rtol=0)


def test_the_window_changes_the_answer(models: tuple) -> None:
    """Guard: the same weights with every layer global answer differently, so the parity above tests the window."""
    hf, config, model = models
    ids = prompt(90)
    row = Row(config, lowered_session(model, "gqa"), hf.model.embed_tokens.weight.detach().numpy())
    wide = randomised(transformers.Gemma3ForCausalLM(hf_config(sliding_window=4096)))
    assert np.abs(row.step(ids) - reference_logits(wide, ids)).max() > 1e-2


def test_greedy_tokens_over_a_1500_token_prompt_equal_transformers(models: tuple) -> None:
    hf, config, model = models
    ids = prompt(LONG_PROMPT, seed=2)
    expected = reference_greedy(hf, ids, 8)
    path = "kernel" if cpu_kernel_on() else "gqa"
    row = Row(config, lowered_session(model, path), hf.model.embed_tokens.weight.detach().numpy())
    assert row.greedy(ids, len(expected), banned=hf.config.eos_token_id) == expected


# --- export: an HF checkpoint dir through llm_export's loader and writer, its chat template kept ------------------

def save_checkpoint(hf: object, directory: Path, chat_template: str | None = None) -> Path:
    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer

    hf.save_pretrained(directory, safe_serialization=True)
    byte_level_tokenizer().save(str(directory / "tokenizer.json"))
    if chat_template is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    return directory


def test_hf_checkpoint_dir_exports_with_its_chat_template(tmp_path: Path, models: tuple) -> None:
    from kvforge.contract.files import read_json
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.writer import write_onnx_dir

    template = "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    checkpoint = save_checkpoint(models[0], tmp_path / "hf", template)
    loaded = load_hf_dir(checkpoint, kv_cache_dtype="fp32")
    assert loaded.config.model == "gemma3" and loaded.config.tie_word_embeddings
    write_onnx_dir(loaded, tmp_path / "onnx")
    assert read_json(tmp_path / "onnx" / "tokenizer_config.json", "t")["chat_template"] == template
    config = ModelConfig.from_dict(read_json(tmp_path / "onnx" / "config.json", "onnx_dir"))
    row = Row(config, lowered_session(onnx.load(tmp_path / "onnx" / "model.onnx"), "gqa"),
              loaded.weights["model.embed_tokens.weight"])
    ids = prompt(70, seed=4)
    row.step(ids[:40])
    np.testing.assert_allclose(row.step(ids[40:]), reference_logits(models[0], ids), atol=2e-4, rtol=0)


def test_multimodal_checkpoint_dir_exports_its_text_model(tmp_path: Path) -> None:
    """A `gemma3` dir (Gemma3ForConditionalGeneration, what Google ships): the text model under
    model.language_model.*, the vision tower and projector skipped; logits match Gemma3ForCausalLM over those
    weights (transformers' multimodal forward never applies the text config's final_logit_softcapping, 30 here;
    Google's multimodal checkpoints leave it unset, where the two agree)."""
    from kvforge.tools.export.sources.hf import load_hf_dir

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4)
    full = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=hf_config().to_dict(), vision_config=vision, mm_tokens_per_image=4))
    full = randomised(full, seed=3)
    loaded = load_hf_dir(save_checkpoint(full, tmp_path / "hf"), kv_cache_dtype="fp32")
    assert loaded.config.model == "gemma3" and not any("vision" in name for name in loaded.weights)
    row = Row(loaded.config, lowered_session(build_gemma3_graph(loaded.config, loaded.weights), "gqa"),
              loaded.weights["model.embed_tokens.weight"])
    ids = prompt(50, seed=5)
    text = transformers.Gemma3ForCausalLM(hf_config()).eval()
    loaded_keys = text.load_state_dict({name.replace("model.language_model.", "model."): value for name, value in
                                        full.state_dict().items() if name.startswith("model.language_model.")},
                                       strict=False)
    assert loaded_keys.missing_keys in ([], ["lm_head.weight"]) and not loaded_keys.unexpected_keys  # tied head
    np.testing.assert_allclose(row.step(ids), reference_logits(text, ids), atol=2e-4, rtol=0)


@pytest.mark.parametrize(("change", "needle"), [
    (dict(layer_types=["sliding_attention"] * 5 + ["chunked_attention"]), "layer_types"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "rope_parameters"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "rope_parameters"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="relu"), "hidden_activation"),
])
def test_configs_the_exporter_cannot_reproduce_are_refused_in_one_line(run_cli, tmp_path: Path, models: tuple,
                                                                       change: dict, needle: str) -> None:
    from support.cli_checks import assert_one_line_error

    checkpoint = save_checkpoint(models[0], tmp_path / "hf")
    hf = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**hf, **change}))
    export = run_cli(["llm_export", checkpoint, "--outputDir", tmp_path / "onnx"])
    assert_one_line_error(export, needle)


# --- the engine: llm_export's synthetic tiny-gemma3 built by llm_build, run by the engine loop with reuse -----------

def hf_twin(c: ModelConfig) -> object:
    """transformers' Gemma3ForCausalLM for a kvforge gemma3 ModelConfig (weights loaded by the caller)."""
    return transformers.Gemma3ForCausalLM(hf_config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        sliding_window=c.sliding_window, query_pre_attn_scalar=int(c.query_pre_attn_scalar),
        final_logit_softcapping=c.final_logit_softcapping, tie_word_embeddings=c.tie_word_embeddings,
        layer_types=["sliding_attention" if i in c.sliding_window_layers else "full_attention"
                     for i in range(c.num_hidden_layers)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}})).eval()


def test_synthetic_engine_answers_equal_transformers_with_and_without_reuse(tmp_path: Path) -> None:
    """A 300-token prompt, then a second turn extending it: greedy answers equal transformers' cold and warm, and
    the second turn reuses the first's pages (every layer keeps a full-length cache, so reuse is exact)."""
    from support.engine_driver import make_engine

    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.runtime.sequence import EngineRequest
    from kvforge.runtime.types import SamplingParams
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    loaded = synthetic_model("tiny-gemma3", kv_cache_dtype="fp32")
    hf = hf_twin(loaded.config)
    keys = hf.load_state_dict({k: torch.tensor(v) for k, v in loaded.weights.items()}, strict=False)
    assert keys.missing_keys == ["lm_head.weight"] and not keys.unexpected_keys  # tied to the embedding
    write_onnx_dir(loaded, tmp_path / "onnx")
    build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(max_input_len=512, max_kv_cache_capacity=1024,
                                                                      tokens_per_page=16))
    first = [int(t) for t in np.random.default_rng(6).integers(3, loaded.config.vocab_size, 300)]
    eos = loaded.config.eos_token_ids[0]  # banned on both sides, so every answer has its full length
    expected_first = reference_greedy(hf, first, 6, eos)
    second = first + expected_first + [int(t) for t in np.random.default_rng(7).integers(3, 200, 40)]
    expected_second = reference_greedy(hf, second, 6, eos)
    greedy = SamplingParams(max_generate_length=6, temperature=0.0, logit_bias={eos: -100.0})
    for reuse in (False, True):
        engine = make_engine(tmp_path / "engine", reuse=reuse, prefill_chunk_size=64)
        answers, cached = [], []
        for ids in (first, second):
            engine.add_request(EngineRequest(ids, greedy))
            done = []
            while not done:
                done = [o for o in engine.step() if o.finished]
            answers.append(done[0].token_ids)
            cached.append(done[0].cached_tokens)
        assert answers == [expected_first, expected_second], reuse
        assert (cached[1] > 0) == reuse


@pytest.mark.parametrize("synthetic", ["tiny-gemma3", "tiny-gemma4"])
def test_quantized_gemma_exports_are_refused_in_one_line(run_cli, tmp_path: Path, synthetic: str) -> None:
    from support.cli_checks import assert_one_line_error

    export = run_cli(["llm_export", "--synthetic", synthetic, "--outputDir", tmp_path / "q", "--quantization", "int4"])
    assert_one_line_error(export, "--quantization", "float32")


def test_older_config_fields_map_like_rope_parameters() -> None:
    """Gemma 3 configs written before transformers 5 (Google's own): flat rope_theta, rope_local_base_freq,
    rope_scaling and sliding_window_pattern instead of rope_parameters and layer_types."""
    old = dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=12,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
               sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=32)
    config = config_from_hf(old, kv_cache_dtype="fp32")
    assert config.sliding_window_layers == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert (config.rope_theta, config.rope_local_theta, config.rope_linear_factor) == (1e6, 1e4, 8.0)
    assert config_from_hf({**old, "rope_scaling": None}, kv_cache_dtype="fp32").rope_linear_factor == 0.0
