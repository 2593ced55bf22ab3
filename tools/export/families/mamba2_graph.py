"""The Mamba2 decoder (pure recurrent: causal conv + selective state space per layer) as an ONNX graph.

Every layer takes and returns its carried state next to the hidden states: `conv_state_{i}` [B, C, K-1]
(the conv's previous inputs) and `recurrent_state_{i}` [B, H, P, N] (fp32), so a prefill continues in
chunks, or after a restored snapshot, exactly. The recurrence is the `kvforge` SelectiveScan op and the
conv CausalConv1dWithState (plugins/recurrent.py); llm_build lowers both (builder/lower_recurrent.py).
Weight names follow transformers' Mamba2ForCausalLM (`backbone.layers.{i}.mixer.*`), except the embedding, which is
`model.embed_tokens.weight` as for every family (tools/export/sources/base.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from kvforge.graph.onnx_graph import FLOAT, INT32, OPSET, GraphWriter, value_info
from kvforge.graph.positions import attach_hidden_states, gather_positions, logits_indices_input, logits_output
from kvforge.plugins import ops, recurrent


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
