"""Qwen3.5 checkpoints (Hugging Face `qwen3_5_text`, or the text model of a `qwen3_5` dir) and the synthetic
tiny-qwen3_5: config, weight names, weights.

HF's layer_types "linear_attention" / "full_attention" become kvforge's "mamba" / "attention" (LAYER_TYPES: "mamba"
is any recurrent mixer, as TensorRT Edge-LLM normalizes them; the family says it is a gated delta-net). The
delta-net's geometry goes into the shared recurrent fields (see ModelConfig): value heads / value head dim / key
head dim / key heads as recurrent_state_num_heads / recurrent_state_head_dim / recurrent_state_size / n_groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.families.qwen3_5_graph import build_qwen3_5_graph
from kvforge.tools.export.families.registry import Family, register

if TYPE_CHECKING:
    from kvforge.tools.export.sources.base import LoadedModel

HF_LAYER_TYPES = {"linear_attention": "mamba", "full_attention": "attention"}
# A `qwen3_5` (vision-language) dir holds the text model under this prefix; kvforge exports the text model only.
LANGUAGE_MODEL_PREFIX = "model.language_model."
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")  # the vision tower and the multi-token-prediction head
_DELTA_NET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's HF config: `text_config` of a `qwen3_5` dir, else the dir's own."""
    nested = hf.get("text_config")
    if not isinstance(nested, dict):
        return hf
    # The outer config decides whether the LM head is the embedding (its lm_head sits outside the text model).
    return {**nested, "model_type": "qwen3_5_text",
            "tie_word_embeddings": hf.get("tie_word_embeddings", nested.get("tie_word_embeddings", False))}


def config_from_hf(hf: dict[str, Any], **common: Any) -> ModelConfig:
    """ModelConfig of an HF Qwen3.5 text config (`common`: tokens, name, kv dtype: what every family shares)."""
    hf = text_config(hf)
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r} is not supported (only default)")
    layers = int(hf["num_hidden_layers"])
    hf_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % int(hf.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(layers)]
    unknown = sorted(set(hf_types) - set(HF_LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer type {unknown[0]!r} is not supported (known: {', '.join(HF_LAYER_TYPES)})")
    # Text positions are equal on Qwen3.5's three M-RoPE axes, so its interleaved M-RoPE is plain RoPE here.
    return ModelConfig(
        model="qwen3_5", vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_hidden_layers=layers,
        num_attention_heads=int(hf["num_attention_heads"]), num_key_value_heads=int(hf["num_key_value_heads"]),
        head_dim=int(hf.get("head_dim", 256)), max_position_embeddings=int(hf["max_position_embeddings"]),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(hf.get("tie_word_embeddings")),
        qk_norm=True, layer_types=[HF_LAYER_TYPES[t] for t in hf_types],
        recurrent_state_num_heads=int(hf.get("linear_num_value_heads", 32)),
        recurrent_state_head_dim=int(hf.get("linear_value_head_dim", 128)),
        recurrent_state_size=int(hf.get("linear_key_head_dim", 128)),
        n_groups=int(hf.get("linear_num_key_heads", 16)), conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
        **common)


def checkpoint_name(name: str) -> str | None:
    """The kvforge weight name of a checkpoint tensor (None: a tensor the text model does not use)."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    if name.startswith(LANGUAGE_MODEL_PREFIX):
        return "model." + name.removeprefix(LANGUAGE_MODEL_PREFIX)
    return name


def expected_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        if kind == "attention":
            names += [p + f"self_attn.{m}.weight" for m in (*_ATTENTION, "q_norm", "k_norm")]
        else:
            names += [p + f"linear_attn.{m}.weight" for m in (*_DELTA_NET, "conv1d", "norm")]
            names += [p + "linear_attn.dt_bias", p + "linear_attn.A_log"]
    return names


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Tiny random Qwen3.5 weights in transformers' layout, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    v_heads = config.recurrent_state_num_heads
    value_dim = v_heads * config.recurrent_state_head_dim  # conv_dim = 2 * key heads * key dim + value_dim

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def near(value: float, dim: int, spread: float = 0.1) -> np.ndarray:
        return (value + spread * rng.standard_normal(dim)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((config.vocab_size, hidden)).astype(np.float32),
               "model.norm.weight": near(0.0, hidden)}  # zero-centred norms: 1 + w multiplies
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}."
        weights.update({p + "input_layernorm.weight": near(0.0, hidden),
                        p + "post_attention_layernorm.weight": near(0.0, hidden),
                        p + "mlp.gate_proj.weight": linear(inter, hidden),
                        p + "mlp.up_proj.weight": linear(inter, hidden),
                        p + "mlp.down_proj.weight": linear(hidden, inter)})
        if kind == "attention":
            q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
            weights.update({p + "self_attn.q_proj.weight": linear(2 * q_out, hidden),
                            p + "self_attn.k_proj.weight": linear(kv_out, hidden),
                            p + "self_attn.v_proj.weight": linear(kv_out, hidden),
                            p + "self_attn.o_proj.weight": linear(hidden, q_out),
                            p + "self_attn.q_norm.weight": near(0.0, head_dim),
                            p + "self_attn.k_norm.weight": near(0.0, head_dim)})
            continue
        q = p + "linear_attn."
        weights.update({q + "in_proj_qkv.weight": linear(config.conv_dim, hidden),
                        q + "in_proj_z.weight": linear(value_dim, hidden),
                        q + "in_proj_b.weight": linear(v_heads, hidden),
                        q + "in_proj_a.weight": linear(v_heads, hidden),
                        q + "conv1d.weight": (0.5 * rng.standard_normal((config.conv_dim, 1, config.conv_kernel))
                                              ).astype(np.float32),
                        q + "dt_bias": near(1.0, v_heads, 0.5),
                        q + "A_log": np.log(rng.uniform(1.0, 16.0, v_heads)).astype(np.float32),
                        q + "norm.weight": near(1.0, config.recurrent_state_head_dim),
                        q + "out_proj.weight": linear(hidden, value_dim)})
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = linear(config.vocab_size, hidden)
    return weights


def build_graph(loaded: LoadedModel, progress: Callable[[int], None]) -> onnx.ModelProto:
    return build_qwen3_5_graph(loaded.config, loaded.weights, progress=progress)


# `qwen3_5` dirs (vision-language) export their text model; ModelConfig.model is "qwen3_5" for both.
FAMILY = register(Family(
    model_types=("qwen3_5", "qwen3_5_text"),
    config_from_hf=config_from_hf,
    expected_names=expected_names,
    build_graph=build_graph,
    random_weights=random_weights,
    architectures={"Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5ForConditionalGeneration": "qwen3_5"},
    synthetic={
        # Hybrid: gated delta-net, attention, delta-net, attention; attention heads of 32 rotating 8 dims (partial
        # rotary 0.25), output-gated; delta-nets with 2 key heads of 16 serving 4 value heads of 16.
        "tiny-qwen3_5": {"model": "qwen3_5", "num_hidden_layers": 4, "head_dim": 32, "qk_norm": True,
                         "partial_rotary_factor": 0.25, "layer_types": ["mamba", "attention"] * 2,
                         "recurrent_state_num_heads": 4, "recurrent_state_head_dim": 16,
                         "recurrent_state_size": 16, "n_groups": 2, "conv_kernel": 4},
        # For benchmarks: Qwen3.5-0.8B's widths as we read its config (hidden 1024, 8/2 heads of 256 rotating 64,
        # delta-nets with 16 key and 16 value heads of 128), 8 of its 24 layers in its 3:1 pattern.
        "small-qwen3_5": {"model": "qwen3_5", "num_hidden_layers": 8, "hidden_size": 1024,
                          "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2,
                          "head_dim": 256, "qk_norm": True, "partial_rotary_factor": 0.25,
                          "layer_types": ["mamba", "mamba", "mamba", "attention"] * 2,
                          "recurrent_state_num_heads": 16, "recurrent_state_head_dim": 128,
                          "recurrent_state_size": 128, "n_groups": 16, "conv_kernel": 4},
    },
    checkpoint_name=checkpoint_name,
    lora=False,  # no LoRA inputs on the delta-nets yet
))
