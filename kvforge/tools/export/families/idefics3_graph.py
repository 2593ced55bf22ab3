"""The Idefics3 (SmolVLM) vision encoder and pixel-shuffle connector as one ONNX graph: pixels -> text embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from kvforge.contract.multimodal import ENCODER_INPUT, ENCODER_OUTPUT
from kvforge.graph.onnx_graph import FLOAT, OPSET, GraphWriter, value_info

VISION = "model.vision_model."
CONNECTOR = "model.connector.modality_projection.proj.weight"
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True, slots=True)
class VisionGeometry:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int
    image_size: int  # the size the position table was trained for
    layer_norm_eps: float
    hidden_act: str
    scale_factor: int  # pixel shuffle: scale_factor² patches become one token
    text_hidden_size: int
    num_channels: int = 3

    def patches_per_side(self, input_size: int) -> int:
        return input_size // self.patch_size

    def tokens_per_image(self, input_size: int) -> int:
        return self.patches_per_side(input_size) ** 2 // self.scale_factor ** 2


def position_ids(geometry: VisionGeometry, input_size: int) -> np.ndarray:
    """Position-table rows of an unpadded square image of `input_size` pixels, computed as Idefics3VisionEmbeddings
    does (fractional coordinates bucketized onto the trained grid, in float32), so sizes other than the trained
    one index the same rows as transformers."""
    trained = geometry.image_size // geometry.patch_size
    side = geometry.patches_per_side(input_size)
    boundaries = np.arange(1 / trained, 1.0, 1 / trained, dtype=np.float64).astype(np.float32)
    coords = np.arange(side, dtype=np.float32) * (np.float32(1.0) / np.float32(side))
    coords = np.minimum(coords, np.float32(1.0 - 1e-6))
    buckets = np.searchsorted(boundaries, coords, side="right")
    return (buckets[:, None] * trained + buckets[None, :]).reshape(-1).astype(np.int64)


def build_vision_graph(geometry: VisionGeometry, weights: dict[str, np.ndarray], input_size: int) -> onnx.ModelProto:
    """`pixel_values` [N, C, S, S] -> `image_embeds` [N, tokens_per_image, text hidden]; S is fixed at export."""
    g = GraphWriter()
    w = _Weights(g, weights)
    hidden, patch = geometry.hidden_size, geometry.patch_size
    side = geometry.patches_per_side(input_size)
    if side * patch != input_size or side % geometry.scale_factor:
        raise ValueError(f"image size {input_size} must be a multiple of patch {patch} × scale {geometry.scale_factor}")
    conv = g.op("Conv", [ENCODER_INPUT, w.get("embeddings.patch_embedding.weight"),
                         w.get("embeddings.patch_embedding.bias")],
                kernel_shape=[patch, patch], strides=[patch, patch])  # [N, E, side, side]
    x = g.transpose(g.reshape(conv, [0, hidden, side * side]), [0, 2, 1])  # [N, L, E]
    table = weights[VISION + "embeddings.position_embedding.weight"]
    x = g.add(x, g.weight("vision.position_embeds", table[position_ids(geometry, input_size)].astype(np.float32)))
    for layer in range(geometry.num_hidden_layers):
        p = f"encoder.layers.{layer}."
        h = _layer_norm(g, x, w, p + "layer_norm1", geometry.layer_norm_eps)
        x = g.add(x, _attention(g, h, w, p + "self_attn.", geometry))
        h = _layer_norm(g, x, w, p + "layer_norm2", geometry.layer_norm_eps)
        h = _gelu(g, w.linear(h, p + "mlp.fc1"), geometry.hidden_act)
        x = g.add(x, w.linear(h, p + "mlp.fc2"))
    x = _layer_norm(g, x, w, "post_layernorm", geometry.layer_norm_eps)
    shuffled = _pixel_shuffle(g, x, side, hidden, geometry.scale_factor)
    projection = g.weight(CONNECTOR, weights[CONNECTOR].astype(np.float32).T)
    g.op("MatMul", [shuffled, projection], outputs=[ENCODER_OUTPUT])
    tokens = geometry.tokens_per_image(input_size)
    graph = helper.make_graph(
        g.nodes, "kvforge_idefics3_visual",
        [value_info(ENCODER_INPUT, FLOAT, ["num_images", geometry.num_channels, input_size, input_size])],
        [value_info(ENCODER_OUTPUT, FLOAT, ["num_images", tokens, geometry.text_hidden_size])],
        g.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="kvforge")


class _Weights:
    """Vision-tower initializers by their name under `model.vision_model.`; Linear weights stored [in, out]."""

    def __init__(self, g: GraphWriter, weights: dict[str, np.ndarray]) -> None:
        self.g, self.weights = g, weights

    def get(self, name: str, transpose: bool = False) -> str:
        array = self.weights[VISION + name].astype(np.float32)
        return self.g.weight(VISION + name, array.T if transpose else array)

    def linear(self, x: str, name: str) -> str:
        return self.g.add(self.g.matmul(x, self.get(name + ".weight", transpose=True)), self.get(name + ".bias"))


def _layer_norm(g: GraphWriter, x: str, w: _Weights, name: str, eps: float) -> str:
    return g.op("LayerNormalization", [x, w.get(name + ".weight"), w.get(name + ".bias")], axis=-1, epsilon=eps)


def _gelu(g: GraphWriter, x: str, act: str) -> str:
    if act == "gelu":  # exact: x/2 (1 + erf(x / sqrt 2))
        inner = g.op("Erf", [g.mul(x, g.const(1 / np.sqrt(2.0), np.float32))])
    else:  # gelu_pytorch_tanh: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        cube = g.mul(g.mul(x, x), x)
        poly = g.add(x, g.mul(cube, g.const(0.044715, np.float32)))
        inner = g.op("Tanh", [g.mul(poly, g.const(np.sqrt(2 / np.pi), np.float32))])
    return g.mul(g.mul(x, g.const(0.5, np.float32)), g.add(inner, g.const(1.0, np.float32)))


def _attention(g: GraphWriter, x: str, w: _Weights, prefix: str, geometry: VisionGeometry) -> str:
    """Bidirectional multi-head attention over all patches (an unpadded image needs no mask)."""
    heads = geometry.num_attention_heads
    head_dim = geometry.hidden_size // heads

    def split_heads(t: str) -> str:  # [N, L, E] -> [N, heads, L, d]
        return g.transpose(g.reshape(t, [0, 0, heads, head_dim]), [0, 2, 1, 3])

    q = split_heads(w.linear(x, prefix + "q_proj"))
    k = split_heads(w.linear(x, prefix + "k_proj"))
    v = split_heads(w.linear(x, prefix + "v_proj"))
    scores = g.mul(g.matmul(q, g.transpose(k, [0, 1, 3, 2])), g.const(head_dim ** -0.5, np.float32))
    context = g.matmul(g.op("Softmax", [scores], axis=-1), v)  # [N, heads, L, d]
    merged = g.reshape(g.transpose(context, [0, 2, 1, 3]), [0, 0, geometry.hidden_size])
    return w.linear(merged, prefix + "out_proj")


def _pixel_shuffle(g: GraphWriter, x: str, side: int, dim: int, scale: int) -> str:
    """Idefics3Connector.pixel_shuffle: each scale×scale block of patches becomes one token of scale²·dim features."""
    x = g.reshape(x, [-1, side, side // scale, dim * scale])  # [N, h, w/s, s·E]
    x = g.transpose(x, [0, 2, 1, 3])  # [N, w/s, h, s·E]
    x = g.reshape(x, [-1, side // scale, side // scale, dim * scale * scale])  # [N, w/s, h/s, s²·E]
    x = g.transpose(x, [0, 2, 1, 3])  # [N, h/s, w/s, s²·E]
    return g.reshape(x, [-1, (side // scale) ** 2, dim * scale * scale])
