"""Qwen3.5: the text decoder (hybrid: gated delta-net layers interleaved with gated attention) as an ONNX graph.

Attention layers follow the llama graph's paged-KV contract (`past_key_values_{i}` in, PagedKVWrite +
PagedAttention) with Qwen3.5's differences: q_proj also yields a per-head output gate (sigmoid), q/k get a
per-head RMSNorm, and RoPE rotates only the first `rotary_dim` dims of each head. Recurrent layers take and
return `conv_state_{i}` [B, conv_dim, K-1] and `recurrent_state_{i}` [B, Hv, Dv, Dk] (fp32) like Mamba2's, so a
prefill continues in chunks or after a restored snapshot; the recurrence is the kvforge GatedDeltaRule op and the
short conv CausalConv1dWithState (zero bias: the checkpoint's conv has none; SiLU as in transformers). Layer i's
tensors keep their absolute index i, so a graph has `past_key_values_3` but no `past_key_values_0` when layer 0
is recurrent. Every RMSNorm but the delta-net's gated one is zero-centred in the checkpoint (x * (1 + w)): the
graph stores 1 + w. Weight names are transformers' Qwen3_5ForCausalLM ones (`model.layers.{i}.linear_attn.*`,
`model.layers.{i}.self_attn.*`).

The family (HF `qwen3_5_text`, or the text model of a `qwen3_5` dir, and the synthetic tiny-/small-qwen3_5) registers
itself at the end. HF's layer_types "linear_attention" / "full_attention" become kvforge's "mamba" / "attention"
(LAYER_TYPES: "mamba" is any recurrent mixer, as TensorRT Edge-LLM normalizes them). The delta-net's geometry goes
into the shared recurrent fields (see ModelConfig): value heads / value head dim / key head dim / key heads as
recurrent_state_num_heads / recurrent_state_head_dim / recurrent_state_size / n_groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from kvforge.contract.model_config import ModelConfig
from kvforge.graph.onnx_graph import FLOAT, INT32, OPSET, GraphWriter, value_info
from kvforge.graph.positions import attach_hidden_states, gather_positions, logits_indices_input, logits_output
from kvforge.graph.rope import apply_rope
from kvforge.plugins import ops, recurrent
from kvforge.tools.export.families.llama import POOL_ELEM_TYPES, pool_input_name, pool_output_name, rope_inputs
from kvforge.tools.export.families.mamba2 import conv_state_name, recurrent_state_name
from kvforge.tools.export.families.registry import Family, register

if TYPE_CHECKING:
    from kvforge.tools.export.sources.base import LoadedModel


L2_NORM_EPS = 1e-6  # transformers' (and FLA's) l2norm of the delta-net's q and k


def delta_net_shapes(config: ModelConfig) -> tuple[int, int, int, int]:
    """(key heads, value heads, key head dim, value head dim) of a gated delta-net layer (see ModelConfig)."""
    return (config.n_groups, config.recurrent_state_num_heads, config.recurrent_state_size,
            config.recurrent_state_head_dim)


def conv_state_shape(config: ModelConfig) -> list[int | str]:
    return ["batch", config.conv_dim, config.conv_kernel - 1]


def recurrent_state_shape(config: ModelConfig) -> list[int | str]:
    """[B, Hv, Dv, Dk]: value heads, value head dim, key head dim (the Mamba2 [B, H, P, N] formula)."""
    return ["batch", config.recurrent_state_num_heads, config.recurrent_state_head_dim, config.recurrent_state_size]


def build_qwen3_5_graph(config: ModelConfig, weights: dict[str, np.ndarray],
                        progress: Callable[[int], None] | None = None) -> onnx.ModelProto:
    """`inputs_embeds` [B,S,H] + the paged-KV inputs + per-recurrent-layer states in; `logits` [N,V] at
    `logits_indices` (graph/positions.py), optional `hidden_states`, the attention layers' pools and the recurrent
    layers' states out."""
    g = GraphWriter()
    rope_cos, rope_sin = rope_inputs(g, "inputs_embeds")
    inputs = [
        value_info("inputs_embeds", FLOAT, ["batch", "seq", config.hidden_size]),
        value_info("context_lengths", INT32, ["batch"]),
        value_info("kvcache_start_index", INT32, ["batch"]),
        value_info("kv_page_table", INT32, ["batch", "pages_per_seq"]),
        value_info("rope_rotary_cos_sin", FLOAT, ["capacity", config.rotary_dim]),
        logits_indices_input(),
    ]
    outputs = [logits_output(config.vocab_size)]
    hidden = "inputs_embeds"
    layer_outputs = []
    for layer, kind in enumerate(config.layer_types):
        p = f"model.layers.{layer}."
        x = g.rms_norm(hidden, centred_norm(g, weights, p + "input_layernorm.weight"), config.rms_norm_eps)
        if kind == "attention":
            mixed = gated_attention(g, config, weights, layer, x, (rope_cos, rope_sin), inputs, outputs)
        else:
            mixed = _gated_delta_net(g, config, weights, layer, x, inputs, outputs)
        hidden = g.add(hidden, mixed)
        x = g.rms_norm(hidden, centred_norm(g, weights, p + "post_attention_layernorm.weight"), config.rms_norm_eps)
        gate, up = fused_linears(g, weights, x, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                                 p + "mlp.gate_up")
        hidden = g.add(hidden, linear(g, weights, g.mul(g.mul(gate, g.op("Sigmoid", [gate])), up),
                                       p + "mlp.down_proj.weight"))
        layer_outputs.append(hidden)
        if progress:
            progress(layer)
    g.op("Identity", [_position_logits(g, config, weights, hidden)], outputs=["logits"])
    attach_hidden_states(g, layer_outputs, config.hidden_state_layers, config.hidden_size, inputs, outputs)
    graph = helper.make_graph(g.nodes, "kvforge_qwen3_5", inputs, outputs, g.initializers)
    return helper.make_model(graph, producer_name="kvforge", opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)])


def centred_norm(g: GraphWriter, weights: dict[str, np.ndarray], name: str) -> str:
    """A zero-centred RMSNorm weight as the multiplier the graph applies: 1 + w."""
    return g.weight(name, 1.0 + weights[name].astype(np.float32))


def linear(g: GraphWriter, weights: dict[str, np.ndarray], x: str, name: str) -> str:
    return g.matmul(x, g.weight(name, np.ascontiguousarray(weights[name].astype(np.float32).T)))


def fused_linears(g: GraphWriter, weights: dict[str, np.ndarray], x: str, names: list[str], fused: str) -> list[str]:
    """Projections of one input as one MatMul over their weights side by side, then Split (as the llama graph)."""
    joined = np.concatenate([weights[n].astype(np.float32).T for n in names], axis=1)
    y = g.matmul(x, g.weight(fused + ".fused.weight", joined))
    return g.op("Split", [y, g.const([weights[n].shape[0] for n in names])], n_out=len(names), axis=-1)


def gated_attention(g: GraphWriter, config: ModelConfig, weights: dict[str, np.ndarray], layer: int, x: str,
                     rope: tuple[str, str], inputs: list, outputs: list) -> str:
    p = f"model.layers.{layer}.self_attn."
    num_q, num_kv, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q_gate, k, v = fused_linears(g, weights, x, [p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"],
                          p + "qkv")
    # q_proj's rows are per head: the head's D query rows, then its D gate rows.
    q, gate = g.op("Split", [g.reshape(q_gate, [0, 0, num_q, 2 * head_dim]), g.const([head_dim, head_dim])],
                   n_out=2, axis=-1)
    q = g.reshape(g.rms_norm(q, centred_norm(g, weights, p + "q_norm.weight"), config.rms_norm_eps),
                  [0, 0, num_q * head_dim])
    k = g.reshape(g.rms_norm(g.reshape(k, [0, 0, num_kv, head_dim]), centred_norm(g, weights, p + "k_norm.weight"),
                             config.rms_norm_eps), [0, 0, num_kv * head_dim])
    q = apply_rope(g, q, num_q, head_dim, rope[0], rope[1], config.rotary_dim)
    pool_in, pool_out = pool_input_name(layer), pool_output_name(layer)
    pool_shape = ["num_pages", 2, num_kv, "tokens_per_page", head_dim]
    inputs.append(value_info(pool_in, POOL_ELEM_TYPES[config.kv_cache_dtype], pool_shape))
    outputs.append(value_info(pool_out, POOL_ELEM_TYPES[config.kv_cache_dtype], pool_shape))
    g.op(ops.PAGED_KV_WRITE.name, [k, v, "rope_rotary_cos_sin", "context_lengths", "kvcache_start_index",
                                   "kv_page_table", pool_in],
         outputs=[pool_out], domain=ops.DOMAIN, name=f"paged_kv_write_{layer}", num_kv_heads=num_kv,
         head_dim=head_dim, tokens_per_page=0, rotary_dim=config.rotary_dim)
    attn = g.op(ops.PAGED_ATTENTION.name, [q, pool_out, "context_lengths", "kvcache_start_index", "kv_page_table"],
                domain=ops.DOMAIN, name=f"paged_attention_{layer}", num_q_heads=num_q, num_kv_heads=num_kv,
                head_dim=head_dim, tokens_per_page=0, scale=float(head_dim ** -0.5))
    gated = g.mul(attn, g.op("Sigmoid", [g.reshape(gate, [0, 0, num_q * head_dim])]))
    return linear(g, weights, gated, p + "o_proj.weight")


def _l2_normalised(g: GraphWriter, x: str, heads: int, dim: int, scale: float = 1.0) -> str:
    per_head = g.reshape(x, [0, 0, heads, dim])
    squares = g.op("ReduceSum", [g.mul(per_head, per_head), g.const([-1])], keepdims=1)
    inverse = g.op("Reciprocal", [g.op("Sqrt", [g.add(squares, g.const(L2_NORM_EPS, np.float32))])])
    if scale != 1.0:
        inverse = g.mul(inverse, g.const(scale, np.float32))
    return g.reshape(g.mul(per_head, inverse), [0, 0, heads * dim])


def _gated_delta_net(g: GraphWriter, config: ModelConfig, weights: dict[str, np.ndarray], layer: int, x: str,
                     inputs: list, outputs: list) -> str:
    p = f"model.layers.{layer}.linear_attn."
    k_heads, v_heads, k_dim, v_dim = delta_net_shapes(config)
    for name, shape in ((conv_state_name(layer), conv_state_shape(config)),
                        (recurrent_state_name(layer), recurrent_state_shape(config))):
        inputs.append(value_info(name, FLOAT, shape))
        outputs.append(value_info("present_" + name, FLOAT, shape))
    qkv, z, b, a = fused_linears(g, weights, x, [p + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")],
                          p + "in_proj")
    conv_weight = weights[p + "conv1d.weight"].reshape(config.conv_dim, config.conv_kernel).astype(np.float32)
    mixed, _ = g.op(recurrent.CAUSAL_CONV.name,
                    [qkv, g.weight(p + "conv1d.weight", conv_weight),
                     g.weight(p + "conv1d.bias", np.zeros(config.conv_dim, np.float32)), "context_lengths",
                     conv_state_name(layer)],
                    outputs=[g.fresh("conv"), conv_state_name(layer, True)], domain=ops.DOMAIN,
                    name=f"causal_conv_{layer}", kernel_size=config.conv_kernel)
    q, k, v = g.op("Split", [mixed, g.const([k_heads * k_dim, k_heads * k_dim, v_heads * v_dim])], n_out=3, axis=-1)
    q = _l2_normalised(g, q, k_heads, k_dim, scale=k_dim ** -0.5)  # transformers scales q by Dk^-0.5 after the norm
    k = _l2_normalised(g, k, k_heads, k_dim)
    beta = g.op("Sigmoid", [b])
    a_log = weights[p + "A_log"].astype(np.float32)
    # g = -exp(A_log) * softplus(a + dt_bias): the log decay per value head; exp(A_log) folded at export.
    log_decay = g.mul(g.op("Softplus", [g.add(a, g.weight(p + "dt_bias", weights[p + "dt_bias"].astype(np.float32)))]),
                      g.weight(p + "neg_exp_A_log", -np.exp(a_log)))
    y, _ = g.op(recurrent.GATED_DELTA_RULE.name, [q, k, v, log_decay, beta, "context_lengths",
                                                  recurrent_state_name(layer)],
                outputs=[g.fresh("delta"), recurrent_state_name(layer, True)], domain=ops.DOMAIN,
                name=f"gated_delta_rule_{layer}", num_k_heads=k_heads, num_v_heads=v_heads, k_head_dim=k_dim,
                v_head_dim=v_dim)
    # Gated RMSNorm per value head (a plain weight, not zero-centred), then SiLU(z).
    normed = g.rms_norm(g.reshape(y, [0, 0, v_heads, v_dim]),
                        g.weight(p + "norm.weight", weights[p + "norm.weight"].astype(np.float32)), config.rms_norm_eps)
    z_heads = g.reshape(z, [0, 0, v_heads, v_dim])
    gated = g.reshape(g.mul(normed, g.mul(z_heads, g.op("Sigmoid", [z_heads]))), [0, 0, v_heads * v_dim])
    return linear(g, weights, gated, p + "out_proj.weight")


def _position_logits(g: GraphWriter, config: ModelConfig, weights: dict[str, np.ndarray], hidden: str) -> str:
    last = gather_positions(g, hidden, config.hidden_size)  # [N, H]
    normed = g.rms_norm(last, centred_norm(g, weights, "model.norm.weight"), config.rms_norm_eps)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])  # tied: the embedding
    return g.matmul(normed, g.weight("lm_head.weight", np.ascontiguousarray(head.T, dtype=np.float32)))


# ---------------------------------------------------------------------------------------------------- the family

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
