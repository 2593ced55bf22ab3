"""The fourth hostile pass (issue 52 items 4, 5, 7, 8 and "also seen"): flags and configs refused in one line
naming them, tier secret rotation without overwrites, and llm_inference's exit status when requests fail."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.engine_driver import make_engine, run_file, top1_ids
from support.hardening_support import invoke, request_file

from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.runtime.cli import app as inference_app
from kvforge.runtime.engine import engine as engine_module
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.sampling.sampler import Sampler
from kvforge.runtime.shared_tier.secret import SECRET_ENV, tier_secret
from kvforge.runtime.shared_tier.stores.memory import MemoryStore
from kvforge.server.cli import app as serve_app
from kvforge.tools.export.cli import app as export_app
from kvforge.tools.export.sources.hf import text_model_config

URL = "redis://in-process"
READ_SECRETS_ENV = "KVFORGE_SHARED_CACHE_READ_SECRETS"  # the documented name (docs/shared-tier.md)
OLD, NEW = "the old tier secret, 33 bytes...", "the new tier secret, also long!!"
DATA = {"temperature": 0, "max_generate_length": 4, "num_logprobs": 1,
        "requests": [{"messages": [{"role": "system", "content": "Tides rise and fall twice a day. " * 4},
                                   {"role": "user", "content": "When is the tide high?"}]}]}


# --- --sharedCacheSecret: 16 bytes at least; rotation reads with several, writes with one ---------------------


def test_a_short_tier_secret_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    for secret in ("x", "fifteen bytes.."):
        with pytest.raises(InvalidConfig) as info:
            tier_secret(secret, encrypt=False)
        assert info.value.field == "shared_cache_secret" and "at least 16 bytes" in info.value.message
        assert secret not in info.value.message
    assert tier_secret("sixteen bytes..!", encrypt=False) is not None
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(InvalidConfig) as info:
        tier_secret(None, encrypt=False)
    assert SECRET_ENV in info.value.message
    monkeypatch.setenv(SECRET_ENV, NEW)
    monkeypatch.setenv(READ_SECRETS_ENV, f"{OLD},short")
    with pytest.raises(InvalidConfig) as info:
        tier_secret(None, encrypt=False)
    assert info.value.field == "shared_cache_read_secrets" and READ_SECRETS_ENV in info.value.message


def test_llm_inference_refuses_a_one_byte_secret_in_one_line(tmp_path: Path, tiny_engine_dir: Path) -> None:
    source = request_file(tmp_path / "in.json")
    invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", source, "--outputFile",
           tmp_path / "out.json", "--enableContextReuse", "--sharedCache", "redis://127.0.0.1:1/0",
           "--sharedCacheSecret", "k").one_line_error("--sharedCacheSecret", "at least 16 bytes")


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    shared = MemoryStore()
    monkeypatch.setattr(engine_module, "open_store", lambda url, timeout_s: shared)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(READ_SECRETS_ENV, raising=False)
    return shared


def _run(engine: Engine) -> tuple[list[int], dict[str, Any]]:
    [response] = run_file(engine, DATA)
    engine.close()
    return top1_ids(response), engine.profile().get("context_cache", {}).get("shared_tier", {})


def test_two_groups_mid_rotation_share_the_tier_and_overwrite_nothing(tier_engine: Callable[..., Path],
                                                                      store: MemoryStore) -> None:
    """Mid-rotation one group writes with the new secret, the other still with the old one; both read with both.
    Each finds the other's values and rewrites none of them (before, a reader "healed" every value it could not
    verify, so the groups overwrote each other and the hit rate fell to 0)."""
    engine_dir = tier_engine("tiny-llama")
    cold, _ = _run(make_engine(engine_dir))
    ids, tier = _run(make_engine(engine_dir, reuse=True, shared_cache=URL, shared_cache_secret=NEW,
                                 shared_cache_read_secrets=(OLD,)))
    assert ids == cold and tier["writes"] > 0
    written = dict(store.data)
    ids, tier = _run(make_engine(engine_dir, reuse=True, shared_cache=URL, shared_cache_secret=OLD,
                                 shared_cache_read_secrets=(NEW,)))
    assert ids == cold and tier["hits"] == 1 and tier["corrupt"] == 0
    assert {key: store.data.get(key) for key in written} == written  # not one value replaced
    # Without the rotation's read secret the old group rejects the new group's values and replaces them: the bug.
    ids, tier = _run(make_engine(engine_dir, reuse=True, shared_cache=URL, shared_cache_secret=OLD))
    assert ids == cold and tier["hits"] == 0 and tier["corrupt"] >= 1
    assert any(store.data.get(key) != value for key, value in written.items())


# --- --maxRequestsPerTenant: at most maxBatchSize + --maxQueuedRequests -----------------------------------------


def test_a_request_share_above_the_servers_requests_is_refused(tiny_engine_dir: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": "alice"}), encoding="utf-8")
    invoke(serve_app, "--engineDir", tiny_engine_dir, "--apiKeys", keys, "--port", "0", "--maxQueuedRequests", "4",
           "--maxRequestsPerTenant", "1000").one_line_error("--maxRequestsPerTenant", "maxBatchSize",
                                                           "--maxQueuedRequests", "got 1000")


# --- llm_inference: a run whose requests fail does not exit 0 ------------------------------------------------


def test_llm_inference_exits_3_when_requests_fail(tmp_path: Path, tiny_engine_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    source = request_file(tmp_path / "in.json")
    out = tmp_path / "out.json"
    args = ("--engineDir", tiny_engine_dir, "--inputFile", source, "--outputFile", out)
    assert invoke(inference_app, *args).code == 0

    def broken(self: Sampler, *_: Any) -> Any:
        raise IndexError("a simulated engine fault")

    monkeypatch.setattr(Sampler, "sample", broken)
    result = invoke(inference_app, *args)
    assert result.code == 3 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error:") and "failed in the engine" in line and "simulated" in line
    responses = json.loads(out.read_text())["responses"]
    assert responses and all(r["finish_reason"] == "error" for r in responses)  # every response is kept


# --- Gemma configs transformers refuses are refused at export --------------------------------------------------


def gemma_config(model_type: str = "gemma3_text", **overrides: Any) -> dict[str, Any]:
    config = {"model_type": model_type, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "sliding_window": 32, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
              "query_pre_attn_scalar": 24, "rms_norm_eps": 1e-6}
    return {**config, **overrides}


BAD_GEMMA = [("sliding_window", 0), ("sliding_window", None), ("sliding_window", 31.5),
             ("num_key_value_heads", 0), ("num_key_value_heads", 3), ("query_pre_attn_scalar", 0),
             ("rope_scaling", {"rope_type": "warp-drive", "factor": 2.0}), ("rope_scaling", {"factor": 2.0})]


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma4_text"])
@pytest.mark.parametrize(("field", "value"), BAD_GEMMA)
def test_gemma_configs_transformers_refuses_are_refused_naming_the_field(tmp_path: Path, model_type: str,
                                                                        field: str, value: Any) -> None:
    text_model_config(gemma_config(model_type), tmp_path, "fp32")  # the same config with the field fine
    with pytest.raises(KvforgeError) as info:
        text_model_config(gemma_config(model_type, **{field: value}), tmp_path, "fp32")
    assert f"{field} must" in info.value.message and "\n" not in info.value.message


def test_gemma4_refuses_a_rope_scaling_it_would_ignore(tmp_path: Path) -> None:
    with pytest.raises(KvforgeError) as info:
        text_model_config(gemma_config("gemma4_text", rope_scaling={"rope_type": "linear", "factor": 8.0}),
                          tmp_path, "fp32")
    assert "rope_scaling type 'linear' is not supported" in info.value.message


def test_llm_export_names_the_field_in_one_line(tmp_path: Path) -> None:
    source = tmp_path / "gemma"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(gemma_config(sliding_window=0)), encoding="utf-8")
    invoke(export_app, "model", source, "--outputDir", tmp_path / "onnx").one_line_error("sliding_window must")
    assert not (tmp_path / "onnx").exists()
