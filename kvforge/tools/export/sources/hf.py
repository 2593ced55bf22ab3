"""Turn a Hugging Face checkpoint dir (config.json + safetensors) of a registered text family (families/: llama,
qwen2, qwen3, mamba2, qwen3_5) into a LoadedModel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import read_json
from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.families import Family, family_for, model_type_of, model_types
from kvforge.tools.export.sources.base import LoadedModel
from kvforge.tools.export.sources.hf_common import (
    FIELD,
    optional_json,
    read_safetensors_header,
    read_tensor,
    safetensors_files,
    tokenizer_config,
    tokenizer_json,
)

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
    return LoadedModel(config=config, weights=weights, tokenizer_json=tokenizer_json(path),
                       tokenizer_config=tokenizer_config(path, config))


# ------------------------------------------------------------------------------------------------ config

def _model_type(hf: dict[str, Any]) -> str:
    model_type = hf.get("model_type")
    if model_type is None:
        model_type = model_type_of(hf.get("architectures") or [])
    if model_type not in model_types():
        supported = ", ".join(model_types())
        raise KvforgeError(f"unsupported model_type {model_type!r} (architectures "
                           f"{hf.get('architectures')}); supported: {supported}", FIELD)
    return model_type


def _family(config: ModelConfig) -> Family:
    family = family_for(config.model)
    assert family is not None, config.model  # text_model_config made it from a registered family
    return family


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
    common = dict(kv_cache_dtype=kv_cache_dtype, eos_token_ids=eos_ids, name=path.resolve().name,
                  bos_token_id=_first(hf.get("bos_token_id"), gen.get("bos_token_id")),
                  pad_token_id=_first(hf.get("pad_token_id"), gen.get("pad_token_id")))
    family = family_for(model_type)
    assert family is not None, model_type  # _model_type checked it
    try:
        config = family.config_from_hf({**hf, "model_type": model_type}, **common)
    except KeyError as exc:
        raise KvforgeError(f"{path / 'config.json'} lacks {exc.args[0]!r}", FIELD) from None
    except (TypeError, OverflowError) as exc:  # "64" is fine for int(); [], null are not
        raise KvforgeError(f"{path / 'config.json'} has a field of the wrong type ({exc})", FIELD) from None
    except ValueError as exc:  # an unsupported setting, or a string int() cannot read
        raise KvforgeError(f"{path / 'config.json'}: {exc}", FIELD) from None
    config.validate()
    return config


def _first(*values: Any) -> int | None:
    ids = [v for v in values if v is not None]
    return _token_ids(ids[0])[0] if ids and _token_ids(ids[0]) else None


# ----------------------------------------------------------------------------------------------- weights

def text_weight_names(config: ModelConfig) -> list[str]:
    """Every weight name the checkpoint of `config` must hold (lm_head excepted: it may be tied)."""
    return _family(config).expected_names(config)


def _load_weights(path: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    locations: dict[str, tuple[Path, dict[str, Any], int]] = {}
    rename = _family(config).checkpoint_name  # None: not the text model's
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
