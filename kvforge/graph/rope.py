"""Rotate-half RoPE as ONNX nodes: the exporter's attention and the builder's K/V lowering share it."""

from __future__ import annotations

from kvforge.graph.onnx_graph import GraphWriter


def apply_rope(g: GraphWriter, x: str, num_heads: int, head_dim: int, cos: str, sin: str,
               rotary_dim: int = 0) -> str:
    """Rotate-half RoPE of [B,S,heads*D] with cos/sin [B,S,1,R/2]; returns [B,S,heads*D].

    `rotary_dim` R (0 = head_dim): partial rotary (Qwen3.5) rotates each head's first R dims and passes the rest."""
    heads = g.reshape(x, [0, 0, num_heads, head_dim])
    rotary_dim = rotary_dim or head_dim
    passed = None
    if rotary_dim < head_dim:
        heads, passed = g.op("Split", [heads, g.const([rotary_dim, head_dim - rotary_dim])], n_out=2, axis=-1)
    x1, x2 = g.split_halves(heads)
    rotated = g.op("Concat", [g.op("Sub", [g.mul(x1, cos), g.mul(x2, sin)]),
                              g.add(g.mul(x2, cos), g.mul(x1, sin))], axis=-1)
    if passed is not None:
        rotated = g.op("Concat", [rotated, passed], axis=-1)
    return g.reshape(rotated, [0, 0, num_heads * head_dim])
