"""Rotate-half RoPE as ONNX nodes: the exporter's attention and the builder's K/V lowering share it."""

from __future__ import annotations

from kvforge.graph.onnx_graph import GraphWriter


def apply_rope(g: GraphWriter, x: str, num_heads: int, head_dim: int, cos: str, sin: str) -> str:
    """Rotate-half RoPE of [B,S,heads*D] with cos/sin [B,S,1,D/2]; returns [B,S,heads*D]."""
    heads = g.reshape(x, [0, 0, num_heads, head_dim])
    x1, x2 = g.split_halves(heads)
    rotated = g.op("Concat", [g.op("Sub", [g.mul(x1, cos), g.mul(x2, sin)]),
                              g.add(g.mul(x2, cos), g.mul(x1, sin))], axis=-1)
    return g.reshape(rotated, [0, 0, num_heads * head_dim])
