"""The llama family (Llama, SmolLM, Qwen2, Qwen3) for the exporter: its HF config mapping, weight names, synthetic
models and random weights, registered with llama_graph.py's builder."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from kvforge.contract.errors import KvforgeError
from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.families.llama_graph import build_llama_graph
from kvforge.tools.export.families.registry import Family, register
from kvforge.tools.export.sources.hf_common import FIELD

if TYPE_CHECKING:
    from kvforge.tools.export.sources.base import LoadedModel

_LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _rope_theta(hf: dict[str, Any]) -> float:
    # transformers 5 nests RoPE settings in rope_parameters; older configs use rope_theta + rope_scaling.
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise KvforgeError(f"unsupported rope_scaling type {rope_type!r}; only plain RoPE is supported", FIELD)
    return float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))


def _check_supported(hf: dict[str, Any], model_type: str) -> None:
    # The weight layout carries q/k/v biases only: llama/qwen3 attention_bias also adds an o_proj bias.
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise KvforgeError(f"attention_bias=true on {model_type} (adds an o_proj bias) is not supported", FIELD)
    if hf.get("mlp_bias"):
        raise KvforgeError("mlp_bias=true is not supported", FIELD)
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding:
        raise KvforgeError("sliding-window attention layers are not supported", FIELD)


def config_from_hf(hf: dict[str, Any], **common: Any) -> ModelConfig:
    """ModelConfig of an HF llama/qwen2/qwen3 config.json (`common`: tokens, name, kv dtype)."""
    model_type = hf["model_type"]
    _check_supported(hf, model_type)
    heads = int(hf["num_attention_heads"])
    return ModelConfig(
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
        **common,
    )


def expected_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    per_layer = [f"{t}.weight" for t in _LAYER_TENSORS]
    if config.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return names + [f"model.layers.{i}.{n}" for i in range(config.num_hidden_layers) for n in per_layer]


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Scaled so activations stay O(1) through the layers and logits are far from ties."""
    rng = np.random.default_rng(seed)
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((config.vocab_size, hidden)).astype(np.float32)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": linear(q_out, hidden),
            p + "self_attn.k_proj.weight": linear(kv_out, hidden),
            p + "self_attn.v_proj.weight": linear(kv_out, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, q_out),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
        })
        if config.attention_bias:
            for proj, dim in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                weights[p + f"self_attn.{proj}_proj.bias"] = (0.1 * rng.standard_normal(dim)).astype(np.float32)
        if config.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
    weights["model.norm.weight"] = norm(hidden)
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = linear(config.vocab_size, hidden)
    return weights


def build_graph(loaded: LoadedModel, progress: Callable[[int], None]) -> onnx.ModelProto:
    return build_llama_graph(loaded.config, loaded.weights, progress=progress, quantized=loaded.quantized)


FAMILY = register(Family(
    model_types=("llama", "qwen2", "qwen3"),
    config_from_hf=config_from_hf,
    expected_names=expected_names,
    build_graph=build_graph,
    random_weights=random_weights,
    architectures={"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"},
    synthetic={
        "tiny-llama": {"model": "llama"},
        "tiny-qwen2": {"model": "qwen2", "attention_bias": True, "tie_word_embeddings": True},
        "tiny-qwen3": {"model": "qwen3", "qk_norm": True, "head_dim": 32},
        "tiny-llama-mha": {"model": "llama", "num_key_value_heads": 4},
    },
    gguf_architecture="llama",
))
