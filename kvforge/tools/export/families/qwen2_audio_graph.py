"""The Qwen2-Audio (Whisper-style) audio encoder and projector as one ONNX graph: log-mel frames -> embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from kvforge.graph.onnx_graph import FLOAT, INT64, OPSET, GraphWriter, value_info

AUDIO = "audio_tower."
PROJECTOR = "multi_modal_projector.linear."
AUDIO_INPUT = "input_features"  # [N, mel bins, 2 × max_source_positions] log-mel frames, padded to 30 s
AUDIO_LENGTHS = "feature_lengths"  # [N] int64: valid mel frames before padding
AUDIO_OUTPUT = "audio_embeds"  # [N, max_source_positions / 2, text hidden]; the first audio_tokens(len) rows count


@dataclass(frozen=True, slots=True)
class AudioGeometry:
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    num_mel_bins: int
    max_source_positions: int
    text_hidden_size: int

    @property
    def num_frames(self) -> int:
        return 2 * self.max_source_positions


def audio_tokens(num_frames: int) -> int:
    """Placeholder rows for `num_frames` valid mel frames: conv2 halves them, the pooling halves them again."""
    after_conv = (num_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def build_audio_graph(geometry: AudioGeometry, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    g = GraphWriter()

    def w(name: str, transpose: bool = False) -> str:
        array = weights[name].astype(np.float32)
        return g.weight(name, array.T if transpose else array)

    def linear(x: str, name: str, bias: bool = True) -> str:
        y = g.matmul(x, w(name + ".weight", transpose=True))
        return g.add(y, w(name + ".bias")) if bias else y

    def layer_norm(x: str, name: str) -> str:
        return g.op("LayerNormalization", [x, w(name + ".weight"), w(name + ".bias")], axis=-1, epsilon=1e-5)

    d, heads = geometry.d_model, geometry.encoder_attention_heads
    head_dim = d // heads
    x = _gelu(g, g.op("Conv", [AUDIO_INPUT, w(AUDIO + "conv1.weight"), w(AUDIO + "conv1.bias")],
                      kernel_shape=[3], pads=[1, 1]))
    x = _gelu(g, g.op("Conv", [x, w(AUDIO + "conv2.weight"), w(AUDIO + "conv2.bias")],
                      kernel_shape=[3], pads=[1, 1], strides=[2]))
    x = g.add(g.transpose(x, [0, 2, 1]), w(AUDIO + "embed_positions.weight"))  # [N, P, d]
    # Keys past the valid frames (after conv2) are masked, as transformers' feature_attention_mask does.
    valid = g.add(g.op("Div", [g.op("Sub", [AUDIO_LENGTHS, g.const(1)]), g.const(2)]), g.const(1))
    positions = g.op("Range", [g.const(0), g.const(geometry.max_source_positions), g.const(1)])
    keep = g.op("Less", [g.unsqueeze(positions, [0]), g.unsqueeze(valid, [1])])  # [N, P]
    bias = g.op("Where", [keep, g.const(0.0, np.float32), g.const(float(np.finfo(np.float32).min), np.float32)])
    bias = g.unsqueeze(bias, [1, 2])  # [N, 1, 1, P]

    def split_heads(t: str) -> str:
        return g.transpose(g.reshape(t, [0, 0, heads, head_dim]), [0, 2, 1, 3])

    for layer in range(geometry.encoder_layers):
        p = f"{AUDIO}layers.{layer}."
        h = layer_norm(x, p + "self_attn_layer_norm")
        q = split_heads(linear(h, p + "self_attn.q_proj"))
        k = split_heads(linear(h, p + "self_attn.k_proj", bias=False))
        v = split_heads(linear(h, p + "self_attn.v_proj"))
        scores = g.add(g.mul(g.matmul(q, g.transpose(k, [0, 1, 3, 2])), g.const(head_dim ** -0.5, np.float32)), bias)
        context = g.matmul(g.op("Softmax", [scores], axis=-1), v)
        x = g.add(x, linear(g.reshape(g.transpose(context, [0, 2, 1, 3]), [0, 0, d]), p + "self_attn.out_proj"))
        h = layer_norm(x, p + "final_layer_norm")
        x = g.add(x, linear(_gelu(g, linear(h, p + "fc1")), p + "fc2"))
    pooled = g.op("AveragePool", [g.transpose(x, [0, 2, 1])], kernel_shape=[2], strides=[2])
    x = layer_norm(g.transpose(pooled, [0, 2, 1]), AUDIO + "layer_norm")
    y = g.add(g.matmul(x, w(PROJECTOR + "weight", transpose=True)), w(PROJECTOR + "bias"))
    g.op("Identity", [y], outputs=[AUDIO_OUTPUT])
    graph = helper.make_graph(
        g.nodes, "kvforge_qwen2_audio_encoder",
        [value_info(AUDIO_INPUT, FLOAT, ["num_audios", geometry.num_mel_bins, geometry.num_frames]),
         value_info(AUDIO_LENGTHS, INT64, ["num_audios"])],
        [value_info(AUDIO_OUTPUT, FLOAT, ["num_audios", geometry.max_source_positions // 2,
                                          geometry.text_hidden_size])],
        g.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="kvforge")


def _gelu(g: GraphWriter, x: str) -> str:
    inner = g.op("Erf", [g.mul(x, g.const(1 / np.sqrt(2.0), np.float32))])
    return g.mul(g.mul(x, g.const(0.5, np.float32)), g.add(inner, g.const(1.0, np.float32)))
