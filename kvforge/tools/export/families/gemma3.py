"""Gemma 3 (HF `gemma3_text`, and the text model of a multimodal `gemma3` dir), registered once: its decoder as an
ONNX graph over the paged-KV ops with sliding-window layers, and its HF config mapping, weights and synthetic model."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from kvforge.contract.errors import KvforgeError
from kvforge.contract.model_config import ModelConfig
from kvforge.graph.onnx_graph import FLOAT, INT32, INT64, OPSET, GraphWriter, value_info
from kvforge.graph.positions import attach_hidden_states, gather_positions, logits_indices_input, logits_output
from kvforge.graph.rope import apply_rope
from kvforge.plugins import ops
from kvforge.tools.export.families.llama import (
    POOL_ELEM_TYPES,
    LoraActivation,
    LoraInputs,
    pool_input_name,
    pool_output_name,
    rope_inputs,
)
from kvforge.tools.export.families.qwen3_5 import centred_norm, fused_linears, linear
from kvforge.tools.export.families.registry import Family, register

if TYPE_CHECKING:
    from kvforge.tools.export.sources.base import LoadedModel

# Gemma's differences from the llama graph: embeddings scaled by sqrt(hidden); zero-centred RMSNorms (x * (1 + w),
# stored as 1 + w) around both the attention and the MLP ("sandwich" norms) and on each q/k head; a GELU-tanh MLP;
# queries scaled by query_pre_attn_scalar^-0.5; logits soft-capped by tanh. Sliding layers attend over their last
# `sliding_window` positions (PagedAttention's `sliding_window` attribute) and rotate with their own RoPE base; the
# global layers may scale theirs linearly. The runtime feeds one plain RoPE table (rope_theta), so a layer whose
# frequencies differ first rotates q and k by the difference of the angles and then by the table: rotations
# compose, so the result is the layer's own RoPE, and every backend's K/V write and attention stay as they are.
# Each layer keeps a full-length KV cache for now. LoRA inputs sit on the seven linears as on llama's graph (its
# LoraInputs: q/k/v before the head norms, o on the attention output, gate/up/down around the GELU), where PEFT wraps
# the same nn.Linear modules.

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of GELU's tanh approximation


def inverse_frequencies(config: ModelConfig, theta: float, head_dim: int = 0) -> np.ndarray:
    """Rotate-half inverse frequencies of base `theta` over a whole head of `head_dim` (0: config.head_dim, the
    table's with rope_theta), float64."""
    dim = head_dim or config.head_dim
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def frequency_delta(config: ModelConfig, own: np.ndarray) -> np.ndarray | None:
    """A layer type's inverse frequencies minus the table's (None: they are the same)."""
    table = inverse_frequencies(config, config.rope_theta)
    return None if np.array_equal(own, table) else (own - table).astype(np.float32)


def rope_delta_frequencies(config: ModelConfig, sliding: bool) -> np.ndarray | None:
    """The extra rotation of a Gemma 3 layer type: sliding layers turn with the local base, global ones with
    rope_theta linearly scaled."""
    if sliding:
        return frequency_delta(config, inverse_frequencies(config, config.rope_local_theta or config.rope_theta))
    return frequency_delta(config, inverse_frequencies(config, config.rope_theta) / (config.rope_linear_factor or 1.0))


def delta_rope(g: GraphWriter, embeds: str, delta: np.ndarray, name: str) -> tuple[str, str]:
    """cos/sin [B,S,1,D/2] of positions start+i times `delta`: a layer type's rotation before the table's."""
    seq = g.op("Squeeze", [g.dim(embeds, 1), g.const([0])])
    steps = g.op("Range", [g.const(0), seq, g.const(1)])
    positions = g.add(g.unsqueeze(g.cast("kvcache_start_index", INT64), [1]), g.unsqueeze(steps, [0]))
    angles = g.mul(g.unsqueeze(g.cast(positions, FLOAT), [2, 3]), g.weight(name, delta))
    return g.op("Cos", [angles]), g.op("Sin", [angles])


def _head_norm(g: GraphWriter, weights: dict[str, np.ndarray], x: str, heads: int, head_dim: int, name: str,
               eps: float) -> str:
    normed = g.rms_norm(g.reshape(x, [0, 0, heads, head_dim]), centred_norm(g, weights, name), eps)
    return g.reshape(normed, [0, 0, heads * head_dim])


def gelu_tanh(g: GraphWriter, x: str) -> str:
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); ONNX's Gelu(approximate="tanh") needs opset 20.
    cube = g.mul(g.mul(x, x), x)
    inner = g.mul(g.add(x, g.mul(cube, g.const(0.044715, np.float32))), g.const(np.sqrt(2.0 / np.pi), np.float32))
    return g.mul(g.mul(x, g.const(0.5, np.float32)), g.add(g.op("Tanh", [inner]), g.const(1.0, np.float32)))


def _attention(g: GraphWriter, config: ModelConfig, weights: dict[str, np.ndarray], layer: int, x: str,
               rope: tuple[str, str], extra: dict[bool, tuple[str, str] | None], inputs: list, outputs: list,
               lora: LoraInputs) -> str:
    p = f"model.layers.{layer}.self_attn."
    num_q, num_kv, head_dim, eps = config.num_attention_heads, config.num_key_value_heads, config.head_dim, \
        config.rms_norm_eps
    q, k, v = fused_linears(g, weights, x, [p + f"{n}_proj.weight" for n in "qkv"], p + "qkv")
    q, k, v = (lora.apply(g, target, x, y) for target, y in zip("qkv", (q, k, v), strict=True))
    q = _head_norm(g, weights, q, num_q, head_dim, p + "q_norm.weight", eps)
    k = _head_norm(g, weights, k, num_kv, head_dim, p + "k_norm.weight", eps)
    sliding = layer in config.sliding_window_layers
    if extra[sliding] is not None:  # the layer type's extra angle; the table's rotation follows
        q = apply_rope(g, q, num_q, head_dim, *extra[sliding])
        k = apply_rope(g, k, num_kv, head_dim, *extra[sliding])
    q = apply_rope(g, q, num_q, head_dim, *rope)
    pool_in, pool_out = pool_input_name(layer), pool_output_name(layer)
    pool_shape = ["num_pages", 2, num_kv, "tokens_per_page", head_dim]
    inputs.append(value_info(pool_in, POOL_ELEM_TYPES[config.kv_cache_dtype], pool_shape))
    outputs.append(value_info(pool_out, POOL_ELEM_TYPES[config.kv_cache_dtype], pool_shape))
    g.op(ops.PAGED_KV_WRITE.name, [k, v, "rope_rotary_cos_sin", "context_lengths", "kvcache_start_index",
                                   "kv_page_table", pool_in],
         outputs=[pool_out], domain=ops.DOMAIN, name=f"paged_kv_write_{layer}", num_kv_heads=num_kv,
         head_dim=head_dim, tokens_per_page=0)
    window = {"sliding_window": config.sliding_window} if sliding else {}
    attn = g.op(ops.PAGED_ATTENTION.name, [q, pool_out, "context_lengths", "kvcache_start_index", "kv_page_table"],
                domain=ops.DOMAIN, name=f"paged_attention_{layer}", num_q_heads=num_q, num_kv_heads=num_kv,
                head_dim=head_dim, tokens_per_page=0, scale=float(query_scalar(config) ** -0.5), **window)
    return lora.apply(g, "o", attn, linear(g, weights, attn, p + "o_proj.weight"))


def query_scalar(config: ModelConfig) -> float:
    return config.query_pre_attn_scalar or float(config.head_dim)


NormWeight = Callable[[GraphWriter, dict[str, np.ndarray], str], str]  # a norm's weight as the graph multiplies
RopeDeltas = Callable[[ModelConfig, bool], "np.ndarray | None"]  # a layer type's rotation beyond the table's
Attend = Callable[[str], str]  # a layer's normed input -> its attention output


def graph_start(g: GraphWriter, config: ModelConfig, rope_deltas: RopeDeltas
                ) -> tuple[tuple[str, str], dict[bool, tuple[str, str] | None], list, list, str]:
    """What both Gemma graphs start with: the table's rope, each layer type's extra rotation, the llama graph's
    inputs and `logits` output, and the embedding rows scaled by sqrt(hidden) (transformers rounds that factor to
    the weights' dtype, float32 here)."""
    rope = rope_inputs(g, "inputs_embeds")
    extra: dict[bool, tuple[str, str] | None] = {}
    for sliding, name in ((True, "rope_sliding_delta_inv_freq"), (False, "rope_full_delta_inv_freq")):
        delta = rope_deltas(config, sliding)
        extra[sliding] = None if delta is None else delta_rope(g, "inputs_embeds", delta, name)
    inputs = [
        value_info("inputs_embeds", FLOAT, ["batch", "seq", config.hidden_size]),
        value_info("context_lengths", INT32, ["batch"]),
        value_info("kvcache_start_index", INT32, ["batch"]),
        value_info("kv_page_table", INT32, ["batch", "pages_per_seq"]),
        value_info("rope_rotary_cos_sin", FLOAT, ["capacity", config.head_dim]),
        logits_indices_input(),
    ]
    outputs = [logits_output(config.vocab_size)]
    hidden = g.mul("inputs_embeds", g.const(np.float32(config.hidden_size ** 0.5), np.float32))
    return rope, extra, inputs, outputs, hidden


def sandwich_layer(g: GraphWriter, config: ModelConfig, weights: dict[str, np.ndarray], layer: int, hidden: str,
                   norm: NormWeight, attend: Attend, lora: LoraInputs) -> str:
    """One Gemma decoder layer: attention and the GELU-tanh MLP, each between a pre- and a post-norm; `lora` adds
    the layer's gate/up/down adapters (attend adds q/k/v/o)."""
    p, eps = f"model.layers.{layer}.", config.rms_norm_eps
    attn = attend(g.rms_norm(hidden, norm(g, weights, p + "input_layernorm.weight"), eps))
    hidden = g.add(hidden, g.rms_norm(attn, norm(g, weights, p + "post_attention_layernorm.weight"), eps))
    x = g.rms_norm(hidden, norm(g, weights, p + "pre_feedforward_layernorm.weight"), eps)
    gate, up = fused_linears(g, weights, x, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], p + "mlp.gate_up")
    gate, up = lora.apply(g, "gate", x, gate), lora.apply(g, "up", x, up)
    gated = g.mul(gelu_tanh(g, gate), up)
    mlp = lora.apply(g, "down", gated, linear(g, weights, gated, p + "mlp.down_proj.weight"))
    return g.add(hidden, g.rms_norm(mlp, norm(g, weights, p + "post_feedforward_layernorm.weight"), eps))


def graph_end(g: GraphWriter, config: ModelConfig, weights: dict[str, np.ndarray], hidden: str,
              layer_outputs: list[str], inputs: list, outputs: list, norm: NormWeight, name: str) -> onnx.ModelProto:
    """The logits at `logits_indices` (final norm, the LM head or the tied embedding, soft-capping), the optional
    hidden states, and the model."""
    last = gather_positions(g, hidden, config.hidden_size)  # [N, H]
    normed = g.rms_norm(last, norm(g, weights, "model.norm.weight"), config.rms_norm_eps)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])  # tied: the embedding
    logits = g.matmul(normed, g.weight("lm_head.weight", np.ascontiguousarray(head.T, dtype=np.float32)))
    if cap := config.final_logit_softcapping:
        logits = g.mul(g.op("Tanh", [g.mul(logits, g.const(np.float32(1.0 / cap), np.float32))]),
                       g.const(np.float32(cap), np.float32))
    g.op("Identity", [logits], outputs=["logits"])
    attach_hidden_states(g, layer_outputs, config.hidden_state_layers, config.hidden_size, inputs, outputs)
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.initializers)
    return helper.make_model(graph, producer_name="kvforge", opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)])


def build_gemma3_graph(config: ModelConfig, weights: dict[str, np.ndarray],
                       progress: Callable[[int], None] | None = None) -> onnx.ModelProto:
    """The llama graph's contract (`inputs_embeds`, paged-KV inputs, `logits` at `logits_indices`, optional
    `hidden_states`): the runtime's embedding rows come in unscaled, as the tied LM head reads them."""
    g = GraphWriter()
    rope, extra, inputs, outputs, hidden = graph_start(g, config, rope_delta_frequencies)
    activation = LoraActivation(inputs)  # adds its input only when a LoRA target is exported
    layer_outputs = []
    for layer in range(config.num_hidden_layers):
        lora = LoraInputs(config, layer, inputs, activation)
        hidden = sandwich_layer(g, config, weights, layer, hidden, centred_norm, lambda x, layer=layer, lora=lora:
                                _attention(g, config, weights, layer, x, rope, extra, inputs, outputs, lora), lora)
        layer_outputs.append(hidden)
        if progress:
            progress(layer)
    return graph_end(g, config, weights, hidden, layer_outputs, inputs, outputs, centred_norm, "kvforge_gemma3")


# ---------------------------------------------------------------------------------------------------- the family

HF_LAYER_TYPES = ("sliding_attention", "full_attention")
# Multimodal dirs keep the text model under one of these prefixes (transformers 5's layout, then the older one).
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_SKIPPED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
_LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
                  "mlp.down_proj")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's HF config: `text_config` of a multimodal dir (the outer config decides tying), else hf."""
    nested = hf.get("text_config")
    if not isinstance(nested, dict):
        return hf
    return {**nested, "tie_word_embeddings": hf.get("tie_word_embeddings", nested.get("tie_word_embeddings", True))}


def layer_types(hf: dict[str, Any], layers: int) -> list[str]:
    """HF layer_types, or the older sliding_window_pattern (every n-th layer global) it replaced."""
    types = hf.get("layer_types")
    if types is None:
        pattern = int(hf.get("sliding_window_pattern", 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    unknown = sorted(set(types) - set(HF_LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types: layer type {unknown[0]!r} is not supported (known: "
                         f"{', '.join(HF_LAYER_TYPES)})")
    if len(types) != layers:
        raise ValueError(f"layer_types: has {len(types)} entries for {layers} layers")
    return list(types)


# transformers' rope types (ROPE_INIT_FUNCTIONS): a type outside them is a typo or a newer model, refused by name.
HF_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")


def check_hf_fields(hf: dict[str, Any], sliding: bool, supported_rope_scaling: tuple[str, ...]) -> None:
    """Fields transformers refuses, refused here by name instead of replaced by a default (issue 52 item 5): a
    sliding window that is 0, null or fractional (with sliding layers), num_key_value_heads 0 or not dividing the
    heads, query_pre_attn_scalar 0, and a rope_scaling type transformers does not know or this export does not
    reproduce (`supported_rope_scaling`)."""
    window = hf.get("sliding_window", 1)
    if sliding and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a whole number of positions >= 1 for the sliding layers, got "
                         f"{window!r}")
    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and (isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1
                                 or (isinstance(heads, int) and heads % kv_heads)):
        raise ValueError(f"num_key_value_heads must be a whole number >= 1 dividing num_attention_heads ({heads}), "
                         f"got {kv_heads!r}")
    scalar = hf.get("query_pre_attn_scalar")
    if scalar is not None and (isinstance(scalar, bool) or not isinstance(scalar, int | float)
                               or not math.isfinite(scalar) or scalar <= 0):
        raise ValueError(f"query_pre_attn_scalar must be a finite number > 0, got {scalar!r}")
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        if kind not in HF_ROPE_TYPES:
            raise ValueError(f"rope_scaling must be an object with a rope_type transformers knows "
                             f"({', '.join(HF_ROPE_TYPES)}), got {scaling!r}")
        if kind not in supported_rope_scaling:
            raise ValueError(f"rope_scaling type {kind!r} is not supported by this export (only "
                             f"{' or '.join(supported_rope_scaling) or 'none'})")


def rope_bases(hf: dict[str, Any]) -> tuple[float, float, float]:
    """(global base, local base, the global layers' linear factor or 0) from transformers 5's per-layer-type
    rope_parameters or the older flat fields; plain RoPE and linear scaling (global layers) are reproduced."""
    params = hf.get("rope_parameters") or {}
    per_type = {t: params.get(t) or {} for t in HF_LAYER_TYPES} if any(t in params for t in HF_LAYER_TYPES) else \
        {"full_attention": {**params, **(hf.get("rope_scaling") or {})}, "sliding_attention": {}}
    for kind, values in per_type.items():
        rope_type = values.get("rope_type", values.get("type", "default"))
        allowed = ("default", "linear") if kind == "full_attention" else ("default",)
        if rope_type not in allowed:
            raise ValueError(f"rope_parameters: {kind} rope_type {rope_type!r} is not supported (only "
                             f"{' or '.join(allowed)})")
    full = per_type["full_attention"]
    factor = float(full.get("factor", 1.0)) if full.get("rope_type", full.get("type")) == "linear" else 0.0
    local = per_type["sliding_attention"].get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    return float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))), float(local), factor


def config_from_hf(hf: dict[str, Any], **common: Any) -> ModelConfig:
    """ModelConfig of an HF Gemma 3 text config (`common`: tokens, name, kv dtype: what every family shares)."""
    hf = text_config(hf)
    for name, unsupported in (("attention_bias", bool(hf.get("attention_bias"))),
                              ("attn_logit_softcapping", hf.get("attn_logit_softcapping") is not None),
                              ("use_bidirectional_attention", bool(hf.get("use_bidirectional_attention")))):
        if unsupported:
            raise ValueError(f"{name}={hf[name]!r} is not supported")
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or GELU_TANH[0]
    if activation not in GELU_TANH:
        raise ValueError(f"hidden_activation {activation!r} is not supported (only {GELU_TANH[0]})")
    layers = int(hf["num_hidden_layers"])
    types = layer_types(hf, layers)
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    # rope_scaling is read (merged into the global layers' parameters) only without per-type rope_parameters.
    per_type = any(t in (hf.get("rope_parameters") or {}) for t in HF_LAYER_TYPES)
    check_hf_fields(hf, bool(sliding), ("default",) if per_type else ("default", "linear"))
    theta, local_theta, linear_factor = rope_bases(hf)
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or 256)
    return ModelConfig(
        model="gemma3", vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads), head_dim=head_dim,
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)), rope_theta=theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qk_norm=True, sliding_window=int(hf.get("sliding_window") or 4096) if sliding else 0,
        sliding_window_layers=sliding, rope_local_theta=local_theta if sliding else 0.0,
        rope_linear_factor=0.0 if linear_factor == 1.0 else linear_factor,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or head_dim),
        final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0), **common)


def checkpoint_name(name: str) -> str | None:
    """The kvforge weight name of a checkpoint tensor (None: the vision tower and projector)."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name.removeprefix(prefix)
    return name.removeprefix("language_model.")  # language_model.lm_head.weight in the older layout


def expected_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    return names + [f"model.layers.{i}.{t}.weight" for i in range(config.num_hidden_layers) for t in _LAYER_TENSORS]


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Tiny random Gemma 3 weights in transformers' layout, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def dense(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:  # zero-centred: the graph multiplies by 1 + w
        return (0.1 * rng.standard_normal(dim)).astype(np.float32)

    # Rows of norm ~1: the graph scales them by sqrt(hidden) before the first norm.
    weights = {"model.embed_tokens.weight": (rng.standard_normal((config.vocab_size, hidden))
                                             / np.sqrt(hidden)).astype(np.float32),
               "model.norm.weight": norm(hidden)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({p + f"{n}.weight": norm(hidden) for n in _LAYER_TENSORS[:4]})
        weights.update({p + "self_attn.q_proj.weight": dense(q_out, hidden),
                        p + "self_attn.k_proj.weight": dense(kv_out, hidden),
                        p + "self_attn.v_proj.weight": dense(kv_out, hidden),
                        p + "self_attn.o_proj.weight": dense(hidden, q_out),
                        p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
                        p + "mlp.gate_proj.weight": dense(inter, hidden),
                        p + "mlp.up_proj.weight": dense(inter, hidden),
                        p + "mlp.down_proj.weight": dense(hidden, inter)})
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = dense(config.vocab_size, hidden)
    return weights


def refuse_quantized(loaded: LoadedModel) -> None:
    """The Gemma graphs take float32 weights only (their int4 blocks are not written yet)."""
    if loaded.quantized:
        raise KvforgeError(f"{loaded.config.model} exports float32 weights only for now; use --quantization none",
                           "--quantization")


def build_graph(loaded: LoadedModel, progress: Callable[[int], None]) -> onnx.ModelProto:
    refuse_quantized(loaded)
    return build_gemma3_graph(loaded.config, loaded.weights, progress=progress)


FAMILY = register(Family(
    model_types=("gemma3_text", "gemma3"),
    config_from_hf=config_from_hf,
    expected_names=expected_names,
    build_graph=build_graph,
    random_weights=random_weights,
    architectures={"Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3"},
    synthetic={
        # Five sliding layers (window 32, their own RoPE base) per global one, as Gemma 3 interleaves them; heads
        # of 32 (the CPU kernel's multiple of 16), queries scaled by 1/sqrt(24), logits soft-capped at 30.
        "tiny-gemma3": {"model": "gemma3", "num_hidden_layers": 6, "head_dim": 32, "qk_norm": True,
                        "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rope_local_theta": 10_000.0,
                        "sliding_window": 32, "sliding_window_layers": [0, 1, 2, 3, 4],
                        "query_pre_attn_scalar": 24.0, "final_logit_softcapping": 30.0},
    },
    checkpoint_name=checkpoint_name,
    gguf_architectures=("gemma3",),  # llama.cpp's text-only Gemma 3 files (sources/gguf.py maps the implicit fields)
    takes_blocks=False,
))
