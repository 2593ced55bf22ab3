"""The model description every stage agrees on: written by llm_export, extended by llm_build."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvforge.contract.errors import InvalidConfig, KvforgeError

# Marks an ONNX dir as ours; an export from another tool lacks it and is refused clearly.
EXPORT_FORMAT = "kvforge-onnx-v1"
KV_CACHE_DTYPES = ("fp16", "fp8", "fp32")
QUANTIZATIONS = ("none", "int8", "int4")  # linear weights: float32, or MatMulNBits blocks
MODEL_FAMILIES = ("llama", "qwen2", "qwen3", "mamba2")
RECURRENT_FAMILIES = ("mamba2",)  # every layer a Mamba2 mixer: no KV cache, carried conv + recurrent states
LAYER_TYPES = ("attention", "mamba")  # TensorRT Edge-LLM's normalized names


@dataclass(slots=True)
class ModelConfig:
    model: str  # family: llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    kv_cache_dtype: str = "fp16"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    name: str = ""
    lora_targets: list[str] = field(default_factory=list)  # linears with lora_A/lora_B inputs (q, k, ..., down)
    quantization: str = "none"  # requested weight format; GGUF blocks that map exactly keep their own bits
    quant_block_size: int = 0  # MatMulNBits block size of re-quantized weights (0 = not quantized)
    # Recurrent layers (Mamba2); names as TensorRT Edge-LLM's config.json. layer_types empty = all attention.
    layer_types: list[str] = field(default_factory=list)
    recurrent_state_num_heads: int = 0
    recurrent_state_head_dim: int = 0
    recurrent_state_size: int = 0
    n_groups: int = 0
    conv_kernel: int = 0
    format: str = EXPORT_FORMAT

    @property
    def is_recurrent(self) -> bool:
        return self.model in RECURRENT_FAMILIES

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: the SSM input plus its B and C projections."""
        return self.recurrent_state_num_heads * self.recurrent_state_head_dim + \
            2 * self.n_groups * self.recurrent_state_size

    def validate(self) -> None:
        if self.model not in MODEL_FAMILIES:
            raise InvalidConfig(f"unsupported model family {self.model!r}; expected one of {MODEL_FAMILIES}",
                                "config.model")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidConfig(f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
                                "config.kv_cache_dtype")
        if self.quantization not in QUANTIZATIONS:
            raise KvforgeError(f"must be one of {QUANTIZATIONS}, got {self.quantization!r}", "config.quantization")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise InvalidConfig(f"unknown layer type {unknown[0]!r} (known: {', '.join(LAYER_TYPES)})",
                                "config.layer_types")
        if self.is_recurrent:
            self._validate_recurrent()
            return
        if self.num_attention_heads <= 0 or self.num_key_value_heads <= 0 or \
                self.num_attention_heads % self.num_key_value_heads:
            raise InvalidConfig("num_attention_heads must be a positive multiple of num_key_value_heads",
                                "config.num_key_value_heads")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidConfig("must be positive", f"config.{name}")
        if self.head_dim % 2:
            raise InvalidConfig("must be even for rotate-half RoPE", "config.head_dim")
        if any(t != "attention" for t in self.layer_types):
            raise InvalidConfig(f"family {self.model} has attention layers only", "config.layer_types")

    def _validate_recurrent(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "recurrent_state_num_heads",
                     "recurrent_state_head_dim", "recurrent_state_size", "n_groups", "conv_kernel"):
            if getattr(self, name) <= 0:
                raise InvalidConfig("must be positive", f"config.{name}")
        if self.recurrent_state_num_heads % self.n_groups:
            raise InvalidConfig("recurrent_state_num_heads must be a multiple of n_groups", "config.n_groups")
        if self.layer_types != ["mamba"] * self.num_hidden_layers:
            raise InvalidConfig(f"a {self.model} model has one 'mamba' entry per layer", "config.layer_types")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config.json") -> ModelConfig:
        if data.get("format") != EXPORT_FORMAT:
            raise InvalidConfig(
                f"not a kvforge export (format is {data.get('format')!r}, expected {EXPORT_FORMAT!r}); "
                "re-export it with llm_export", where)
        known = {f.name for f in fields(cls)}
        try:
            config = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise InvalidConfig(f"missing or invalid field ({exc})", where) from None
        config.validate()
        return config


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Read a JSON object file with one-line errors naming the file."""
    if not path.is_file():
        raise KvforgeError(f"missing file {path}", what)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KvforgeError(f"malformed JSON in {path}: {exc}", what) from None
    if not isinstance(data, dict):
        raise KvforgeError(f"{path} must hold a JSON object", what)
    return data


def write_json(path: Path, data: Any, indent: int = 2) -> None:
    path.write_text(json.dumps(data, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")
