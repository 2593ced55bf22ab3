"""Mamba2: the decoder (pure recurrent: causal conv + selective state space per layer) as an ONNX graph.

Every layer takes and returns its carried state next to the hidden states: `conv_state_{i}` [B, C, K-1]
(the conv's previous inputs) and `recurrent_state_{i}` [B, H, P, N] (fp32), so a prefill continues in
chunks, or after a restored snapshot, exactly. The recurrence is the `kvforge` SelectiveScan op and the
conv CausalConv1dWithState (kvforge/plugins/recurrent.py); llm_build lowers both (kvforge/builder/lower_recurrent.py).
Weight names follow transformers' Mamba2ForCausalLM (`backbone.layers.{i}.mixer.*`), except the embedding, which is
`model.embed_tokens.weight` as for every family (kvforge/tools/export/sources/base.py). The family (HF `model_type:
mamba2` and the synthetic tiny-mamba2: config, weight names, random weights) registers itself at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from kvforge.contract.model_config import ModelConfig
from kvforge.graph.onnx_graph import FLOAT, INT32, OPSET, GraphWriter, value_info
from kvforge.graph.positions import attach_hidden_states, gather_positions, logits_indices_input, logits_output
from kvforge.plugins import ops, recurrent
from kvforge.tools.export.families.registry import Family, register

if TYPE_CHECKING:
    from kvforge.tools.export.sources.base import LoadedModel


@dataclass(frozen=True, slots=True)
class Mamba2Geometry:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_heads: int  # SSM heads
    head_dim: int  # SSM head dim: num_heads * head_dim = expand * hidden_size
    state_size: int
    n_groups: int
    conv_kernel: int
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    hidden_state_layers: tuple[int, ...] = ()  # layers whose outputs go out as `hidden_states` (a drafter's)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def conv_state_shape(self) -> list[int | str]:
        return ["batch", self.conv_dim, self.conv_kernel - 1]

    def recurrent_state_shape(self) -> list[int | str]:
        return ["batch", self.num_heads, self.head_dim, self.state_size]


def conv_state_name(layer: int, present: bool = False) -> str:
    return f"{'present_' if present else ''}conv_state_{layer}"


def recurrent_state_name(layer: int, present: bool = False) -> str:
    return f"{'present_' if present else ''}recurrent_state_{layer}"


def build_mamba2_graph(geometry: Mamba2Geometry, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """`inputs_embeds` [B,S,H] + per-layer states in; `logits` [N,V] at `logits_indices` (graph/positions.py),
    optional `hidden_states`, + per-layer states out (after each row's last real token)."""
    g = GraphWriter()
    cfg = geometry
    inputs = [value_info("inputs_embeds", FLOAT, ["batch", "seq", cfg.hidden_size]),
              value_info("context_lengths", INT32, ["batch"]), logits_indices_input()]
    outputs = [logits_output(cfg.vocab_size)]
    hidden = "inputs_embeds"
    layer_outputs = []
    for layer in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{layer}."

        def w(name: str, array: np.ndarray | None = None, p: str = p) -> str:
            return g.weight(p + name, np.asarray(weights[p + name] if array is None else array, dtype=np.float32))

        for name, shape in ((conv_state_name(layer), cfg.conv_state_shape()),
                            (recurrent_state_name(layer), cfg.recurrent_state_shape())):
            inputs.append(value_info(name, FLOAT, shape))
        outputs += [value_info(conv_state_name(layer, True), FLOAT, cfg.conv_state_shape()),
                    value_info(recurrent_state_name(layer, True), FLOAT, cfg.recurrent_state_shape())]
        x = g.rms_norm(hidden, w("norm.weight"), cfg.rms_norm_eps)
        projected = g.matmul(x, w("mixer.in_proj.weight", weights[p + "mixer.in_proj.weight"].T))
        gate, xbc, dt = g.op("Split", [projected, g.const([cfg.intermediate_size, cfg.conv_dim, cfg.num_heads])],
                             n_out=3, axis=-1)
        conv = weights[p + "mixer.conv1d.weight"].reshape(cfg.conv_dim, cfg.conv_kernel)
        conv_bias = weights.get(p + "mixer.conv1d.bias", np.zeros(cfg.conv_dim, dtype=np.float32))
        conv_inputs = [xbc, w("mixer.conv1d.weight", conv), w("mixer.conv1d.bias", conv_bias), "context_lengths",
                       conv_state_name(layer)]
        mixed = g.op(recurrent.CAUSAL_CONV.name, conv_inputs,
                     outputs=[g.fresh("conv"), conv_state_name(layer, True)], domain=ops.DOMAIN,
                     name=f"causal_conv_{layer}", kernel_size=cfg.conv_kernel)
        groups = cfg.n_groups * cfg.state_size
        xs, b, c = g.op("Split", [mixed[0], g.const([cfg.intermediate_size, groups, groups])], n_out=3, axis=-1)
        y, _ = g.op(recurrent.SELECTIVE_SCAN.name,
                    [xs, dt, b, c, w("mixer.A_log"), w("mixer.D"), w("mixer.dt_bias"), "context_lengths",
                     recurrent_state_name(layer)],
                    outputs=[g.fresh("scan"), recurrent_state_name(layer, True)], domain=ops.DOMAIN,
                    name=f"selective_scan_{layer}", num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                    n_groups=cfg.n_groups, state_size=cfg.state_size)
        gated = g.mul(y, g.mul(gate, g.op("Sigmoid", [gate])))
        # Gated RMSNorm per group of intermediate_size / n_groups channels, then one weight over all of them.
        per_group = g.reshape(gated, [0, 0, cfg.n_groups, cfg.intermediate_size // cfg.n_groups])
        normed = g.reshape(g.rms_norm(per_group, g.const(1.0, np.float32), cfg.rms_norm_eps),
                           [0, 0, cfg.intermediate_size])
        normed = g.mul(normed, w("mixer.norm.weight"))
        hidden = g.add(hidden, g.matmul(normed, w("mixer.out_proj.weight", weights[p + "mixer.out_proj.weight"].T)))
        layer_outputs.append(hidden)
    g.op("Identity", [_position_logits(g, hidden, cfg, weights)], outputs=["logits"])
    attach_hidden_states(g, layer_outputs, cfg.hidden_state_layers, cfg.hidden_size, inputs, outputs)
    graph = helper.make_graph(g.nodes, "kvforge_mamba2", inputs, outputs, g.initializers)
    return helper.make_model(graph, producer_name="kvforge", opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)])


def _position_logits(g: GraphWriter, hidden: str, cfg: Mamba2Geometry, weights: dict[str, np.ndarray]) -> str:
    last = gather_positions(g, hidden, cfg.hidden_size)  # [N, H]
    normed = g.rms_norm(last, g.weight("backbone.norm_f.weight", weights["backbone.norm_f.weight"]), cfg.rms_norm_eps)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])  # tied: the embedding
    return g.matmul(normed, g.weight("lm_head.weight.T", np.ascontiguousarray(head.T, dtype=np.float32)))


# ---------------------------------------------------------------------------------------------------- the family

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
