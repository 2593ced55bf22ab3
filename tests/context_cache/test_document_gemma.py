"""Documents on Gemma 3 and Gemma 4 (issue 53): each pool layer's restored keys turn by that layer's own RoPE (local
base on sliding layers, linear scaling or proportional RoPE on global ones, wider global heads in table order, one
turn for a KV-shared pool), so the first layer's restored rows equal a cold run's, `full` answers as cold and `none`
reuses the documents; tiny random checkpoints made here, as the parity tests make theirs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from support.engine_driver import document_prompt, first_layer_rows, run_alone

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.model_config import ModelConfig
from kvforge.contract.rope import rope_table
from kvforge.plugins.reference import apply_rope
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.execution.key_rotation import KeyRotation, layer_rotations, moved_keys
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.families import gemma3, gemma4
from kvforge.tools.export.families.registry import family_for
from kvforge.tools.export.sources.base import LoadedModel
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

BUILD = BuildOptions(max_input_len=256, max_kv_cache_capacity=512, max_batch_size=2, tokens_per_page=16)
GREEDY = SamplingParams(temperature=0, max_generate_length=6)
DOC_A = [int(t) for t in np.random.default_rng(11).integers(40, 250, 40)]  # longer than the window (32)
DOC_B = [int(t) for t in np.random.default_rng(12).integers(40, 250, 36)]
FIRST = document_prompt([1, 2, 3, 4, 5], [DOC_A, DOC_B], [9, 10, 11], GREEDY)
# Another system prompt (a timestamp), the documents in the other order, another question.
SECOND = document_prompt([1, 2, 3, 4, 6, 7, 8], [DOC_B, DOC_A], [12, 13, 14, 15], GREEDY)

# name -> (synthetic model, config changes): every kind of layer rotation placed on layer 0 once (its K/V depends
# on each token alone, so there restored rows can be compared with a cold run's).
VARIANTS = {
    "gemma3-local": ("tiny-gemma3", {}),
    "gemma3-global-linear": ("tiny-gemma3", {"sliding_window_layers": [1, 2, 3, 4, 5], "rope_linear_factor": 8.0}),
    "gemma4-local": ("tiny-gemma4", {}),
    "gemma4-global-proportional": ("tiny-gemma4", {"sliding_window_layers": [1, 2, 3, 4, 5]}),
    "gemma4-wide-global": ("tiny-gemma4-wide", {"sliding_window_layers": [1, 2, 3, 4, 5], "rope_proportion": 0.75}),
    # Layers 5 and 6 attend over the pools of 4 and 3 (KV sharing): five pools for seven layers, each turned once.
    "gemma4-kv-shared": ("tiny-gemma4", {"num_hidden_layers": 7, "sliding_window_layers": [0, 1, 2, 4, 5],
                                         "kv_source_layers": [0, 1, 2, 3, 4, 4, 3]}),
}


def variant_config(name: str) -> tuple[LoadedModel, ModelConfig]:
    synthetic, changes = VARIANTS[name]
    loaded = synthetic_model(synthetic, kv_cache_dtype="fp32")
    config = replace(loaded.config, **changes)
    config.validate()
    return loaded, config


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def gemma_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    loaded, config = variant_config(request.param)
    family = family_for(config.model)
    assert family is not None
    root = tmp_path_factory.mktemp(request.param)
    write_onnx_dir(LoadedModel(config, family.random_weights(config, 3), loaded.tokenizer_json,
                               loaded.tokenizer_config), root / "onnx")
    build_engine(root / "onnx", root / "engine", BUILD)
    return root / "engine"


def documents_engine(engine_dir: Path, repair: str) -> Engine:
    return Engine(engine_dir, EngineConfig(num_threads=1, document_reuse=True, document_repair=repair))


def test_full_equals_cold_and_none_reuses_the_documents(gemma_engine: Path) -> None:
    cold = Engine(gemma_engine, EngineConfig(num_threads=1))
    expected = [run_alone(cold, request).token_ids for request in (FIRST, SECOND)]
    full = documents_engine(gemma_engine, "full")
    assert [run_alone(full, request).token_ids for request in (FIRST, SECOND)] == expected
    assert full.profile()["context_cache"]["documents"]["document_hits"] == 4
    none = documents_engine(gemma_engine, "none")
    run_alone(none, FIRST)  # stores both documents
    assert run_alone(none, SECOND).cached_tokens == len(DOC_A) + len(DOC_B)


def test_restored_rows_sit_where_a_cold_run_computes_them(gemma_engine: Path) -> None:
    """Layer 0's K/V depends on each token alone: restored there (moved from 0 to 7 and 43), its rows equal a cold
    run's within float32 rounding of the rotations, whatever that layer's kind of RoPE."""
    cold_rows = first_layer_rows(Engine(gemma_engine, EngineConfig(num_threads=1)), SECOND)
    warm = documents_engine(gemma_engine, "none")
    run_alone(warm, FIRST)
    warm_rows = first_layer_rows(warm, SECOND)
    assert warm.profile()["context_cache"]["documents"]["reused_tokens"] >= 2 * (len(DOC_A) + len(DOC_B))
    np.testing.assert_allclose(warm_rows, cold_rows, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_layers_rotation_is_the_exporters(name: str) -> None:
    """Per pool layer, the rotation's frequencies (in the pool's pair order) are the graph's: the table's plus the
    layer type's extra turn that gemma3.py / gemma4.py export, so the two cannot drift apart."""
    _, config = variant_config(name)
    deltas = (gemma4 if config.model == "gemma4" else gemma3).rope_delta_frequencies
    rotations = layer_rotations(config)
    assert len(rotations) == len(config.attention_layer_ids)
    for layer, rotation in zip(config.attention_layer_ids, rotations, strict=True):
        size = config.layer_head_dim(layer)
        table = np.zeros(size // 2)
        table[:config.rotary_dim // 2] = gemma3.inverse_frequencies(config, config.rope_theta)[:config.rotary_dim // 2]
        delta = deltas(config, layer in config.sliding_window_layers)
        graph = table + (0.0 if delta is None else delta.astype(np.float64))
        ours = np.zeros(size // 2)
        for first, freq in rotation.segments:
            at = 0 if first == 0 else config.rotary_dim // 2  # the second segment: the pairs after the table's
            ours[at:at + len(freq)] = freq
        np.testing.assert_allclose(ours, graph, rtol=1e-6, atol=1e-7)  # the exported turn is float32
    if name == "gemma4-wide-global":
        assert len(rotations[0].segments) == 2  # a wide head with turning pairs past the table's: two segments


def test_a_rotation_moves_keys_as_computing_them_there_would() -> None:
    """KeyRotation.move on keys computed at p gives the keys computed at p + delta (also back, and in fp16),
    for a segment placed after the first dims as a wide head's second one is."""
    rng = np.random.default_rng(2)
    low, high = 1.0 / 10_000.0 ** (np.arange(0, 8, 2) / 8), 1.0 / 50.0 ** (np.arange(0, 4, 2) / 4)
    rotation = KeyRotation(((0, low), (8, high)))
    keys = rng.standard_normal((5, 2, 12)).astype(np.float32)
    positions = np.arange(5) * 7 + 3

    def at(p: np.ndarray) -> np.ndarray:
        first = apply_rope(keys[..., :8], rope_freqs(low, 600), p)
        return np.concatenate([first, apply_rope(keys[..., 8:], rope_freqs(high, 600), p)], axis=-1)

    for delta in (0, 37, 400):
        np.testing.assert_allclose(rotation.move(at(positions), delta, "fp32"), at(positions + delta), atol=2e-5)
    np.testing.assert_allclose(rotation.move(at(positions + 99), -99, "fp32"), at(positions), atol=2e-5)
    moved16 = rotation.move(at(positions).astype(np.float16), 37, "fp16")
    assert moved16.dtype == np.float16
    np.testing.assert_allclose(moved16.astype(np.float32), at(positions + 37), atol=4e-3)


def rope_freqs(inv_freq: np.ndarray, capacity: int) -> np.ndarray:
    angles = np.arange(capacity, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def test_a_uniform_engine_moves_keys_by_its_table() -> None:
    """A plain engine's layers all turn by the runtime's table: the same bytes as the table-driven move."""
    config = synthetic_model("tiny-llama").config
    [rotation, *rest] = layer_rotations(config)
    assert all(r is rotation for r in rest)
    keys = np.random.default_rng(4).standard_normal((3, 2, config.head_dim)).astype(np.float16)
    table = rope_table(512, config.rotary_dim, config.rope_theta)
    assert np.array_equal(rotation.move(keys, 301, "fp16"), moved_keys(keys, 301, table, "fp16"))
    assert np.array_equal(rotation.move(keys, -301, "fp16"), moved_keys(keys, -301, table, "fp16"))


@pytest.mark.parametrize("name", ["gemma3-local", "gemma3-global-linear", "gemma4-global-proportional"])
def test_the_runtime_table_alone_would_move_gemma_keys_wrongly(name: str) -> None:
    """Why the rotation is per layer: layer 0's keys moved by the runtime's one table (what document reuse did on
    every engine) land off by O(1) from where that layer's own RoPE puts them."""
    _, config = variant_config(name)
    keys = np.random.default_rng(5).standard_normal((4, 2, config.head_dim)).astype(np.float32)
    own = layer_rotations(config)[0].move(keys, 40, "fp32")
    table = moved_keys(keys, 40, rope_table(64, config.rotary_dim, config.rope_theta), "fp32")
    assert np.abs(own - table).max() > 0.1
