"""Qwen3.5's multi-token-prediction layer (`mtp.*` in its checkpoint) as a draft engine over a hybrid base.

The layer (vLLM's `qwen3_5_mtp`, Qwen3-Next's MTP module) predicts the token after next: at position p it reads the
embedding of token p + 1 and the base's normed last hidden state h_p,

    x = mtp.fc(concat(pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h)))

then one full-attention Qwen3.5 decoder layer (gated attention with q/k norms and partial RoPE, SwiGLU MLP) with its
own KV pool, and `mtp.norm`; the base's head scores the result, which also serves as the next drafting step's h.
Like EAGLE3, the draft's K/V at p depend on token p + 1, so the graph keeps EAGLE3's engine contract (the base's
hidden state through `hidden_states_input`, the draft's own through `draft_hidden_states_input`, zeros for the one a
call does not use) and the EAGLE3 proposer drives it. The base returns its last layer's output before the final
norm (kvforge's hidden_state_layers convention), so the graph applies the base's final norm to that input; Qwen3.5's
zero-centred norms (x * (1 + w)) are stored as multipliers, as in families/qwen3_5.py.

Sources: a Qwen3.5 Hugging Face dir (its `mtp.*` tensors; text_config's `mtp_num_hidden_layers`, 1 in every
released checkpoint), or `write_random_mtp` for a synthetic base (tests, demos).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper
from safetensors.numpy import save_file

from kvforge.contract.engine_dir import (
    DRAFT_HIDDEN_INPUT,
    HIDDEN_STATES,
)
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import read_json, write_json
from kvforge.contract.model_config import SPEC_MTP, ModelConfig
from kvforge.contract.speculation import SPEC_SUPPORT, base_kind
from kvforge.graph.onnx_graph import FLOAT, OPSET, GraphWriter, value_info
from kvforge.graph.positions import NUM_POSITIONS, gather_positions, logits_output
from kvforge.plugins import ops
from kvforge.tools.export.drafts.common import (
    base_embedding,
    base_final_norm,
    base_head,
    check_base_layers,
    draft_graph_inputs,
    normed_hidden_input,
    open_draft_export,
    write_draft_dir,
)
from kvforge.tools.export.families.llama import rope_inputs
from kvforge.tools.export.families.qwen3_5 import centred_norm, fused_linears, gated_attention, linear, text_config
from kvforge.tools.export.sources.hf_common import read_safetensors_header, read_tensor, safetensors_files

FIELD = "--draftDir"
MODEL = "qwen3_5_mtp"
_TOP = ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")
_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
          "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
          "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def check_hybrid_base(base: ModelConfig) -> None:
    if base_kind(base.is_recurrent, base.is_hybrid) not in SPEC_SUPPORT[SPEC_MTP].bases:  # the support table
        raise KvforgeError(f"standard MTP drafts for a hybrid (Qwen3.5) base; {base.model} is not one (the support "
                           "matrix rejects MTP on an attention-only base)", "--baseOnnxDir")


def mtp_config(hf: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The MTP draft's ModelConfig: one attention layer with the base's attention geometry."""
    check_hybrid_base(base)
    text = text_config(hf)
    layers = int(text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 0)) or 0)
    if layers != 1:
        raise KvforgeError(f"mtp_num_hidden_layers is {layers}; kvforge runs checkpoints with one MTP layer (every "
                           "released Qwen3.5 has one)", FIELD)
    if int(text.get("hidden_size", base.hidden_size)) != base.hidden_size:
        raise KvforgeError(f"hidden_size {text.get('hidden_size')} is not the base's {base.hidden_size}", FIELD)
    config = ModelConfig(
        model=MODEL, vocab_size=base.vocab_size, hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size, num_hidden_layers=1, num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.num_key_value_heads, head_dim=base.head_dim,
        max_position_embeddings=base.max_position_embeddings, rope_theta=base.rope_theta,
        rms_norm_eps=base.rms_norm_eps, qk_norm=True, kv_cache_dtype=base.kv_cache_dtype,
        bos_token_id=base.bos_token_id, eos_token_ids=list(base.eos_token_ids), pad_token_id=base.pad_token_id,
        partial_rotary_factor=base.partial_rotary_factor, hidden_state_layers=[0], spec_decode_type=SPEC_MTP,
        base_model_hidden_size=base.hidden_size, eagle_hidden_state_layers=[base.num_hidden_layers - 1])
    config.validate()
    return config


def load_weights(path: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """The `mtp.*` tensors (of a full Qwen3.5 checkpoint, or a random one), renamed for families/qwen3_5.py's layer
    helpers: `mtp.layers.0.X` -> `model.layers.0.X`."""
    tensors: dict[str, tuple[Path, dict[str, Any], int]] = {}
    for file in safetensors_files(path):
        header, start = read_safetensors_header(file)
        for name, entry in header.items():
            if name.startswith("mtp."):
                tensors[name] = (file, entry, start)
    names = [*_TOP, *(f"mtp.layers.0.{suffix}" for suffix in _LAYER)]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise KvforgeError(f"checkpoint in {path} lacks tensor {missing[0]} ({len(missing)} missing; a Qwen3.5 "
                           "checkpoint without its MTP layer cannot draft)", FIELD)
    out = {}
    for name in names:
        file, entry, start = tensors[name]
        out[name.replace("mtp.layers.0.", "model.layers.0.")] = read_tensor(file, name, entry, start).astype(
            np.float32)
    H = config.hidden_size
    q_out = config.num_attention_heads * config.head_dim
    shapes = {"mtp.fc.weight": (H, 2 * H), "model.layers.0.self_attn.q_proj.weight": (2 * q_out, H),
              "model.layers.0.self_attn.o_proj.weight": (H, q_out)}
    for name, shape in shapes.items():
        if out[name].shape != shape:
            raise KvforgeError(f"tensor {name} is {list(out[name].shape)}, the base implies {list(shape)}", FIELD)
    return out


def build_mtp_graph(config: ModelConfig, weights: dict[str, np.ndarray], head: np.ndarray,
                    base_norm: tuple[np.ndarray, float]) -> onnx.ModelProto:
    """The MTP layer as an engine graph (see the module docstring): logits [N, V] and the normed output [N, H] at
    logits_indices."""
    g = GraphWriter()
    H, eps = config.hidden_size, config.rms_norm_eps
    rope = rope_inputs(g, "inputs_embeds")
    inputs = draft_graph_inputs(config, DRAFT_HIDDEN_INPUT, H)
    outputs: list[onnx.ValueInfoProto] = []
    h = normed_hidden_input(g, base_norm)
    x = linear(g, weights, g.op("Concat", [
        g.rms_norm("inputs_embeds", centred_norm(g, weights, "mtp.pre_fc_norm_embedding.weight"), eps),
        g.rms_norm(h, centred_norm(g, weights, "mtp.pre_fc_norm_hidden.weight"), eps)], axis=-1), "mtp.fc.weight")
    p = "model.layers.0."
    normed = g.rms_norm(x, centred_norm(g, weights, p + "input_layernorm.weight"), eps)
    x = g.add(x, gated_attention(g, config, weights, 0, normed, rope, inputs, outputs))
    normed = g.rms_norm(x, centred_norm(g, weights, p + "post_attention_layernorm.weight"), eps)
    gate, up = fused_linears(g, weights, normed, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                             p + "mlp.gate_up")
    x = g.add(x, linear(g, weights, g.mul(g.mul(gate, g.op("Sigmoid", [gate])), up), p + "mlp.down_proj.weight"))
    last = g.rms_norm(gather_positions(g, x, H), centred_norm(g, weights, "mtp.norm.weight"), eps)
    g.op("Identity", [g.matmul(last, g.weight("base_lm_head", np.ascontiguousarray(head.T)))], outputs=["logits"])
    g.op("Identity", [last], outputs=[HIDDEN_STATES])
    graph = helper.make_graph(g.nodes, "kvforge_qwen3_5_mtp", inputs,
                              [logits_output(config.vocab_size), value_info(HIDDEN_STATES, FLOAT, [NUM_POSITIONS, H]),
                               *outputs], g.initializers)
    return helper.make_model(graph, producer_name="kvforge", opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)])


def export_mtp(draft_dir: Path, base_onnx_dir: Path, output_dir: Path) -> ModelConfig:
    """Write the MTP draft's ONNX dir from a Qwen3.5 checkpoint's `mtp.*` tensors: model.onnx (with float copies of
    the base's head and final norm), config.json and the base's embedding table. The base must return its last
    layer's hidden state (--hiddenStateLayers N-1)."""
    draft_dir, base_onnx_dir = Path(draft_dir), Path(base_onnx_dir)
    hf, base = open_draft_export(draft_dir, base_onnx_dir, output_dir, FIELD)
    config = mtp_config(hf, base)
    check_base_layers(base, config)
    weights = load_weights(draft_dir, config)
    model = build_mtp_graph(config, weights, base_head(base_onnx_dir, base), base_final_norm(base_onnx_dir, base))
    write_draft_dir(output_dir, model, config, base_embedding(base_onnx_dir), {})
    return config


def write_random_mtp(base_onnx_dir: Path, output_dir: Path, *, seed: int = 0) -> Path:
    """A random Qwen3.5 MTP layer in the checkpoint's layout (`mtp.*` tensors, a config.json with
    mtp_num_hidden_layers 1) for a hybrid base's ONNX dir: tests and demos (its guesses are rarely accepted)."""
    base = ModelConfig.from_dict(read_json(Path(base_onnx_dir) / "config.json", "--baseOnnxDir"), "--baseOnnxDir")
    check_hybrid_base(base)
    rng = np.random.default_rng(seed)
    H, inter, D = base.hidden_size, base.intermediate_size, base.head_dim
    q_out, kv_out = base.num_attention_heads * D, base.num_key_value_heads * D

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def near_zero(dim: int) -> np.ndarray:  # zero-centred norms: 1 + w multiplies
        return (0.1 * rng.standard_normal(dim)).astype(np.float32)

    p = "mtp.layers.0."
    tensors = {"mtp.fc.weight": linear(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": near_zero(H),
               "mtp.pre_fc_norm_hidden.weight": near_zero(H), "mtp.norm.weight": near_zero(H),
               p + "input_layernorm.weight": near_zero(H), p + "post_attention_layernorm.weight": near_zero(H),
               p + "self_attn.q_proj.weight": linear(2 * q_out, H), p + "self_attn.k_proj.weight": linear(kv_out, H),
               p + "self_attn.v_proj.weight": linear(kv_out, H), p + "self_attn.o_proj.weight": linear(H, q_out),
               p + "self_attn.q_norm.weight": near_zero(D), p + "self_attn.k_norm.weight": near_zero(D),
               p + "mlp.gate_proj.weight": linear(inter, H), p + "mlp.up_proj.weight": linear(inter, H),
               p + "mlp.down_proj.weight": linear(H, inter)}
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output_dir / "model.safetensors"))
    write_json(output_dir / "config.json", {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                                            "hidden_size": H, "mtp_num_hidden_layers": 1,
                                            "mtp_use_dedicated_embeddings": False})
    return output_dir
