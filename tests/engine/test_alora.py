"""Activated LoRA (PEFT's alora_invocation_tokens): carried through conversion, checked at conversion and at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from support.engine_driver import lora_model_with_adapters, make_engine
from support.hardening_support import invoke

from kvforge.builder.build import BuildOptions
from kvforge.contract.errors import KvforgeError
from kvforge.tools.export.cli import app as export_app
from kvforge.tools.export.lora import write_converted_adapter, write_random_peft_adapter

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
