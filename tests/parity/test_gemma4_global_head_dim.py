"""Gemma 4 global layers with heads of their own size (global_head_dim 32 over head_dim 16, as released checkpoints'
512 over 256): the exported graph against transformers on each attention path, and the table-order RoPE on its
own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from parity.test_gemma4_parity import exported, hf_config, prompt, randomised, reference_logits
from support.paged_rows import PATHS, Row, lowered_session

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.model_config import ModelConfig
from kvforge.plugins.reference import apply_rope, rope_table
from kvforge.tools.export.families.gemma4 import table_order

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WIDE = dict(head_dim=16, global_head_dim=32, vocab_size=320)  # the byte-level tokenizer's 259 tokens fit


@pytest.fixture(scope="module")
def wide() -> tuple[object, ModelConfig, object]:
    hf = randomised(transformers.Gemma4ForCausalLM(hf_config(**WIDE)), seed=21)
    config, model = exported(hf)
    assert (config.head_dim, config.global_head_dim, config.rope_proportion) == (16, 32, 0.25)
    assert [config.layer_head_dim(i) for i in range(6)] == [16] * 5 + [32]
    shapes = {i.name: i.type.tensor_type.shape.dim[-1].dim_value for i in model.graph.input}
    assert shapes["past_key_values_0"] == 16 and shapes["past_key_values_5"] == 32
    return hf, config, model


@pytest.mark.parametrize("path", PATHS)
def test_wider_global_heads_match_transformers_past_the_window(wide: tuple, path: str) -> None:
    hf, config, model = wide
    row, ids = Row(config, lowered_session(model, path), hf.model.embed_tokens.weight.detach().numpy()), prompt(90)
    row.step(ids[:23])
    np.testing.assert_allclose(row.step(ids[23:]), reference_logits(hf, ids), atol=2e-4, rtol=0)
    for token in (5, 17):
        ids = ids + [token]
        np.testing.assert_allclose(row.step([token]), reference_logits(hf, ids), atol=2e-4, rtol=0)


@pytest.mark.parametrize("rope", [
    {"rope_type": "proportional", "partial_rotary_factor": 0.75, "rope_theta": 1e6},  # pairs past the table's turn
    {"rope_type": "default", "rope_theta": 5e5},
])
def test_global_rope_beyond_the_tables_dims_matches_transformers(rope: dict) -> None:
    """The global layers turn pairs the 16-wide table does not reach (12 of 16, or all): the graph turns them."""
    hf = randomised(transformers.Gemma4ForCausalLM(hf_config(**WIDE, rope_parameters={
        "full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})), seed=22)
    config, model = exported(hf)
    row, ids = Row(config, lowered_session(model, "gqa"), hf.model.embed_tokens.weight.detach().numpy()), prompt(70)
    np.testing.assert_allclose(row.step(ids), reference_logits(hf, ids), atol=2e-4, rtol=0)


def test_table_order_puts_a_wide_heads_pairs_where_the_table_turns_them() -> None:
    """The runtime's 16-wide table turning the first 16 dims of a 32-wide head in table order turns the head's own
    rotate-half pairs (j, j + 16), j < 8, by the table's angles, and leaves the other pairs as they were."""
    order, table = table_order(32, 16), rope_table(64, 16, 1e6)
    assert sorted(order.tolist()) == list(range(32))
    x = np.random.default_rng(0).standard_normal((40, 2, 32)).astype(np.float32)
    positions = np.arange(3, 43)
    turned = apply_rope(x[..., order], table, positions)[..., np.argsort(order)]  # back to the head's own order
    cos, sin = table[positions, None, :8], table[positions, None, 8:]
    expected = x.copy()
    expected[..., :8] = x[..., :8] * cos - x[..., 16:24] * sin
    expected[..., 16:24] = x[..., 16:24] * cos + x[..., :8] * sin
    np.testing.assert_allclose(turned, expected, atol=1e-6)
    assert np.abs(apply_rope(x, table, positions) - expected).max() > 0.1  # the head's own order would pair wrong


def test_config_records_the_global_head_size_and_older_configs_load(wide: tuple) -> None:
    config = wide[1]
    older = {k: v for k, v in config.to_dict().items() if k != "global_head_dim"}
    assert ModelConfig.from_dict(older).global_head_dim == 0 and ModelConfig.from_dict(older).layer_head_dim(5) == 16
    for bad in (33, 8):  # odd; narrower than the table
        with pytest.raises(InvalidConfig) as refused:
            ModelConfig.from_dict({**config.to_dict(), "global_head_dim": bad})
        assert refused.value.field == "config.global_head_dim"


def test_an_assistant_over_a_base_with_wider_global_heads_is_refused_in_one_line(tmp_path: Path) -> None:
    """An assistant's global layers read the base's last global pool with heads of head_dim: they would not fit the
    wider global heads (nor their table order), so the assistant export names the mismatch."""
    from kvforge.contract.errors import KvforgeError
    from kvforge.tools.export.drafts.gemma4_assistant import export_gemma4_assistant, write_random_gemma4_assistant
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    base = synthetic_model("tiny-gemma4-wide", kv_cache_dtype="fp32", hidden_state_layers=[5])
    assert base.config.global_head_dim == 32 and base.weights["model.layers.5.self_attn.k_proj.weight"].shape[0] == 64
    write_onnx_dir(base, tmp_path / "base_onnx")
    write_random_gemma4_assistant(tmp_path / "base_onnx", tmp_path / "hf", seed=3, hidden_size=48, num_layers=3)
    with pytest.raises(KvforgeError, match=r"does not fit the base: head_dim \[16\] vs the base's 16 \(global: 32\)"):
        export_gemma4_assistant(tmp_path / "hf", tmp_path / "base_onnx", tmp_path / "onnx")
