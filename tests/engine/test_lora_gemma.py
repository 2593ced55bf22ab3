"""LoRA on Gemma 3 and Gemma 4 as on llama: PEFT adapters on tiny random checkpoints give PEFT's own greedy tokens and
log-probabilities through the engine, stay apart from the base model's cached pages, and skip (as PEFT does) the k/v
projections Gemma 4's KV-shared layers do not have."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.engine_driver import assert_idle, make_engine
from support.lazy_import import LazyModule
from support.peft_support import randomize_lora_b

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import LORA_TARGETS, lora_inputs
from kvforge.contract.model_config import ModelConfig
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.lora import write_converted_adapter, write_random_peft_adapter
from kvforge.tools.export.sources.hf import load_hf_dir
from kvforge.tools.export.sources.synthetic import byte_level_tokenizer
from kvforge.tools.export.writer import write_onnx_dir

# Imported on first use (collecting this file stays torch-free); a missing one skips the test with the reason.
torch = LazyModule("torch", reason="PEFT parity needs torch")
transformers = LazyModule("transformers", reason="PEFT parity needs transformers")
peft = LazyModule("peft", reason="PEFT parity needs peft")
pytestmark = pytest.mark.torch

VOCAB, WINDOW, T = 320, 16, 16  # the byte-level tokenizer's 259 tokens fit the vocabulary
PEFT_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=256, sliding_window=WINDOW, final_logit_softcapping=30.0,
              rms_norm_eps=1e-6, tie_word_embeddings=True)


def gemma3() -> object:
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, **COMMON, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}))


def gemma4(**overrides: object) -> object:
    """Global layers with heads twice as wide as the sliding ones', and the last two layers reading an earlier
    layer's K/V (layer 4 reads layer 3's pool, layer 5 layer 2's): q_proj and o_proj only there."""
    fields = dict(num_hidden_layers=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                  global_head_dim=64, hidden_size_per_layer_input=0, num_kv_shared_layers=2, **COMMON)
    fields.update(overrides)
    return transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**fields))


def randomised(hf: object, zero_centred: bool) -> object:
    """Norms off their init (Gemma 3's multiply by 1 + w, Gemma 4's by w), embeddings of norm ~1, layer scalars
    off one, so each part matters."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_((0.0 if zero_centred else 1.0) + 0.3 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
        for name, buffer in hf.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand(1))
    return hf.eval()


@dataclass
class Setup:
    peft_model: object  # the base model wrapped by PEFT; `disable_adapter()` runs the base model
    config: ModelConfig  # the ONNX dir's
    root: Path
    adapter: Path  # converted


def export_with_adapter(root: Path, hf: object, seed: int) -> Setup:
    """The checkpoint exported with every LoRA target and built with --maxLoraRank 4; a rank-4 PEFT adapter on
    every module PEFT finds, its B drawn at random (PEFT starts B at zero), converted."""
    hf.save_pretrained(root / "hf", safe_serialization=True)
    byte_level_tokenizer().save(str(root / "hf" / "tokenizer.json"))
    loaded = load_hf_dir(root / "hf", kv_cache_dtype="fp32")
    loaded.config.lora_targets = list(LORA_TARGETS)  # llm_export's default --loraTargets all
    write_onnx_dir(loaded, root / "onnx")
    build_engine(root / "onnx", root / "engine", BuildOptions(max_input_len=128, max_kv_cache_capacity=256,
                                                              max_batch_size=2, tokens_per_page=T, max_lora_rank=4))
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=12, target_modules=PEFT_MODULES)).eval()
    randomize_lora_b(model, 0.2, seed)
    model.save_pretrained(root / "peft")
    write_converted_adapter(root / "peft", root / "onnx", root / "adapter.safetensors")
    return Setup(model, loaded.config, root, root / "adapter.safetensors")


@pytest.fixture(scope="module")
def gemma3_setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    torch.manual_seed(0)
    return export_with_adapter(tmp_path_factory.mktemp("gemma3_lora"), randomised(gemma3(), True), seed=1)


@pytest.fixture(scope="module")
def gemma4_setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    torch.manual_seed(2)
    setup = export_with_adapter(tmp_path_factory.mktemp("gemma4_lora"), randomised(gemma4(), False), seed=3)
    assert setup.config.kv_source_layers == [0, 1, 2, 3, 3, 2] and setup.config.global_head_dim == 64
    return setup


def prompt(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB - 64, length)]  # byte tokens, no specials


def peft_greedy(setup: Setup, ids: list[int], count: int, adapter: bool) -> tuple[list[int], np.ndarray]:
    """PEFT's greedy tokens (its own cache and sliding masks) and the log-probabilities of each step's logits."""
    model = setup.peft_model
    with torch.no_grad():
        if adapter:
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
        else:
            with model.disable_adapter():
                out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits)[:, 0].double()
    return out.sequences[0, len(ids):].tolist(), torch.log_softmax(logits, -1).numpy()


def run(engine: Engine, ids: list[int], adapter: str | None, count: int) -> tuple[list[int], np.ndarray, int]:
    """The engine's greedy tokens, the top-3 log-probabilities per step and the prompt tokens it reused."""
    engine.add_request(EngineRequest(ids, SamplingParams(max_generate_length=count, temperature=0.0, num_logprobs=3),
                                     adapter=engine.loras.get(adapter)))
    done = []
    while not done:
        done = [o for o in engine.step() if o.finished]
    out = done[0]
    assert out.adapter == (adapter or "base")
    return out.token_ids, np.array([[e.logprob for e in step] for step in out.logprobs]), out.cached_tokens


def check_parity_and_isolation(setup: Setup, engine_dir: str = "engine") -> None:
    """Past the window: base, adapter, base again on one prompt with reuse on. The adapter's tokens and
    log-probabilities are PEFT's, the base's are the base model's each time; the adapter reuses none of the base's
    pages, and the second base run reuses them."""
    engine = make_engine(setup.root / engine_dir, reuse=True)
    engine.load_adapters({"peft": str(setup.adapter)})
    ids, count = prompt(40, seed=7), 6
    runs = [run(engine, ids, name, count) for name in (None, "peft", None)]
    assert_idle(engine)
    for (tokens, logprobs, _), adapter in zip(runs, (False, True, False), strict=True):
        expected, reference = peft_greedy(setup, ids, count, adapter)
        assert tokens == expected
        top = np.sort(reference, axis=-1)[:, ::-1][:, :3]
        np.testing.assert_allclose(logprobs, top, atol=2e-4)
    (base, _, cold), (adapted, _, adapter_hit), (again, _, warm) = runs
    assert adapted != base and again == base  # the adapter matters; the base model's answer is unchanged
    assert cold == 0 and adapter_hit == 0 and warm > 0  # pages keyed by the adapter's digest
    # One engine call with a base row and an adapter row (per-row LoRA inputs): each answers as alone.
    fresh = make_engine(setup.root / engine_dir)
    fresh.load_adapters({"peft": str(setup.adapter)})
    assert together(fresh, [(ids, None), (ids, "peft")], count) == [base, adapted]


def together(engine: Engine, rows: list[tuple[list[int], str | None]], count: int) -> list[list[int]]:
    """Greedy tokens of requests queued before the first step, so they share engine calls."""
    request_ids = [engine.add_request(EngineRequest(ids, SamplingParams(max_generate_length=count, temperature=0.0),
                                                    adapter=engine.loras.get(name))) for ids, name in rows]
    finished = {}
    while len(finished) < len(rows):
        finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert_idle(engine)
    return [finished[r] for r in request_ids]


def test_gemma3_adapter_equals_peft_and_stays_apart_from_the_base(gemma3_setup: Setup) -> None:
    check_parity_and_isolation(gemma3_setup)


def test_gemma4_adapter_equals_peft_and_stays_apart_from_the_base(gemma4_setup: Setup) -> None:
    """Wide global heads (per-layer LoRA shapes) and KV-shared layers (q/o only) included."""
    check_parity_and_isolation(gemma4_setup)


def test_gemma4_adapter_with_the_sliding_window_pool(gemma4_setup: Setup) -> None:
    """The same with the sliding layers on their own page group and window records (llm_build
    --slidingWindowPool): the window pages a reuse hit restores are keyed by the adapter too."""
    build_engine(gemma4_setup.root / "onnx", gemma4_setup.root / "engine_window", BuildOptions(
        max_input_len=128, max_kv_cache_capacity=256, max_batch_size=2, tokens_per_page=T, max_lora_rank=4,
        sliding_window_pool=True, sliding_window_records=8))
    check_parity_and_isolation(gemma4_setup, "engine_window")


INVOCATION = [290, 291, 292]  # ids the prompts below never draw


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_activated_adapter_equals_peft_and_reuses_the_base_pages(family: str, request: pytest.FixtureRequest,
                                                                   tmp_path: Path) -> None:
    """PEFT's activated LoRA (alora_invocation_tokens) on Gemma: after the base model answers a conversation, the
    adapter invoked over it reuses the whole pages before its invocation and answers with PEFT's own tokens."""
    setup: Setup = request.getfixturevalue(f"{family}_setup")
    fresh = type(setup.peft_model.get_base_model()).from_pretrained(setup.root / "hf").eval()
    activated = peft.LoraConfig(r=4, lora_alpha=12, target_modules=PEFT_MODULES, task_type="CAUSAL_LM",
                                alora_invocation_tokens=INVOCATION)  # PEFT applies aLoRA to causal LMs only
    model = peft.get_peft_model(fresh, activated).eval()
    randomize_lora_b(model, 0.3, 6)
    model.save_pretrained(tmp_path / "peft")
    write_converted_adapter(tmp_path / "peft", setup.root / "onnx", tmp_path / "act.safetensors")
    engine = make_engine(setup.root / "engine", reuse=True)
    engine.load_adapters({"act": str(tmp_path / "act.safetensors")})
    conversation = prompt(44, seed=11)
    answer, _, _ = run(engine, conversation, None, 4)
    follow_up = conversation + answer + INVOCATION + [40, 41]
    tokens, _, cached = run(engine, follow_up, "act", 6)
    assert_idle(engine)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([follow_up]), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, attention_mask=torch.ones(1, len(follow_up), dtype=torch.long))
    assert tokens == out[0, len(follow_up):].tolist()
    assert tokens != together(make_engine(setup.root / "engine"), [(follow_up, None)], 6)[0]  # the adapter matters
    # Every whole page of the base run's K/V (its last token's was never computed), all before the invocation.
    assert cached == (len(conversation) + len(answer) - 1) // T * T == 32


def test_gemma4_kv_shared_layers_take_q_and_o_only(gemma4_setup: Setup, tmp_path: Path) -> None:
    """PEFT finds no k_proj/v_proj in a KV-shared layer and adapts the rest; kvforge does the same: the graph has
    no k/v inputs there, random adapters leave them out, and a hand-made adapter naming them is refused in one line
    naming the adapter dir (the engine would have nowhere to apply it)."""
    setup = gemma4_setup
    saved = load_file(str(setup.root / "peft" / "adapter_model.safetensors"))
    assert not [n for n in saved if ".layers.4.self_attn.k_proj" in n or ".layers.5.self_attn.v_proj" in n]
    assert [n for n in saved if ".layers.5.self_attn.q_proj" in n] and [n for n in saved if ".layers.3.self_attn.k_"
                                                                        "proj" in n]
    import onnx
    names = {i.name for i in onnx.load(str(setup.root / "engine" / "model.onnx"), load_external_data=False).graph.input}
    assert {"lora_A_5_q", "lora_B_5_o", "lora_A_3_k", "lora_A_2_k"} <= names
    assert not names & {"lora_A_4_k", "lora_A_4_v", "lora_B_5_k", "lora_B_5_v"}
    assert {a for a, _, _, _ in lora_inputs(setup.config)} == {n for n in names if n.startswith("lora_A_")}
    wide = setup.config.layer_head_dim(2) * setup.config.num_attention_heads  # the global layer's q width
    assert load_file(str(setup.adapter))["lora_B_2_q"].shape == (4, wide) == (4, 256)

    write_random_peft_adapter(setup.root / "onnx", tmp_path / "random", rank=2, seed=4)
    random_names = load_file(str(tmp_path / "random" / "adapter_model.safetensors"))
    assert not [n for n in random_names if ".layers.4.self_attn.k_proj" in n]
    write_converted_adapter(tmp_path / "random", setup.root / "onnx", tmp_path / "random.safetensors")

    forged = dict(saved)
    prefix = "base_model.model.model.layers.4.self_attn.k_proj"
    forged[f"{prefix}.lora_A.weight"] = np.zeros((4, 64), np.float32)
    forged[f"{prefix}.lora_B.weight"] = np.zeros((64, 4), np.float32)
    (tmp_path / "forged").mkdir()
    save_file(forged, str(tmp_path / "forged" / "adapter_model.safetensors"))
    (tmp_path / "forged" / "adapter_config.json").write_text(
        (setup.root / "peft" / "adapter_config.json").read_text(encoding="utf-8"), encoding="utf-8")
    with pytest.raises(KvforgeError, match=r"layer 4 k_proj.*reads layer 3's K/V") as refused:
        write_converted_adapter(tmp_path / "forged", setup.root / "onnx", tmp_path / "forged.safetensors")
    assert refused.value.field == "adapter_dir" and "\n" not in str(refused.value)


def test_gemma4_double_wide_mlps_export_attention_targets_only(tmp_path: Path) -> None:
    """use_double_wide_mlp doubles the KV-shared layers' MLPs, a width config.json does not record: the export keeps
    q/k/v/o and leaves gate/up/down out, so an adapter for those is refused by name at conversion."""
    torch.manual_seed(5)
    hf = randomised(gemma4(global_head_dim=32, use_double_wide_mlp=True), False)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    byte_level_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    loaded = load_hf_dir(tmp_path / "hf", kv_cache_dtype="fp32")
    loaded.config.lora_targets = list(LORA_TARGETS)
    write_onnx_dir(loaded, tmp_path / "onnx")
    config = json.loads((tmp_path / "onnx" / "config.json").read_text(encoding="utf-8"))
    assert config["lora_targets"] == ["q", "k", "v", "o"]
    write_random_peft_adapter(tmp_path / "onnx", tmp_path / "mlp", rank=2, targets=["up"])
    with pytest.raises(KvforgeError, match="--loraTargets q,k,v,o") as refused:
        write_converted_adapter(tmp_path / "mlp", tmp_path / "onnx", tmp_path / "mlp.safetensors")
    assert refused.value.field == "adapter_dir"
