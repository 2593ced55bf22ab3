"""The exported Gemma 4 graph (lowered for ONNX Runtime) against transformers' Gemma4ForCausalLM on tiny random
configs: plain-weight norms, the value norm, no query scale, layer scalars, proportional RoPE on the global layer,
sliding layers (window 32) past their window, KV sharing, per-layer embeddings (global layers with wider heads:
test_gemma4_global_head_dim.py). What the runtime cannot hold yet is refused in one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.lazy_import import LazyModule
from support.ort_support import cpu_kernel_on
from support.paged_rows import CAPACITY, PATHS, Row, lowered_session

from kvforge.contract.engine_dir import PER_LAYER_INPUT
from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.families.gemma4 import build_gemma4_graph, config_from_hf

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

torch = LazyModule("torch")
transformers = LazyModule("transformers")
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
            elif param.dim() >= 2:  # the projections too: the constructor drew them from torch's global generator,
                # whose state depends on what ran before in the process (under xdist, on which files a worker took)
                param.normal_(0.0, hf.config.initializer_range)
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


PER_LAYER = dict(hidden_size_per_layer_input=16, vocab_size=320, vocab_size_per_layer_input=352)


@pytest.fixture(scope="module")
def per_layer() -> tuple[object, ModelConfig, object]:
    """Per-layer embeddings 16 wide; the table has more rows than the vocabulary (the export keeps the ids' rows)
    and entries of norm ~1, so each token's row matters."""
    torch.manual_seed(12)  # the projections' init too: the same model whatever ran before
    hf = randomised(transformers.Gemma4ForCausalLM(hf_config(**PER_LAYER)), seed=12)
    with torch.no_grad():
        hf.model.embed_tokens_per_layer.weight.normal_()
    config, model = exported(hf)
    assert config.hidden_size_per_layer_input == 16 and PER_LAYER_INPUT in {i.name for i in model.graph.input}
    return hf, config, model


def per_layer_row(hf: object, config: ModelConfig, model: object, path: str) -> Row:
    return Row(config, lowered_session(model, path), hf.model.embed_tokens.weight.detach().numpy(),
               per_layer=hf.model.embed_tokens_per_layer.weight.detach().numpy())


@pytest.mark.parametrize("path", PATHS)
def test_per_layer_embeddings_match_transformers_past_the_window(per_layer: tuple, path: str) -> None:
    hf, config, model = per_layer
    row, ids = per_layer_row(hf, config, model, path), prompt(90, seed=13)
    row.step(ids[:37])
    np.testing.assert_allclose(row.step(ids[37:]), reference_logits(hf, ids), atol=2e-4, rtol=0)
    for token in (3, 250):
        ids = ids + [token]
        np.testing.assert_allclose(row.step([token]), reference_logits(hf, ids), atol=2e-4, rtol=0)


def test_per_layer_embeddings_change_the_answer(per_layer: tuple) -> None:
    """The per-layer rows are not a no-op: another token's rows give other logits."""
    hf, config, model = per_layer
    ids = prompt(40, seed=14)
    table = hf.model.embed_tokens_per_layer.weight.detach().numpy()
    row = per_layer_row(hf, config, model, "gqa")
    wrong = Row(config, lowered_session(model, "gqa"), hf.model.embed_tokens.weight.detach().numpy(),
                per_layer=np.roll(table, 1, axis=0))
    assert np.abs(row.step(ids) - wrong.step(ids)).max() > 1e-2


def test_per_layer_checkpoint_runs_in_the_engine_cold_and_with_reuse(tmp_path: Path, per_layer: tuple) -> None:
    """llm_export's HF dir path writes the per-layer table (the vocabulary's rows), llm_build copies it, and the
    engine feeds each token's rows: a 300-token prompt past the window, then a second turn extending it (a reuse
    hit); both greedy answers equal transformers'."""
    from safetensors.numpy import load_file
    from support.engine_driver import make_engine

    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.contract.engine_dir import EMBEDDING_TENSOR, PER_LAYER_EMBEDDING_FILE
    from kvforge.runtime.sequence import EngineRequest
    from kvforge.runtime.types import SamplingParams
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer
    from kvforge.tools.export.writer import write_onnx_dir

    hf = per_layer[0]
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    byte_level_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    write_onnx_dir(load_hf_dir(tmp_path / "hf", kv_cache_dtype="fp32"), tmp_path / "onnx")
    build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(max_input_len=512, max_kv_cache_capacity=1024,
                                                                      tokens_per_page=16))
    table = load_file(str(tmp_path / "engine" / PER_LAYER_EMBEDDING_FILE))[EMBEDDING_TENSOR]
    np.testing.assert_array_equal(table, hf.model.embed_tokens_per_layer.weight.detach().numpy()[:320])
    eos = hf.config.eos_token_id
    first = prompt(300, seed=15)

    def generate(ids: list[int]) -> list[int]:  # an explicit mask: a generated pad token (0) stays attended to
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=6, min_new_tokens=6, do_sample=False)
        return out[0, len(ids):].tolist()

    expected_first = generate(first)
    second = first + expected_first + prompt(40, seed=16)
    expected_second = generate(second)
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
    (dict(hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB - 1), "vocab_size_per_layer_input"),
    (dict(per_layer_config={"5": {"head_dim": 16}}), "global_head_dim"),  # narrower than the sliding heads
    (dict(per_layer_config={"5": {"head_dim": 64, "num_key_value_heads": 1}}), "per_layer_config"),
    (dict(per_layer_config={"0": {"head_dim": 64}}), "per_layer_config"),  # a sliding layer's
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


def test_executor_feeds_the_pad_rows_per_layer_at_media_positions() -> None:
    """transformers' Gemma4Model looks a media placeholder up in the per-layer table as the pad token (its
    projection part comes from the spliced media row); the executor feeds the same, chunk by chunk."""
    from types import SimpleNamespace

    from kvforge.runtime.context_cache.keys import MediaKey
    from kvforge.runtime.execution.backend import ForwardOutput
    from kvforge.runtime.execution.executor import ModelExecutor
    from kvforge.runtime.media_spans import MediaSpan
    from kvforge.runtime.step import ScheduledRow

    calls = []

    class Recording:
        def forward(self, step: object) -> ForwardOutput:
            calls.append(step)
            return ForwardOutput(np.zeros((1, 4), np.float32))

    rng = np.random.default_rng(0)
    embedding, table = rng.standard_normal((10, 3)), rng.standard_normal((10, 6))
    media = MediaSpan(MediaKey(2, 4, b"image"), np.full((4, 3), 7.0, np.float32))
    ids = [1, 2, 9, 9, 9, 9, 3, 4]
    seq = SimpleNamespace(num_computed_tokens=0, all_token_ids=lambda: ids,
                          lease=SimpleNamespace(page_ids=[0], parts={}),
                          request=SimpleNamespace(adapter=None, adapter_start=0, media=[media]))
    executor = ModelExecutor(Recording(), embedding, {}, per_layer=table, media_row=5)  # type: ignore[arg-type]
    for count in (4, 4):  # the span straddles the two chunks
        executor.run([ScheduledRow(seq, count, True)])  # type: ignore[arg-type]
        seq.num_computed_tokens += count
    fed = np.concatenate([call.extra_inputs[PER_LAYER_INPUT][0] for call in calls])
    embeds = np.concatenate([call.inputs_embeds[0] for call in calls])
    expected = table[ids]
    expected[2:6] = table[5]
    np.testing.assert_array_equal(fed, expected.astype(np.float32))
    assert (embeds[2:6] == 7.0).all()
    np.testing.assert_array_equal(embeds[[0, 1, 6, 7]], embedding[[1, 2, 3, 4]].astype(np.float32))


def test_synthetic_per_layer_model_loads_into_transformers_and_matches() -> None:
    """`--synthetic tiny-gemma4-ple`'s weights are a Gemma4ForCausalLM's with per-layer embeddings (no key missing
    but the tied head, none unexpected), and the graph's logits equal its."""
    from kvforge.tools.export.sources.synthetic import synthetic_model

    loaded = synthetic_model("tiny-gemma4-ple", kv_cache_dtype="fp32")
    c = loaded.config
    hf = transformers.Gemma4ForCausalLM(hf_config(
        vocab_size=c.vocab_size, vocab_size_per_layer_input=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, hidden_size_per_layer_input=c.hidden_size_per_layer_input,
        rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": c.rope_proportion,
                                            "rope_theta": c.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}})).eval()
    keys = hf.load_state_dict({k: torch.tensor(v) for k, v in loaded.weights.items()}, strict=False)
    assert keys.missing_keys == ["lm_head.weight"] and not keys.unexpected_keys
    weights = loaded.weights
    row = Row(c, lowered_session(build_gemma4_graph(c, weights), "gqa"), weights["model.embed_tokens.weight"],
              per_layer=weights["model.embed_tokens_per_layer.weight"])
    ids = [int(t) for t in np.random.default_rng(17).integers(3, c.vocab_size, 70)]
    np.testing.assert_allclose(row.step(ids), reference_logits(hf, ids), atol=2e-4, rtol=0)


def test_tensorrt_refuses_per_layer_embeddings_in_one_line(tmp_path: Path) -> None:
    """The TensorRT runner binds no per_layer_embeds: a Gemma 4 graph with them (here without sliding layers, which
    TensorRT refuses first) is refused naming --backend before TensorRT is imported."""
    from dataclasses import replace

    from kvforge.builder.build import BuildOptions
    from kvforge.builder.trt_build import build_tensorrt_engine
    from kvforge.contract.errors import InvalidConfig
    from kvforge.tools.export.sources.synthetic import synthetic_model

    config = replace(synthetic_model("tiny-gemma4-ple").config, sliding_window=0, sliding_window_layers=[])
    geometry = BuildOptions(max_input_len=64, max_kv_cache_capacity=128).geometry(4096)
    with pytest.raises(InvalidConfig, match="per-layer embeddings .* --backend onnxruntime") as refused:
        build_tensorrt_engine(tmp_path / "onnx", tmp_path / "engine", config, geometry)
    assert refused.value.field == "backend"
