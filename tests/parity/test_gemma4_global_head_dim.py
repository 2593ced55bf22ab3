"""Gemma 4 global layers with heads of their own size (global_head_dim 32 over head_dim 16, as released checkpoints'
512 over 256): the exported graph against transformers on each attention path, the table-order RoPE on its own, and
the engine (one pool width per layer) cold and with a reuse hit, with and without the sliding-window page group,
on the CPU kernel and on the fallback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from parity.test_gemma4_parity import exported, hf_config, prompt, randomised, reference_logits
from support.lazy_import import LazyModule
from support.paged_rows import PATHS, Row, lowered_session

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.model_config import ModelConfig
from kvforge.plugins.reference import apply_rope, rope_table
from kvforge.tools.export.families.gemma4 import table_order

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

torch = LazyModule("torch")
transformers = LazyModule("transformers")

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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, wide: tuple) -> tuple[Path, list[list[int]], list, int]:
    """The HF dir through llm_export's checkpoint path, two turns (the second extends the first), transformers'
    greedy answers to each, and the end-of-sequence token they never produce (min_new_tokens)."""
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer
    from kvforge.tools.export.writer import write_onnx_dir

    hf, root = wide[0], tmp_path_factory.mktemp("gemma4_wide")
    hf.save_pretrained(root / "hf", safe_serialization=True)
    byte_level_tokenizer().save(str(root / "hf" / "tokenizer.json"))
    write_onnx_dir(load_hf_dir(root / "hf", kv_cache_dtype="fp32"), root / "onnx")
    assert json.loads((root / "onnx" / "config.json").read_text())["global_head_dim"] == 32

    def generate(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=5, min_new_tokens=5, do_sample=False)
        return out[0, len(ids):].tolist()

    first = prompt(120, seed=23)
    answer = generate(first)
    second = first + answer + prompt(30, seed=24)
    return root / "onnx", [first, second], [answer, generate(second)], hf.config.eos_token_id


@pytest.mark.parametrize("window_pool", [False, True])
@pytest.mark.parametrize("attention", ["kernel", "onnx"])
def test_engine_answers_equal_transformers_cold_and_with_reuse(request: pytest.FixtureRequest, checkpoint: tuple,
                                                               attention: str, window_pool: bool) -> None:
    """Each pool is as wide as its layer's heads; the first turn runs cold, the second hits its pages; both greedy
    answers equal transformers'. With the sliding-window page group the sliding pools hold the window only."""
    from support.engine_driver import make_engine

    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.runtime.sequence import EngineRequest
    from kvforge.runtime.types import SamplingParams

    if attention == "kernel":
        request.getfixturevalue("library")  # skips where the kernel cannot be built
    onnx_dir, prompts, expected, eos = checkpoint
    engine_dir = onnx_dir.parent / f"engine-{attention}-{window_pool}"
    build_engine(onnx_dir, engine_dir, BuildOptions(max_input_len=256, max_kv_cache_capacity=512, tokens_per_page=16,
                                                    cpu_attention=attention, sliding_window_pool=window_pool))
    built = json.loads((engine_dir / "config.json").read_text())["builder_config"]
    assert built["kernel_kv_write"] == (attention == "kernel")  # the kernel's fused RoPE + write + attention
    page = 2 * 2 * 16 * 16 * 4  # K+V, 2 KV heads, 16 tokens, 16 dims, fp32: a sliding layer's page
    assert built["partial_kv_snapshot_bytes_per_slot"] == page * (5 + 2)  # the global layer's page is twice as big
    assert built["kv_pool_bytes_global"] == (2 if window_pool else 5 + 2) * page * built["max_kv_pool_pages"]
    # Without the window group, partial-KV snapshots (a page of every layer, each its own width) keep the tails too.
    snapshots = {} if window_pool else {"context_cache_partial_kv_snapshot_pool_bytes": 8 * (5 + 2) * page}
    engine = make_engine(engine_dir, reuse=True, prefill_chunk_size=64, **snapshots)
    assert [layer.shape[-1] for layer in engine.backend.kv_store.layers] == [16] * 5 + [32]
    assert engine.engine_dir.kv_pool_bytes == sum(layer.nbytes for layer in engine.backend.kv_store.layers)
    greedy = SamplingParams(max_generate_length=5, temperature=0.0, logit_bias={eos: -100.0})
    answers, cached = [], []
    for ids in prompts:
        engine.add_request(EngineRequest(ids, greedy))
        done = []
        while not done:
            done = [o for o in engine.step() if o.finished]
        answers.append(done[0].token_ids)
        cached.append(done[0].cached_tokens)
    engine.cache.check_invariants()
    assert answers == expected and cached[0] == 0 and cached[1] > 0
    if not window_pool:  # the first turn's tail page came back from its snapshot: a hit past the last full page
        assert cached[1] % 16 and [layer.shape[-1] for layer in engine.partial_store.layers] == [16] * 5 + [32]


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


def test_llm_build_prints_the_wider_global_pools(run_cli, tmp_path: Path) -> None:
    """The plan llm_build prints adds the global layer's wider pages up, with and without the sliding-window group."""
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    write_onnx_dir(synthetic_model("tiny-gemma4-wide"), tmp_path / "onnx")  # fp16 K/V: 2,048-byte sliding pages
    printed = {}
    for window in (False, True):
        built = run_cli(["llm_build", "--onnxDir", tmp_path / "onnx", "--engineDir", tmp_path / f"engine{window}",
                         "--tokensPerPage", "16", "--maxKVCacheCapacity", "512", "--maxInputLen", "256",
                         "--maxBatchSize", "2", "--cpuAttention", "onnx", *(["--slidingWindowPool"] if window else [])])
        assert built.returncode == 0, built.stderr
        printed[window] = built.stdout + built.stderr  # the console writes to stderr
    assert "KV pool: 2,048 bytes per page per layer; 0.1 MiB per layer × 5 layers + 0.2 MiB × 1 layers with wider " \
           "heads = 0.9 MiB in total" in printed[False]
    assert "partial-KV snapshot slot: 14,336 bytes" in printed[False]  # 5 × 2,048 + 4,096
    assert "2,048 bytes per page per layer (4,096 on the global layers)" in printed[True]
    assert "global layers: 64 pages × 1 layers = 0.2 MiB" in printed[True]
    assert "sliding-window checkpoint: 2 pages × 5 layers = 20,480 bytes" in printed[True]


def test_a_second_engine_answers_from_the_shared_tier_as_transformers(checkpoint: tuple, monkeypatch) -> None:
    """The shared tier stores and loads each layer's pages at their own width: a second engine's hit on the first's
    pages (an in-process store) answers as transformers does."""
    from support.engine_driver import make_engine
    from support.memory_store import MemoryStore

    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.runtime.engine import engine as engine_module
    from kvforge.runtime.sequence import EngineRequest
    from kvforge.runtime.types import SamplingParams

    onnx_dir, prompts, expected, eos = checkpoint
    engine_dir = onnx_dir.parent / "engine-tier"
    build_engine(onnx_dir, engine_dir, BuildOptions(max_input_len=256, max_kv_cache_capacity=512, tokens_per_page=16))
    shared = MemoryStore()
    monkeypatch.setattr(engine_module, "open_store", lambda url, timeout_s: shared)
    greedy = SamplingParams(max_generate_length=5, temperature=0.0, logit_bias={eos: -100.0})
    cached = []
    for _ in range(2):
        engine = make_engine(engine_dir, reuse=True, shared_cache="redis://in-process")
        engine.add_request(EngineRequest(prompts[0], greedy))
        done = []
        while not done:
            done = [o for o in engine.step() if o.finished]
        engine.close()
        assert done[0].token_ids == expected[0]
        cached.append(done[0].cached_tokens)
    assert cached[0] == 0 and cached[1] >= 112  # the second engine loaded the first's 7 full pages
