"""LoRA at run time: merged-weight parity, transformers+peft parity, adapter isolation in the cache, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from support.engine_driver import lora_model_with_adapters, make_engine, run_file
from support.numpy_llama import dense_logits

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import LORA_MODULES, LORA_TARGETS, lora_inputs
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.inputs.request_file import parse_request_file
from kvforge.tools.export.lora import write_converted_adapter, write_random_peft_adapter
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

pytestmark = pytest.mark.attention_path  # assertions that depend on the attention lowering: run again on the fallback

ROOT = Path(__file__).resolve().parents[2]
T = 16


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora")
    loaded, adapters = lora_model_with_adapters(
        root, BuildOptions(max_input_len=512, max_kv_cache_capacity=576, max_batch_size=4, tokens_per_page=T,
                           max_lora_rank=8), "fp32", (("a", 1, 4), ("b", 2, 8), ("x", 3, 4)))
    return loaded, root, adapters


def run(runtime: Engine, data: dict) -> list[dict]:
    return run_file(runtime, data)


def merged_weights(weights: dict[str, np.ndarray], adapter_file: Path, config) -> dict[str, np.ndarray]:
    tensors = load_file(str(adapter_file))
    merged = dict(weights)
    for a_name, b_name, layer, target in lora_inputs(config):
        key = f"model.layers.{layer}.{LORA_MODULES[target]}.weight"
        merged[key] = weights[key] + (tensors[a_name] @ tensors[b_name]).T
    return merged


def test_adapter_output_equals_merged_weights(lora_setup) -> None:
    loaded, root, adapters = lora_setup
    runtime = make_engine(root / "engine", num_threads=2)
    prompt = "merge me, please"
    data = {"temperature": 0.0, "max_generate_length": 6, "num_logprobs": 3, "apply_chat_template": False,
            "available_lora_weights": {"a": str(adapters["a"])},
            "requests": [{"messages": [{"role": "user", "content": prompt}], "lora_name": "a"},
                         {"messages": [{"role": "user", "content": prompt}]}]}
    with_adapter, base = run(runtime, data)
    ids = runtime.tokenizer.encode(prompt)
    for response, weights in ((with_adapter, merged_weights(loaded.weights, adapters["a"], loaded.config)),
                              (base, loaded.weights)):
        generated = [step[0]["token_id"] for step in response["logprobs"]]
        reference = dense_logits(loaded.config, weights, ids + generated)
        for i, step in enumerate(response["logprobs"]):
            row = reference[len(ids) - 1 + i].astype(np.float64)
            log_probs = row - row.max() - np.log(np.exp(row - row.max()).sum())
            assert [e["token_id"] for e in step] == np.argsort(-log_probs)[:3].tolist()
            np.testing.assert_allclose([e["logprob"] for e in step], np.sort(log_probs)[::-1][:3], atol=1e-4)
    assert with_adapter["output_text"] != base["output_text"]  # the adapter really changes the model


def test_mixed_adapter_batch_equals_each_row_alone(lora_setup) -> None:
    """Per-row adapter inputs: base, rank-4 and rank-8 adapters in one engine call give what each gives alone."""
    _, root, adapters = lora_setup
    runtime = make_engine(root / "engine", num_threads=2)
    rows = [None, "a", "b", "a"]
    data = {"batch_size": 4, "temperature": 0.0, "max_generate_length": 8, "num_logprobs": 2,
            "available_lora_weights": {name: str(path) for name, path in adapters.items()},
            "requests": [{"messages": [{"role": "user", "content": f"row {i} asks something"}],
                          **({"lora_name": name} if name else {})} for i, name in enumerate(rows)]}
    together = run(runtime, data)
    alone = run(runtime, {**data, "batch_size": 1})
    for t, a in zip(together, alone, strict=True):
        assert (t["output_text"], [s[0]["token_id"] for s in t["logprobs"]]) == \
               (a["output_text"], [s[0]["token_id"] for s in a["logprobs"]])
        np.testing.assert_allclose([s[0]["logprob"] for s in t["logprobs"]], [s[0]["logprob"] for s in a["logprobs"]],
                                   atol=1e-4)
    assert together[1]["output_text"] != together[0]["output_text"]


def test_isolation_matrix(lora_setup, tmp_path: Path) -> None:
    """{none, A, B, A re-saved with changed weights under the same name} × {no salt, salt "x"}: a hit only on
    identical pairs. Adapter "x" and salt "x" share a name and must still never collide."""
    _, root, adapters = lora_setup
    changed = tmp_path / "a_changed.safetensors"
    tensors = load_file(str(adapters["a"]))
    with safe_open(str(adapters["a"]), framework="numpy") as handle:  # keep the metadata, change one weight
        metadata = handle.metadata()
    first = sorted(k for k in tensors if k.startswith("lora_B"))[0]
    tensors[first] = tensors[first] + 0.01
    save_file(tensors, str(changed), metadata=metadata)
    variants = [(None, None), ("a", adapters["a"]), ("b", adapters["b"]), ("a", changed), ("x", adapters["x"])]
    prompt = [{"role": "user", "content": "a shared prefix long enough for two pages of tokens"}]

    def request(adapter: tuple, salt: str | None) -> dict:
        name, path = adapter
        return {"temperature": 0.0, "max_generate_length": 2,
                "available_lora_weights": {name: str(path)} if name else {},
                "requests": [{"messages": prompt, **({"lora_name": name} if name else {}),
                              **({"cache_salt": salt} if salt is not None else {})}]}

    combos = [(v, salt) for v in variants for salt in (None, "x")]
    for first_combo in combos:
        for second_combo in combos:
            runtime = make_engine(root / "engine", num_threads=1, reuse=True)
            run(runtime, request(*first_combo))
            cached = run(runtime, request(*second_combo))[0]["usage"]["cached_tokens"]
            same = first_combo[1] == second_combo[1] and first_combo[0][1] == second_combo[0][1]
            assert (cached > 0) == same, (first_combo, second_combo, cached)


def test_reuse_is_invisible_on_llm_lora_case(lora_setup, monkeypatch: pytest.MonkeyPatch) -> None:
    _, root, adapters = lora_setup
    lora_dir = root / "case_adapters"
    lora_dir.mkdir(exist_ok=True)
    for name, source in (("summarizer", "a"), ("classifier", "b")):
        (lora_dir / f"{name}.safetensors").write_bytes(adapters[source].read_bytes())
    monkeypatch.setenv("KVFORGE_LORA_DIR", str(lora_dir))
    data = json.loads((ROOT / "test_cases" / "llm_lora.json").read_text())
    warm_runtime = make_engine(root / "engine", num_threads=2, reuse=True)
    warm = run(warm_runtime, data)
    cold = run(make_engine(root / "engine", num_threads=2), data)
    for w, c in zip(warm, cold, strict=True):
        assert (w["output_text"], [s[0]["token_id"] for s in w["logprobs"]]) == \
               (c["output_text"], [s[0]["token_id"] for s in c["logprobs"]])
    assert warm[1]["usage"]["cached_tokens"] == 0  # same prompt as request 0 but another adapter
    assert all(w["usage"]["cached_tokens"] > 0 for w in warm[3:])
    assert os.environ["KVFORGE_LORA_DIR"] == str(lora_dir)


def test_bad_adapters(lora_setup, tmp_path: Path) -> None:
    _, root, adapters = lora_setup
    runtime = make_engine(root / "engine", num_threads=1)

    def load(path: Path) -> str:
        with pytest.raises(KvforgeError) as info:
            runtime.load_adapters({"bad": str(path)})
        assert info.value.field == 'available_lora_weights["bad"]'
        return info.value.message

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    assert "cannot read" in load(garbage)
    assert "does not exist" in load(tmp_path / "missing.safetensors")
    # Rank above --maxLoraRank 8.
    write_random_peft_adapter(root / "onnx", tmp_path / "wide", rank=16, seed=5)
    write_converted_adapter(tmp_path / "wide", root / "onnx", tmp_path / "wide.safetensors")
    assert "exceeds the engine's --maxLoraRank 8" in load(tmp_path / "wide.safetensors")
    # An adapter converted for another model.
    other = synthetic_model("tiny-qwen3")
    other.config.lora_targets = list(LORA_TARGETS)
    write_onnx_dir(other, tmp_path / "other_onnx")
    write_random_peft_adapter(tmp_path / "other_onnx", tmp_path / "other_peft", rank=4)
    write_converted_adapter(tmp_path / "other_peft", tmp_path / "other_onnx", tmp_path / "other.safetensors")
    assert "another model" in load(tmp_path / "other.safetensors")
    # A PEFT adapter that was never converted.
    assert "llm_export lora" in load(tmp_path / "other_peft" / "adapter_model.safetensors")
    with pytest.raises(KvforgeError, match="requests\\[0\\].lora_name"):
        parse_request_file({"requests": [{"messages": [{"role": "user", "content": "hi"}], "lora_name": "nope"}]})


def test_converter_refuses_mismatches(lora_setup, tmp_path: Path) -> None:
    _, root, _ = lora_setup
    other = synthetic_model("tiny-qwen3")
    other.config.lora_targets = list(LORA_TARGETS)
    write_onnx_dir(other, tmp_path / "other_onnx")
    write_random_peft_adapter(tmp_path / "other_onnx", tmp_path / "other_peft", rank=4)
    with pytest.raises(KvforgeError, match="another model") as info:  # q_proj is 128 wide there, 64 here
        write_converted_adapter(tmp_path / "other_peft", root / "onnx", tmp_path / "x.safetensors")
    assert info.value.field == "adapter_dir"  # llm_export lora maps it to --adapterDir
    narrow = synthetic_model("tiny-llama")
    narrow.config.lora_targets = ["q", "v"]
    write_onnx_dir(narrow, tmp_path / "narrow_onnx")
    write_random_peft_adapter(root / "onnx", tmp_path / "all_peft", rank=2)
    with pytest.raises(KvforgeError, match="--loraTargets q,v"):
        write_converted_adapter(tmp_path / "all_peft", tmp_path / "narrow_onnx", tmp_path / "y.safetensors")
    with pytest.raises(KvforgeError, match="adapter_config.json"):
        write_converted_adapter(tmp_path, root / "onnx", tmp_path / "z.safetensors")


def test_base_engine_refuses_adapters_and_strips_lora(lora_setup, tmp_path: Path) -> None:
    _, root, adapters = lora_setup
    build_engine(root / "onnx", tmp_path / "base", BuildOptions(max_input_len=64, max_kv_cache_capacity=128,
                                                               max_batch_size=1, tokens_per_page=T))
    import onnx
    model = onnx.load(tmp_path / "base" / "model.onnx", load_external_data=False)
    assert not [i for i in model.graph.input if i.name.startswith("lora_")]
    runtime = make_engine(tmp_path / "base", num_threads=1)
    with pytest.raises(KvforgeError, match="--maxLoraRank"):
        runtime.load_adapters({"a": str(adapters["a"])})


@pytest.mark.torch
def test_matches_transformers_with_peft(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="transformers+peft parity needs torch")
    transformers = pytest.importorskip("transformers", reason="transformers+peft parity needs transformers")
    peft = pytest.importorskip("peft", reason="transformers+peft parity needs peft")
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    base = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0.0, 0.2)
    base.save_pretrained(tmp_path / "hf", safe_serialization=True)
    Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(tmp_path / "hf" / "tokenizer.json"))
    lora_config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(base, lora_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)  # PEFT initialises B to zero: make the adapter matter
    model.save_pretrained(tmp_path / "peft")

    from kvforge.tools.export.sources.hf import load_hf_dir
    loaded = load_hf_dir(tmp_path / "hf", kv_cache_dtype="fp32")
    loaded.config.lora_targets = list(LORA_TARGETS)
    write_onnx_dir(loaded, tmp_path / "onnx")
    build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(max_input_len=64, max_kv_cache_capacity=128,
                                                                      max_batch_size=1, tokens_per_page=T,
                                                                      max_lora_rank=4))
    write_converted_adapter(tmp_path / "peft", tmp_path / "onnx", tmp_path / "adapter.safetensors")
    from kvforge.contract.engine_dir import load_engine_dir
    from kvforge.runtime.adapters import load_adapter, lora_input_shapes, stack_adapters
    from kvforge.runtime.execution.backend import StepInputs
    from kvforge.runtime.execution.ort import OrtBackend
    engine = load_engine_dir(tmp_path / "engine")
    adapter = load_adapter("p", tmp_path / "adapter.safetensors", engine, "test")
    runner = OrtBackend(engine, num_threads=2)
    ids = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        expected = model(input_ids=ids).logits[0].numpy()
    embeds = loaded.weights["model.embed_tokens.weight"][ids[0].numpy()][None]
    for n in (24,):
        lora = stack_adapters([adapter], lora_input_shapes(engine))
        logits = runner.forward(StepInputs(embeds[:, :n], np.array([n]), np.array([0]), [[0, 1]], lora)).logits
        np.testing.assert_allclose(logits[0], expected[n - 1], atol=1e-4)
