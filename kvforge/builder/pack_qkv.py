"""Hands kvforge's attention kernel the packed q/k/v projection itself, so the Split between them leaves the graph.

The export projects q, k and v with one packed matmul and splits its output (kvforge/tools/export/families/llama.py):
the readable reference form. On kernel engines `kvforge.cpu.PagedAttentionRope` reads the three heads' rows straight
from the packed tensor (attribute `packed_qkv`; kvforge/plugins/cpu/paged_attention.cc): one node less a layer, and no
copy of q, k and v before the kernel copies them again to rotate them. Only the exact pattern is taken: a last-axis
Split into [Hq*D, Hkv*D, Hkv*D] whose outputs (through a LoRA engine's Identity placeholders) the attention alone reads.
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from kvforge.builder.graph_edit import GraphIndex, drop_unread_initializers, int_attribute, splice
from kvforge.plugins.ops import CPU_DOMAIN, CPU_PAGED_ATTENTION_ROPE


def pack_attention_inputs(model: onnx.ModelProto) -> int:
    """Every PagedAttentionRope fed by one q/k/v Split reads the packed tensor instead, in place; returns how many."""
    graph = model.graph
    index = GraphIndex.of(graph)
    replaced: dict[int, onnx.NodeProto] = {}
    removed: set[int] = set()
    for node in graph.node:
        if node.op_type != CPU_PAGED_ATTENTION_ROPE.name or node.domain != CPU_DOMAIN:
            continue
        match = _packed_split(node, index)
        if match is None:
            continue
        split, passed = match
        packed = onnx.NodeProto()
        packed.CopyFrom(node)
        packed.input[0] = packed.input[1] = packed.input[2] = split.input[0]
        packed.attribute.append(helper.make_attribute("packed_qkv", 1))
        replaced[id(node)] = packed  # at the attention's place: the packed tensor exists before the Split did
        removed.update(id(n) for n in (split, *passed))
    if replaced:
        splice(graph, replaced, removed)
        drop_unread_initializers(graph)  # the Splits' sizes
    return len(replaced)


def _packed_split(attention: onnx.NodeProto, index: GraphIndex
                  ) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """(the Split, the Identity nodes on the way) where `attention`'s q, k and v are that Split's outputs 0, 1, 2."""
    if int_attribute(attention, "packed_qkv", 0):
        return None
    passed: list[onnx.NodeProto] = []
    sources = [_before_identities(name, attention, index, passed) for name in attention.input[:3]]
    split = index.producers.get(sources[0]) if sources[0] else None
    if split is None or split.op_type != "Split" or split.domain not in ("", "ai.onnx"):
        return None
    if list(split.output) != sources or int_attribute(split, "axis", 0) != -1:
        return None
    if len(split.input) < 2 or split.input[1] not in index.initializers:
        return None
    dim = int_attribute(attention, "head_dim")
    widths = [int_attribute(attention, "num_q_heads") * dim, *[int_attribute(attention, "num_kv_heads") * dim] * 2]
    if numpy_helper.to_array(index.initializers[split.input[1]]).tolist() != widths:
        return None
    return split, passed


def _before_identities(name: str, reader: onnx.NodeProto, index: GraphIndex,
                       passed: list[onnx.NodeProto]) -> str | None:
    """Follows `name` back through Identity nodes, each of whose outputs only the next step reads; None where a
    tensor on the way is read by anything else or is a graph output."""
    while True:
        if name in index.outputs or [id(n) for n in index.consumers.get(name, [])] != [id(reader)]:
            return None
        producer = index.producers.get(name)
        if producer is None or producer.op_type != "Identity":
            return name
        passed.append(producer)
        reader, name = producer, producer.input[0]
