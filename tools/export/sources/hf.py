"""Turn a Hugging Face llama/qwen2/qwen3/mamba2/qwen3_5 checkpoint dir (config.json + safetensors) into a
LoadedModel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import read_json
from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.families import mamba2_source, qwen3_5_source
from kvforge.tools.export.sources.base import LoadedModel, layer_weight
from kvforge.tools.export.sources.hf_common import (
    FIELD,
    optional_json,
    read_safetensors_header,
    read_tensor,
    safetensors_files,
    tokenizer_config,
    tokenizer_json,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mamba2", "qwen3_5_text", "qwen3_5")
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "Mamba2ForCausalLM": "mamba2", "Qwen3_5ForCausalLM": "qwen3_5_text",
                  "Qwen3_5ForConditionalGeneration": "qwen3_5"}
# Families whose config has its own reader (tools/export/<family>_source.py); `qwen3_5` dirs export the text model.
_OWN_CONFIGS = {"mamba2": mamba2_source.config_from_hf, "qwen3_5_text": qwen3_5_source.config_from_hf,
                "qwen3_5": qwen3_5_source.config_from_hf}
_LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Buffers some older checkpoints saved; recomputed by the graph, so skipping them loses nothing.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_dir(path: Path, kv_cache_dtype: str = "fp16") -> LoadedModel:
    """Read config.json, the (possibly sharded) safetensors and tokenizer files of an HF checkpoint dir."""
    path = Path(path)
    if not path.is_dir():
        raise KvforgeError(f"no such directory {path}", FIELD)
    hf = read_json(path / "config.json", FIELD)
    config = text_model_config(hf, path, kv_cache_dtype)
    weights = _load_weights(path, config)
    if config.is_recurrent:
        weights[mamba2_source.EMBEDDING] = weights.pop(mamba2_source.HF_EMBEDDING)
    return LoadedModel(config=config, weights=weights, tokenizer_json=tokenizer_json(path),
                       tokenizer_config=tokenizer_config(path, config))


# ------------------------------------------------------------------------------------------------ config

def _model_type(hf: dict[str, Any]) -> str:
    model_type = hf.get("model_type")
    if model_type is None:
        known = [_ARCHITECTURES[a] for a in hf.get("architectures") or [] if a in _ARCHITECTURES]
        model_type = known[0] if known else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        raise KvforgeError(f"unsupported model_type {model_type!r} (architectures "
                           f"{hf.get('architectures')}); supported: {supported}", FIELD)
    return model_type


def _rope_theta(hf: dict[str, Any]) -> float:
    # transformers 5 nests RoPE settings in rope_parameters; older configs use rope_theta + rope_scaling.
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise KvforgeError(f"unsupported rope_scaling type {rope_type!r}; only plain RoPE is supported",
                           FIELD)
    return float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))


def _check_supported(hf: dict[str, Any], model_type: str) -> None:
    # The weight layout carries q/k/v biases only: llama/qwen3 attention_bias also adds an o_proj bias.
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise KvforgeError(f"attention_bias=true on {model_type} (adds an o_proj bias) is not supported",
                           FIELD)
    if hf.get("mlp_bias"):
        raise KvforgeError("mlp_bias=true is not supported", FIELD)
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding:
        raise KvforgeError("sliding-window attention layers are not supported", FIELD)


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def text_model_config(hf: dict[str, Any], path: Path, kv_cache_dtype: str) -> ModelConfig:
    """The ModelConfig of an HF config.json (or a multimodal dir's text_config), validated."""
    model_type = _model_type(hf)
    gen = optional_json(path / "generation_config.json")
    # Chat checkpoints often list the end-of-turn token only in generation_config.json.
    # A vision-language dir (qwen3_5) may keep its text model's tokens in text_config only.
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    eos_ids = sorted(set(_token_ids(hf.get("eos_token_id")) + _token_ids(gen.get("eos_token_id"))
                         + _token_ids(text.get("eos_token_id"))))
    if model_type in _OWN_CONFIGS:
        common = dict(kv_cache_dtype=kv_cache_dtype, eos_token_ids=eos_ids, name=path.resolve().name,
                      bos_token_id=_first(hf.get("bos_token_id"), gen.get("bos_token_id")),
                      pad_token_id=_first(hf.get("pad_token_id"), gen.get("pad_token_id")))
        try:
            config = _OWN_CONFIGS[model_type](hf, **common)
        except KeyError as exc:
            raise KvforgeError(f"{path / 'config.json'} lacks {exc.args[0]!r}", FIELD) from None
        except ValueError as exc:
            raise KvforgeError(f"{path / 'config.json'}: {exc}", FIELD) from None
        config.validate()
        return config
    _check_supported(hf, model_type)
    try:
        heads = int(hf["num_attention_heads"])
        config = ModelConfig(
            model=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            max_position_embeddings=int(hf["max_position_embeddings"]),
            rope_theta=_rope_theta(hf),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2",  # Qwen2's q/k/v projections always carry a bias
            qk_norm=model_type == "qwen3",
            kv_cache_dtype=kv_cache_dtype,
            bos_token_id=_first(hf.get("bos_token_id"), gen.get("bos_token_id")),
            eos_token_ids=eos_ids,
            pad_token_id=_first(hf.get("pad_token_id"), gen.get("pad_token_id")),
            name=path.resolve().name,
        )
    except KeyError as exc:
        raise KvforgeError(f"{path / 'config.json'} lacks {exc.args[0]!r}", FIELD) from None
    except (TypeError, ValueError, OverflowError) as exc:  # "64" is fine for int(); "abc", [], null are not
        raise KvforgeError(f"{path / 'config.json'} has a field of the wrong type ({exc})", FIELD) from None
    config.validate()
    return config


def _first(*values: Any) -> int | None:
    ids = [v for v in values if v is not None]
    return _token_ids(ids[0])[0] if ids and _token_ids(ids[0]) else None


# ----------------------------------------------------------------------------------------------- weights

def text_weight_names(config: ModelConfig) -> list[str]:
    """Every weight name the checkpoint of `config` must hold (lm_head excepted: it may be tied)."""
    if config.is_recurrent:
        return mamba2_source.expected_names(config)
    if config.is_hybrid:
        return qwen3_5_source.expected_names(config)
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    per_layer = [f"{t}.weight" for t in _LAYER_TENSORS]
    if config.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return names + [layer_weight(i, n) for i in range(config.num_hidden_layers) for n in per_layer]


def _load_weights(path: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    locations: dict[str, tuple[Path, dict[str, Any], int]] = {}
    rename = qwen3_5_source.checkpoint_name if config.is_hybrid else (lambda n: n)  # None: not the text model's
    for file in safetensors_files(path):
        header, data_start = read_safetensors_header(file)
        for name, entry in header.items():
            if rename(name) is not None:
                locations[rename(name)] = (file, entry, data_start)
    expected = text_weight_names(config)
    if "lm_head.weight" in locations and not config.tie_word_embeddings:
        expected.append("lm_head.weight")
    else:
        config.tie_word_embeddings = True  # no lm_head in the files: the embedding doubles as it
    missing = [n for n in expected if n not in locations]
    if missing:
        raise KvforgeError(f"checkpoint in {path} lacks tensor {missing[0]} ({len(missing)} missing in all)",
                           FIELD)
    unexpected = [n for n in locations if n not in expected and n != "lm_head.weight"
                  and not n.endswith(_IGNORED_SUFFIXES)]
    if unexpected:
        raise KvforgeError(f"checkpoint in {path} has tensor {unexpected[0]} this loader does not handle",
                           FIELD)
    weights = {}
    for name in expected:
        file, entry, data_start = locations[name]
        weights[name] = read_tensor(file, name, entry, data_start)
    return weights
