"""Mamba2 checkpoints (Hugging Face `model_type: mamba2`) and the synthetic tiny-mamba2: config, weight names, weights.

Weight names stay transformers' (`backbone.layers.{i}.mixer.*`, `backbone.norm_f.weight`, `lm_head.weight`) except
the embedding, renamed `model.embed_tokens.weight` like every family's (the runtime's embedding table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.families.mamba2_graph import Mamba2Geometry, build_mamba2_graph
from kvforge.tools.export.families.registry import Family, register

if TYPE_CHECKING:
    from kvforge.tools.export.sources.base import LoadedModel

HF_EMBEDDING = "backbone.embeddings.weight"
EMBEDDING = "model.embed_tokens.weight"
# A recurrent model has no position table: the sequence limit is the engine's capacity alone.
UNLIMITED_POSITIONS = 1 << 20
_MIXER_TENSORS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                  "out_proj.weight")


def config_from_hf(hf: dict[str, Any], **common: Any) -> ModelConfig:
    """ModelConfig of an HF Mamba2 config.json (`common`: tokens, name, kv dtype: what every family shares)."""
    hidden, heads, head_dim = int(hf["hidden_size"]), int(hf["num_heads"]), int(hf["head_dim"])
    if hf.get("use_bias"):
        raise ValueError("use_bias=true (in_proj/out_proj biases) is not supported")
    if not hf.get("use_conv_bias", True):
        raise ValueError("use_conv_bias=false is not supported")
    limit = [_number(v) for v in hf.get("time_step_limit") or (0.0, float("inf"))]
    if limit[0] > 0.0 or limit[1] != float("inf"):
        raise ValueError(f"time_step_limit {list(limit)} is not supported (only the default (0, inf))")
    layers = int(hf["num_hidden_layers"])
    return ModelConfig(model="mamba2", vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
                       intermediate_size=heads * head_dim, num_hidden_layers=layers, num_attention_heads=0,
                       num_key_value_heads=0, head_dim=0, max_position_embeddings=UNLIMITED_POSITIONS,
                       rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), layer_types=["mamba"] * layers,
                       recurrent_state_num_heads=heads, recurrent_state_head_dim=head_dim,
                       recurrent_state_size=int(hf["state_size"]), n_groups=int(hf.get("n_groups", 1)),
                       conv_kernel=int(hf.get("conv_kernel", 4)), **common)


def _number(value: Any) -> float:
    # transformers 5 writes non-finite floats as {"__float__": "Infinity"} (JSON has no inf).
    return float(value["__float__"] if isinstance(value, dict) and "__float__" in value else value)


def checkpoint_name(name: str) -> str | None:
    """The embedding takes every family's name; the rest keep transformers'."""
    return EMBEDDING if name == HF_EMBEDDING else name


def expected_names(config: ModelConfig) -> list[str]:
    names = [EMBEDDING, "backbone.norm_f.weight"]
    for i in range(config.num_hidden_layers):
        names.append(f"backbone.layers.{i}.norm.weight")
        names += [f"backbone.layers.{i}.mixer.{t}" for t in _MIXER_TENSORS]
    return names


def geometry(config: ModelConfig) -> Mamba2Geometry:
    return Mamba2Geometry(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                          num_hidden_layers=config.num_hidden_layers, num_heads=config.recurrent_state_num_heads,
                          head_dim=config.recurrent_state_head_dim, state_size=config.recurrent_state_size,
                          n_groups=config.n_groups, conv_kernel=config.conv_kernel, rms_norm_eps=config.rms_norm_eps,
                          tie_word_embeddings=config.tie_word_embeddings,
                          hidden_state_layers=tuple(config.hidden_state_layers))


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Tiny random Mamba2 weights in transformers' layout (embedding renamed), scaled like the llama ones."""
    rng = np.random.default_rng(seed)
    shape = geometry(config)

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def near(value: float, dim: int, spread: float = 0.1) -> np.ndarray:
        return (value + spread * rng.standard_normal(dim)).astype(np.float32)

    heads, projection = shape.num_heads, shape.intermediate_size + shape.conv_dim + shape.num_heads
    weights = {EMBEDDING: rng.standard_normal((config.vocab_size, config.hidden_size)).astype(np.float32),
               "backbone.norm_f.weight": near(1.0, config.hidden_size)}
    for i in range(config.num_hidden_layers):
        p = f"backbone.layers.{i}."
        weights.update({
            p + "norm.weight": near(1.0, config.hidden_size),
            p + "mixer.in_proj.weight": linear(projection, config.hidden_size),
            p + "mixer.conv1d.weight": (0.5 * rng.standard_normal((shape.conv_dim, 1, shape.conv_kernel))
                                        ).astype(np.float32),
            p + "mixer.conv1d.bias": near(0.0, shape.conv_dim),
            p + "mixer.dt_bias": near(-1.0, heads, 0.5),
            p + "mixer.A_log": np.log(np.arange(1, heads + 1, dtype=np.float32)),
            p + "mixer.D": near(1.0, heads),
            p + "mixer.norm.weight": near(1.0, shape.intermediate_size),
            p + "mixer.out_proj.weight": linear(config.hidden_size, shape.intermediate_size),
        })
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = linear(config.vocab_size, config.hidden_size)
    return weights


def build_graph(loaded: LoadedModel, progress: Callable[[int], None]) -> onnx.ModelProto:
    return build_mamba2_graph(geometry(loaded.config), loaded.weights)


FAMILY = register(Family(
    model_types=("mamba2",),
    config_from_hf=config_from_hf,
    expected_names=expected_names,
    build_graph=build_graph,
    random_weights=random_weights,
    architectures={"Mamba2ForCausalLM": "mamba2"},
    # Pure recurrent: 8 SSM heads of 16 (expand 2), state 16, 2 groups, conv kernel 4.
    synthetic={"tiny-mamba2": {"model": "mamba2", "num_attention_heads": 0, "num_key_value_heads": 0, "head_dim": 0,
                               "intermediate_size": 128, "max_position_embeddings": UNLIMITED_POSITIONS,
                               "rms_norm_eps": 1e-5, "layer_types": ["mamba", "mamba"],
                               "recurrent_state_num_heads": 8, "recurrent_state_head_dim": 16,
                               "recurrent_state_size": 16, "n_groups": 2, "conv_kernel": 4}},
    checkpoint_name=checkpoint_name,
    lora=False,  # no LoRA inputs on the mixers yet
))
