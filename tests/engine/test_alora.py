"""Activated LoRA (PEFT's alora_invocation_tokens): conversion and load checks, PEFT's own greedy tokens warm and
cold, base pages shared before the invocation, and ordinary adapters still isolated."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from support.engine_driver import lora_model_with_adapters, make_engine, run_file
from support.hardening_support import invoke
from support.peft_support import save_peft_adapter, save_tiny_llama

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import LORA_TARGETS, NEVER_ACTIVATED
from kvforge.runtime.adapters import NOT_INVOKED
from kvforge.runtime.api import LLM
from kvforge.runtime.cli import app as inference_app
from kvforge.runtime.context_cache.keys import KeyExtras, page_keys
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.cli import app as export_app
from kvforge.tools.export.lora import write_converted_adapter, write_random_peft_adapter
from kvforge.tools.export.writer import write_onnx_dir

INVOCATION = [5, 17, 9]


@pytest.fixture(scope="module")
def alora_setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("alora")
    lora_model_with_adapters(root, BuildOptions(max_input_len=128, max_kv_cache_capacity=160, max_batch_size=2,
                                                tokens_per_page=16, max_lora_rank=4), "fp32", (("plain", 1, 4),))
    return root


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="numpy") as handle:
        return handle.metadata()


def test_invocation_tokens_survive_conversion_and_load(alora_setup: Path, tmp_path: Path) -> None:
    root = alora_setup
    write_random_peft_adapter(root / "onnx", tmp_path / "peft", rank=4, seed=3, invocation_tokens=INVOCATION)
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["alora_invocation_tokens"] == INVOCATION
    write_converted_adapter(tmp_path / "peft", root / "onnx", tmp_path / "a.safetensors")
    assert json.loads(_metadata(tmp_path / "a.safetensors")["alora_invocation_tokens"]) == INVOCATION
    runtime = make_engine(root / "engine", num_threads=1)
    runtime.load_adapters({"act": str(tmp_path / "a.safetensors"), "plain": str(root / "plain.safetensors")})
    assert runtime.loras.get("act").invocation_tokens == tuple(INVOCATION)
    assert runtime.loras.get("plain").invocation_tokens is None  # an ordinary adapter stays ordinary


@pytest.mark.parametrize(("value", "needle"), [([], "non-empty"), (["5"], "integers"), ([1.5], "integers"),
                                               ([True], "integers"), ([10 ** 6], "outside the vocabulary"),
                                               ([-1], "outside the vocabulary"), ("5", "non-empty list")])
def test_malformed_invocation_is_one_line_at_conversion(alora_setup: Path, tmp_path: Path, value: object,
                                                        needle: str) -> None:
    root = alora_setup
    write_random_peft_adapter(root / "onnx", tmp_path / "peft", rank=4)
    config_path = tmp_path / "peft" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["alora_invocation_tokens"] = value
    config_path.write_text(json.dumps(config))
    with pytest.raises(KvforgeError, match=needle) as info:
        write_converted_adapter(tmp_path / "peft", root / "onnx", tmp_path / "x.safetensors")
    assert info.value.field == "adapter_dir" and "alora_invocation_tokens" in info.value.message
    assert str(tmp_path / "peft") in info.value.message and "\n" not in str(info.value)
    assert not (tmp_path / "x.safetensors").exists()
    result = invoke(export_app, "lora", "--adapterDir", tmp_path / "peft", "--onnxDir", root / "onnx",
                    "--output", tmp_path / "y.safetensors")
    result.one_line_error("--adapterDir", "alora_invocation_tokens", needle)


@pytest.mark.parametrize(("text", "needle"), [("[]", "non-empty"), ('["a"]', "integers"), ("nonsense", "non-empty"),
                                              ("[99999]", "outside the vocabulary")])
def test_malformed_invocation_is_refused_at_load(alora_setup: Path, tmp_path: Path, text: str, needle: str) -> None:
    root = alora_setup
    path = tmp_path / "edited.safetensors"
    metadata = dict(_metadata(root / "plain.safetensors"), alora_invocation_tokens=text)
    save_file(load_file(str(root / "plain.safetensors")), str(path), metadata=metadata)
    runtime = make_engine(root / "engine", num_threads=1)
    with pytest.raises(KvforgeError, match=needle) as info:
        runtime.load_adapters({"bad": str(path)})
    assert info.value.field == 'available_lora_weights["bad"]'
    assert "alora_invocation_tokens" in info.value.message and str(path) in info.value.message


def test_random_lora_writes_an_activated_adapter(alora_setup: Path, tmp_path: Path) -> None:
    root = alora_setup
    made = invoke(export_app, "random-lora", "--onnxDir", root / "onnx", "--outputDir", tmp_path / "ok",
                  "--invocationTokens", "5,17,9")
    assert made.code == 0, made.stderr
    assert json.loads((tmp_path / "ok" / "adapter_config.json").read_text())["alora_invocation_tokens"] == INVOCATION
    invoke(export_app, "random-lora", "--onnxDir", root / "onnx", "--outputDir", tmp_path / "bad",
           "--invocationTokens", "5,x").one_line_error("--invocationTokens", "token ids")
    invoke(export_app, "random-lora", "--onnxDir", root / "onnx", "--outputDir", tmp_path / "far",
           "--invocationTokens", "999999").one_line_error("--invocationTokens", "outside the vocabulary")
    assert not (tmp_path / "far").exists()


def test_page_keys_drop_the_adapter_before_its_activation() -> None:
    ids = list(range(64))
    base, adapter = KeyExtras(), KeyExtras(b"adapter", adapter_start=40)
    other = KeyExtras(b"another", adapter_start=40)
    plain = KeyExtras(b"adapter")
    base_keys, keys, other_keys = page_keys(ids, 16, base), page_keys(ids, 16, adapter), page_keys(ids, 16, other)
    assert keys[:2] == base_keys[:2] == other_keys[:2]  # pages [0, 16) and [16, 32) end before position 40
    assert keys[2] != base_keys[2] and keys[2] != other_keys[2]  # [32, 48) holds the activation: the adapter's
    assert not set(page_keys(ids, 16, plain)) & set(base_keys)  # an ordinary adapter shares nothing
    salted = page_keys(ids, 16, KeyExtras(b"adapter", "tenant", adapter_start=40))
    assert not set(salted) & set(keys)  # the salt stays in every key, base pages included
    assert page_keys(ids, 16, KeyExtras(b"adapter", adapter_start=NEVER_ACTIVATED)) == base_keys


def test_base_pages_reused_are_the_whole_pages_before_the_activation() -> None:
    from kvforge.runtime.adapters import LoraAdapter, base_pages_reused

    adapter = LoraAdapter("a", Path("a"), 4, {}, b"digest", tuple(INVOCATION))
    assert base_pages_reused(None, 0, 96, 16) == 0  # a base request's pages are not counted as an adapter's
    assert base_pages_reused(adapter, 0, 96, 16) == 0  # an ordinary adapter: every page carries its digest
    assert base_pages_reused(adapter, 40, 96, 16) == 2  # pages [0, 16) and [16, 32) end before position 40
    assert base_pages_reused(adapter, 40, 20, 16) == 1  # only what was reused counts
    assert base_pages_reused(adapter, NEVER_ACTIVATED, 70, 16) == 4  # not invoked: every reused page is a base page


# --- parity with PEFT's own aLoRA on a tiny random float32 llama ------------------------------------------------

PEFT_INVOCATION = [7, 42, 99]
VOCAB = 128
PAGE = 16


@pytest.fixture(scope="module")
def peft_setup(tmp_path_factory: pytest.TempPathFactory):
    torch = pytest.importorskip("torch", reason="PEFT parity needs torch")
    pytest.importorskip("transformers", reason="PEFT parity needs transformers")
    pytest.importorskip("peft", reason="PEFT parity needs peft")
    from kvforge.tools.export.sources.hf import load_hf_dir

    root = tmp_path_factory.mktemp("alora_peft")
    base = save_tiny_llama(root / "hf", VOCAB, 2)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    models_by_name = {name: save_peft_adapter(root / "hf", root / f"peft_{name}", modules, invocation, seed)
                      for name, invocation, seed in (("act", PEFT_INVOCATION, 1), ("act2", [5, 6], 2),
                                                     ("plain", None, 3))}
    loaded = load_hf_dir(root / "hf", kv_cache_dtype="fp32")
    loaded.config.lora_targets = list(LORA_TARGETS)
    write_onnx_dir(loaded, root / "onnx")
    build_engine(root / "onnx", root / "engine", BuildOptions(max_input_len=160, max_kv_cache_capacity=192,
                                                              max_batch_size=2, tokens_per_page=PAGE,
                                                              max_lora_rank=4))
    paths = {}
    for name in models_by_name:
        paths[name] = str(root / f"{name}.safetensors")
        write_converted_adapter(root / f"peft_{name}", root / "onnx", Path(paths[name]))
    return torch, base, models_by_name, root / "engine", paths


def _peft_greedy(torch, model, ids: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=count, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


GREEDY = SamplingParams(temperature=0.0, top_k=1, max_generate_length=6)


def _llm(engine_dir: Path, paths: dict[str, str]) -> LLM:
    return LLM(engine_dir, lora_weights=paths, num_threads=2, enable_context_reuse=True)


def test_greedy_tokens_equal_peft_warm_and_cold(peft_setup) -> None:
    torch, base, models, engine_dir, paths = peft_setup
    rng = np.random.default_rng(4)
    history = rng.integers(10, VOCAB, 50).tolist()
    invoked = history + PEFT_INVOCATION + [11, 12]
    absent = [t if t != PEFT_INVOCATION[0] else 8 for t in history]  # no occurrence of the invocation
    expected = _peft_greedy(torch, models["act"], invoked, 6)
    assert expected != _peft_greedy(torch, base, invoked, 6)  # the adapter changes the answer once invoked
    llm = _llm(engine_dir, paths)
    cold = llm.generate([invoked], GREEDY, lora_name="act")[0]
    warm = llm.generate([invoked], GREEDY, lora_name="act")[0]
    assert cold.token_ids == expected and warm.token_ids == expected
    assert cold.cached_tokens == 0 and warm.cached_tokens >= 48
    assert cold.adapter == "act"
    # Without the invocation PEFT runs the base model, and the response says the adapter was not invoked.
    not_invoked = llm.generate([absent], GREEDY, lora_name="act")[0]
    assert not_invoked.token_ids == _peft_greedy(torch, models["act"], absent, 6) == _peft_greedy(torch, base,
                                                                                                   absent, 6)
    assert not_invoked.adapter == "act" + NOT_INVOKED
    # One engine call with both rows: each keeps its own activation start.
    fresh = _llm(engine_dir, paths)
    both = fresh.generate([invoked, absent], GREEDY, lora_name="act")
    assert [o.token_ids for o in both] == [expected, not_invoked.token_ids]


def test_activated_adapter_reuses_the_base_conversation(peft_setup) -> None:
    torch, base, models, engine_dir, paths = peft_setup
    rng = np.random.default_rng(5)
    conversation = rng.integers(10, VOCAB, 96).tolist()
    conversation = [t if t not in (PEFT_INVOCATION[0], 5) else 8 for t in conversation]
    llm = _llm(engine_dir, paths)
    answer = llm.generate([conversation], GREEDY)[0]
    assert answer.cached_tokens == 0
    follow_up = conversation + answer.token_ids + PEFT_INVOCATION + [11, 12]
    checked = llm.generate([follow_up], GREEDY, lora_name="act")[0]
    assert checked.cached_tokens >= 0.8 * len(follow_up), (checked.cached_tokens, len(follow_up))
    assert checked.token_ids == _peft_greedy(torch, models["act"], follow_up, 6)  # reuse never changes an answer
    # Another activated adapter over the same conversation finds the same base pages.
    other = conversation + answer.token_ids + [5, 6, 13]
    second = llm.generate([other], GREEDY, lora_name="act2")[0]
    assert second.cached_tokens >= 0.8 * len(other)
    assert second.token_ids == _peft_greedy(torch, models["act2"], other, 6)
    # An ordinary adapter shares nothing with the base.
    plain = llm.generate([follow_up], GREEDY, lora_name="plain")[0]
    assert plain.cached_tokens == 0
    assert plain.token_ids == _peft_greedy(torch, models["plain"], follow_up, 6)
    # The profile and /metrics count the base pages each adapter reused: the whole pages before its activation.
    per_adapter = llm.engine.profile()["per_adapter"]
    act_pages = (len(conversation) + len(answer.token_ids)) // PAGE
    assert per_adapter["act"]["base_pages_reused"] == act_pages
    assert per_adapter["act2"]["base_pages_reused"] == act_pages
    assert per_adapter["plain"]["base_pages_reused"] == 0 and "base_pages_reused" not in per_adapter["base"]
    from kvforge.server.metrics import ServerMetrics

    scraped = ServerMetrics(llm.engine.stats).render().decode()
    assert f"kvforge_adapter_base_pages_reused_total {float(2 * act_pages)}" in scraped


def test_request_file_output_names_the_adapter_as_it_ran(alora_setup: Path, tmp_path: Path) -> None:
    root = alora_setup
    write_random_peft_adapter(root / "onnx", tmp_path / "peft", rank=4, seed=3, invocation_tokens=INVOCATION)
    write_converted_adapter(tmp_path / "peft", root / "onnx", tmp_path / "act.safetensors")
    request = {"messages": [{"role": "user", "content": "hello there"}], "max_generate_length": 2}
    data = {"batch_size": 1, "temperature": 0.0, "top_k": 1,
            "available_lora_weights": {"act": str(tmp_path / "act.safetensors"),
                                       "plain": str(root / "plain.safetensors")},
            "requests": [request, {**request, "lora_name": "act"}, {**request, "lora_name": "plain"}]}
    responses = run_file(make_engine(root / "engine", num_threads=1), data)
    assert "adapter" not in responses[0]  # a base request's entry keeps the reference tool's keys
    assert responses[1]["adapter"] == "act" + NOT_INVOKED  # the prompt holds no invocation: the base model ran
    assert responses[2]["adapter"] == "plain"
    # llm_inference writes the same entries and shows the label with --dumpOutput.
    (tmp_path / "in.json").write_text(json.dumps(data))
    result = invoke(inference_app, "--engineDir", root / "engine", "--inputFile", tmp_path / "in.json",
                    "--outputFile", tmp_path / "out.json", "--dumpOutput", "--numThreads", "1")
    assert result.code == 0, result.stderr
    written = json.loads((tmp_path / "out.json").read_text())["responses"]
    assert [r.get("adapter") for r in written] == [None, "act" + NOT_INVOKED, "plain"]
    lines = result.stdout.splitlines()
    assert lines[1].startswith("[1] (act (not invoked)) ") and lines[2].startswith("[2] (plain) ")
    assert lines[0].startswith("[0] ") and not lines[0].startswith("[0] (")


class HybridView:
    """An engine's model config seen as a hybrid (one recurrent layer): what load_adapter reads of it."""

    def __init__(self, config: object) -> None:
        self.config = config
        self.recurrent_layer_ids = [1]

    def __getattr__(self, name: str) -> object:
        return getattr(self.config, name)


def test_recurrent_engines_refuse_activated_adapters(peft_setup) -> None:
    from types import SimpleNamespace

    from kvforge.contract.engine_dir import load_engine_dir
    from kvforge.runtime.adapters import load_adapter

    _, _, _, engine_dir, paths = peft_setup
    engine = load_engine_dir(engine_dir)
    hybrid = SimpleNamespace(model=HybridView(engine.model), build=engine.build)
    assert load_adapter("plain", Path(paths["plain"]), hybrid, "where").invocation_tokens is None  # type: ignore[arg-type]
    with pytest.raises(KvforgeError, match="recurrent and hybrid engines") as info:
        load_adapter("act", Path(paths["act"]), hybrid, "where")  # type: ignore[arg-type]
    assert info.value.field == "where" and "\n" not in str(info.value)


def test_graph_without_the_activation_input_refuses_an_activated_row() -> None:
    from kvforge.runtime.execution.backend import activation_values

    assert activation_values(None, 3, graph_has_input=False) is None
    assert activation_values(np.zeros(2, np.int32), 2, graph_has_input=False) is None  # ordinary rows still run
    assert activation_values(None, 3, graph_has_input=True).tolist() == [0, 0, 0]
    with pytest.raises(KvforgeError, match="re-export"):
        activation_values(np.array([0, 40], np.int32), 2, graph_has_input=False)
