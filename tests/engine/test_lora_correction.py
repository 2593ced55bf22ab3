"""Corrected adapters in the engine (issue 39 item 2, `lora_corrections`, off by default): the stored factors and the
corrected pages against the experiment's definition computed with PEFT, layer 0 exact, base pages reused, counters,
and the one-line refusals. The answers are approximate by design: no test asserts them equal to the exact run."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.hardening_support import invoke
from support.peft_support import save_peft_adapter, save_tiny_llama

from experiments.adapters import adapter_correction as experiment  # the repository root is on pytest's pythonpath
from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import LORA_TARGETS
from kvforge.runtime.api import LLM
from kvforge.runtime.cli import app as inference_app
from kvforge.runtime.execution.corrections import (
    correction_factors,
    fold_correction,
    load_attention_norms,
    normed_inputs,
)
from kvforge.runtime.types import SamplingParams
from kvforge.server.metrics import ServerMetrics
from kvforge.tools.export.lora import write_converted_adapter
from kvforge.tools.export.writer import write_onnx_dir

VOCAB, PAGE, LAYERS = 128, 16, 3
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0.0, top_k=1, max_generate_length=6)
BUILD = BuildOptions(max_input_len=160, max_kv_cache_capacity=192, max_batch_size=2, tokens_per_page=PAGE,
                     max_lora_rank=4)


@dataclass
class Setup:
    torch: Any
    models: dict[str, Any]  # PEFT models by adapter name (adapter name "default" inside each)
    paths: dict[str, str]
    engine: Path  # exported with hidden states of layers 0..L-2
    plain_engine: Path  # exported without hidden states


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    torch = pytest.importorskip("torch", reason="the reference is PEFT's")
    pytest.importorskip("transformers", reason="the reference is PEFT's")
    pytest.importorskip("peft", reason="the reference is PEFT's")
    from kvforge.tools.export.sources.hf import load_hf_dir

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora_correction")
    save_tiny_llama(root / "hf", VOCAB, LAYERS)
    peft_models, paths = {}, {}
    for name, targets, invocation, seed in (("checker", ALL, None, 1), ("qo", ["q_proj", "o_proj"], None, 2),
                                            ("act", ALL, [7, 42, 99], 3)):
        peft_models[name] = save_peft_adapter(root / "hf", root / f"peft_{name}", targets, invocation, seed)
    for folder, layers in (("", list(range(LAYERS - 1))), ("plain_", [])):
        loaded = load_hf_dir(root / "hf", kv_cache_dtype="fp32")
        loaded.config.lora_targets = list(LORA_TARGETS)
        loaded.config.hidden_state_layers = layers
        write_onnx_dir(loaded, root / f"{folder}onnx")
        build_engine(root / f"{folder}onnx", root / f"{folder}engine", BUILD)
    for name in peft_models:
        paths[name] = str(root / f"{name}.safetensors")
        write_converted_adapter(root / f"peft_{name}", root / "onnx", Path(paths[name]))
    return Setup(torch, peft_models, paths, root / "engine", root / "plain_engine")


def _llm(setup: Setup, corrections: tuple[str, ...] = ("checker", "qo")) -> LLM:
    adapters = {name: setup.paths[name] for name in ("checker", "qo")}
    return LLM(setup.engine, lora_weights=adapters, lora_corrections=corrections, num_threads=1)


def _conversation(seed: int, length: int) -> list[int]:
    ids = np.random.default_rng(seed).integers(10, VOCAB, length).tolist()
    return [t if t != 7 else 8 for t in ids]


def test_factors_are_x_times_a(setup: Setup) -> None:
    """P = x A from the engine's inputs (embedding, layers' residual stream, norm weights read from the graph)
    equals PEFT's lora_A applied to the input_layernorm outputs that transformers computes."""
    torch, model = setup.torch, setup.models["checker"]
    ids = _conversation(1, 40)
    with torch.inference_mode():
        _, _, xs = experiment.base_prefill(model, ids)
        with model.disable_adapter():
            states = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    engine = load_engine_dir(setup.engine)
    norms, eps = load_attention_norms(engine)
    llm = _llm(setup)
    folded = fold_correction(llm.engine.loras.get("checker"), norms)
    hidden = torch.cat(states[1:LAYERS], dim=-1)[0].numpy()  # residual after layers 0..L-2
    factors = correction_factors(folded, normed_inputs(states[0][0].numpy(), hidden, eps))
    assert factors.shape == (len(ids), LAYERS, 2, 4)
    layers = model.base_model.model.model.layers
    for layer in range(LAYERS):
        attention = layers[layer].self_attn
        for slot, module in enumerate((attention.k_proj, attention.v_proj)):
            expected = (xs[layer] @ module.lora_A["default"].weight.detach().T).numpy()
            np.testing.assert_allclose(factors[:, layer, slot], expected, atol=2e-4, rtol=1e-4)


def _corrected_pages(llm: LLM, follow: list[int], adapter: str) -> tuple[list[np.ndarray], int]:
    """Admit `follow` with `adapter`, run one step, and read the pool's pages the lease starts from: per layer
    [n, 2, Hkv, T, D] for its n corrected pages. The request then runs to its end."""
    engine = llm.engine
    request_id = engine.add_request(engine.prepare(follow, GREEDY, lora_name=adapter))
    engine.step()
    seq = engine.core.sequences[request_id]
    assert seq.lease is not None
    n = seq.lease.reuse_tokens // PAGE
    pages = [np.array(layer[seq.lease.page_ids[:n]]) for layer in engine.backend.kv_store.layers]
    while engine.has_unfinished():
        engine.step()
    engine.cache.check_invariants()
    return pages, n


def _as_cache_layout(pages: np.ndarray, part: int) -> np.ndarray:
    """Pool pages [n, 2, Hkv, T, D] -> transformers' [Hkv, n*T, D] for K (part 0) or V (part 1)."""
    n, _, heads, tokens, dim = pages.shape
    return pages[:, part].transpose(1, 0, 2, 3).reshape(heads, n * tokens, dim)


def test_corrected_pages_equal_the_definition_and_layer0_is_exact(setup: Setup) -> None:
    torch = setup.torch
    llm = _llm(setup)
    conversation = _conversation(2, 70)
    answer = llm.generate([conversation], GREEDY)[0]
    follow = conversation + answer.token_ids + [3, 4, 5]
    pages, n = _corrected_pages(llm, follow, "checker")
    assert n == (len(conversation) + len(answer.token_ids) - 1) // PAGE == 4
    model, prefix = setup.models["checker"], follow[:n * PAGE]
    with torch.inference_mode():
        keys, values, xs = experiment.base_prefill(model, prefix)
        reference = experiment.corrected_cache(model, "default", keys, values, xs)
        _, exact = experiment.forward(model, prefix)
    for layer in range(LAYERS):
        for part, expected in ((0, reference.layers[layer].keys), (1, reference.layers[layer].values)):
            np.testing.assert_allclose(_as_cache_layout(pages[layer], part), expected[0].numpy(), atol=2e-4,
                                       err_msg=f"layer {layer} part {part}")
    # Layer 0 sees the same input with or without the adapter: the corrected K/V are the adapter's own.
    np.testing.assert_allclose(_as_cache_layout(pages[0], 0), exact.layers[0].keys[0].numpy(), atol=2e-4)
    np.testing.assert_allclose(_as_cache_layout(pages[0], 1), exact.layers[0].values[0].numpy(), atol=2e-4)
    assert not np.allclose(_as_cache_layout(pages[0], 0), keys[0][0].numpy(), atol=1e-3)  # it did correct
    # An adapter without k/v targets starts from the base K/V exactly.
    plain_pages, plain_n = _corrected_pages(llm, follow, "qo")
    assert plain_n == n
    for layer in range(LAYERS):
        np.testing.assert_allclose(_as_cache_layout(plain_pages[layer], 0), keys[layer][0].numpy(), atol=2e-4)
        np.testing.assert_allclose(_as_cache_layout(plain_pages[layer], 1), values[layer][0].numpy(), atol=2e-4)


def _peft_greedy(torch: Any, model: Any, ids: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=count, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_corrected_adapter_reuses_the_base_conversation_and_is_counted(setup: Setup) -> None:
    llm = _llm(setup)
    conversation = _conversation(3, 106)
    answer = llm.generate([conversation], GREEDY)[0]
    follow = conversation + answer.token_ids + [3, 4, 5]
    corrected = llm.generate([follow], GREEDY, lora_name="checker")[0]
    assert corrected.cached_tokens >= 0.8 * len(follow), (corrected.cached_tokens, len(follow))
    pages = (len(conversation) + len(answer.token_ids) - 1) // PAGE
    per_adapter = llm.engine.profile()["per_adapter"]
    assert per_adapter["checker"]["corrected_pages"] == pages
    assert per_adapter["checker"]["base_pages_reused"] == 0  # the base pages themselves are not used
    scraped = ServerMetrics(llm.engine.stats).render().decode()
    assert f"kvforge_adapter_corrected_pages_total {float(pages)}" in scraped
    # Its copies are its own: a second corrected request computes its tail again and corrects the same pages.
    again = llm.generate([follow], GREEDY, lora_name="checker")[0]
    assert again.cached_tokens == corrected.cached_tokens and again.token_ids == corrected.token_ids
    assert llm.engine.profile()["per_adapter"]["checker"]["corrected_pages"] == 2 * pages
    # Nothing corrected was published: every record is the base model's, and a base request over the same tokens
    # answers as a base request on a fresh engine.
    records = list(llm.engine.cache.records.least_recent_first())
    assert records and all(not r.extras.corrected and not r.extras.adapter_digest for r in records)
    fresh = _llm(setup).generate([follow], GREEDY)[0]
    assert llm.generate([follow], GREEDY)[0].token_ids == fresh.token_ids
    counters = llm.engine.profile()["context_cache"]["adapter_corrections"]
    assert counters["corrected_pages"] == 2 * pages and counters["skipped_pages"] == 0
    assert counters["stored_pages"] >= 2 * pages  # both corrected adapters' factors of every whole base page
    llm.engine.cache.check_invariants()


def test_off_by_default_the_adapter_shares_nothing_and_stays_exact(setup: Setup) -> None:
    llm = LLM(setup.engine, lora_weights={"checker": setup.paths["checker"]}, num_threads=1)
    conversation = _conversation(3, 106)
    answer = llm.generate([conversation], GREEDY)[0]
    follow = conversation + answer.token_ids + [3, 4, 5]
    plain = llm.generate([follow], GREEDY, lora_name="checker")[0]
    assert plain.cached_tokens == 0
    assert plain.token_ids == _peft_greedy(setup.torch, setup.models["checker"], follow, 6)
    assert "corrected_pages" not in llm.engine.profile()["per_adapter"]["checker"]
    assert "kvforge_adapter_corrected_pages_total 0.0" in ServerMetrics(llm.engine.stats).render().decode()


def _refusal(make: Callable[[], Any]) -> KvforgeError:
    with pytest.raises(KvforgeError) as info:
        make()
    assert info.value.field == "lora_corrections" and "\n" not in str(info.value), str(info.value)
    return info.value


def test_refusals_are_one_line(setup: Setup, tier_engine: Callable[..., Path]) -> None:
    unknown = _refusal(lambda: _llm(setup, ("nope",)))
    assert "'nope'" in unknown.message and "not loaded" in unknown.message
    activated = _refusal(lambda: LLM(setup.engine, lora_weights={"act": setup.paths["act"]},
                                     lora_corrections=("act",), num_threads=1))
    assert "activated LoRA" in activated.message
    hidden = _refusal(lambda: LLM(setup.plain_engine, lora_weights={"checker": setup.paths["checker"]},
                                  lora_corrections=("checker",), num_threads=1))
    assert "--hiddenStateLayers 0,1" in hidden.message
    recurrent = _refusal(lambda: LLM(tier_engine("tiny-mamba2"), lora_corrections=("checker",), num_threads=1,
                                     context_cache_recurrent_snapshot_pool_bytes=1 << 22))
    assert "recurrent and hybrid" in recurrent.message
    family = _refusal(lambda: LLM(tier_engine("tiny-gemma3"), lora_corrections=("checker",), num_threads=1))
    assert "llama family only" in family.message
    no_reuse = _refusal(lambda: LLM(setup.engine, lora_corrections=("checker",), enable_context_reuse=False,
                                    num_threads=1))
    assert "enable_context_reuse" in no_reuse.message
    speculative = _refusal(lambda: LLM(setup.engine, lora_corrections=("checker",), spec_decode="ngram",
                                       num_threads=1))
    assert "speculative decoding" in speculative.message


def test_llm_inference_flag(setup: Setup, tmp_path: Path) -> None:
    """--loraCorrection NAME (repeatable) from llm_inference: a request file whose adapter set lacks the name is
    refused in one line naming the flag; with the name the file runs."""
    request = {"messages": [{"role": "user", "content": "hello"}], "max_generate_length": 2}
    data = {"batch_size": 1, "temperature": 0.0, "top_k": 1, "available_lora_weights":
            {"checker": setup.paths["checker"]}, "requests": [request, {**request, "lora_name": "checker"}]}
    (tmp_path / "in.json").write_text(json.dumps(data))
    common = ("--engineDir", setup.engine, "--inputFile", tmp_path / "in.json", "--outputFile",
              tmp_path / "out.json", "--numThreads", "1", "--enableContextReuse")
    invoke(inference_app, *common, "--loraCorrection", "nope").one_line_error("--loraCorrection", "nope")
    invoke(inference_app, "--engineDir", setup.engine, "--inputFile", tmp_path / "in.json", "--outputFile",
           tmp_path / "out.json", "--loraCorrection", "checker").one_line_error("--enableContextReuse")
    result = invoke(inference_app, *common, "--loraCorrection", "checker", "--loraCorrection", "qo")
    result.one_line_error("--loraCorrection", "'qo'")  # every name must be loaded
    ok = invoke(inference_app, *common, "--loraCorrection", "checker")
    assert ok.code == 0, ok.stderr
    assert len(json.loads((tmp_path / "out.json").read_text())["responses"]) == 2


def test_llm_serve_flag_names_itself(setup: Setup) -> None:
    from kvforge.server.cli import app as serve_app

    result = invoke(serve_app, "--engineDir", setup.engine, "--loraWeights", f"checker={setup.paths['checker']}",
                    "--loraCorrection", "nope", "--enableContextReuse", "--numThreads", "1", "--port", "0")
    result.one_line_error("--loraCorrection", "'nope'")


def test_a_full_factor_pool_leaves_pages_uncorrected(setup: Setup) -> None:
    """A budget of 2 slots keeps factors for the first 2 pages only: the adapter starts from those 2 and computes
    the rest; the pages without factors are counted."""
    llm = LLM(setup.engine, lora_weights={"checker": setup.paths["checker"]}, lora_corrections=("checker",),
              lora_correction_pages=2, num_threads=1)
    conversation = _conversation(4, 70)
    answer = llm.generate([conversation], GREEDY)[0]
    corrected = llm.generate([conversation + answer.token_ids + [3]], GREEDY, lora_name="checker")[0]
    assert corrected.cached_tokens == 2 * PAGE
    counters = llm.engine.profile()["context_cache"]["adapter_corrections"]
    assert counters["stored_pages"] == 2 and counters["skipped_pages"] > 0
    assert llm.engine.profile()["context_cache"]["resource_pools"]["adapter_corrections"] == {"free": 0,
                                                                                              "capacity": 2}


def test_correct_rounds_to_the_pool_dtype_and_reads_sources_first() -> None:
    """The copy on an fp16 pool: destination = round(base + delta) with K's delta rotated at the page's positions,
    also when a source page is one of the destinations (a base page evicted for the admission and handed back to
    it as a fresh page): every source is read before anything is written."""
    from kvforge.contract.rope import rope_table
    from kvforge.plugins.reference import apply_rope, round_to_storage
    from kvforge.runtime.adapters import LoraAdapter
    from kvforge.runtime.execution.corrections import AdapterCorrector, FoldedCorrection
    from kvforge.runtime.execution.kv_store import KVStore

    rng = np.random.default_rng(0)
    heads, dim, tokens, rank = 2, 8, 4, 3
    kv = KVStore(1, 5, heads, tokens, dim, "fp16")
    kv.layers[0][:] = rng.standard_normal(kv.layers[0].shape).astype(np.float16)
    cos_sin = rope_table(32, dim, 10000.0)
    corrector = AdapterCorrector(kv, cos_sin, "fp16", heads, dim, np.ones((1, 16), np.float32), 1e-6, ("a",))
    b_k, b_v = (rng.standard_normal((rank, heads * dim)).astype(np.float32) for _ in range(2))
    tensors = {"lora_A_0_k": np.zeros((16, rank), np.float32), "lora_A_0_v": np.zeros((16, rank), np.float32),
               "lora_B_0_k": b_k, "lora_B_0_v": b_v}
    corrector.register([LoraAdapter("a", Path("a"), rank, tensors, b"a")])
    folded = FoldedCorrection(b"a", rank, np.zeros((1, 2, 16, rank), np.float32), np.stack([b_k, b_v])[None], True)
    factors = [rng.standard_normal((tokens, 1, 2, rank)).astype(np.float32) for _ in range(2)]
    before = kv.layers[0].astype(np.float32)
    corrector.correct(b"a", [1, 2], [2, 3], factors)  # page 2 is both a source and a destination
    for i, (src, dst) in enumerate(((1, 2), (2, 3))):
        positions = np.arange(i * tokens, (i + 1) * tokens)
        dk = apply_rope((factors[i][:, 0, 0] @ folded.b[0, 0]).reshape(tokens, heads, dim), cos_sin, positions)
        dv = (factors[i][:, 0, 1] @ folded.b[0, 1]).reshape(tokens, heads, dim)
        np.testing.assert_array_equal(kv.layers[0][dst, 0], round_to_storage(before[src, 0] + dk.transpose(1, 0, 2),
                                                                              "fp16"))
        np.testing.assert_array_equal(kv.layers[0][dst, 1], round_to_storage(before[src, 1] + dv.transpose(1, 0, 2),
                                                                              "fp16"))
