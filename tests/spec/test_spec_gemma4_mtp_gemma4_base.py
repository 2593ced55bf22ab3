"""Gemma4 assistants over a Gemma 4 base (tiny-gemma4: five sliding layers, window 32, then a global one): the
assistant's sliding layers read the base's last sliding layer and its global layer the global one, each turned by
the base's RoPE of its kind, as transformers' Gemma4AssistantForCausalLM; --specDecode gemma4_mtp is lossless past
the window, with and without reuse; what does not fit the base is refused in one line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_BUILD
from support.engine_driver import make_engine
from support.ort_support import cpu_kernel_on
from support.spec_checks import run_all, with_oracle

from kvforge.builder.build import build_engine
from kvforge.contract.engine_dir import (
    BASE_HIDDEN_INPUT,
    DRAFT_HIDDEN_INPUT,
    EMBEDDING_FILE,
    EMBEDDING_TENSOR,
    load_engine_dir,
)
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import read_json, write_json
from kvforge.contract.safetensors_map import map_tensor
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.ort import OrtBackend
from kvforge.tools.export.drafts.common import base_final_norm
from kvforge.tools.export.drafts.gemma4_assistant import export_gemma4_assistant, write_random_gemma4_assistant
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

# Byte-level prompts of 40-50 tokens and 24 generated: every answer runs past the 32-token window.
PROMPTS = ["the cat sat on the mat, the cat sat on the mat, the", "abc abc abc abc abc abc abc abc abc abc abc",
           "0123456789" * 4, "a shared document: forty bytes or so, and more"]


def speculative_engines(root: Path, synthetic: str) -> dict[str, Path]:
    """`synthetic` as a speculative base returning its last layer's hidden state, with a random three-layer
    assistant (sliding, sliding, global) in ENGINE/draft."""
    if not cpu_kernel_on():
        pytest.skip("Gemma4 assistants need the kvforge CPU kernel (attention over the base's pools)")
    write_onnx_dir(synthetic_model(synthetic, kv_cache_dtype="fp32", hidden_state_layers=[5]), root / "base_onnx")
    build_engine(root / "base_onnx", root / "engine", replace(TINY_BUILD, spec_base=True))
    write_random_gemma4_assistant(root / "base_onnx", root / "hf", seed=3, hidden_size=48, num_layers=3)
    export_gemma4_assistant(root / "hf", root / "base_onnx", root / "onnx")
    build_engine(root / "onnx", root / "engine" / "draft", replace(TINY_BUILD, spec_draft=True,
                                                                   cpu_attention="kernel"))
    return {"base": root / "engine", "hf": root / "hf", "base_onnx": root / "base_onnx"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return speculative_engines(tmp_path_factory.mktemp("gemma4_base_mtp"), "tiny-gemma4")


@pytest.fixture(scope="module")
def ple_engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same over tiny-gemma4-ple, whose every call also takes the per-layer rows of its tokens (drafts too)."""
    return speculative_engines(tmp_path_factory.mktemp("gemma4_ple_base_mtp"), "tiny-gemma4-ple")


def test_the_assistant_matches_transformers_over_a_gemma4_bases_pools(engines: dict[str, Path]) -> None:
    """A base prefill of 60 tokens (past the window); the assistant's logits and projected state at position 60
    equal transformers' given the base's last sliding (layer 4) and global (layer 5) K/V as shared_kv_states, the
    base's normed hidden state and the next token's scaled embedding. The sliding layers see the last 33 keys."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    base_dir, draft_dir = load_engine_dir(engines["base"]), load_engine_dir(engines["base"] / "draft")
    assert draft_dir.model.kv_shared_layers == [4, 4, 5]
    base = OrtBackend(base_dir, 2)
    table = np.asarray(map_tensor(base_dir.file(EMBEDDING_FILE), EMBEDDING_TENSOR), np.float32)
    C, pages = 60, [0, 1, 2, 3]
    tokens = np.random.default_rng(0).integers(0, base_dir.model.vocab_size, C + 1)
    out = base.forward(StepInputs(table[tokens[:C]][None], np.array([C], np.int32), np.array([0], np.int32),
                                  [pages]))
    weight, eps = base_final_norm(engines["base_onnx"], base_dir.model)
    raw = out.hidden_states[0]
    hidden = raw / np.sqrt(np.mean(raw * raw) + eps) * weight
    pools = dict(zip(base_dir.model.attention_layer_ids, base.kv_store.layers, strict=True))
    assistant = OrtBackend(draft_dir, 2, shared_pools=pools)
    got = assistant.forward(StepInputs(table[tokens[C:]][None], np.array([1], np.int32), np.array([C], np.int32),
                                       [pages], extra_inputs={BASE_HIDDEN_INPUT: raw[None, None],
                                                              DRAFT_HIDDEN_INPUT: np.zeros_like(raw)[None, None]}))

    def shared(layer: int) -> tuple[object, object]:
        kv = np.concatenate([pools[layer].astype(np.float32)[p] for p in pages], axis=2)[:, :, :C]
        return torch.tensor(kv[0][None]), torch.tensor(kv[1][None])

    reference = transformers.Gemma4AssistantForCausalLM.from_pretrained(str(engines["hf"])).eval()
    scaled = table[tokens[C:]] * np.float32(base_dir.model.hidden_size ** 0.5)  # Gemma's scaled embedding
    with torch.no_grad():
        expected = reference(inputs_embeds=torch.tensor(np.concatenate([scaled, hidden[None]], -1))[None],
                             position_ids=torch.tensor([[C]]), attention_mask=torch.ones(1, C + 1, dtype=torch.long),
                             shared_kv_states={"full_attention": shared(5), "sliding_attention": shared(4)})
    # Tight: a window one key short is off by ~3e-4 on these weights.
    np.testing.assert_allclose(got.logits[0], expected.logits[0, -1].numpy(), rtol=0, atol=1e-4)
    np.testing.assert_allclose(got.hidden_states[0], expected.last_hidden_state[0, -1].numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("reuse", [False, True])
def test_gemma4_mtp_on_a_gemma4_base_changes_no_token(engines: dict[str, Path], reuse: bool) -> None:
    plain = run_all(make_engine(engines["base"]), PROMPTS, length=24)
    engine = make_engine(engines["base"], spec_decode="gemma4_mtp", reuse=reuse, num_pages=12)
    assert run_all(engine, PROMPTS, length=24) == plain
    assert run_all(engine, PROMPTS, length=24) == plain  # again: warm when reuse is on
    with_oracle(engine, PROMPTS, plain)  # guesses that are right: accepted runs past the window
    assert run_all(engine, PROMPTS, length=24) == plain
    profile = engine.profile()
    spec = profile["spec_decode_generation"]
    assert spec["total_draft_tokens"] > 0 and spec["total_accepted_tokens"] > 0
    if reuse:
        assert profile["context_cache"]["reused_tokens"] > 0


def test_an_assistant_that_does_not_fit_the_gemma4_base_is_refused(engines: dict[str, Path], tmp_path: Path) -> None:
    config = read_json(engines["hf"] / "config.json", "x")
    text = config["text_config"]
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").symlink_to(engines["hf"] / "model.safetensors")
    for change, needle in [
        ({"sliding_window": 64}, "sliding_window 64 vs the base's 32"),
        ({"rope_parameters": {**text["rope_parameters"],
                              "sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0}}}, "RoPE"),
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked-attention"),
    ]:
        write_json(hf / "config.json", {**config, "text_config": {**text, **change}})
        with pytest.raises(KvforgeError, match=needle) as error:
            export_gemma4_assistant(hf, engines["base_onnx"], tmp_path / "refused")
        assert error.value.field == "--draftDir"


def test_the_support_tables_sliding_window_column_decides(engines: dict[str, Path]) -> None:
    """Prompt lookup runs on the sliding-window base and changes no token; EAGLE3 is refused in one line naming
    --specDecode before its draft is looked for."""
    from kvforge.contract.errors import InvalidConfig
    from kvforge.contract.speculation import SPEC_SUPPORT

    assert [name for name, row in SPEC_SUPPORT.items() if row.sliding_window_bases] == ["off", "ngram", "gemma4_mtp"]
    plain = run_all(make_engine(engines["base"]), PROMPTS, length=24)
    engine = make_engine(engines["base"], spec_decode="ngram", reuse=True)
    assert run_all(engine, PROMPTS, length=24) == plain
    assert engine.profile()["spec_decode_generation"]["total_draft_tokens"] > 0
    with pytest.raises(InvalidConfig, match="EAGLE3 is not supported on a base with sliding-window layers") as error:
        make_engine(engines["base"], spec_decode="eagle3")
    assert error.value.field == "spec_decode"


@pytest.mark.parametrize("reuse", [False, True])
def test_gemma4_mtp_on_a_base_with_per_layer_embeddings_changes_no_token(ple_engines: dict[str, Path],
                                                                         reuse: bool) -> None:
    plain = run_all(make_engine(ple_engines["base"]), PROMPTS, length=24)
    engine = make_engine(ple_engines["base"], spec_decode="gemma4_mtp", reuse=reuse, num_pages=12)
    assert run_all(engine, PROMPTS, length=24) == plain
    with_oracle(engine, PROMPTS, plain)
    assert run_all(engine, PROMPTS, length=24) == plain
    assert engine.profile()["spec_decode_generation"]["total_accepted_tokens"] > 0


@pytest.mark.parametrize("shared", [0, 2])
def test_the_assistant_reads_the_layers_transformers_stores(shared: int) -> None:
    """Per layer kind, the base layer an assistant layer reads is the one transformers' kv_sharing_modes marks
    "store" (the last of its kind before the KV-shared layers), with and without KV sharing in the base."""
    transformers = pytest.importorskip("transformers")
    from kvforge.tools.export.drafts.gemma4_assistant import base_producers
    from kvforge.tools.export.families.gemma4 import config_from_hf

    hf = transformers.Gemma4TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, global_head_dim=32, hidden_size_per_layer_input=0, sliding_window=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, num_kv_shared_layers=shared)
    stores = {kind: i for i, (kind, mode) in enumerate(zip(hf.layer_types, hf.kv_sharing_modes, strict=True))
              if mode == "store"}
    assert base_producers(config_from_hf(hf.to_dict(), kv_cache_dtype="fp32")) == stores
