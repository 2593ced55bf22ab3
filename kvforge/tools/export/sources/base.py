"""What every weight source (GGUF, HF dir, synthetic) hands to the graph builder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.quantize import BlockQuantized

# Weight names follow the Hugging Face llama layout; every array is float32, Linear weights [out, in]:
#   model.embed_tokens.weight [V, H]                model.norm.weight [H]     lm_head.weight [V, H] (untied)
#   model.layers.{i}.input_layernorm.weight [H]     model.layers.{i}.post_attention_layernorm.weight [H]
#   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   (+ {q,k,v}_proj.bias when attention_bias)
#   model.layers.{i}.self_attn.{q,k}_norm.weight [D]   (when qk_norm)
#   model.layers.{i}.mlp.{gate,up,down}_proj.weight


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer_json: str  # serialized `tokenizers` Tokenizer
    tokenizer_config: dict[str, Any] = field(default_factory=dict)  # chat_template, bos/eos tokens, ...
    # GGUF tensors whose blocks map exactly onto MatMulNBits (Q8_0, Q4_0), by weight name, Q/K unpermuted.
    exact_blocks: dict[str, BlockQuantized] = field(default_factory=dict)
    # Linear weights to export as MatMulNBits (filled by quantize_model.quantize_linears), by weight name.
    quantized: dict[str, BlockQuantized] = field(default_factory=dict)


def layer_weight(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}"
