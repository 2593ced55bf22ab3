"""Gemma4 MTP assistants (`Gemma4AssistantForCausalLM`): their Hugging Face format to an ONNX dir whose layers
read the base's KV pools.

The assistant (transformers `gemma4_assistant`, vLLM `gemma4_mtp`) drafts one token per call from the base's last
hidden state. Its `pre_projection` maps `concat(base input embedding of the token, hidden)` (2 x backbone width) to
its own width; every decoder layer is KV-shared: a query projection with q_norm and RoPE, attention over the K/V
the base wrote into its own pool (no K/V projection, nothing written), then Gemma's four norms around attention and
a GELU-tanh MLP, times the layer's scalar. `norm`, then logits: the tied head, or centroid-sparse ones
(`masked_embedding`: the top-k centroids of the normed state select k x V/C vocabulary rows, the rest get the
row's lowest selected logit minus 1). `post_projection` maps the normed state back to the backbone width: the
hidden input of the next drafting step.

Within one round every step's query sits at the pending token's position C and sees the base's positions
[0, C) only (transformers' candidate generator keeps position_ids constant; the drafted tokens get no K/V). The
engine graph attends with the kvforge CPU kernel over the pool without writing (kvforge/builder/lower_ort.py). Its
`hidden_states` output is the projected state [N, backbone width].

The base feeds the *normed* last hidden state (transformers' hidden_states[-1]): kvforge bases return layer
outputs before the final norm, so the graph keeps EAGLE3's two hidden inputs, as Qwen3.5's MTP layer does: the
base's state (the round's first step, through a copy of the base's final norm) and the draft's own projected state
(the later steps), zeros in the one a call does not use.

Over a Gemma 4 base (kvforge/tools/export/families/gemma4.py) the assistant's layers are of both kinds, as the base's: a
sliding layer reads the base's last sliding layer that has its own pool, a global layer the last global one
(transformers' kv_sharing_modes "store"); each turns its query by the base's RoPE of its kind, and the base's
embedding rows are scaled by sqrt(backbone width) as Gemma's embedding is. A sliding layer's window is
transformers' bidirectional one seen from the query's side: the last sliding_window + 1 positions before C.

What the exporter refuses (one line each): a layer kind the base has no layer of, RoPE or a window other than the
base's, a query head width other than the base's head_dim, per-layer inputs, MoE and double-wide MLPs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper
from safetensors import safe_open
from safetensors.numpy import save_file

from kvforge.contract.engine_dir import DRAFT_HIDDEN_INPUT, HIDDEN_STATES
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import read_json, write_json
from kvforge.contract.model_config import SPEC_GEMMA4_MTP, ModelConfig
from kvforge.contract.speculation import SPEC_SUPPORT, base_kind
from kvforge.graph.onnx_graph import FLOAT, OPSET, GraphWriter, value_info
from kvforge.graph.positions import NUM_POSITIONS, gather_positions, logits_output
from kvforge.graph.rope import apply_rope
from kvforge.plugins import ops
from kvforge.tools.export.drafts.common import (
    base_embedding,
    base_final_norm,
    check_base_layers,
    draft_graph_inputs,
    normed_hidden_input,
    open_draft_export,
    weight_ops,
    write_draft_dir,
)
from kvforge.tools.export.families import gemma4
from kvforge.tools.export.families.gemma3 import delta_rope
from kvforge.tools.export.families.llama import POOL_ELEM_TYPES, pool_input_name, rope_inputs
from kvforge.tools.export.sources.hf_common import read_safetensors_header, read_tensor, safetensors_files

ARCHITECTURE = "Gemma4AssistantForCausalLM"
MODEL_TYPE = "gemma4_assistant"
FIELD = "--draftDir"
_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
          "post_feedforward_layernorm.weight", "self_attn.q_proj.weight", "self_attn.q_norm.weight",
          "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
          "layer_scalar")
_TOP = ("model.norm.weight", "model.embed_tokens.weight", "pre_projection.weight", "post_projection.weight")
_CENTROIDS = ("masked_embedding.centroids.weight", "masked_embedding.token_ordering")
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def is_gemma4_assistant(path: Path) -> bool:
    """Whether `path` holds a Gemma4 assistant checkpoint (config.json's model_type or architecture)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    hf = read_json(config, FIELD)
    return hf.get("model_type") == MODEL_TYPE or ARCHITECTURE in (hf.get("architectures") or [])


SLIDING, FULL = "sliding_attention", "full_attention"


def base_producers(base: ModelConfig) -> dict[str, int]:
    """Per layer kind, the base layer an assistant layer of that kind reads: the last one with its own pool."""
    sliding = set(base.sliding_window_layers)
    return {SLIDING if layer in sliding else FULL: layer for layer in base.attention_layer_ids}


def _rope_fits(text: dict[str, Any], base: ModelConfig, kinds: set[str]) -> tuple[bool, str]:
    """Whether the assistant turns queries as the base does on each kind of layer it has (and why not)."""
    if base.model != "gemma4":
        rope = (text.get("rope_parameters") or {}).get(FULL) or {}
        return (rope.get("rope_type", "default") == "default" and float(rope.get("rope_theta", -1)) == base.rope_theta
                and base.partial_rotary_factor == 1.0,
                f"full-attention RoPE {rope or 'unset'} vs the base's (default, theta {base.rope_theta})")
    try:
        theta, local, proportion = gemma4.rope_bases(text)
    except ValueError as exc:
        return False, str(exc)
    ok = (theta, proportion) == (base.rope_theta, base.rope_proportion) and \
        (SLIDING not in kinds or local == base.rope_local_theta)
    return ok, (f"RoPE (global {theta}, local {local}, proportion {proportion}) vs the base's (global "
                f"{base.rope_theta}, local {base.rope_local_theta}, proportion {base.rope_proportion})")


def assistant_config(hf: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The assistant's ModelConfig over `base`, every Gemma4 feature the graph does not implement refused."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise KvforgeError("config.json has no text_config object (a gemma4_assistant checkpoint has one)", FIELD)
    if base_kind(base.is_recurrent, base.is_hybrid) not in SPEC_SUPPORT[SPEC_GEMMA4_MTP].bases:  # the support table
        raise KvforgeError(f"a Gemma4 assistant reads an attention-only base's K/V; {base.model} has recurrent "
                           "layers", "--baseOnnxDir")

    def need(name: str, where: dict[str, Any] = text) -> Any:
        if name not in where:
            raise KvforgeError(f"config.json lacks {name}", FIELD)
        return where[name]

    layers = int(need("num_hidden_layers"))
    types = text.get("layer_types") or [FULL] * layers
    producers = base_producers(base)
    missing = [t for t in types if t not in producers]
    if missing or len(types) != layers:
        kind = missing[0] if missing else f"{len(types)} layer_types for {layers} layers"
        raise KvforgeError(f"{str(kind).replace('_', '-')} assistant layers read the base's last layer of that kind, "
                           f"and this {base.model} base has none (its kinds: {', '.join(sorted(producers))})", FIELD)
    dims = {int(need("head_dim")) if t == SLIDING else int(text.get("global_head_dim") or need("head_dim"))
            for t in types}
    rope_ok, rope_why = _rope_fits(text, base, set(types))
    window = int(text.get("sliding_window") or 0)
    checks = [
        (int(need("backbone_hidden_size", hf)) == base.hidden_size,
         f"backbone_hidden_size {hf.get('backbone_hidden_size')} vs the base's hidden_size {base.hidden_size}"),
        (int(need("vocab_size")) == base.vocab_size, f"vocab_size {text.get('vocab_size')} vs {base.vocab_size}"),
        (dims == {base.head_dim} and not base.global_head_dim,
         f"head_dim {sorted(dims)} vs the base's {base.head_dim} (global: {base.global_head_dim or 'the same'})"),
        (int(need("num_attention_heads")) % base.num_key_value_heads == 0,
         f"{text.get('num_attention_heads')} query heads over the base's {base.num_key_value_heads} K/V heads"),
        (rope_ok, rope_why),
        (SLIDING not in types or window == base.sliding_window,
         f"sliding_window {window} vs the base's {base.sliding_window}"),
        (text.get("hidden_activation", "gelu_pytorch_tanh") in _GELU_TANH,
         f"hidden_activation {text.get('hidden_activation')!r} (a GELU-tanh MLP)"),
        (not text.get("hidden_size_per_layer_input") and not text.get("enable_moe_block")
         and not text.get("use_double_wide_mlp") and not text.get("attention_bias"),
         "per-layer inputs, MoE blocks, double-wide MLPs and attention biases are not assistant features"),
    ]
    for ok, message in checks:
        if not ok:
            raise KvforgeError(f"this assistant does not fit the base: {message}", FIELD)
    centroids = int(hf.get("num_centroids", 0)) if hf.get("use_ordered_embeddings") else 0
    config = ModelConfig(
        model=MODEL_TYPE, vocab_size=base.vocab_size, hidden_size=int(need("hidden_size")),
        intermediate_size=int(need("intermediate_size")), num_hidden_layers=layers,
        num_attention_heads=int(text["num_attention_heads"]), num_key_value_heads=base.num_key_value_heads,
        head_dim=base.head_dim, max_position_embeddings=base.max_position_embeddings, rope_theta=base.rope_theta,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), tie_word_embeddings=True,
        kv_cache_dtype=base.kv_cache_dtype, bos_token_id=base.bos_token_id, eos_token_ids=list(base.eos_token_ids),
        pad_token_id=base.pad_token_id, name=str(hf.get("_name_or_path", "")),
        hidden_state_layers=[layers - 1], spec_decode_type=SPEC_GEMMA4_MTP,
        base_model_hidden_size=base.hidden_size, eagle_hidden_state_layers=[base.num_hidden_layers - 1],
        kv_shared_layers=[producers[t] for t in types], num_centroids=centroids,
        centroid_top_k=int(hf.get("centroid_intermediate_top_k", 0)) if centroids else 0)
    config.validate()
    return config


def load_weights(path: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """The assistant's tensors as float32 (token_ordering as int64); a missing or misshapen one is one line."""
    tensors: dict[str, tuple[Path, dict[str, Any], int]] = {}
    for file in safetensors_files(path):
        header, start = read_safetensors_header(file)
        for name, entry in header.items():
            tensors[name] = (file, entry, start)
    names = [f"model.layers.{i}.{suffix}" for i in range(config.num_hidden_layers) for suffix in _LAYER]
    names += list(_TOP) + (list(_CENTROIDS) if config.num_centroids else [])
    missing = [n for n in names if n not in tensors]
    if missing:
        raise KvforgeError(f"assistant checkpoint in {path} lacks tensor {missing[0]} ({len(missing)} missing)", FIELD)
    unexpected = sorted(n for n in tensors if n not in {*names, *_CENTROIDS, "lm_head.weight"})
    if unexpected:  # a K/V projection, a sliding layer's or MoE weights: math this graph does not implement
        raise KvforgeError(f"assistant checkpoint in {path} has tensor {unexpected[0]} this loader does not handle",
                           FIELD)
    out = {}
    for name in names:
        file, entry, start = tensors[name]
        if name.endswith("token_ordering"):
            with safe_open(str(file), framework="numpy") as f:
                out[name] = np.asarray(f.get_tensor(name), dtype=np.int64)
        else:
            out[name] = read_tensor(file, name, entry, start).astype(np.float32)
    H, Hb, D = config.hidden_size, config.base_model_hidden_size, config.head_dim
    shapes = {"pre_projection.weight": (H, 2 * Hb), "post_projection.weight": (Hb, H),
              "model.embed_tokens.weight": (config.vocab_size, H)}
    for i in range(config.num_hidden_layers):
        shapes |= {f"model.layers.{i}.self_attn.q_proj.weight": (config.num_attention_heads * D, H),
                   f"model.layers.{i}.self_attn.o_proj.weight": (H, config.num_attention_heads * D)}
    for name, shape in shapes.items():
        if out[name].shape != shape:
            raise KvforgeError(f"tensor {name} is {list(out[name].shape)}, the config implies {list(shape)}", FIELD)
    if config.num_centroids:
        ordering = out["masked_embedding.token_ordering"]
        if sorted(ordering.tolist()) != list(range(config.vocab_size)):
            raise KvforgeError("masked_embedding.token_ordering is not a permutation of the vocabulary", FIELD)
    return out


def _gelu_tanh(g: GraphWriter, x: str) -> str:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): opset 19 has no Gelu."""
    cube = g.mul(g.mul(x, x), x)
    inner = g.mul(g.add(x, g.mul(cube, g.const(0.044715, np.float32))), g.const(np.sqrt(2 / np.pi), np.float32))
    return g.mul(g.mul(x, g.const(0.5, np.float32)),
                 g.add(g.op("Tanh", [inner]), g.const(1.0, np.float32)))


def build_assistant_graph(config: ModelConfig, weights: dict[str, np.ndarray],
                          base_norm: tuple[np.ndarray, float], base: ModelConfig | None = None) -> onnx.ModelProto:
    """The assistant as an engine graph (see the module docstring): logits [N, V] and the projected state [N, Hb]
    at logits_indices. `base`: the base's config, which a Gemma 4 base's RoPE, windows and embedding scale need."""
    g = GraphWriter()
    gemma_base = base is not None and base.model == "gemma4"
    sliding_layers = set(base.sliding_window_layers) if base is not None else set()
    extra: dict[bool, tuple[str, str] | None] = {True: None, False: None}
    if gemma_base:  # the base's extra turn of each layer kind, before the table's (gemma4.build_gemma4_graph)
        for sliding, name in ((True, "rope_sliding_delta_inv_freq"), (False, "rope_full_delta_inv_freq")):
            delta = gemma4.rope_delta_frequencies(base, sliding)  # type: ignore[arg-type]
            extra[sliding] = None if delta is None else delta_rope(g, "inputs_embeds", delta, name)
    H, heads, kv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps
    rope_cos, rope_sin = rope_inputs(g, "inputs_embeds")

    w, linear = weight_ops(g, weights)

    inputs = draft_graph_inputs(config, DRAFT_HIDDEN_INPUT, config.base_model_hidden_size)
    pool_shape = ["num_pages", 2, kv, "tokens_per_page", D]
    for layer in sorted(set(config.kv_shared_layers)):
        inputs.append(value_info(pool_input_name(layer), POOL_ELEM_TYPES[config.kv_cache_dtype], pool_shape))
    embeds = "inputs_embeds"
    if gemma_base:  # transformers hands the assistant the base's scaled embedding
        embeds = g.mul(embeds, g.const(np.float32(config.base_model_hidden_size ** 0.5), np.float32))
    h = linear(g.op("Concat", [embeds, normed_hidden_input(g, base_norm)], axis=-1), "pre_projection.weight")
    for i, base_layer in enumerate(config.kv_shared_layers):
        p = f"model.layers.{i}."
        sliding = base_layer in sliding_layers
        x = g.rms_norm(h, w(p + "input_layernorm.weight"), eps)
        q = linear(x, p + "self_attn.q_proj.weight")
        q = g.reshape(g.rms_norm(g.reshape(q, [0, 0, heads, D]), w(p + "self_attn.q_norm.weight"), eps),
                      [0, 0, heads * D])
        if extra[sliding] is not None:
            q = apply_rope(g, q, heads, D, *extra[sliding])  # type: ignore[misc]
        q = apply_rope(g, q, heads, D, rope_cos, rope_sin)
        # transformers sees the last window + 1 keys before C; a window here also counts C, which holds no key: + 2.
        window = {"sliding_window": base.sliding_window + 2} if sliding else {}  # type: ignore[union-attr]
        attn = g.op(ops.PAGED_ATTENTION.name, [q, pool_input_name(base_layer), "context_lengths",
                                               "kvcache_start_index", "kv_page_table"],
                    domain=ops.DOMAIN, name=f"paged_attention_{i}", num_q_heads=heads, num_kv_heads=kv, head_dim=D,
                    tokens_per_page=0, scale=1.0, **window)  # Gemma4: q_norm and k_norm instead of 1/sqrt(D)
        h = g.add(h, g.rms_norm(linear(attn, p + "self_attn.o_proj.weight"),
                                w(p + "post_attention_layernorm.weight"), eps))
        x = g.rms_norm(h, w(p + "pre_feedforward_layernorm.weight"), eps)
        mlp = g.mul(_gelu_tanh(g, linear(x, p + "mlp.gate_proj.weight")), linear(x, p + "mlp.up_proj.weight"))
        h = g.add(h, g.rms_norm(linear(mlp, p + "mlp.down_proj.weight"), w(p + "post_feedforward_layernorm.weight"),
                                eps))
        h = g.mul(h, w(p + "layer_scalar"))
    last = g.rms_norm(gather_positions(g, h, H), w("model.norm.weight"), eps)  # [N, H]
    head = g.weight("lm_head", weights["model.embed_tokens.weight"])  # [V, H]
    logits = _sparse_logits(g, last, head, config, weights) if config.num_centroids else \
        g.matmul(last, g.weight("lm_head_t", np.ascontiguousarray(weights["model.embed_tokens.weight"].T)))
    g.op("Identity", [logits], outputs=["logits"])
    g.op("Identity", [linear(last, "post_projection.weight")], outputs=[HIDDEN_STATES])
    outputs = [logits_output(config.vocab_size),
               value_info(HIDDEN_STATES, FLOAT, [NUM_POSITIONS, config.base_model_hidden_size])]
    graph = helper.make_graph(g.nodes, "kvforge_gemma4_assistant", inputs, outputs, g.initializers)
    return helper.make_model(graph, producer_name="kvforge", opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)])


def _sparse_logits(g: GraphWriter, last: str, head: str, config: ModelConfig, weights: dict[str, np.ndarray]) -> str:
    """Centroid-sparse logits [N, V]: k x V/C selected rows scored exactly, the others at the row's least selected
    logit minus 1 (transformers fills with the call's least; argmax and top-1 agree)."""
    per = config.vocab_size // config.num_centroids
    centroid = g.matmul(last, g.weight("centroids_t", np.ascontiguousarray(
        weights["masked_embedding.centroids.weight"].T)))  # [N, C]
    _, top = g.op("TopK", [centroid, g.const([config.centroid_top_k])], n_out=2, axis=-1)
    ordering = g.weight("token_ordering", weights["masked_embedding.token_ordering"].reshape(config.num_centroids,
                                                                                             per))
    ids = g.reshape(g.op("Gather", [ordering, top], axis=0), [0, -1])  # [N, k * V/C]
    rows = g.op("Gather", [head, ids], axis=0)  # [N, M, H]
    chosen = g.op("Squeeze", [g.matmul(rows, g.unsqueeze(last, [2])), g.const([2])])  # [N, M]
    floor = g.op("Sub", [g.op("ReduceMin", [chosen, g.const([1])], keepdims=1), g.const(1.0, np.float32)])
    shape = g.op("Concat", [g.dim(last, 0), g.const([config.vocab_size])], axis=0)
    return g.op("ScatterElements", [g.op("Expand", [floor, shape]), ids, chosen], axis=1)


def export_gemma4_assistant(draft_dir: Path, base_onnx_dir: Path, output_dir: Path) -> ModelConfig:
    """Write the assistant's ONNX dir: model.onnx, config.json, the base's embedding table and final norm. The base
    must return its last layer's hidden state (--hiddenStateLayers N-1)."""
    draft_dir, base_onnx_dir = Path(draft_dir), Path(base_onnx_dir)
    hf, base = open_draft_export(draft_dir, base_onnx_dir, output_dir, FIELD)
    config = assistant_config(hf, base)
    check_base_layers(base, config)
    weights = load_weights(draft_dir, config)
    graph = build_assistant_graph(config, weights, base_final_norm(base_onnx_dir, base), base)
    write_draft_dir(output_dir, graph, config, base_embedding(base_onnx_dir), {})
    return config


def write_random_gemma4_assistant(base_onnx_dir: Path, output_dir: Path, *, seed: int = 0, num_layers: int = 2,
                                  hidden_size: int = 0, num_heads: int = 0, num_centroids: int = 0,
                                  centroid_top_k: int = 2) -> Path:
    """A random-weight Gemma4 assistant in the Hugging Face format for a base's ONNX dir (tests, demos): the base's
    head geometry, `num_layers` layers (full-attention; over a base with sliding layers, sliding ones but the last,
    as Google's assistants), centroid-sparse logits when `num_centroids` > 0."""
    base = ModelConfig.from_dict(read_json(Path(base_onnx_dir) / "config.json", "--baseOnnxDir"), "--baseOnnxDir")
    last = base.num_hidden_layers - 1  # an assistant reads the base's last layer (assistant_config): refused up front
    if base.hidden_state_layers != [last]:  # rather than written and then refused by llm_export gemma4-assistant
        raise KvforgeError(f"an assistant reads the base's last layer {last}, this base returns "
                           f"{base.hidden_state_layers or 'none'}; re-export it with --hiddenStateLayers {last}",
                           "--baseOnnxDir")
    rng = np.random.default_rng(seed)
    Hb, D, V = base.hidden_size, base.head_dim, base.vocab_size
    if num_centroids < 0 or (num_centroids and V % num_centroids):
        raise KvforgeError(f"must divide the base's vocabulary of {V} tokens (or be 0), got {num_centroids}",
                           "--numCentroids")
    H = hidden_size or Hb
    heads = num_heads or base.num_attention_heads
    inter = 2 * H

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(n: int = H) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"model.norm.weight": norm(), "model.embed_tokens.weight": (0.5 * rng.standard_normal((V, H))).astype(
        np.float32), "pre_projection.weight": linear(H, 2 * Hb), "post_projection.weight": linear(Hb, H)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                    p + "pre_feedforward_layernorm.weight": norm(), p + "post_feedforward_layernorm.weight": norm(),
                    p + "self_attn.q_proj.weight": linear(heads * D, H), p + "self_attn.q_norm.weight": norm(D),
                    p + "self_attn.o_proj.weight": linear(H, heads * D), p + "mlp.gate_proj.weight": linear(inter, H),
                    p + "mlp.up_proj.weight": linear(inter, H), p + "mlp.down_proj.weight": linear(H, inter),
                    p + "layer_scalar": np.array([0.9 + 0.2 * rng.random()], dtype=np.float32)}
    if num_centroids:
        tensors |= {"masked_embedding.centroids.weight": linear(num_centroids, H),
                    "masked_embedding.token_ordering": rng.permutation(V).astype(np.int64)}
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output_dir / "model.safetensors"))
    rope = {"rope_type": "default", "rope_theta": base.rope_theta}
    ropes = {FULL: rope, SLIDING: rope}
    types = [FULL] * num_layers
    if base.model == "gemma4":  # the base's own RoPE of each kind
        ropes = {FULL: {"rope_type": "proportional", "partial_rotary_factor": base.rope_proportion,
                        "rope_theta": base.rope_theta} if base.rope_proportion else rope,
                 SLIDING: {"rope_type": "default", "rope_theta": base.rope_local_theta or base.rope_theta}}
        if base.sliding_window_layers:
            types = [SLIDING] * (num_layers - 1) + [FULL]
    write_json(output_dir / "config.json", {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "backbone_hidden_size": Hb,
        "use_ordered_embeddings": bool(num_centroids), "num_centroids": num_centroids or 2048,
        "centroid_intermediate_top_k": centroid_top_k, "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text", "vocab_size": V, "hidden_size": H, "intermediate_size": inter,
            "num_hidden_layers": num_layers, "num_attention_heads": heads,
            "num_key_value_heads": base.num_key_value_heads, "head_dim": D, "global_head_dim": D,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": base.rms_norm_eps,
            "max_position_embeddings": base.max_position_embeddings, "layer_types": types,
            "sliding_window": base.sliding_window or 512, "rope_parameters": ropes, "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0, "num_kv_shared_layers": num_layers, "tie_word_embeddings": True,
            "attention_bias": False, "enable_moe_block": False, "use_double_wide_mlp": False}})
    return output_dir

