"""EAGLE3 drafts: the public Hugging Face checkpoint format to an ONNX dir whose graph runs the draft on a paged pool.

The checkpoint (SpecForge's `LlamaForCausalLMEagle3`, vLLM's `Eagle3LlamaForCausalLM`) is one llama decoder layer
whose q/k/v read [input_layernorm(embedding of the next token), hidden_norm(h)] (2H wide, embeddings first), where
h is `fc` over the concatenated hidden states of three base layers on the first drafting step and the layer's own
previous output afterwards; `lm_head` scores a reduced draft vocabulary mapped to base ids by `d2t`
(base id = draft id + d2t[draft id]). Tensors may be named `midlayer.*` (SpecForge) or `layers.0.*` (vLLM); an
`embed_tokens.weight` is optional (the base's table is used otherwise).

Which base layers: kvforge's `hidden_state_layers` name decoder layers whose *outputs* a graph returns; the
checkpoint's `eagle_aux_hidden_state_layer_ids` (vLLM's convention) name layers whose *input* is captured, so layer
i there is our output of layer i - 1. Without the key the default is vLLM's (2, n // 2, n - 3) in its convention.
A `kvforge_hidden_state_layers` key (written by scripts/train_eagle3.py) gives ours directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper
from safetensors.numpy import save_file

from kvforge.contract.engine_dir import (
    BASE_HIDDEN_INPUT,
    D2T_FILE,
    D2T_TENSOR,
    DRAFT_HIDDEN_INPUT,
)
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import read_json, write_json
from kvforge.contract.formats import EXPORT_FORMAT
from kvforge.contract.model_config import SPEC_EAGLE3, ModelConfig
from kvforge.graph.onnx_graph import OPSET, GraphWriter, value_info
from kvforge.graph.positions import gather_positions, hidden_states_output, logits_output
from kvforge.graph.rope import apply_rope
from kvforge.plugins import ops
from kvforge.tools.export.drafts.common import (
    base_embedding,
    check_base_layers,
    draft_graph_inputs,
    open_draft_export,
    weight_ops,
    write_draft_dir,
)
from kvforge.tools.export.families.llama import POOL_ELEM_TYPES, pool_input_name, pool_output_name, rope_inputs
from kvforge.tools.export.sources.hf_common import read_safetensors_header, read_tensor, safetensors_files

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
FIELD = "--draftDir"
_LAYER = ("hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
          "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_TOP = ("fc.weight", "norm.weight", "lm_head.weight")
_IGNORED = ("t2d",)  # the target-to-draft mask: not needed at inference


def is_eagle3_dir(path: Path) -> bool:
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return any(a in ARCHITECTURES for a in json.loads(config.read_text()).get("architectures") or [])
    except (OSError, ValueError, AttributeError):
        return False


def default_base_layers(num_base_layers: int) -> list[int]:
    """vLLM's default capture (2, n // 2, n - 3) as the outputs kvforge's hidden_states name (one layer earlier)."""
    return [1, num_base_layers // 2 - 1, num_base_layers - 4]


def base_layers_of(hf: dict[str, Any], num_base_layers: int) -> list[int]:
    if "kvforge_hidden_state_layers" in hf:
        layers = hf["kvforge_hidden_state_layers"]
    else:
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
            or hf.get("eagle_aux_hidden_state_layer_ids")
        layers = [int(i) - 1 for i in ids] if ids else default_base_layers(num_base_layers)
    if not isinstance(layers, list) or not all(type(i) is int and 0 <= i < num_base_layers for i in layers):
        raise KvforgeError(f"the draft reads base layers {layers}, not all in [0, {num_base_layers})", FIELD)
    return layers


def draft_config(hf: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The draft's model config from its HF config.json, checked against the base's."""
    if not any(a in ARCHITECTURES for a in hf.get("architectures") or []):
        raise KvforgeError(f"not an EAGLE3 draft: architectures {hf.get('architectures')} (expected one of "
                           f"{', '.join(ARCHITECTURES)})", FIELD)
    if int(hf.get("num_hidden_layers", 1)) != 1:
        raise KvforgeError(f"an EAGLE3 draft has one decoder layer, this one says {hf.get('num_hidden_layers')}",
                           FIELD)
    vocab = int(hf.get("vocab_size", base.vocab_size))
    if vocab != base.vocab_size:
        raise KvforgeError(f"the draft's vocab_size {vocab} is not the base's {base.vocab_size}", FIELD)
    layers = base_layers_of(hf, base.num_hidden_layers)
    target_hidden = int(hf.get("target_hidden_size") or base.hidden_size)
    if target_hidden != base.hidden_size:
        raise KvforgeError(f"the draft was trained on a base of hidden size {target_hidden}, this base has "
                           f"{base.hidden_size}", FIELD)
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    config = ModelConfig(
        model="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        max_position_embeddings=int(hf.get("max_position_embeddings") or base.max_position_embeddings),
        rope_theta=float(hf.get("rope_theta") or base.rope_theta), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        kv_cache_dtype=base.kv_cache_dtype, eos_token_ids=list(base.eos_token_ids), name="eagle3-draft",
        hidden_state_layers=[0], spec_decode_type=SPEC_EAGLE3,
        draft_vocab_size=int(hf.get("draft_vocab_size") or vocab),
        base_model_hidden_size=len(layers) * base.hidden_size, eagle_hidden_state_layers=layers,
        lm_head="float", format=EXPORT_FORMAT)
    config.validate()
    return config


def load_weights(path: Path, config: ModelConfig) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray | None]:
    """(weights by canonical name `midlayer.*` / `fc.weight` / ..., d2t int64, embed_tokens or None)."""
    tensors: dict[str, tuple[Path, dict[str, Any], int]] = {}
    for file in safetensors_files(path):
        header, start = read_safetensors_header(file)
        for name, entry in header.items():
            canonical = name.removeprefix("model.").replace("layers.0.", "midlayer.")
            tensors[canonical] = (file, entry, start)
    expected = [*_TOP, *(f"midlayer.{n}" for n in _LAYER)]
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise KvforgeError(f"draft checkpoint in {path} lacks tensor {missing[0]} ({len(missing)} missing)", FIELD)
    known = {*expected, "d2t", "embed_tokens.weight", *_IGNORED}
    unexpected = sorted(n for n in tensors if n not in known)
    if unexpected:
        raise KvforgeError(f"draft checkpoint in {path} has tensor {unexpected[0]} this loader does not handle",
                           FIELD)

    def read(name: str) -> np.ndarray:
        file, entry, start = tensors[name]
        return read_tensor(file, name, entry, start)

    weights = {n: read(n).astype(np.float32) for n in expected}
    H, heads, kv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes = {"fc.weight": (H, config.base_model_hidden_size), "lm_head.weight": (config.draft_vocab_size, H),
              "midlayer.self_attn.q_proj.weight": (heads * D, 2 * H),
              "midlayer.self_attn.k_proj.weight": (kv * D, 2 * H), "midlayer.self_attn.v_proj.weight": (kv * D, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, heads * D)}
    for name, shape in shapes.items():
        if weights[name].shape != shape:
            raise KvforgeError(f"tensor {name} is {list(weights[name].shape)}, the config implies {list(shape)}",
                               FIELD)
    if "d2t" in tensors:
        from safetensors import safe_open  # an integer tensor: the float reader does not take it

        with safe_open(str(tensors["d2t"][0]), "np") as f:
            name = next(k for k in f.keys() if k.endswith("d2t"))  # noqa: SIM118 - safe_open is not a mapping
            d2t = np.asarray(f.get_tensor(name), dtype=np.int64).ravel()
    elif config.draft_vocab_size == config.vocab_size:
        d2t = np.zeros(config.vocab_size, dtype=np.int64)  # the full vocabulary: ids map to themselves
    else:
        raise KvforgeError(f"draft checkpoint in {path} has a reduced vocabulary but no d2t map", FIELD)
    targets = np.arange(len(d2t)) + d2t
    if len(d2t) != config.draft_vocab_size or targets.min(initial=0) < 0 or \
            targets.max(initial=0) >= config.vocab_size:
        raise KvforgeError(f"d2t must map {config.draft_vocab_size} draft ids into [0, {config.vocab_size})", FIELD)
    embed = read("embed_tokens.weight").astype(np.float32) if "embed_tokens.weight" in tensors else None
    return weights, d2t, embed


def build_eagle3_graph(config: ModelConfig, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The draft as an engine graph: the kvforge engine contract plus `hidden_states_input` [B, S, base width]
    (through fc) and `draft_hidden_states_input` [B, S, H], which are added, so a call passes zeros for the one it
    does not use; logits [N, draft_vocab] and the layer's output as hidden_states [N, H] at logits_indices."""
    g = GraphWriter()
    H, heads, kv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps
    rope_cos, rope_sin = rope_inputs(g, "inputs_embeds")

    w, linear = weight_ops(g, weights)

    pool = POOL_ELEM_TYPES[config.kv_cache_dtype]
    pool_shape = ["num_pages", 2, kv, "tokens_per_page", D]
    inputs = [*draft_graph_inputs(config, DRAFT_HIDDEN_INPUT, H), value_info(pool_input_name(0), pool, pool_shape)]
    h = g.add(linear(BASE_HIDDEN_INPUT, "fc.weight"), DRAFT_HIDDEN_INPUT)
    x = g.op("Concat", [g.rms_norm("inputs_embeds", w("midlayer.input_layernorm.weight"), eps),
                        g.rms_norm(h, w("midlayer.hidden_norm.weight"), eps)], axis=-1)
    q = linear(x, "midlayer.self_attn.q_proj.weight")
    k = linear(x, "midlayer.self_attn.k_proj.weight")
    v = linear(x, "midlayer.self_attn.v_proj.weight")
    q = apply_rope(g, q, heads, D, rope_cos, rope_sin)
    pool_in, pool_out = pool_input_name(0), pool_output_name(0)
    g.op(ops.PAGED_KV_WRITE.name, [k, v, "rope_rotary_cos_sin", "context_lengths", "kvcache_start_index",
                                   "kv_page_table", pool_in],
         outputs=[pool_out], domain=ops.DOMAIN, name="paged_kv_write_0", num_kv_heads=kv, head_dim=D,
         tokens_per_page=0)
    attn = g.op(ops.PAGED_ATTENTION.name, [q, pool_out, "context_lengths", "kvcache_start_index", "kv_page_table"],
                domain=ops.DOMAIN, name="paged_attention_0", num_q_heads=heads, num_kv_heads=kv, head_dim=D,
                tokens_per_page=0, scale=float(D ** -0.5))
    h = g.add(h, linear(attn, "midlayer.self_attn.o_proj.weight"))
    normed = g.rms_norm(h, w("midlayer.post_attention_layernorm.weight"), eps)
    gate, up = linear(normed, "midlayer.mlp.gate_proj.weight"), linear(normed, "midlayer.mlp.up_proj.weight")
    h = g.add(h, linear(g.mul(g.mul(gate, g.op("Sigmoid", [gate])), up), "midlayer.mlp.down_proj.weight"))
    last = g.rms_norm(gather_positions(g, h, H), w("norm.weight"), eps)
    g.op("Identity", [linear(last, "lm_head.weight")], outputs=["logits"])
    hidden = hidden_states_output(g, [h], [0], H, indices="logits_indices")
    assert hidden is not None
    outputs = [logits_output(config.draft_vocab_size), hidden,
               value_info(pool_out, pool, pool_shape)]
    graph = helper.make_graph(g.nodes, "kvforge_eagle3_draft", inputs, outputs, g.initializers)
    return helper.make_model(graph, producer_name="kvforge", opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)])


def export_eagle3(draft_dir: Path, base_onnx_dir: Path, output_dir: Path) -> ModelConfig:
    """Write the draft's ONNX dir: model.onnx, config.json, d2t.safetensors, and its embedding table (its own, or
    the base's). The base's ONNX dir must return the hidden states the draft reads (llm_export --hiddenStateLayers)."""
    draft_dir, base_onnx_dir = Path(draft_dir), Path(base_onnx_dir)
    hf, base = open_draft_export(draft_dir, base_onnx_dir, output_dir, FIELD)
    config = draft_config(hf, base)
    check_base_layers(base, config)
    weights, d2t, embed = load_weights(draft_dir, config)
    if embed is None:
        embed = base_embedding(base_onnx_dir)
    if embed.shape != (config.vocab_size, config.hidden_size):
        raise KvforgeError(f"the embedding table is {list(embed.shape)}, the draft needs "
                           f"{[config.vocab_size, config.hidden_size]} (a draft narrower than its base needs its own "
                           "embed_tokens)", FIELD)
    write_draft_dir(output_dir, build_eagle3_graph(config, weights), config, embed, {D2T_FILE: {D2T_TENSOR: d2t}})
    return config


def write_random_eagle3(base_onnx_dir: Path, output_dir: Path, *, draft_vocab_size: int = 0, seed: int = 0,
                        layers: list[int] | None = None) -> Path:
    """A random-weight EAGLE3 checkpoint in the Hugging Face format for a base's ONNX dir (tests, demos): the base's
    attention geometry, a reduced vocabulary of `draft_vocab_size` tokens (0 = the base's), the base layers it
    reads in `kvforge_hidden_state_layers` (default: the base's hidden_state_layers, else vLLM's default)."""
    base = ModelConfig.from_dict(read_json(Path(base_onnx_dir) / "config.json", "--baseOnnxDir"))
    rng = np.random.default_rng(seed)
    H, heads, kv, D = base.hidden_size, base.num_attention_heads, base.num_key_value_heads, base.head_dim
    layers = layers or base.hidden_state_layers or default_base_layers(base.num_hidden_layers)
    vocab = draft_vocab_size or base.vocab_size
    if not 0 < vocab <= base.vocab_size:
        raise KvforgeError(f"must be in [1, {base.vocab_size}], got {vocab}", "--draftVocab")

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)

    chosen = np.sort(rng.choice(base.vocab_size, size=vocab, replace=False))
    tensors = {"fc.weight": linear(H, len(layers) * H), "norm.weight": norm(), "lm_head.weight": linear(vocab, H),
               "midlayer.hidden_norm.weight": norm(), "midlayer.input_layernorm.weight": norm(),
               "midlayer.post_attention_layernorm.weight": norm(),
               "midlayer.self_attn.q_proj.weight": linear(heads * D, 2 * H),
               "midlayer.self_attn.k_proj.weight": linear(kv * D, 2 * H),
               "midlayer.self_attn.v_proj.weight": linear(kv * D, 2 * H),
               "midlayer.self_attn.o_proj.weight": linear(H, heads * D),
               "midlayer.mlp.gate_proj.weight": linear(base.intermediate_size, H),
               "midlayer.mlp.up_proj.weight": linear(base.intermediate_size, H),
               "midlayer.mlp.down_proj.weight": linear(H, base.intermediate_size),
               "d2t": (chosen - np.arange(vocab)).astype(np.int64),
               "t2d": np.isin(np.arange(base.vocab_size), chosen)}
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output_dir / "model.safetensors"))
    write_json(output_dir / "config.json", {
        "architectures": [ARCHITECTURES[0]], "model_type": "llama", "num_hidden_layers": 1, "hidden_size": H,
        "intermediate_size": base.intermediate_size, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": D, "rms_norm_eps": base.rms_norm_eps, "rope_theta": base.rope_theta,
        "max_position_embeddings": base.max_position_embeddings, "vocab_size": base.vocab_size,
        "draft_vocab_size": vocab, "target_hidden_size": H, "tie_word_embeddings": False,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers]},
        "kvforge_hidden_state_layers": list(layers)})
    return output_dir
