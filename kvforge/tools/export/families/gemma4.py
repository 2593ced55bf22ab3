"""Gemma 4 (HF `gemma4_text`, and the text model of a multimodal `gemma4` dir), registered once: its decoder as an
ONNX graph over the paged-KV ops, global layers with heads of their own size included, and one-line refusals naming
the fields of what the runtime cannot hold yet."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from kvforge.contract.engine_dir import PER_LAYER_INPUT
from kvforge.contract.model_config import ModelConfig
from kvforge.graph.onnx_graph import FLOAT, GraphWriter, value_info
from kvforge.graph.rope import apply_rope
from kvforge.plugins import ops
from kvforge.tools.export.families import gemma3
from kvforge.tools.export.families.gemma3 import (
    GELU_TANH,
    check_hf_fields,
    frequency_delta,
    gelu_tanh,
    graph_end,
    graph_start,
    inverse_frequencies,
    layer_types,
    refuse_quantized,
    sandwich_layer,
    text_config,
)
from kvforge.tools.export.families.llama import (
    POOL_ELEM_TYPES,
    LoraActivation,
    LoraInputs,
    pool_input_name,
    pool_output_name,
)
from kvforge.tools.export.families.qwen3_5 import fused_linears, linear
from kvforge.tools.export.families.registry import Family, register

if TYPE_CHECKING:
    from kvforge.tools.export.sources.base import LoadedModel


# What differs from Gemma 3 (gemma3.py, whose RoPE pre-rotation and sliding windows it shares): plain-weight RMSNorms
# (x * w), a scale-free RMSNorm on each value head, attention without a query scale (the q/k norms replace it), a
# learned scalar multiplying each layer's output, proportional RoPE on the global layers (only the first
# `partial_rotary_factor` of the rotate-half frequencies turn; the rest stay still, which the pre-rotation expresses
# as a negative turn of the table's angle), KV shared between layers: the last `num_kv_shared_layers` layers
# project queries only and attend over the pool of the last earlier layer of their kind (ModelConfig.
# kv_source_layers; they get no pool), and per-layer embeddings (hidden_size_per_layer_input): each layer adds a
# gated projection of its slice of a per-layer input, the mean of the token's row of a second table (fed by the
# runtime as PER_LAYER_INPUT, since the graph gets embedding rows, not token ids) and a projection of its
# embedding. Refused until the runtime has them: keys used as values (attention_k_eq_v) and the mixture-of-experts
# block.
#
# Global layers with heads of their own size (global_head_dim G, wider than the sliding layers' head_dim D; released
# checkpoints: 512 and 256) get pools of their own width: the pool is one array per layer already, so each layer's
# array takes its layer's head size (ModelConfig.layer_head_dim) and page copies, snapshots and the shared tier,
# which go layer by layer, carry them as they are; nothing is padded. (Padding every head to G would have cost the
# sliding layers twice their KV memory and attention work.) What needs care is RoPE: the runtime's one table is
# [capacity, D], and the K/V write (and the CPU kernel's fused PagedAttentionRope) rotates a head's first D dims
# as rotate-half pairs (i, i + D/2), while a G-wide head pairs (j, j + G/2). So a global layer's q and k are first
# turned in the graph by their own angle minus the table's (the pre-rotation above, over all G/2 pairs), then their
# dims are put in table order (table_order: the first D/2 pairs' two halves first, the other pairs after), where
# the table's turn lands on the right pairs (the write op's rotary_dim D passes the rest). q and k share that
# order, so every q . k is unchanged; values keep theirs, so the attention output needs no undoing.


def rope_delta_frequencies(config: ModelConfig, sliding: bool) -> np.ndarray | None:
    """The extra rotation of a Gemma 4 layer type: sliding layers turn with the local base; global layers with
    rope_theta on their first rope_proportion of frequencies (proportional RoPE: the others do not turn)."""
    if sliding:
        return frequency_delta(config, inverse_frequencies(config, config.rope_local_theta or config.rope_theta))
    size = config.global_head_dim or config.head_dim
    own = inverse_frequencies(config, config.rope_theta, size)
    if config.rope_proportion:
        own[int(config.rope_proportion * size // 2):] = 0.0  # transformers' int(p * D // 2) turning
    if size == config.head_dim:
        return frequency_delta(config, own)
    table = np.zeros_like(own)  # a wider head: the table turns its first rotary_dim / 2 pairs only (table_order)
    table[:config.rotary_dim // 2] = inverse_frequencies(config, config.rope_theta)[:config.rotary_dim // 2]
    return (own - table).astype(np.float32)


def table_order(head_dim: int, table_dims: int) -> np.ndarray:
    """The dim order of a head wider than the RoPE table: the rotate-half pairs (j, j + head_dim/2) the table turns
    (j < table_dims/2) as the table's pairs (i, i + table_dims/2) over the first table_dims dims, the others after."""
    half, turned = head_dim // 2, table_dims // 2
    return np.concatenate([np.arange(turned), half + np.arange(turned), np.arange(turned, half),
                           half + np.arange(turned, half)])


def _in_table_order(g: GraphWriter, x: str, heads: int, head_dim: int, table_dims: int) -> str:
    order = g.const(table_order(head_dim, table_dims))
    return g.reshape(g.op("Gather", [g.reshape(x, [0, 0, heads, head_dim]), order], axis=3), [0, 0, heads * head_dim])


def _weight(g: GraphWriter, weights: dict[str, np.ndarray], name: str) -> str:
    return g.weight(name, weights[name].astype(np.float32))


def _head_norm(g: GraphWriter, x: str, heads: int, head_dim: int, weight: str, eps: float) -> str:
    return g.reshape(g.rms_norm(g.reshape(x, [0, 0, heads, head_dim]), weight, eps), [0, 0, heads * head_dim])


def _attention(g: GraphWriter, config: ModelConfig, weights: dict[str, np.ndarray], layer: int, x: str,
               rope: tuple[str, str], extra: dict[bool, tuple[str, str] | None], inputs: list, outputs: list,
               lora: LoraInputs) -> str:
    p = f"model.layers.{layer}.self_attn."
    num_q, num_kv, head_dim, eps = config.num_attention_heads, config.num_key_value_heads, \
        config.layer_head_dim(layer), config.rms_norm_eps
    sliding = layer in config.sliding_window_layers
    # A global head wider than the table: q and k in table order, the table turning their first rotary_dim dims.
    table_dims = config.rotary_dim if head_dim != config.head_dim else 0
    source = config.kv_source_layers[layer] if config.kv_source_layers else layer

    def own_rotation(x: str, heads: int) -> str:  # the layer type's extra angle; the table's rotation follows
        x = x if extra[sliding] is None else apply_rope(g, x, heads, head_dim, *extra[sliding])
        return _in_table_order(g, x, heads, head_dim, table_dims) if table_dims else x

    if source != layer:  # a KV-shared layer: its query attends over the source layer's pool, written this call
        q = _head_norm(g, lora.apply(g, "q", x, linear(g, weights, x, p + "q_proj.weight")), num_q, head_dim,
                       _weight(g, weights, p + "q_norm.weight"), eps)
    else:
        q, k, v = fused_linears(g, weights, x, [p + f"{n}_proj.weight" for n in "qkv"], p + "qkv")
        q, k, v = (lora.apply(g, target, x, y) for target, y in zip("qkv", (q, k, v), strict=True))
        q = _head_norm(g, q, num_q, head_dim, _weight(g, weights, p + "q_norm.weight"), eps)
        k = own_rotation(_head_norm(g, k, num_kv, head_dim, _weight(g, weights, p + "k_norm.weight"), eps), num_kv)
        v = _head_norm(g, v, num_kv, head_dim, g.const(np.float32(1.0), np.float32), eps)  # v_norm has no scale
    q = apply_rope(g, own_rotation(q, num_q), num_q, head_dim, *rope, rotary_dim=table_dims)
    if source == layer:
        pool_in = pool_input_name(layer)
        pool_shape = ["num_pages", 2, num_kv, "tokens_per_page", head_dim]
        inputs.append(value_info(pool_in, POOL_ELEM_TYPES[config.kv_cache_dtype], pool_shape))
        outputs.append(value_info(pool_output_name(layer), POOL_ELEM_TYPES[config.kv_cache_dtype], pool_shape))
        g.op(ops.PAGED_KV_WRITE.name, [k, v, "rope_rotary_cos_sin", "context_lengths", "kvcache_start_index",
                                       "kv_page_table", pool_in],
             outputs=[pool_output_name(layer)], domain=ops.DOMAIN, name=f"paged_kv_write_{layer}",
             num_kv_heads=num_kv, head_dim=head_dim, tokens_per_page=0,
             **({"rotary_dim": table_dims} if table_dims else {}))
    pool_out = pool_output_name(source)
    window = {"sliding_window": config.sliding_window} if sliding else {}
    attn = g.op(ops.PAGED_ATTENTION.name, [q, pool_out, "context_lengths", "kvcache_start_index", "kv_page_table"],
                domain=ops.DOMAIN, name=f"paged_attention_{layer}", num_q_heads=num_q, num_kv_heads=num_kv,
                head_dim=head_dim, tokens_per_page=0, scale=1.0, **window)
    return lora.apply(g, "o", attn, linear(g, weights, attn, p + "o_proj.weight"))


def _per_layer_inputs(g: GraphWriter, config: ModelConfig, weights: dict[str, np.ndarray], embeds: str) -> list[str]:
    """Each layer's per-layer input [B, S, P]: (RMSNorm(embeds @ W / sqrt(H)) + row * sqrt(P)) / sqrt(2), per layer
    (transformers' project_per_layer_inputs over get_per_layer_inputs); `embeds` are the scaled embeddings."""
    layers, width = config.num_hidden_layers, config.hidden_size_per_layer_input
    packed = [0, 0, layers, width]
    projected = linear(g, weights, embeds, "model.per_layer_model_projection.weight")
    projected = g.mul(projected, g.const(np.float32(config.hidden_size ** -0.5), np.float32))
    projected = g.rms_norm(g.reshape(projected, packed), _weight(g, weights, "model.per_layer_projection_norm.weight"),
                           config.rms_norm_eps)
    rows = g.reshape(g.mul(PER_LAYER_INPUT, g.const(np.float32(width ** 0.5), np.float32)), packed)
    combined = g.mul(g.add(projected, rows), g.const(np.float32(2.0 ** -0.5), np.float32))
    slices = g.op("Split", [combined], n_out=layers, axis=2, num_outputs=layers) if layers > 1 else [combined]
    return [g.op("Squeeze", [part, g.const([2])]) for part in slices]


def _per_layer_block(g: GraphWriter, config: ModelConfig, weights: dict[str, np.ndarray], layer: int, hidden: str,
                     per_layer: str) -> str:
    """A decoder layer's last residual: RMSNorm(gelu(h @ gate) * per_layer @ projection), added to h."""
    p = f"model.layers.{layer}."
    gated = g.mul(gelu_tanh(g, linear(g, weights, hidden, p + "per_layer_input_gate.weight")), per_layer)
    projected = linear(g, weights, gated, p + "per_layer_projection.weight")
    return g.add(hidden, g.rms_norm(projected, _weight(g, weights, p + "post_per_layer_input_norm.weight"),
                                    config.rms_norm_eps))


def build_gemma4_graph(config: ModelConfig, weights: dict[str, np.ndarray],
                       progress: Callable[[int], None] | None = None) -> onnx.ModelProto:
    """The llama graph's contract, as gemma3.build_gemma3_graph (embedding rows come in unscaled)."""
    g = GraphWriter()
    rope, extra, inputs, outputs, hidden = graph_start(g, config, rope_delta_frequencies)
    per_layer: list[str] = []
    if config.hidden_size_per_layer_input:
        inputs.append(value_info(PER_LAYER_INPUT, FLOAT, ["batch", "seq", config.num_hidden_layers *
                                                          config.hidden_size_per_layer_input]))
        per_layer = _per_layer_inputs(g, config, weights, hidden)
    activation = LoraActivation(inputs)  # adds its input only when a LoRA target is exported
    layer_outputs = []
    for layer in range(config.num_hidden_layers):
        lora = LoraInputs(config, layer, inputs, activation)  # KV-shared layers: q and o only (lora_inputs)
        hidden = sandwich_layer(g, config, weights, layer, hidden, _weight, lambda x, layer=layer, lora=lora:
                                _attention(g, config, weights, layer, x, rope, extra, inputs, outputs, lora), lora)
        if per_layer:
            hidden = _per_layer_block(g, config, weights, layer, hidden, per_layer[layer])
        hidden = g.mul(hidden, _weight(g, weights, f"model.layers.{layer}.layer_scalar"))
        layer_outputs.append(hidden)
        if progress:
            progress(layer)
    return graph_end(g, config, weights, hidden, layer_outputs, inputs, outputs, _weight, "kvforge_gemma4")


# ---------------------------------------------------------------------------------------------------- the family

_LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
                  "post_feedforward_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                  "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                  "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                  "layer_scalar")
_OWN_KV_TENSORS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")
_PER_LAYER_TENSORS = ("per_layer_input_gate.weight", "per_layer_projection.weight", "post_per_layer_input_norm.weight")
_PER_LAYER_MODEL_TENSORS = ("model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight",
                            "model.per_layer_projection_norm.weight")


def kv_sources(types: list[str], shared: int) -> list[int]:
    """Per layer, the layer whose pool it reads: itself, or for the last `shared` layers the last earlier layer of
    its kind (transformers' kv_sharing_modes: that layer "stores" its full-length K/V); [] when none is shared."""
    if not shared:
        return []
    first = len(types) - shared
    producers = {t: max((i for i in range(first) if types[i] == t), default=None) for t in set(types[first:])}
    missing = sorted(t for t, i in producers.items() if i is None)
    if missing or first <= 0:
        raise ValueError(f"num_kv_shared_layers={shared}: no earlier {missing[0] if missing else 'layer'} layer "
                         "to share K/V from")
    return [i if i < first else producers[t] for i, t in enumerate(types)]


def global_head_dim(hf: dict[str, Any], types: list[str], head_dim: int, kv_heads: int) -> int:
    """The global layers' head size: from transformers' saved per_layer_config (per-layer overrides, which it
    prefers), else the flat global_head_dim (default 512). What the export cannot hold is refused: global layers of
    several sizes or narrower than head_dim, and any other per-layer override."""
    per_layer = hf.get("per_layer_config")
    if not isinstance(per_layer, dict):
        sizes = {int(hf.get("global_head_dim") or 512)} if "full_attention" in types else set()
    else:
        sizes = set()
        for i, kind in enumerate(types):
            override = per_layer.get(str(i), {})
            if not isinstance(override, dict) or set(override) - {"head_dim", "num_key_value_heads"} or \
                    int(override.get("num_key_value_heads") or kv_heads) != kv_heads or \
                    (kind != "full_attention" and int(override.get("head_dim") or head_dim) != head_dim):
                raise ValueError(f"per_layer_config: layer {i}'s {override!r} is not supported (only the global "
                                 "layers' head_dim may differ)")
            if kind == "full_attention":
                sizes.add(int(override.get("head_dim") or head_dim))
    if len(sizes) > 1 or min(sizes, default=head_dim) < head_dim:
        raise ValueError(f"global_head_dim={sorted(sizes)} is not supported (one global head size, at least head_dim "
                         f"{head_dim})")
    return sizes.pop() if sizes else head_dim


def rope_bases(hf: dict[str, Any]) -> tuple[float, float, float]:
    """(global base, local base, the global layers' rotating fraction or 0) from rope_parameters."""
    params = hf.get("rope_parameters") or {}
    full = params.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1_000_000.0}
    local = params.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0}
    for kind, values, allowed in (("full_attention", full, ("default", "proportional")),
                                  ("sliding_attention", local, ("default",))):
        rope_type = values.get("rope_type", "default")
        if rope_type not in allowed or float(values.get("factor", 1.0)) != 1.0:
            raise ValueError(f"rope_parameters: {kind} rope_type {rope_type!r} (factor {values.get('factor', 1.0)})"
                             f" is not supported (only {' or '.join(allowed)}, unscaled)")
    proportion = float(full.get("partial_rotary_factor", 1.0)) if full.get("rope_type") == "proportional" else 0.0
    return float(full.get("rope_theta", 1_000_000.0)), float(local.get("rope_theta", 10_000.0)), \
        0.0 if proportion == 1.0 else proportion


def config_from_hf(hf: dict[str, Any], **common: Any) -> ModelConfig:
    """ModelConfig of an HF Gemma 4 text config (`common`: tokens, name, kv dtype: what every family shares)."""
    hf = text_config(hf)
    layers = int(hf["num_hidden_layers"])
    types = layer_types(hf, layers)
    head_dim = int(hf.get("head_dim") or 256)
    per_layer = int(hf.get("hidden_size_per_layer_input", 256) or 0)
    vocab = int(hf["vocab_size"])
    per_layer_vocab = int(hf.get("vocab_size_per_layer_input") or vocab)
    refusals = (("vocab_size_per_layer_input", per_layer and per_layer_vocab < vocab,
                 f"the per-layer table is looked up by every token id of the embedding's {vocab}"),
                ("attention_k_eq_v", bool(hf.get("attention_k_eq_v")), "keys used as values are not exported"),
                ("enable_moe_block", bool(hf.get("enable_moe_block")), "the mixture-of-experts block is not exported"),
                ("use_bidirectional_attention", bool(hf.get("use_bidirectional_attention")), "causal only"),
                ("attention_bias", bool(hf.get("attention_bias")), "no projection biases"))
    for name, refused, why in refusals:
        if refused:
            raise ValueError(f"{name}={hf.get(name)!r} is not supported yet ({why})")
    activation = hf.get("hidden_activation") or GELU_TANH[0]
    if activation not in GELU_TANH:
        raise ValueError(f"hidden_activation {activation!r} is not supported (only {GELU_TANH[0]})")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    check_hf_fields(hf, bool(sliding), ("default",))  # rope_parameters alone carries Gemma 4's RoPE
    theta, local_theta, proportion = rope_bases(hf)
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    global_dim = global_head_dim(hf, types, head_dim, kv_heads)
    return ModelConfig(
        model="gemma4", vocab_size=vocab, hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)), rope_theta=theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qk_norm=True, sliding_window=int(hf.get("sliding_window") or 512) if sliding else 0,
        sliding_window_layers=sliding, rope_local_theta=local_theta if sliding else 0.0, rope_proportion=proportion,
        global_head_dim=global_dim if global_dim != head_dim else 0,
        kv_source_layers=kv_sources(types, int(hf.get("num_kv_shared_layers") or 0)),
        final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0), hidden_size_per_layer_input=per_layer,
        **common)


_SKIPPED_PREFIXES = ("model.audio_tower.", "model.embed_vision.", "model.embed_audio.")  # beside gemma3's vision tower


def checkpoint_name(name: str) -> str | None:
    """The kvforge weight name of a checkpoint tensor (None: the vision and audio towers and their embedders)."""
    return None if name.startswith(_SKIPPED_PREFIXES) else gemma3.checkpoint_name(name)


def expected_names(config: ModelConfig) -> list[str]:
    """A KV-shared layer (kv_source_layers) has no k/v projections or k norm."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    owners = set(config.attention_layer_ids)
    layer_tensors = _LAYER_TENSORS + (_PER_LAYER_TENSORS if config.hidden_size_per_layer_input else ())
    if config.hidden_size_per_layer_input:
        names += _PER_LAYER_MODEL_TENSORS
    return names + [f"model.layers.{i}.{t}" for i in range(config.num_hidden_layers) for t in layer_tensors
                    if i in owners or t not in _OWN_KV_TENSORS]


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Tiny random Gemma 4 weights in transformers' layout, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    hidden, inter = config.hidden_size, config.intermediate_size

    def dense(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:  # plain weights: the graph multiplies by w
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    weights = {"model.embed_tokens.weight": (rng.standard_normal((config.vocab_size, hidden))
                                             / np.sqrt(hidden)).astype(np.float32),
               "model.norm.weight": norm(hidden)}
    for i in range(config.num_hidden_layers):
        p, head_dim = f"model.layers.{i}.", config.layer_head_dim(i)
        q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        weights.update({p + n: norm(hidden) for n in _LAYER_TENSORS[:4]})
        weights.update({p + "self_attn.q_proj.weight": dense(q_out, hidden),
                        p + "self_attn.k_proj.weight": dense(kv_out, hidden),
                        p + "self_attn.v_proj.weight": dense(kv_out, hidden),
                        p + "self_attn.o_proj.weight": dense(hidden, q_out),
                        p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
                        p + "mlp.gate_proj.weight": dense(inter, hidden),
                        p + "mlp.up_proj.weight": dense(inter, hidden),
                        p + "mlp.down_proj.weight": dense(hidden, inter),
                        p + "layer_scalar": np.array([0.5 + rng.random()], np.float32)})
        if i not in config.attention_layer_ids:
            for name in _OWN_KV_TENSORS:
                del weights[p + name]
        if config.hidden_size_per_layer_input:
            width = config.hidden_size_per_layer_input
            weights.update({p + "per_layer_input_gate.weight": dense(width, hidden),
                            p + "per_layer_projection.weight": dense(hidden, width),
                            p + "post_per_layer_input_norm.weight": norm(hidden)})
    if config.hidden_size_per_layer_input:
        packed = config.num_hidden_layers * config.hidden_size_per_layer_input
        weights.update({"model.embed_tokens_per_layer.weight": (rng.standard_normal((config.vocab_size, packed))
                                                                / np.sqrt(config.hidden_size_per_layer_input))
                        .astype(np.float32),
                        "model.per_layer_model_projection.weight": dense(packed, hidden),
                        "model.per_layer_projection_norm.weight": norm(config.hidden_size_per_layer_input)})
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = dense(config.vocab_size, hidden)
    return weights


MLP_TARGETS = ("gate", "up", "down")


def build_graph(loaded: LoadedModel, progress: Callable[[int], None]) -> onnx.ModelProto:
    refuse_quantized(loaded)
    config = loaded.config
    double_wide = [i for i in range(config.num_hidden_layers)
                   if loaded.weights[f"model.layers.{i}.mlp.up_proj.weight"].shape[0] != config.intermediate_size]
    if double_wide and set(config.lora_targets) & set(MLP_TARGETS):
        # use_double_wide_mlp doubles the KV-shared layers' MLPs, a width config.json does not record, so the LoRA
        # contract (target_dims) cannot size their gate/up/down inputs: those targets are left out of the export
        # (as the writer leaves a family without LoRA inputs), and an adapter for them is refused at conversion.
        config.lora_targets = [t for t in config.lora_targets if t not in MLP_TARGETS]
    return build_gemma4_graph(config, loaded.weights, progress=progress)


FAMILY = register(Family(
    model_types=("gemma4_text", "gemma4"),
    config_from_hf=config_from_hf,
    expected_names=expected_names,
    build_graph=build_graph,
    random_weights=random_weights,
    architectures={"Gemma4ForCausalLM": "gemma4_text", "Gemma4ForConditionalGeneration": "gemma4"},
    synthetic={
        # Gemma 4's 5:1 sliding (window 32) and global layers, global RoPE turning a quarter of its frequencies.
        "tiny-gemma4": {"model": "gemma4", "num_hidden_layers": 6, "head_dim": 32, "qk_norm": True,
                        "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rope_local_theta": 10_000.0,
                        "rope_proportion": 0.25, "sliding_window": 32, "sliding_window_layers": [0, 1, 2, 3, 4],
                        "final_logit_softcapping": 30.0},
        # The same with per-layer embeddings 8 wide (the E2B/E4B models' feature).
        "tiny-gemma4-ple": {"model": "gemma4", "num_hidden_layers": 6, "head_dim": 32, "qk_norm": True,
                            "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rope_local_theta": 10_000.0,
                            "rope_proportion": 0.25, "sliding_window": 32, "sliding_window_layers": [0, 1, 2, 3, 4],
                            "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 8},
        # The global layer's heads twice as wide as the sliding ones' (released checkpoints: 512 and 256).
        "tiny-gemma4-wide": {"model": "gemma4", "num_hidden_layers": 6, "head_dim": 16, "global_head_dim": 32,
                             "qk_norm": True, "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
                             "rope_local_theta": 10_000.0, "rope_proportion": 0.25, "sliding_window": 32,
                             "sliding_window_layers": [0, 1, 2, 3, 4], "final_logit_softcapping": 30.0},
    },
    checkpoint_name=checkpoint_name,
))
