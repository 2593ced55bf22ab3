"""The exported Qwen3.5 hybrid graph (lowered for ONNX Runtime: paged attention + recurrent ops) against
transformers' Qwen3_5ForCausalLM on a tiny random config: prefill, prefill-then-decode, chunked prefill carrying
the KV pages and the recurrent states between chunks, ragged rows. The test binds the pools and states itself
(the runtime's runner is not involved), so it pins the graph contract the runner is written against."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from support.lazy_import import LazyModule
from support.ort_support import cpu_kernel_on, session_for

from kvforge.builder.lower_ort import lower_for_onnxruntime, new_rows_name
from kvforge.builder.lower_recurrent import lower_recurrent_ops
from kvforge.contract.model_config import ModelConfig
from kvforge.plugins.reference import rope_table
from kvforge.runtime.execution.backend import last_token_indices
from kvforge.tools.export.families.llama import pool_input_name
from kvforge.tools.export.families.mamba2 import conv_state_name, recurrent_state_name
from kvforge.tools.export.families.qwen3_5 import build_qwen3_5_graph, config_from_hf

pytestmark = [pytest.mark.attention_path, pytest.mark.in_process]  # fallback rerun; run_cli in process

torch = LazyModule("torch")
transformers = LazyModule("transformers")
TOL = 1e-4
TOKENS_PER_PAGE, NUM_PAGES, CAPACITY = 4, 64, 128
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def hf_config(**overrides: object) -> object:
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=CAPACITY, layer_types=LAYER_TYPES,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                  linear_conv_kernel_dim=4, tie_word_embeddings=False, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    fields.update(overrides)
    return transformers.Qwen3_5TextConfig(**fields)


def randomised(hf: object) -> object:
    """Move every parameter off its init value (zeros, ones) so each one matters."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                param.copy_(torch.randn_like(param) * 0.5)
            elif name.endswith("norm.weight"):
                param.copy_(0.2 * torch.randn_like(param) + (1.0 if "linear_attn.norm" in name else 0.0))
    return hf.eval()


def lowered_session(model: onnx.ModelProto, kv_cache_dtype: str = "fp32") -> ort.InferenceSession:
    lowered = lower_recurrent_ops(lower_for_onnxruntime(model, kv_cache_dtype=kv_cache_dtype,
                                                        tokens_per_page=TOKENS_PER_PAGE, num_pages=NUM_PAGES,
                                                        cpu_kernel=cpu_kernel_on()))
    assert not any(n.domain == "kvforge" for n in lowered.graph.node)
    return session_for(lowered)


@dataclass
class Sequences:
    """What a runner keeps between calls: one page pool per attention layer, each row's pages and length, and the
    recurrent layers' states per row."""

    config: ModelConfig
    session: ort.InferenceSession
    embedding: np.ndarray
    rows: int
    pools: dict[int, np.ndarray] = field(default_factory=dict)
    states: dict[str, np.ndarray] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = self.config
        for layer in c.attention_layer_ids:
            self.pools[layer] = np.zeros((NUM_PAGES, 2, c.num_key_value_heads, TOKENS_PER_PAGE, c.head_dim),
                                         np.float32)
        for layer in c.recurrent_layer_ids:
            self.states[conv_state_name(layer)] = np.zeros((self.rows, c.conv_dim, c.conv_kernel - 1), np.float32)
            self.states[recurrent_state_name(layer)] = np.zeros(
                (self.rows, c.recurrent_state_num_heads, c.recurrent_state_head_dim, c.recurrent_state_size),
                np.float32)
        self.lengths = [0] * self.rows

    def page_table(self) -> np.ndarray:
        per_row = CAPACITY // TOKENS_PER_PAGE  # row b owns pages [b * per_row, (b + 1) * per_row)
        return np.arange(self.rows * per_row, dtype=np.int32).reshape(self.rows, per_row)

    def step(self, chunks: list[list[int]]) -> np.ndarray:
        """One engine call: chunk b continues row b. Returns last-token logits [rows, vocab]."""
        c, width = self.config, max(len(ids) for ids in chunks)
        embeds = np.zeros((self.rows, width, c.hidden_size), np.float32)
        for b, ids in enumerate(chunks):
            embeds[b, :len(ids)] = self.embedding[ids]
        table = self.page_table()
        feeds = {"inputs_embeds": embeds, "context_lengths": np.array([len(ids) for ids in chunks], np.int32),
                 "kvcache_start_index": np.array(self.lengths, np.int32), "kv_page_table": table,
                 "rope_rotary_cos_sin": rope_table(CAPACITY, c.rotary_dim, c.rope_theta),
                 "logits_indices": last_token_indices([len(ids) for ids in chunks], width), **self.states,
                 **{pool_input_name(layer): pool for layer, pool in self.pools.items()}}
        names = [o.name for o in self.session.get_outputs()]
        out = dict(zip(names, self.session.run(names, feeds), strict=True))
        for layer, pool in self.pools.items():  # scatter the new K/V rows into the pages, as the runner does
            rows = out[new_rows_name(pool_input_name(layer))]  # [B, S, 2, Hkv, D]
            for b, ids in enumerate(chunks):
                for i in range(len(ids)):
                    pos = self.lengths[b] + i
                    pool[table[b, pos // TOKENS_PER_PAGE], :, :, pos % TOKENS_PER_PAGE] = rows[b, i]
        self.states = {name: out["present_" + name] for name in self.states}
        self.lengths = [n + len(ids) for n, ids in zip(self.lengths, chunks, strict=True)]
        return out["logits"]


@pytest.fixture(scope="module")
def models() -> tuple[object, ModelConfig, ort.InferenceSession]:
    hf = randomised(transformers.Qwen3_5ForCausalLM(hf_config()))
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    config = config_from_hf(hf.config.to_dict(), kv_cache_dtype="fp32")
    config.validate()
    assert config.layer_types == ["mamba", "attention", "mamba", "attention"] and config.rotary_dim == 8
    return hf, config, lowered_session(build_qwen3_5_graph(config, weights))


def sequences(models: tuple, rows: int = 1) -> Sequences:
    hf, config, session = models
    return Sequences(config, session, hf.model.embed_tokens.weight.detach().numpy(), rows)


def reference(hf: object, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


IDS = [3, 17, 5, 42, 8, 9, 21, 33, 1, 60, 7, 19, 2, 50]


def test_graph_contract(models: tuple) -> None:
    _, config, session = models
    inputs = {i.name for i in session.get_inputs()}
    outputs = {o.name for o in session.get_outputs()}
    assert {"past_key_values_1", "past_key_values_3"} <= inputs and "past_key_values_0" not in inputs
    assert {"conv_state_0", "recurrent_state_2"} <= inputs and "conv_state_1" not in inputs
    assert {"new_key_values_1", "present_conv_state_0", "present_recurrent_state_2"} <= outputs
    table = next(i for i in session.get_inputs() if i.name == "rope_rotary_cos_sin")
    assert table.shape[1] == config.rotary_dim


def test_prefill_matches_transformers(models: tuple) -> None:
    logits = sequences(models).step([IDS])
    np.testing.assert_allclose(logits[0], reference(models[0], IDS), atol=TOL, rtol=0)


def test_long_prefill_in_chunks_of_the_delta_rule_matches_transformers(models: tuple) -> None:
    """100 tokens in one call: the lowered delta rule's chunked form (two 64-token chunks, the second padded)."""
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 64, 100)]
    run = sequences(models)
    np.testing.assert_allclose(run.step([ids])[0], reference(models[0], ids), atol=TOL, rtol=0)
    np.testing.assert_allclose(run.step([[5]])[0], reference(models[0], ids + [5]), atol=TOL, rtol=0)


def test_prefill_then_decode_matches_transformers(models: tuple) -> None:
    run, ids = sequences(models), IDS[:7]
    run.step([ids])
    for token in (11, 12, 40):
        ids = ids + [token]
        np.testing.assert_allclose(run.step([[token]])[0], reference(models[0], ids), atol=TOL, rtol=0)


def test_chunked_prefill_carries_pages_and_states(models: tuple) -> None:
    run = sequences(models)
    run.step([IDS[:5]])  # 5 tokens: the second chunk starts inside a page
    run.step([IDS[5:9]])
    np.testing.assert_allclose(run.step([IDS[9:]])[0], reference(models[0], IDS), atol=TOL, rtol=0)


def test_ragged_rows_keep_their_own_pages_and_states(models: tuple) -> None:
    run, long, short = sequences(models, rows=2), IDS[:10], [50, 4, 6]
    logits = run.step([long, short])
    np.testing.assert_allclose(logits[0], reference(models[0], long), atol=TOL, rtol=0)
    np.testing.assert_allclose(logits[1], reference(models[0], short), atol=TOL, rtol=0)
    logits = run.step([[10], [11]])  # both rows decode from states and pages taken at different lengths
    np.testing.assert_allclose(logits[0], reference(models[0], long + [10]), atol=TOL, rtol=0)
    np.testing.assert_allclose(logits[1], reference(models[0], short + [11]), atol=TOL, rtol=0)


# --- export: an HF checkpoint dir and the synthetic tiny-qwen3_5 through llm_export's writer, then llm_build -------

def exported(onnx_dir: Path) -> tuple[ModelConfig, ort.InferenceSession]:
    from kvforge.contract.files import read_json

    config = ModelConfig.from_dict(read_json(onnx_dir / "config.json", "onnx_dir"))
    return config, lowered_session(onnx.load(onnx_dir / "model.onnx"), config.kv_cache_dtype)


def test_hf_checkpoint_dir_exports_and_matches_transformers(tmp_path: Path, models: tuple) -> None:
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer
    from kvforge.tools.export.writer import write_onnx_dir

    hf = models[0]
    checkpoint = tmp_path / "hf"
    hf.save_pretrained(checkpoint, safe_serialization=True)
    byte_level_tokenizer().save(str(checkpoint / "tokenizer.json"))
    loaded = load_hf_dir(checkpoint, kv_cache_dtype="fp32")
    assert loaded.config.model == "qwen3_5" and loaded.config.attention_layer_ids == [1, 3]
    write_onnx_dir(loaded, tmp_path / "onnx")
    config, session = exported(tmp_path / "onnx")
    run = Sequences(config, session, hf.model.embed_tokens.weight.detach().numpy(), 1)
    run.step([IDS[:6]])
    np.testing.assert_allclose(run.step([IDS[6:]])[0], reference(hf, IDS), atol=TOL, rtol=0)


def test_vision_language_checkpoint_dir_exports_its_text_model(tmp_path: Path) -> None:
    """A `qwen3_5` dir (Qwen3_5ForConditionalGeneration, what Qwen ships): the text model under
    model.language_model.*, the vision tower skipped; text-only logits match the full model's."""
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer
    from kvforge.tools.export.writer import write_onnx_dir

    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(1)
    hf = randomised(transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=hf_config().to_dict(), vision_config=vision)))
    checkpoint = tmp_path / "hf"
    hf.save_pretrained(checkpoint, safe_serialization=True)
    byte_level_tokenizer().save(str(checkpoint / "tokenizer.json"))
    saved = json.loads((checkpoint / "config.json").read_text())
    saved.pop("eos_token_id", None)
    saved["text_config"]["eos_token_id"] = 7  # kept with the text model only
    (checkpoint / "config.json").write_text(json.dumps(saved))
    loaded = load_hf_dir(checkpoint, kv_cache_dtype="fp32")
    assert loaded.config.model == "qwen3_5" and not any("visual" in name for name in loaded.weights)
    assert 7 in loaded.config.eos_token_ids
    write_onnx_dir(loaded, tmp_path / "onnx")
    config, session = exported(tmp_path / "onnx")
    run = Sequences(config, session, loaded.weights["model.embed_tokens.weight"], 1)
    run.step([IDS[:8]])
    np.testing.assert_allclose(run.step([IDS[8:]])[0], reference(hf, IDS), atol=TOL, rtol=0)


def hf_twin(c: ModelConfig) -> object:
    """transformers' Qwen3_5ForCausalLM for a kvforge qwen3_5 ModelConfig (weights loaded by the caller)."""
    return transformers.Qwen3_5ForCausalLM(hf_config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        layer_types=["linear_attention" if t == "mamba" else "full_attention" for t in c.layer_types],
        linear_num_key_heads=c.n_groups, linear_num_value_heads=c.recurrent_state_num_heads,
        linear_key_head_dim=c.recurrent_state_size, linear_value_head_dim=c.recurrent_state_head_dim,
        linear_conv_kernel_dim=c.conv_kernel, tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                         "partial_rotary_factor": c.partial_rotary_factor})).eval()


def test_synthetic_tiny_qwen3_5_matches_transformers(tmp_path: Path) -> None:
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    loaded = synthetic_model("tiny-qwen3_5", kv_cache_dtype="fp32")
    write_onnx_dir(loaded, tmp_path / "onnx")
    hf = hf_twin(loaded.config)
    hf.load_state_dict({k: torch.tensor(v) for k, v in loaded.weights.items()}, strict=True)
    config, session = exported(tmp_path / "onnx")
    run = Sequences(config, session, loaded.weights["model.embed_tokens.weight"], 1)
    ids = [40, 41, 70, 100, 5, 77, 90, 12, 33]
    run.step([ids[:5]])
    np.testing.assert_allclose(run.step([ids[5:]])[0], reference(hf, ids), atol=TOL, rtol=0)


def test_llm_export_and_llm_build_of_the_tiny_hybrid(run_cli, tmp_path: Path) -> None:
    from support.cli_checks import assert_one_line_error

    from kvforge.contract.geometry import kv_bytes_per_page, recurrent_bytes_per_slot
    from kvforge.contract.manifest import ENGINE_KIND, verify_manifest
    from kvforge.tools.export.sources.synthetic import synthetic_model

    export = run_cli(["llm_export", "--synthetic", "tiny-qwen3_5", "--outputDir", tmp_path / "onnx"])
    assert export.returncode == 0, export.stderr
    build = run_cli(["llm_build", "--onnxDir", tmp_path / "onnx", "--engineDir", tmp_path / "engine",
                     "--reuseRecords", "4", "--tokensPerPage", "16", "--maxKVCacheCapacity", "256",
                     "--maxInputLen", "128"])
    assert build.returncode == 0, build.stderr
    config = synthetic_model("tiny-qwen3_5").config
    recurrent_slot = recurrent_bytes_per_slot(len(config.recurrent_layer_ids), config.recurrent_state_num_heads,
                                              config.recurrent_state_head_dim, config.recurrent_state_size,
                                              config.conv_dim, config.conv_kernel)
    partial_slot = config.num_attention_layers * kv_bytes_per_page(config.num_key_value_heads, config.head_dim, 16,
                                                                   config.kv_cache_dtype)
    written = json.loads((tmp_path / "engine" / "config.json").read_text())
    built = written["builder_config"]
    assert built["layer_types"] == config.layer_types == written["layer_types"]
    assert built["recurrent_snapshot_bytes_per_slot"] == recurrent_slot
    assert built["partial_kv_snapshot_bytes_per_slot"] == partial_slot
    verify_manifest(tmp_path / "engine", ENGINE_KIND, "engine_dir", "rebuild")
    text = " ".join(build.stderr.split())
    assert f"× {config.num_attention_layers} layers" in text  # the KV pool spans the attention layers only
    assert f"--contextCacheRecurrentSnapshotPoolBytes {4 * recurrent_slot}" in text
    assert f"--contextCachePartialKVSnapshotPoolBytes {4 * partial_slot}" in text
    lowered = onnx.load(tmp_path / "engine" / "model.onnx")
    assert not any(n.domain == "kvforge" for n in lowered.graph.node)
    pools = sorted(i.name for i in lowered.graph.input if i.name.startswith("past_key_values_"))
    assert pools == [f"past_key_values_{i}" for i in config.attention_layer_ids]
    engine = session_for(str(tmp_path / "engine" / "model.onnx"))
    shapes = {i.name: i.shape for i in engine.get_inputs()}
    assert shapes["past_key_values_1"] == [4 * 16, 2, config.num_key_value_heads, 16, config.head_dim]
    assert shapes["recurrent_state_0"][1:] == [config.recurrent_state_num_heads, config.recurrent_state_head_dim,
                                               config.recurrent_state_size]
    lora = run_cli(["llm_build", "--onnxDir", tmp_path / "onnx", "--engineDir", tmp_path / "engine2",
                    "--maxLoraRank", "8"])
    assert_one_line_error(lora, "--maxLoraRank")


def test_unsupported_qwen3_5_settings_are_refused_in_one_line(run_cli, tmp_path: Path, models: tuple) -> None:
    from support.cli_checks import assert_one_line_error

    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer

    quantized = run_cli(["llm_export", "--synthetic", "tiny-qwen3_5", "--outputDir", tmp_path / "q",
                         "--quantization", "int4"])
    assert_one_line_error(quantized, "--quantization", "qwen3_5", "none")
    checkpoint = tmp_path / "hf"
    models[0].save_pretrained(checkpoint, safe_serialization=True)
    byte_level_tokenizer().save(str(checkpoint / "tokenizer.json"))
    hf = json.loads((checkpoint / "config.json").read_text())
    for change, needle in ((dict(layer_types=["sliding_attention"] * 4), "sliding_attention"),
                           (dict(layer_types=["full_attention"] * 4), "mixes"),
                           (dict(attention_bias=True), "attention_bias")):
        (checkpoint / "config.json").write_text(json.dumps({**hf, **change}))
        export = run_cli(["llm_export", checkpoint, "--outputDir", tmp_path / "onnx"])
        assert_one_line_error(export, needle)
