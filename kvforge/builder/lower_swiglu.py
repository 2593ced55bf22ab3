"""Rewrites a gated MLP's Split, Sigmoid, Mul and Mul into kvforge's one-node `kvforge.cpu.SwiGLU` on kernel engines.

The export packs gate and up into one matmul and splits its output (kvforge/tools/export/families/llama.py), then writes
silu(gate) * up as Sigmoid, Mul, Mul: the readable reference form. ONNX Runtime fuses the SiLU into QuickGelu but
leaves the Split and the last Mul, so each layer launches three nodes for an element-wise product. On engines that
load the CPU kernel library anyway, one SwiGLU node reads the packed projection and writes the product
(kvforge/plugins/cpu/swiglu.cc). Only the exact pattern is taken: the Split's halves equal, each intermediate read by
the pattern alone (a LoRA engine's delta Add between Split and Sigmoid, or a graph output, leaves the layer as it is).
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from kvforge.builder.graph_edit import GraphIndex, drop_unread_initializers, int_attribute, splice
from kvforge.plugins.ops import CPU_DOMAIN, CPU_SWIGLU


def lower_swiglu(model: onnx.ModelProto) -> int:
    """Every Split -> (Sigmoid, Mul, Mul) gated activation -> SwiGLU, in place; returns how many."""
    graph = model.graph
    index = GraphIndex.of(graph)
    replaced: dict[int, onnx.NodeProto] = {}
    removed: set[int] = set()
    for node in graph.node:
        match = _gated_activation(node, index)
        if match is None:
            continue
        product, pattern = match
        fused = helper.make_node(CPU_SWIGLU.name, [node.input[0]], [product.output[0]],
                                 name=f"swiglu/{node.name or product.output[0]}", domain=CPU_DOMAIN)
        replaced[id(node)] = fused  # at the Split's place: its input exists there, every reader comes later
        removed.update(id(n) for n in pattern)
    if replaced:
        splice(graph, replaced, removed)
        drop_unread_initializers(graph)  # the Splits' sizes (ONNX Runtime would warn at every load that it drops them)
    return len(replaced)


def _halves(split: onnx.NodeProto, index: GraphIndex) -> bool:
    """A Split of the last axis into two equal halves."""
    if split.op_type != "Split" or split.domain not in ("", "ai.onnx") or len(split.output) != 2:
        return False
    if int_attribute(split, "axis", 0) != -1:
        return False
    if len(split.input) < 2 or not split.input[1]:
        return int_attribute(split, "num_outputs", 0) == 2
    sizes = index.initializers.get(split.input[1])
    if sizes is None:
        return False
    values = numpy_helper.to_array(sizes).tolist()
    return len(values) == 2 and values[0] == values[1]


def _through_identities(name: str, index: GraphIndex, passed: list[onnx.NodeProto]) -> str | None:
    """Follows `name` through Identity nodes that are its only reader (a LoRA engine's placeholders when the layer
    takes no adapter); None where a tensor on the way is a graph output."""
    while True:
        if name in index.outputs:
            return None
        readers = index.consumers.get(name, [])
        if len(readers) != 1 or readers[0].op_type != "Identity":
            return name
        passed.append(readers[0])
        name = readers[0].output[0]


def _only_reader(name: str, index: GraphIndex, op_type: str) -> onnx.NodeProto | None:
    readers = index.consumers.get(name, [])
    if name in index.outputs or len(readers) != 1 or readers[0].op_type != op_type:
        return None
    return readers[0]


def _gated_activation(split: onnx.NodeProto, index: GraphIndex
                      ) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """(the final Mul, every node the SwiGLU replaces) where `split` starts silu(gate) * up."""
    if not _halves(split, index):
        return None
    pattern: list[onnx.NodeProto] = [split]
    gate = _through_identities(split.output[0], index, pattern)
    up = _through_identities(split.output[1], index, pattern)
    if gate is None or up is None:
        return None
    readers = index.consumers.get(gate, [])
    sigmoid = next((n for n in readers if n.op_type == "Sigmoid"), None)
    silu = next((n for n in readers if n.op_type == "Mul"), None)
    if len(readers) != 2 or sigmoid is None or silu is None or sorted(silu.input) != sorted([gate, sigmoid.output[0]]):
        return None
    if _only_reader(sigmoid.output[0], index, "Mul") is not silu:
        return None
    product = _only_reader(silu.output[0], index, "Mul")
    up_reader = _only_reader(up, index, "Mul")
    if product is None or up_reader is not product or sorted(product.input) != sorted([silu.output[0], up]):
        return None
    return product, [*pattern, sigmoid, silu, product]
